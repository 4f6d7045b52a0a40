"""Inputs written to mislead or to break: option-like names given to `package`, system names that climb out of
the results folder, plugins that exit or raise while they load, config values that pass a type check and cannot
run, and results folders whose files were edited, cut short or crafted. Each ends in exit 0, 1 or 2 and one
sentence, never a traceback, a false pass or a file written outside its folder."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainbench.cli import main as cli_main


def one_sentence(capsys) -> str:
    """What the command printed, checked to be one error line and no traceback."""
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert "Traceback" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out
    return " ".join(out.split())


@pytest.fixture
def folder(converged, tmp_path) -> Path:
    """A copy of the finished tiny run, to change."""
    copy = tmp_path / "run"
    shutil.copytree(converged, copy)
    return copy


# -- package: no argument that the checker could read as an option; its verdict from what it printed ----------------


@pytest.mark.parametrize("option, value", [("--org", "-h"), ("--org", "../up"), ("--org", "."), ("--system", "-h"),
                                           ("--system", ".hidden"), ("--org", "a b")])  # fmt: skip
def test_package_refuses_an_org_or_system_that_is_not_a_plain_name(option, value, tmp_path, capsys):
    results = tmp_path / "results"
    results.mkdir()
    names = {"--org": "acme", "--system": "box"} | {option: value}
    out = tmp_path / "out"
    code = run_cli("package", results, f"--org={names['--org']}", f"--system={names['--system']}", "--out", out)
    said = one_sentence(capsys)
    assert code == 2 and f"{option} {value!r}: give a plain name" in said, said
    assert "no errors" not in said and not out.exists()


def test_the_package_verdict_is_read_from_the_checkers_output_and_it_checks_the_folder_written(
    folder, tmp_path, capsys, monkeypatch
):
    import trainbench.report.package as package

    calls = []

    def usage_only(args, **kwargs):  # what the checker prints when it takes its folder for an option: exit 0
        calls.append(args)
        usage = "usage: mlperf_logging.package_checker [-h] ...\n"
        return subprocess.CompletedProcess(args, 0, stdout=usage, stderr="")

    monkeypatch.setattr(package.subprocess, "run", usage_only)
    out = tmp_path / "out"
    assert run_cli("package", folder, "--org", "acme", "--system", "box", "--out", out) == 1
    said = capsys.readouterr().out
    assert "no errors" not in said and "gave no verdict" in said, said
    (args,) = calls
    folder_arg = args[args.index("--") + 1]
    assert Path(folder_arg).is_absolute() and Path(folder_arg) == (out / "acme").resolve()


# -- system files ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../../x", "-rf", ".", "a/b", ""])
def test_a_system_file_whose_name_is_not_a_plain_name_is_refused_naming_the_file(name, tmp_path, capsys):
    system = tmp_path / "evil.yaml"
    system.write_text(yaml.safe_dump({"name": name, "nodes": 1, "gpus_per_node": 0, "tasks_per_node": 1,
                                      "device": "cpu"}))  # fmt: skip
    results = tmp_path / "results"
    code = run_cli("submit", "bert", "--preset", "tiny", "--system", system, "--dry-run", "data.dir=/nonexistent",
                   f"output.results_dir={results}")  # fmt: skip
    said = one_sentence(capsys)
    assert code == 2 and f"system file {system}: name {name!r} must be a plain name" in said, said
    assert not results.exists() and not (tmp_path.parent / "x").exists()


# -- plugins ---------------------------------------------------------------------------------------------------------

PLUGINS = {
    "exits": "import sys\nsys.exit(3)\n",
    "hook_raises": "from trainbench.benchmarks.bert import BertBenchmark\n"
    "class Bench(BertBenchmark):\n    name = mlperf_name = 'hook_raises'\n    mlperf = False\n"
    "    @staticmethod\n    def add_prepare_arguments(parser):\n        raise RuntimeError('no parser for me')\n",
    "hook_out": "from trainbench.benchmarks.bert import BertBenchmark\n"
    "class Bench(BertBenchmark):\n    name = mlperf_name = 'hook_out'\n    mlperf = False\n"
    "    @staticmethod\n    def add_prepare_arguments(parser):\n        parser.add_argument('--out')\n",
    "markup": "from trainbench.benchmarks.bert import BertBenchmark\n"
    "class Bench(BertBenchmark):\n    name = mlperf_name = 'markup_bench'\n    mlperf = False\n"
    "    description = '[bold red]loud[/] and [/oops] closed'\n",
    "no_presets": "from trainbench.benchmarks.bert import BertBenchmark\n"
    "class Bench(BertBenchmark):\n    name = mlperf_name = 'no_presets'\n    mlperf = False\n    presets = None\n",
    "int_name": "from trainbench.benchmarks.bert import BertBenchmark\n"
    "class Bench(BertBenchmark):\n    name = 5\n    mlperf_name = 'int_name'\n    mlperf = False\n",
    "empty_name": "from trainbench.benchmarks.bert import BertBenchmark\n"
    "class Bench(BertBenchmark):\n    name = ''\n    mlperf_name = 'empty_name'\n    mlperf = False\n",
}


def trainbench(*args, cwd: Path, path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(path), os.environ.get("PYTHONPATH")])),
               COLUMNS="300")  # fmt: skip
    return subprocess.run([sys.executable, "-m", "trainbench", *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def test_plugins_that_exit_raise_or_are_malformed_are_named_and_every_other_command_works(tmp_path):
    site = tmp_path / "site"
    info = site / "hostile_plugins-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hostile-plugins\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[trainbench.benchmarks]\n" + "".join(
        f"{name} = hostile_{name}:{'Bench' if name != 'exits' else 'X'}\n" for name in PLUGINS))  # fmt: skip
    for name, code in PLUGINS.items():
        (site / f"hostile_{name}.py").write_text(code)
    listed = trainbench("list", cwd=tmp_path, path=site)
    out = listed.stdout + listed.stderr
    assert listed.returncode == 0 and "Traceback" not in out, out
    assert "[bold red]loud[/] and [/oops] closed" in out  # the description as written, not as markup
    assert "of hostile-plugins 0.1): it called sys.exit(3)" in out
    assert "no_presets: presets must be a non-empty dict" in out
    assert "a benchmark's name must be a plain name" in out and "not 5" in out and "not ''" in out
    assert (
        "benchmark hook_raises (hostile-plugins 0.1, entry point hook_raises) is left out of `trainbench prepare`: "
        "its add_prepare_arguments failed: RuntimeError: no parser for me"
    ) in " ".join(out.split())
    assert "benchmark hook_out" in out and "add_prepare_arguments failed" in out
    prepared = trainbench("prepare", "hook_raises", "--synthetic", "--out", "data", cwd=tmp_path, path=site)
    said = prepared.stdout + prepared.stderr
    assert prepared.returncode == 2 and "Traceback" not in said and "no parser for me" in said, said
    assert not (tmp_path / "data").exists()
    checked = trainbench("check", tmp_path / "nonexistent", cwd=tmp_path, path=site)
    said = checked.stdout + checked.stderr
    assert checked.returncode == 2 and "does not exist" in said and "Traceback" not in said, said


# -- config ----------------------------------------------------------------------------------------------------------


def test_integers_are_parsed_as_integers_not_through_a_float():
    from trainbench.benchmarks import get_benchmark
    from trainbench.config import apply_overrides

    cfg = get_benchmark("bert").config("tiny")
    apply_overrides(cfg, {"seed": "9007199254740993", "data.global_batch_size": "1e3", "eval_batch_size": "64.0"})
    assert (cfg.seed, cfg.data.global_batch_size, cfg.data.eval_batch_size) == (9007199254740993, 1000, 64)


@pytest.mark.parametrize(
    "args, message",
    [
        (["output.telemetry_hz=1e-300"], "'output.telemetry_hz' must be 0 (off) or between 0.01 and 100"),
        (["perf.offload_recomputed_inputs=true"], "perf.offload_recomputed_inputs=true has no effect on this run of "
                                                  "bert: no block is recomputed"),
        (["distributed.overlap_compiled=true"], "distributed.overlap_compiled=true has no effect on this run of bert"),
        (["distributed.grad_reduce_dtype=bf16"], "distributed.grad_reduce_dtype=bf16 has no effect on this run of "
                                                 "bert: one rank all-reduces no gradients"),
        (["distributed.bucket_cap_mb=50"], "distributed.bucket_cap_mb=50.0 has no effect on this run of bert"),
        (["perf.optimizer_kernel=torch"], "perf.optimizer_kernel=torch has no effect on bert: its LAMB"),
        (["--benchmark", "llama31_8b", "distributed.reduce_once_a_step=true"],
         "distributed.reduce_once_a_step=true has no effect on this run of llama31_8b: one rank all-reduces no"),
        (["distributed.reduce_once_a_step=true"], "distributed.reduce_once_a_step=true has no effect on bert: DDP "
                                                  "reduces its gradients once a step already"),
        (["--benchmark", "llama31_8b", "distributed.keep_gathered=true"],
         "distributed.keep_gathered=true has no effect on this run of llama31_8b: one rank all-reduces no"),
        (["--benchmark", "llama2_70b_lora", "distributed.nproc=2", "distributed.keep_gathered=true"],
         "distributed.keep_gathered=true has no effect on llama2_70b_lora: its frozen base is what FSDP2 gathers"),
        (["device=cpu", "output.gpu_links=false"], "output.gpu_links=false has no effect on this run of bert: a run on "
                                                   "the CPU records no GPU's links"),
        (["--benchmark", "llama31_8b", "perf.probe_sustained_s=40"],
         "perf.probe_sustained_s=40.0 has no effect on this run of llama31_8b: only perf.plan=auto probes the GPU"),
        (["--benchmark", "llama31_8b", "perf.probe_blocks=8"],
         "perf.probe_blocks=8 has no effect on this run of llama31_8b: only perf.plan=auto probes the GPU"),
        (["--benchmark", "llama31_8b", "perf.plan=auto", "perf.probe_sustained_s=601"],
         "'perf.probe_sustained_s' must be at least 0 and at most 600"),
        (["--benchmark", "llama31_8b", "device=cpu", "perf.optimizer_kernel=torch"],
         "perf.optimizer_kernel=torch has no effect on this run of llama31_8b: the CPU takes torch's AdamW update"),
        # values that built a model that crashed mid-run, or tried to allocate without end
        (["--benchmark", "flux1", "model.rope_axes=40,-4,-4"], "three positive even widths"),
        (["--benchmark", "flux1", "model.mlp_ratio=1e308"], "'model.mlp_ratio' must be above 0 and at most 64"),
        (["--benchmark", "gpt_oss_20b", "model.num_experts=1e9"], "'model.num_experts' must be at least 1 and at most"),
    ],
)  # fmt: skip
def test_config_values_that_would_break_or_do_nothing_are_refused_before_anything_runs(args, message, tmp_path,
                                                                                         capsys):  # fmt: skip
    results = tmp_path / "results"
    benchmark = args[1] if args[0] == "--benchmark" else "bert"
    args = args[2:] if args[0] == "--benchmark" else args
    code = run_cli("run", benchmark, "--preset", "tiny", "data.dir=/nonexistent", f"output.results_dir={results}",
                   *args)  # fmt: skip
    said = one_sentence(capsys)
    assert code == 2 and message in said, said
    assert not results.exists()


def test_keys_without_effect_are_refused_by_the_python_api_too():
    """The refusal lives where every entry point builds its config (Benchmark.validate), not in the command line:
    build_config, and validate on a config changed after it was built, say the same sentence."""
    import dataclasses

    from trainbench.errors import ConfigError
    from trainbench.resolve import build_config

    with pytest.raises(ConfigError, match="distributed.grad_reduce_dtype=bf16 has no effect on this run of bert: one "
                                          "rank all-reduces no gradients"):  # fmt: skip
        build_config("bert", "tiny", overrides={"distributed.grad_reduce_dtype": "bf16"})
    bench, cfg = build_config("bert", "tiny", overrides={"distributed.grad_reduce_dtype": "bf16",
                                                         "distributed.nproc": "2"})  # fmt: skip
    one_rank = dataclasses.replace(cfg, distributed=dataclasses.replace(cfg.distributed, nproc=1))
    with pytest.raises(ConfigError, match="distributed.grad_reduce_dtype=bf16 has no effect on this run of bert"):
        bench.validate(one_rank)
    with pytest.raises(ConfigError, match="perf.offload_recomputed_inputs=true has no effect on this run of bert: no "
                                          "block is recomputed"):  # fmt: skip
        bench.validate(dataclasses.replace(cfg, perf=dataclasses.replace(cfg.perf, offload_recomputed_inputs=True)))
    with pytest.raises(ConfigError, match="perf.optimizer_kernel=torch has no effect on bert: its LAMB"):
        build_config("bert", "tiny", overrides={"perf.optimizer_kernel": "torch"})


@pytest.mark.parametrize("ranks, refused", [(2, False), (1, True)])
def test_submit_judges_keys_without_effect_at_the_systems_ranks(ranks, refused, small_data, tmp_path, capsys):
    """`submit` takes its ranks from the system file: a key that takes effect on several ranks is accepted for a
    system of two and refused, in the same sentence as `run`'s, for a system of one."""
    system = tmp_path / "s.yaml"
    system.write_text(f"nodes: 1\ntasks_per_node: {ranks}\ndevice: cpu\ncpu_bind: null\n")
    results = tmp_path / "results"
    code = run_cli("submit", "bert", "--preset", "tiny", "--system", system, "--dry-run", f"data.dir={small_data}",
                   f"output.results_dir={results}", "distributed.bucket_cap_mb=50")  # fmt: skip
    if refused:
        said = one_sentence(capsys)
        assert code == 2 and "distributed.bucket_cap_mb=50.0 has no effect on this run of bert: one rank" in said
        assert not results.exists()
    else:
        assert code == 0, capsys.readouterr().out[-2000:]
        config = yaml.safe_load((next(results.iterdir()) / "config.yaml").read_text())
        assert config["distributed"]["bucket_cap_mb"] == 50 and config["distributed"]["nproc"] == 2


