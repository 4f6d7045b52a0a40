"""MLPerf rulesets: each benchmark follows the newest ruleset that knows it unless told another, its log holds what
that ruleset requires (v6.x: the nine keys of what the run ran in and how it was laid out, each read off the run),
and the checker, the report and the package speak of the ruleset the run followed."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import only_run_dir, run_cli

from trainbench import __version__
from trainbench.benchmarks import get_benchmark
from trainbench.distributed import DistInfo, Placed
from trainbench.mlperf import DISCLOSURE_KEYS, check_compliance, known_mlperf_benchmarks, read_log, round_benchmarks
from trainbench.report.package import check_package
from trainbench.resolve import build_config
from trainbench.train.setup import run_disclosure

ONE = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
TWO = dataclasses.replace(ONE, world_size=2)


def logged(log: Path) -> dict:
    return {e["key"]: e["value"] for e in read_log(log)}


# -- which ruleset --------------------------------------------------------------------------------------------------


def test_each_benchmark_follows_the_newest_ruleset_that_knows_it_by_default():
    defaults = {name: get_benchmark(name).ruleset for name in ("bert", "gpt3", "llama31_8b", "llama2_70b_lora")}
    assert defaults == {"bert": "5.0.0", "gpt3": "4.1.0", "llama31_8b": "6.1.0", "llama2_70b_lora": "6.1.0"}
    for name in ("llama31_8b", "llama2_70b_lora"):
        bench = get_benchmark(name)
        assert bench.rulesets == ("6.1.0", "6.0.0", "5.1.0")
        assert all(bench.mlperf_name in round_benchmarks(r) and bench.mlperf_name in known_mlperf_benchmarks(r)
                   for r in bench.rulesets)  # fmt: skip
    # Later rounds dropped bert and gpt3: their newest is the last round that lists them.
    assert "bert" in round_benchmarks("5.0.0") and "bert" not in round_benchmarks("5.1.0")
    assert "gpt3" in round_benchmarks("4.1.0") and "gpt3" not in round_benchmarks("5.0.0")


@pytest.mark.parametrize(
    "benchmark, ruleset, says",
    [
        ("bert", "6.1.0", "bert follows ruleset 5.0.0 (the 6.1.0 round does not list bert)"),
        ("llama31_8b", "9.9.9", "output.ruleset=9.9.9 is not a ruleset of the installed mlperf-logging"),
        ("llama2_70b_lora", "4.0.0", "llama2_70b_lora follows ruleset 6.1.0, 6.0.0, 5.1.0"),
    ],
)
def test_a_ruleset_the_benchmark_does_not_follow_is_one_sentence_before_any_folder(benchmark, ruleset, says, tmp_path,
                                                                                    capsys):  # fmt: skip
    code = run_cli("run", benchmark, "--ruleset", ruleset, "data.dir=/nonexistent", f"output.results_dir={tmp_path}")
    out = capsys.readouterr().out
    assert code == 2 and says in out and len([ln for ln in out.splitlines() if ln.strip()]) == 1, out
    assert not any(tmp_path.iterdir())


def test_an_older_ruleset_is_taken_and_saved_in_the_config():
    _, cfg = build_config("llama2_70b_lora", "tiny", overrides={"output.ruleset": "5.1.0"})
    assert get_benchmark("llama2_70b_lora").ruleset_of(cfg) == "5.1.0"
    _, default = build_config("llama2_70b_lora", "tiny")
    assert get_benchmark("llama2_70b_lora").ruleset_of(default) == "6.1.0"


def test_check_and_package_refuse_a_ruleset_in_one_sentence(converged, tmp_path, capsys):
    for args in (
        ["check", converged, "--ruleset", "6.1.0"],
        ["check", converged, "--ruleset", "0.0.9"],
        ["package", converged, "--org", "o", "--system", "s", "--out", tmp_path / "p", "--ruleset", "6.1.0"],
    ):
        assert run_cli(*args) == 2, args
        out = capsys.readouterr().out
        assert out.startswith("error:") and "ruleset" in out and "Traceback" not in out, out
    assert not (tmp_path / "p").exists()


# -- the nine keys, read off the run -------------------------------------------------------------------------------


def _disclosure(benchmark: str, overrides: dict, info: DistInfo = ONE, convert=None, yaml_files=None) -> dict:
    """What a run of this config would log: its model built and placed on one CPU rank (``info`` says how many ranks
    the run has), ``convert`` applied to it as a placement would."""
    bench, cfg = build_config(benchmark, "tiny", yaml_files, {"device": "cpu", **overrides})
    model = bench.family.build_model(cfg)
    if any(p.is_meta for p in model.parameters()):
        model = model.to_empty(device="cpu")
    if convert is not None:
        convert(model)
    bf16 = cfg.precision == "bf16"
    comm = "bfloat16" if info.world_size > 1 and bf16 else "fp32"  # as the FSDP placement sets it
    return run_disclosure(cfg, Placed(module=model, model=model, comm_precision=comm), bf16, info)


def _frozen_base_in_fp8(model) -> None:
    """The FP8 base's placement: the base frozen, its linear layers quantised (the adapters would stay)."""
    from trainbench.families import fp8

    model.requires_grad_(False)
    assert fp8.quantize_frozen(model) > 0


