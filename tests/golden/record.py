"""The runs whose numbers a restructure must keep: per-step losses, every eval, and the MLPerf log.

``python tests/golden/record.py`` (from the repository root) writes ``tests/golden/<name>.json`` for each run;
``tests/test_golden.py`` runs them again (``--out DIR``) and compares bit for bit. Record again only when a change is
meant to alter what a run computes, and say so in the commit.

Bit for bit holds across machines only on one numeric path: by default MKL picks its GEMM kernels by CPU (an AVX-512
Intel and an AMD EPYC gave first losses 6.273987293 and 6.273986816 for the same run), PyTorch and oneDNN their
vector kernels by the widest instruction set, and reductions split by thread count. So the runs execute with MKL's
conditional numerical reproducibility on its ``COMPATIBLE`` branch (the same results on Intel and compatible CPUs),
PyTorch's and oneDNN's AVX2 kernels, and the threads a 2-core machine gives each rank (2 for one rank, 1 each for
two), whatever this machine has; the script re-executes itself with that environment when started without it. (The
optimizers' square roots avoid MKL's vector math, which differs by vendor even so: trainbench/optim/sqrt.py.) On
that path the five runs gave the same bits on an AMD EPYC (PyTorch 2.13) and an Intel Xeon (PyTorch 2.11).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # conftest's helpers

from conftest import only_run_dir, read_metrics, run_cli, tiny_spec  # noqa: E402

from trainbench.data.synthetic_bert import prepare_synthetic  # noqa: E402

# 30 optimizer steps each, a loss record every step, evals inside the window, no telemetry, a fixed platform name.
COMMON = ["--preset", "tiny", "log_every_steps=1", "telemetry_hz=0", "progress=false", "submission_platform=golden"]
BERT = ["eval_samples=256", "eval.every_samples=640", "schedule.max_samples=1920"]  # GBS 64
LLM = ["eval_samples=64", "eval.every_samples=320", "schedule.max_samples=960"]  # GBS 32
# GBS 128; a target past what 30 steps reach, so that the run keeps its 30 steps and 3 evals.
DLRMV4 = ["eval_samples=256", "eval.every_samples=1280", "schedule.max_samples=3840", "eval.target=0.95"]
RUNS = {
    "bert_1rank": ("bert", "bert", [*BERT]),
    "bert_2ranks": ("bert", "bert", [*BERT, "--nproc", "2", "micro_batch_size=32"]),
    "bert_accumulation4": ("bert", "bert", [*BERT, "micro_batch_size=16"]),
    "llama31_8b": ("llama31_8b", "llm", [*LLM]),
    "gpt3": ("gpt3", "llm", [*LLM]),
    "gpt_oss_20b": ("gpt_oss_20b", "llm", [*LLM]),
    "dlrmv4": ("dlrmv4", "dlrmv4", [*DLRMV4]),
}


# Read when torch and MKL load, so they must be in the environment before the process starts.
PINNED = {"MKL_CBWR": "COMPATIBLE,STRICT", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
CORES = 2  # threads per machine, split over a run's ranks


def pinned_path_missing() -> str | None:
    """Why this machine cannot take the recorded numeric path, or None."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the recorded numbers are x86-64's MKL and AVX2 path; this machine is {platform.machine()}"
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if " avx2" not in flags:
        return "the recorded numbers are PyTorch's AVX2 kernels' and this CPU has no AVX2"
    return None


def ranks(name: str) -> int:
    extra = RUNS[name][2]
    return int(extra[extra.index("--nproc") + 1]) if "--nproc" in extra else 1


def prepare_data(root: Path, names: list[str]) -> dict[str, Path]:
    """The data the runs ``names`` read: the tests' small BERT set, the tiny synthetic LLM language, the tiny
    synthetic listening sessions."""
    needed = {RUNS[name][1] for name in names}
    data = {key: root / key for key in needed}
    if "bert" in needed:
        prepare_synthetic(data["bert"], tiny_spec())
    if "llm" in needed:
        assert run_cli("prepare", "llama31_8b", "--synthetic", "--preset", "tiny", "--out", data["llm"]) == 0
    if "dlrmv4" in needed:
        assert run_cli("prepare", "dlrmv4", "--synthetic", "--preset", "tiny", "--out", data["dlrmv4"]) == 0
    return data


# What the log says of the machine and of the code that ran, not of the numbers: whether the page cache was dropped
# (the runner's rights) and which trainbench wrote it (a new commit each time).
MACHINE_KEYS = {"cache_clear"}
CODE_KEYS = {"trainbench_version", "trainbench_commit"}


def strip_log(path: Path) -> list[dict]:
    """The MLPerf log without what changes from run to run, with the machine or with the code's version and layout:
    times, call sites, the cache_clear value and trainbench's version and commit."""
    events = []
    for line in path.read_text().splitlines():
        event = json.loads(line.split(":::MLLOG", 1)[1])
        event.pop("time_ms", None)
        if event["key"] in CODE_KEYS:
            continue
        if event["key"] in MACHINE_KEYS:
            event["value"] = None
        meta = {k: v for k, v in (event.get("metadata") or {}).items() if k not in ("file", "lineno")}
        events.append(event | {"metadata": meta})
    return events


def run(name: str, data: dict[str, Path], results: Path) -> dict:
    benchmark, data_key, extra = RUNS[name]
    os.environ["OMP_NUM_THREADS"] = str(CORES // ranks(name))  # each rank's threads (trainbench honours it)
    run_cli("run", benchmark, *COMMON, *extra, f"data.dir={data[data_key]}", f"output.results_dir={results}")
    run_dir = only_run_dir(results)
    rows = read_metrics(run_dir)
    metric = json.loads((run_dir / "run_0.json").read_text())["metric_name"]
    return {
        "losses": [r["loss"] for r in rows if "loss" in r],
        "evals": [[r["samples"], r[metric]] for r in rows if metric in r],
        "log": strip_log(run_dir / "result_0.txt"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE, help="folder for <name>.json (default: tests/golden)")
    parser.add_argument("--only", nargs="+", choices=list(RUNS), default=list(RUNS))
    args = parser.parse_args(argv)
    if any(os.environ.get(k) != v for k, v in PINNED.items()):
        os.execve(sys.executable, [sys.executable, __file__, *sys.argv[1:]], {**os.environ, **PINNED})
    why = pinned_path_missing()
    if why:
        sys.exit(why)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_data(Path(tmp) / "data", args.only)
        for name in args.only:
            result = run(name, data, Path(tmp) / name)
            (args.out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
            counts = f"{len(result['losses'])} losses, {len(result['evals'])} evals, {len(result['log'])} log lines"
            print(f"{name}: {counts}", flush=True)


if __name__ == "__main__":
    main()