@pytest.mark.parametrize(
    "content, message",
    [
        (b"a: &x [*x]\n", "holds an alias that refers to itself"),
        ("optimizer:\n  lr: 0.001\n".encode("utf-16"), "is not UTF-8 text"),
    ],
)
def test_a_config_file_that_is_recursive_or_not_utf8_is_one_sentence(content, message, tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_bytes(content)
    assert run_cli("run", "bert", "--config", config, "data.dir=/nonexistent") == 2
    said = one_sentence(capsys)
    assert f"config file {config}" in said and message in said, said


def test_help_config_shows_every_keys_choices(capsys):
    assert run_cli("run", "bert", "--preset", "tiny", "--help-config") == 0
    out = capsys.readouterr().out
    assert "device (str [auto|cpu|cuda])" in out and "grad_reduce_dtype (str [fp32|bf16])" in out


# -- results folders -------------------------------------------------------------------------------------------------


def set_json(path: Path, **fields) -> None:
    path.write_text(json.dumps(json.loads(path.read_text()) | fields))


@pytest.mark.parametrize(
    "change, command, message",
    [
        (lambda f: set_json(f / "summary.json", mlperf_benchmark=5), "report", "summary.json: mlperf_benchmark should"),
        (lambda f: set_json(f / "summary.json", waived_checks="all"), "report", "waived_checks should be a list"),
        (lambda f: set_json(f / "run_0.json", energy="lots"), "report", "run_0.json: energy should be an object"),
        (lambda f: (f / "metrics.jsonl").write_text('{"run": 0, "step": 1, "samples": 64, "loss": "low"}\n'),
         "report", "metrics.jsonl, line 1: loss should be a number"),
        (lambda f: (f / "job.json").write_text("{not json"), "report", "job.json is not a JSON object"),
        (lambda f: (f / "job.json").write_text("{not json"), "package", "job.json is not a JSON object"),
        (lambda f: (f / "job.json").write_text('{"system": ["a"]}'), "report", "job.json: system should be a string"),
        (lambda f: (f / "config.yaml").write_text("seed: 1\n"), "check", "names no benchmark and preset"),
        (lambda f: (f / "config.yaml").write_text("seed: 1\n"), "package", "names no benchmark and preset"),
        (lambda f: (f / "telemetry_x_gpu0.csv").write_text("time_ms,power_w\n1,abc\n"), "report",
         "GPU telemetry files"),
    ],
)  # fmt: skip
def test_a_results_file_of_the_wrong_shape_is_one_sentence_naming_it(change, command, message, folder, tmp_path,
                                                                     capsys):  # fmt: skip
    change(folder)
    extra = ["--org", "acme", "--system", "box", "--out", tmp_path / "pkg"] if command == "package" else []
    code = run_cli(command, folder, *extra)
    said = one_sentence(capsys)
    assert code == 2 and message in said, said


def test_report_md_shows_crafted_html_as_text(folder, capsys):
    crafted = '<img src=x onerror="alert(1)"> [link](javascript:alert(1)) |'
    set_json(folder / "summary.json", benchmark=crafted, metric_explanation=crafted)
    (folder / "job.json").write_text(json.dumps({"system": crafted}))
    assert run_cli("report", folder) == 0
    md = (folder / "report.md").read_text()
    assert "<img" not in md and "&lt;img" in md and "\\[link\\](javascript" in md  # a link shown, not followed
    assert "<img src=x" not in (folder / "report.html").read_text()  # (its plots are images of its own)


def test_the_index_and_the_comparison_show_crafted_html_as_text(folder, converged, tmp_path):
    crafted = '<img src=x onerror="alert(1)">'
    set_json(folder / "summary.json", benchmark=crafted, preset=crafted)
    outcome = json.loads((folder / "run_0.json").read_text())
    (folder / "run_0.json").write_text(
        json.dumps(outcome | {"system": outcome["system"] | {"cpu": crafted, "trainbench": crafted}})
    )
    (folder / "config.yaml").write_text((folder / "config.yaml").read_text() + f"note: '{crafted}'\n")
    root = tmp_path / "many"
    shutil.copytree(folder, root / "<img src=x onerror=alert(2)>")
    measured = root / "bench"
    measured.mkdir(parents=True)
    (measured / "bench.json").write_text(json.dumps(BENCH | {"device": crafted, "benchmark": crafted}))
    assert run_cli("report", root) == 0
    index = (root / "index.html").read_text()
    assert "<img" not in index and "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in index
    assert 'href="%3Cimg%20src%3Dx%20onerror%3Dalert%282%29%3E/report.html"' in index
    for page in (root / "bench" / "report.html", root / "<img src=x onerror=alert(2)>" / "report.html"):
        assert "<img src=x" not in page.read_text()
    page = tmp_path / "compare.html"
    assert run_cli("report", folder, converged, "--allow-different", "--out", page) == 0
    text = page.read_text()
    assert "<img src=x" not in text and "&lt;img src=x" in text and text.count("<img ") == 2  # the two plots
    assert run_cli("report", measured, measured, "--out", page) == 0
    assert "<img" not in page.read_text()


BENCH = {"kind": "throughput measurement", "benchmark": "bert", "preset": "tiny", "figures": "measured",
         "blocks": 2, "blocks_measured": None, "ranks": 1, "device": "cpu", "global_batch_size": 64,
         "samples_per_step": 64, "step_seconds": 0.5, "samples_per_s": 128.0, "tokens_per_s": 16384.0,
         "tokens_per_s_per_rank": 16384.0, "tokens_per_s_per_node": 16384.0, "mfu": None, "peak_memory_gib": None,
         "eval_seconds_per_sample": 0.001, "energy_joules_per_token": None, "ruleset": "5.0.0", "projection": None,
         "profile": None}  # fmt: skip


@pytest.mark.parametrize("fields, message", [({"ranks": "one"}, "ranks should be a whole number"),
                                             ({"projection": {"samples": 1}}, "projection.minutes is missing"),
                                             ({"kind": None, "figures": 3}, "figures should be a string"),
                                             ({"projection_none": ["x"]}, "projection_none should be a string")],
                         )  # fmt: skip
def test_a_crafted_bench_json_is_one_sentence(fields, message, tmp_path, capsys):
    folder = tmp_path / "bench"
    folder.mkdir()
    (folder / "bench.json").write_text(json.dumps(BENCH | fields))
    assert run_cli("report", folder) == 2
    said = one_sentence(capsys)
    assert "bench.json" in said and message in said, said


# -- fuzz: every file report, check and package read, mutated ------------------------------------------------------

JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=12)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=6,
)
MUTATION = st.tuples(st.sampled_from(["truncate", "garbage", "retype"]), st.floats(0, 1), st.binary(max_size=64),
                     JSON_VALUES, st.integers(0, 10**6))  # fmt: skip