def test_the_precisions_follow_the_run():
    plain = _disclosure("llama31_8b", {})
    assert [plain[k] for k in DISCLOSURE_KEYS[:3]] == ["fp32", "fp32", "fp32"]
    bf16 = _disclosure("llama31_8b", {"precision": "bf16"}, TWO)
    assert [bf16[k] for k in DISCLOSURE_KEYS[:3]] == ["bfloat16", "bfloat16", "bfloat16"]
    assert _disclosure("llama31_8b", {"precision": "bf16"})["lowest_numerical_precision_in_comm"] == "fp32"  # 1 rank

    from trainbench.families import fp8

    fp8_run = _disclosure("llama31_8b", {"precision": "bf16"}, convert=fp8.train_blocks_in_fp8)  # torchao's swap
    assert fp8_run["lowest_numerical_precision_in_linear"] == "fp8"
    assert fp8_run["lowest_numerical_precision_in_attn"] == "bfloat16"
    fp8_base = _disclosure("llama2_70b_lora", {}, convert=_frozen_base_in_fp8)
    assert fp8_base["lowest_numerical_precision_in_linear"] == "fp8"


def test_the_layout_follows_the_config(tmp_path):
    two_tp = _disclosure("llama31_8b", {"distributed.nproc": "2", "distributed.tp": "2"}, TWO)
    assert two_tp["tensor_parallelism"] == 2 and two_tp["micro_batch_size"] == 32
    assert _disclosure("llama31_8b", {"distributed.nproc": "2"}, TWO)["tensor_parallelism"] == 1
    small = _disclosure("llama2_70b_lora", {"micro_batch_size": "2"})
    assert small["micro_batch_size"] == 2 and small["config_filename"] == "tiny"
    assert {small[k] for k in ("pipeline_parallelism", "context_parallelism", "expert_parallelism")} == {1}
    mine = tmp_path / "my_system.yaml"
    mine.write_text("optimizer:\n  lr: 0.001\n")
    assert _disclosure("llama2_70b_lora", {}, yaml_files=[str(mine)])["config_filename"] == "my_system.yaml"


def test_bert_reduces_in_the_gradient_dtype_it_is_given():
    """DDP's all-reduce dtype (distributed.grad_reduce_dtype) on a one-process gloo group."""
    import torch.distributed as dist

    from trainbench.benchmarks.bert import BertBenchmark  # noqa: F401  (registers bert)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for dtype, expected in (("bf16", "bfloat16"), ("fp32", "fp32")):
            # configured for the two ranks it is placed as (TWO): on one, the key has no effect and is refused
            bench, cfg = build_config("bert", "tiny", overrides={"distributed.grad_reduce_dtype": dtype,
                                                                 "distributed.nproc": "2"})  # fmt: skip
            placed = bench.family.place(bench.family.build_model(cfg), cfg, TWO, bf16=False)
            assert run_disclosure(cfg, placed, False, TWO)["lowest_numerical_precision_in_comm"] == expected
    finally:
        dist.destroy_process_group()


# -- logs under 6.1.0 and under an older ruleset ------------------------------------------------------------------

LORA_SHORT = ["progress=false", "telemetry_hz=0", "eval.every_samples=32", "schedule.max_samples=64"]


