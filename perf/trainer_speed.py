"""Training speed through `trainbench run`, of one source tree against another, in one call on one GPU.

BERT-large packed (the large preset, compiled, cuDNN or flash attention as `auto` picks, 48 rows a step, no dropout)
on WikiText-2 prepared with MLPerf's vocab, and the `llama-1b` decoder (compiled blocks, bf16, seq 8192, global
batch 8) on its synthetic language. The trees run in turns (A, B, then B, A while time is left), so drift of the
machine falls on both; each run's rate is the median of its logged intervals after the compiling steps.

    python perf/trainer_speed.py --out OUT --tree before=/path/to/old/src --tree after=src [--budget-s 540]

Writes OUT/trainer_speed.json: samples/s (and tokens/s for the decoder) of every run, by tree.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "perf"))

from bert_scaling import prepare, run, train_command  # noqa: E402

LLM_SEQ, LLM_GBS = 8192, 8


def src_env(src: Path) -> dict[str, str]:
    """PYTHONPATH with ``src`` first (what else was on it, e.g. carried packages, stays)."""
    return {"PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}


def steady_rate(results: Path, skip_steps: int) -> dict:
    (run_dir,) = [d for d in results.iterdir() if d.is_dir()]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["samples_per_s"] for r in rows if "samples_per_s" in r and r["step"] > skip_steps]
    return {"samples_per_s": statistics.median(rates), "intervals": rates}


def bert(src: Path, prepared: Path, results: Path, steps: int) -> dict:
    shutil.rmtree(results, ignore_errors=True)
    run(train_command(1, prepared, results, steps, ["telemetry_hz=0"]), ok=(0, 1), env=src_env(src))
    return steady_rate(results, skip_steps=30)


def llm(src: Path, data: Path, results: Path, steps: int) -> dict:
    shutil.rmtree(results, ignore_errors=True)
    cmd = [sys.executable, "-m", "trainbench", "run", "llama31_8b", "--preset", "llama-1b", f"data.dir={data}",
           f"global_batch_size={LLM_GBS}", "micro_batch_size=1", "perf.compile=true", "eval_samples=8",
           "eval.every_samples=100000000", f"schedule.max_samples={LLM_GBS * steps}", "log_every_steps=5",
           "progress=false", "telemetry_hz=0", f"output.results_dir={results}"]  # fmt: skip
    run(cmd, ok=(0, 1), env=src_env(src))
    out = steady_rate(results, skip_steps=10)
    return out | {"tokens_per_s": out["samples_per_s"] * LLM_SEQ}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tree", action="append", required=True, help="NAME=SRC_DIR (a trainbench src/ folder)")
    p.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data")
    p.add_argument("--work", type=Path, default=Path("/tmp/tb-speed"))
    p.add_argument("--bert-steps", type=int, default=80)
    p.add_argument("--llm-steps", type=int, default=30)
    p.add_argument("--budget-s", type=float, default=540, help="start no second round after this many seconds")
    args = p.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree)
    trees = {name: Path(src).resolve() for name, src in trees.items()}
    start = time.monotonic()
    prepared = prepare(args.work, args.data)
    llm_data = args.work / "llm-1b"
    if not (llm_data / "manifest.json").exists():
        tokens = (args.llm_steps + 2) * LLM_GBS * (LLM_SEQ + 1)
        run([sys.executable, "-m", "trainbench", "prepare", "llama31_8b", "--synthetic", "--preset", "llama-1b",
             "--train-tokens", str(tokens), "--out", str(llm_data)], env=src_env(REPO / "src"))  # fmt: skip
    results: dict[str, dict[str, list]] = {name: {"bert_large_packed": [], "llama_1b": []} for name in trees}
    order = list(trees)
    for round_ in range(2):
        if round_ and time.monotonic() - start > args.budget_s:
            break
        for name in order if round_ == 0 else order[::-1]:
            work = args.work / f"{name}-{round_}"
            results[name]["bert_large_packed"].append(bert(trees[name], prepared, work / "bert", args.bert_steps))
            results[name]["llama_1b"].append(llm(trees[name], llm_data, work / "llm", args.llm_steps))
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "trainer_speed.json").write_text(json.dumps(results, indent=1) + "\n")
    for name, by_config in results.items():
        for config, runs in by_config.items():
            print(name, config, [round(r["samples_per_s"], 2) for r in runs])


if __name__ == "__main__":
    main()