PREFIX = ":::MLLOG "


def mutate(path: Path, mutation) -> None:
    """Cut the file short, replace it by bytes, or give one of its values (a JSON field, a YAML key, a CSV cell, a log
    event's field) another value of any JSON kind."""
    how, fraction, garbage, value, pick = mutation
    if how == "garbage":
        path.write_bytes(garbage)
        return
    text = path.read_text(errors="replace")
    if how == "truncate":
        path.write_text(text[: int(len(text) * fraction)])
        return
    if path.suffix == ".json":
        record = json.loads(text)
        key = sorted(record)[pick % len(record)]
        if isinstance(record[key], dict) and record[key] and pick % 2:
            inner = record[key]
            inner[sorted(inner)[pick % len(inner)]] = value
        else:
            record[key] = value
        path.write_text(json.dumps(record))
    elif path.suffix == ".yaml":
        record = yaml.safe_load(text)
        key = sorted(record)[pick % len(record)]
        if isinstance(record[key], dict) and record[key]:
            record[key][sorted(record[key])[pick % len(record[key])]] = value
        else:
            record[key] = value
        path.write_text(yaml.safe_dump(record))
    elif path.suffix == ".csv":
        lines = text.splitlines()
        n = pick % len(lines)
        cells = lines[n].split(",")
        cells[pick % len(cells)] = json.dumps(value)
        lines[n] = ",".join(cells)
        path.write_text("\n".join(lines) + "\n")
    else:  # metrics.jsonl and the MLPerf log: one line's JSON
        lines = text.splitlines()
        rows = [i for i, line in enumerate(lines) if line.startswith("{") or PREFIX in line]
        n = rows[pick % len(rows)]
        head, _, body = lines[n].rpartition(PREFIX) if PREFIX in lines[n] else ("", "", lines[n])
        record = json.loads(body)
        record[sorted(record)[pick % len(record)] if pick % 3 else "value"] = value
        lines[n] = (head + PREFIX if head or PREFIX in lines[n] else "") + json.dumps(record)
        path.write_text("\n".join(lines) + "\n")