def test_a_run_under_an_older_ruleset_writes_none_of_the_newer_keys(lora_data, tmp_path):
    for ruleset, results in (("5.1.0", tmp_path / "old"), ("6.1.0", tmp_path / "new")):
        run_cli("run", "llama2_70b_lora", "--ruleset", ruleset, f"data.dir={lora_data}",
                f"output.results_dir={results}", *LORA_SHORT)  # fmt: skip
        run_dir = only_run_dir(results)
        keys = logged(run_dir / "result_0.txt")
        assert json.loads((run_dir / "summary.json").read_text())["ruleset"] == ruleset
        if ruleset == "5.1.0":
            assert not set(DISCLOSURE_KEYS) & set(keys)
        else:
            assert set(DISCLOSURE_KEYS) <= set(keys)
        # Short of the target: the checker's one complaint is the eval target, never a missing key.
        result = check_compliance(run_dir / "result_0.txt", ruleset)
        assert not [e for e in result.other_errors() if "Required" in e], result.output[-2000:]


# -- a v6.1 submission package --------------------------------------------------------------------------------------


@pytest.mark.full
def test_a_package_of_ten_tiny_lora_runs_passes_the_6_1_0_package_checker_but_its_rcp_check(lora_data, tmp_path,
                                                                                             capsys):  # fmt: skip
    """10 runs (seeds 1 to 10) to the target, laid out as a v6.1 submission: mlperf-logging's package checker passes
    the system description, the seeds and every result file's compliance; its one error is the RCP check, which
    compares the tiny model's samples to converge with the 70B model's reference points and is named as such."""
    results = tmp_path / "results"
    assert run_cli("run", "llama2_70b_lora", "--nexp", "10", f"data.dir={lora_data}", f"output.results_dir={results}",
                   "progress=false", "telemetry_hz=0", "seed=1") == 0  # fmt: skip
    run_dir = only_run_dir(results)
    assert sorted(logged(run_dir / f"result_{i}.txt")["seed"] for i in range(10)) == list(range(1, 11))
    capsys.readouterr()
    assert run_cli("package", run_dir, "--org", "acme", "--system", "cpu_box", "--out", tmp_path / "pkg") == 0
    out = capsys.readouterr().out
    log = (tmp_path / "pkg" / "acme" / "package_checker.log").read_text()
    errors = [ln for ln in log.splitlines() if ln.startswith("ERROR")]
    assert errors == ["ERROR - RCP Test Failed: RCP found"], log[-3000:]
    assert "System description checker passed for cpu_box" in log and "Seed checker failed" not in log
    assert log.count("Running compliance on file") == 10 and "do not comply" not in log and "does not" not in log
    assert "runs: 10 finished, of the 10 a llama2_70b_lora submission needs\n" in out, out
    assert "failed, as a scaled-down preset must: RCP Test Failed: RCP found" in out, out
    assert "(ruleset 6.1.0): SUCCESS except the RCP check a scaled-down preset cannot pass" in out, out
    # A submission skeleton: the code that ran, and a system description from what the runs recorded of their node.
    impl = (
        tmp_path / "pkg" / "acme" / "benchmarks" / "llama2_70b_lora" / "implementations" / f"trainbench-{__version__}"
    )
    assert (impl / "src" / "trainbench" / "benchmarks" / "lora.py").is_file() and (
        impl / "config_cpu_box.yaml"
    ).is_file()
    record = json.loads(next(run_dir.glob("node_*.json")).read_text())
    desc = json.loads((tmp_path / "pkg" / "acme" / "systems" / "cpu_box.json").read_text())
    assert desc["host_processors_per_node"] == str(record["cpu"]["sockets"])
    assert desc["host_processor_core_count"] == str(record["cpu"]["cores_per_socket"])
    assert desc["number_of_nodes"] == "1" and desc["operating_system"] == record["os"]
    # Of a full-size run, nothing excuses the RCP check.
    full = check_package(tmp_path / "pkg" / "acme", "6.1.0", scaled_down=False)
    assert full.errors == ["RCP Test Failed: RCP found"] and not full.beyond_scale and not full.ok
    bench = get_benchmark("llama2_70b_lora")
    assert bench.scaled_down(build_config("llama2_70b_lora", "tiny")[1])
    assert not bench.scaled_down(bench.presets["llama2-70b"]())
    # An edited system description that lacks a required field is refused before anything is written.
    desc = json.loads((tmp_path / "pkg" / "acme" / "systems" / "cpu_box.json").read_text())
    del desc["cooling"]
    edited = tmp_path / "desc.json"
    edited.write_text(json.dumps(desc))
    assert run_cli("package", run_dir, "--org", "acme", "--system", "cpu_box", "--out", tmp_path / "pkg2",
                   "--system-desc", edited) == 2  # fmt: skip
    assert "lacks 1 field(s) the package checker requires: cooling" in capsys.readouterr().out
    assert not (tmp_path / "pkg2").exists()
