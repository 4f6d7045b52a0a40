"""A benchmark of one's own, built as docs/extending.md says, from the names it gives (no private imports): a
GPT-2-shaped language model as a member of the LLM family, registered, prepared, trained on the CPU to its target,
checked as a benchmark that is not MLPerf's by mlperf-logging's common rules, and marked so in its log, in `check`
and in the report."""

import json

import pytest
from conftest import only_run_dir, run_cli

from trainbench.benchmarks import ORIGINS, register, unregister
from trainbench.benchmarks.llm import TINY_DATA, TINY_MODEL, LLMBenchmark, run_config
from trainbench.config import OptimizerConfig, ScheduleConfig


def gpt2_tiny():
    model = TINY_MODEL.__class__(**{**TINY_MODEL.__dict__, "arch": "gpt3", "num_kv_heads": None})
    optimizer = OptimizerConfig(name="adamw", lr=3e-3, beta1=0.9, beta2=0.95, epsilon=1e-8, weight_decay=0.1,
                                max_grad_norm=1.0)  # fmt: skip
    return run_config("gpt2_tiny_lm", "tiny", model, TINY_DATA.__class__(**TINY_DATA.__dict__), optimizer,
                      ScheduleConfig(warmup_steps=20, total_steps=1000), target=2.0, every=1600)  # fmt: skip


class Gpt2TinyLM(LLMBenchmark):
    name = "gpt2_tiny_lm"
    mlperf = False  # not one of MLPerf's: checked by the common rules, no reference convergence
    mlperf_name = "gpt2_tiny_lm"
    ruleset = "5.1.0"
    description = "A GPT-2-shaped language model on the synthetic tiny language, target log perplexity 2.0"
    optimizer_name = "adamw"
    eval_every = 1600
    full_preset = "tiny"
    presets = {"tiny": gpt2_tiny}

    def optimizer_keys(self, cfg):
        o = cfg.optimizer
        return {"opt_adamw_beta_1": o.beta1, "opt_adamw_beta_2": o.beta2, "opt_adamw_epsilon": o.epsilon,
                "opt_adamw_weight_decay": o.weight_decay}  # fmt: skip


@pytest.fixture
def own_benchmark():
    bench = register(Gpt2TinyLM())
    yield bench
    unregister(bench.name)


def test_a_benchmark_of_ones_own_trains_to_its_target_and_is_checked_as_not_mlperf(own_benchmark, tmp_path, capsys):
    data, results = tmp_path / "data", tmp_path / "results"
    assert run_cli("list") == 0 and "gpt2_tiny_lm (registered in this process)" in capsys.readouterr().out
    assert ORIGINS["gpt2_tiny_lm"] == "registered in this process"
    assert run_cli("prepare", "gpt2_tiny_lm", "--synthetic", "--preset", "tiny", "--out", data) == 0
    code = run_cli("run", "gpt2_tiny_lm", "--preset", "tiny", f"data.dir={data}", f"output.results_dir={results}",
                   "progress=false")  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed
    run_dir = only_run_dir(results)
    run = json.loads((run_dir / "summary.json").read_text())["runs"][0]
    assert run["status"] == "success" and run["compliance"]["passed"], run
    assert "not an MLPerf benchmark" in run["compliance"]["reason"]
    log = (run_dir / "result_0.txt").read_text()
    assert '"key": "submission_benchmark", "value": "gpt2_tiny_lm"' in log
    assert '"key": "trainbench_own_benchmark", "value": "not an MLPerf benchmark' in log
    # check, on the folder and on the bare log (resolved through the registry, not as another benchmark)
    for target in (run_dir, run_dir / "result_0.txt"):
        assert run_cli("check", target) == 0
        assert "SUCCESS (not an MLPerf benchmark" in capsys.readouterr().out
    assert run_cli("report", run_dir) == 0
    report = (run_dir / "report.md").read_text()
    assert "gpt2_tiny_lm is not an MLPerf benchmark" in report and "no MLPerf reference convergence" in report
    assert "log_perplexity is the mean next-token cross entropy over the eval tokens, in nats" in report


def test_the_common_rules_still_fail_a_broken_log_of_ones_own(own_benchmark, tmp_path):
    """The common rules check something: a log without its run_stop and with an empty submission_org fails."""
    from trainbench.mlperf import check_compliance

    lines = [
        ':::MLLOG {"namespace": "", "time_ms": 1, "event_type": "POINT_IN_TIME", "key": "submission_benchmark", '
        '"value": "gpt2_tiny_lm", "metadata": {}}',
        ':::MLLOG {"namespace": "", "time_ms": 2, "event_type": "POINT_IN_TIME", "key": "submission_org", '
        '"value": "", "metadata": {}}',
    ]
    log = tmp_path / "result_0.txt"
    log.write_text("\n".join(lines) + "\n")
    result = check_compliance(log, "5.1.0", own=True)
    assert not result.ok and "submission_org" in result.output