# Which commands read each file of a results folder (package's checker itself is stubbed: its reading is not ours).
FILES = {
    "summary.json": ("report", "check", "package"),
    "run_0.json": ("report",),
    "job.json": ("report", "package"),
    "config.yaml": ("check", "package", "report"),
    "metrics.jsonl": ("report",),
    "telemetry_vm_cpu.csv": ("report",),
    "result_0.txt": ("report", "check", "package"),
}


def quiet(*args) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main([str(a) for a in args])
    return code, out.getvalue() + err.getvalue()


def test_a_summary_whose_lists_are_null_is_read_as_one_without_them(converged, tmp_path):
    """summary.json with its runs and its waived checks null (as a hand edit or another writer leaves them): the
    reader lets a null field stand for a missing one, so the report finds no metric's name (no eval plot) and the
    check waives nothing, each ending in its verdict (once a TypeError in the report, found by the fuzz below)."""
    folder = tmp_path / "run"
    shutil.copytree(converged, folder)
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["runs"] and "waived_checks" in summary  # (the run wrote both: the test nulls what was there)
    (folder / "summary.json").write_text(json.dumps(summary | {"runs": None, "waived_checks": None}))
    code, out = quiet("report", folder)
    assert code == 0 and "Traceback" not in out, out
    assert "min** — time to train (one run)" in (folder / "report.md").read_text()  # the verdict, read as before
    code, out = quiet("check", folder)
    assert code in (0, 1) and "Traceback" not in out, out


