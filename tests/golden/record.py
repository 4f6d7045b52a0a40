"""The runs whose numbers a restructure must keep: per-step losses, every eval, and the MLPerf log.

``python tests/golden/record.py`` (from the repository root) writes ``tests/golden/<name>.json`` for each run;
``tests/test_golden.py`` runs them again and compares bit for bit. Record again only when a change is meant to
alter what a run computes, and say so in the commit.
"""

from __future__ import annotations

import json
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
RUNS = {
    "bert_1rank": ("bert", "bert", [*BERT]),
    "bert_2ranks": ("bert", "bert", [*BERT, "--nproc", "2", "micro_batch_size=32"]),
    "bert_accumulation4": ("bert", "bert", [*BERT, "micro_batch_size=16"]),
    "llama31_8b": ("llama31_8b", "llm", [*LLM]),
    "gpt3": ("gpt3", "llm", [*LLM]),
}


def prepare_data(root: Path) -> dict[str, Path]:
    """The data the runs read: the tests' small BERT set and the tiny synthetic LLM language."""
    bert, llm = root / "bert", root / "llm"
    prepare_synthetic(bert, tiny_spec())
    assert run_cli("prepare", "llama31_8b", "--synthetic", "--preset", "tiny", "--out", llm) == 0
    return {"bert": bert, "llm": llm}


def strip_log(path: Path) -> list[dict]:
    """The MLPerf log without what changes from run to run or with the code's layout: times and call sites."""
    events = []
    for line in path.read_text().splitlines():
        event = json.loads(line.split(":::MLLOG", 1)[1])
        event.pop("time_ms", None)
        meta = {k: v for k, v in (event.get("metadata") or {}).items() if k not in ("file", "lineno")}
        events.append(event | {"metadata": meta})
    return events


def run(name: str, data: dict[str, Path], results: Path) -> dict:
    benchmark, data_key, extra = RUNS[name]
    run_cli("run", benchmark, *COMMON, *extra, f"data.dir={data[data_key]}", f"output.results_dir={results}")
    run_dir = only_run_dir(results)
    rows = read_metrics(run_dir)
    metric = json.loads((run_dir / "run_0.json").read_text())["metric_name"]
    return {
        "losses": [r["loss"] for r in rows if "loss" in r],
        "evals": [[r["samples"], r[metric]] for r in rows if metric in r],
        "log": strip_log(run_dir / "result_0.txt"),
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_data(Path(tmp) / "data")
        for name in RUNS:
            result = run(name, data, Path(tmp) / name)
            (HERE / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
            counts = f"{len(result['losses'])} losses, {len(result['evals'])} evals, {len(result['log'])} log lines"
            print(f"{name}: {counts}")


if __name__ == "__main__":
    main()