@pytest.mark.parametrize("name", sorted(FILES))
def test_a_mutated_results_file_ends_in_a_verdict_or_one_sentence(name, converged, tmp_path_factory, monkeypatch):
    import trainbench.report.package as package

    base = tmp_path_factory.mktemp("fuzz")
    shutil.copytree(converged, base / "original")
    if name == "job.json":
        (base / "original" / "job.json").write_text(json.dumps({"system": "local_cpu_1x2", "layout": "1x1x64x1"}))
    if name.startswith("telemetry_"):
        found = sorted((base / "original").glob("telemetry_*.csv"))
        assert found, "the converged run recorded no telemetry"
        found[0].rename(base / "original" / name)
    verdict = "INFO - PACKAGE CHECKER FOUND NO ERRORS, SUCCESS !\n"
    import trainbench.mlperf as mlperf
    import trainbench.report.scoring as scoring

    checked, real = {}, mlperf.check_compliance

    def remembered(log, ruleset, *args, **kwargs):  # the compliance checker once per distinct log: the fuzz's time
        key = (Path(log).read_bytes(), ruleset, args, tuple(sorted(kwargs.items())))
        if key not in checked:
            checked[key] = real(log, ruleset, *args, **kwargs)
        return checked[key]

    monkeypatch.setattr(mlperf, "check_compliance", remembered)
    monkeypatch.setattr(scoring, "check_compliance", remembered)
    monkeypatch.setattr(package.subprocess, "run", lambda args, **kw: subprocess.CompletedProcess(args, 0, verdict, ""))
    counter = iter(range(10**6))

    @settings(max_examples=8, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(mutation=MUTATION)
    def one(mutation):
        folder = base / f"case{next(counter)}"
        shutil.copytree(base / "original", folder)
        try:
            mutate(folder / name, mutation)
        except (ValueError, KeyError, TypeError, AttributeError, ZeroDivisionError, yaml.YAMLError):
            return  # a mutation that does not apply to this file (an empty one, a line that is no object)
        for command in FILES[name]:
            extra = ["--org", "acme", "--system", "box", "--out", folder / "pkg"] if command == "package" else []
            code, out = quiet(command, folder, *extra)
            assert code in ((0, 2) if command == "report" else (0, 1, 2)), (command, code, out)
            assert "Traceback" not in out, out
        shutil.rmtree(folder)

    one()
