"""BERT-large data-parallel scaling on one node, through `trainbench run` itself.

Prepares packed data from WikiText-2 with MLPerf's vocab (as bert_throughput.py does), then trains the large
preset on packed rows with the speed switches on (compiled model, fused LAMB), 48 rows per GPU per step and
no accumulation: on 1 GPU, then on N GPUs with DDP (global batch 48 x N rows): plain, with bucket-wise
clipping, with the all-reduce in bf16, and with bf16 and 100 MB buckets; and N independent one-GPU runs at
once (no communication at all: what the node gives when every GPU trains alone). Throughput is read from each
run's metrics.jsonl: samples/s per logging interval, the first intervals (compilation) left out.

    python benchmarks/bert_scaling.py --out OUT --gpus 4 [--steps 80] [--data DIR]

Writes OUT/bert_scaling.json: samples/s for each configuration and the scaling efficiency
(N-GPU samples/s divided by N times the 1-GPU samples/s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def prepare(work: Path, data: Path) -> Path:
    prepared = work / "wikitext"
    if (prepared / "manifest.json").exists():
        return prepared
    corpus = work / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    text = "".join((data / "text" / "wikitext-2" / n).read_text() for n in ("valid.txt", "test.txt"))
    for c in range(4):
        (corpus / f"wiki.{c}.txt").write_text(text)
    run([sys.executable, "-m", "trainbench", "prepare", "bert", "--input", str(corpus), "--vocab",
         str(data / "bert" / "vocab.txt"), "--out", str(prepared), "--num-shards", "8", "--eval-samples", "256",
         "--eval-fraction", "0.05", "--formats", "fixed,packed", "--no-progress"])  # fmt: skip
    return prepared


def env_with_src() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))


def run(cmd: list[str], ok: tuple[int, ...] = (0,)) -> None:
    print("+", " ".join(cmd), flush=True)
    code = subprocess.run(cmd, env=env_with_src()).returncode
    if code not in ok:
        raise SystemExit(f"exit code {code}: {' '.join(cmd)}")


def train_command(gpus: int, prepared: Path, results: Path, steps: int, extra: list[str]) -> list[str]:
    rows = 48 * gpus
    return [
        sys.executable, "-m", "trainbench", "run", "bert", "--preset", "large", "--nproc", str(gpus),
        f"data.dir={prepared}", "data.layout=packed", f"global_batch_size={rows}", "micro_batch_size=48",
        "eval_samples=256", "eval.every_samples=100000000", f"schedule.max_samples={rows * steps}",
        "perf.compile=true", "log_every_steps=10", "progress=false", "telemetry_hz=1", "model.hidden_dropout=0.0",
        "model.attention_dropout=0.0", f"output.results_dir={results}", *extra,
    ]  # fmt: skip


def read_run(results: Path) -> dict:
    (run_dir,) = [d for d in results.iterdir() if d.is_dir()]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [m["samples_per_s"] for m in metrics if "samples_per_s" in m]
    steady = rates[3:]  # the first 30 steps hold the compilation and the first CUDA allocations
    outcome = json.loads((run_dir / "run_0.json").read_text())
    return {
        "samples_per_s": statistics.median(steady),
        "samples_per_s_intervals": rates,
        "peak_memory_gib": outcome["peak_memory_gib"],
    }


def train(name: str, gpus: int, prepared: Path, out: Path, steps: int, extra: list[str]) -> dict:
    results = out / name
    run(train_command(gpus, prepared, results, steps, extra), ok=(0, 1))  # 1: stopped before the target
    return {"config": name, "gpus": gpus, "rows_per_step": 48 * gpus} | read_run(results)


def train_apart(name: str, gpus: int, prepared: Path, out: Path, steps: int, extra: list[str]) -> dict:
    """``gpus`` independent one-GPU runs at once, one per GPU: the node's throughput without any communication
    (what DDP would reach if the all-reduce cost nothing), so power, clocks and the host are shared as under DDP."""
    procs = []
    for i in range(gpus):
        cmd = train_command(1, prepared, out / name / str(i), steps, extra)
        print("+", f"CUDA_VISIBLE_DEVICES={i}", " ".join(cmd), flush=True)
        procs.append(subprocess.Popen(cmd, env=env_with_src() | {"CUDA_VISIBLE_DEVICES": str(i)}))
    if any(p.wait() not in (0, 1) for p in procs):
        raise SystemExit(f"{name}: a run failed")
    runs = [read_run(out / name / str(i)) for i in range(gpus)]
    return {
        "config": name,
        "gpus": gpus,
        "rows_per_step": 48,
        "samples_per_s": sum(r["samples_per_s"] for r in runs),
        "samples_per_s_per_run": [r["samples_per_s"] for r in runs],
        "peak_memory_gib": max(r["peak_memory_gib"] for r in runs),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data")
    p.add_argument("--work", type=Path, default=Path("/tmp/tb-scaling"))
    p.add_argument("--only", nargs="*", help="run only these N-GPU configurations (and the 1-GPU run)")
    p.add_argument("--reference", type=float, help="1-GPU samples/s measured before: skip the 1-GPU run")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    prepared = prepare(args.work, args.data)
    report = {"runs": []}
    n = args.gpus
    configs = [
        ("1gpu", 1, []),
        (f"{n}x1gpu_apart", n, []),
        (f"{n}gpu_ddp", n, []),
        (f"{n}gpu_ddp_bucket_clip", n, ["optimizer.clip=bucket"]),
        (f"{n}gpu_ddp_bf16_reduce", n, ["distributed.grad_reduce_dtype=bf16"]),
        (f"{n}gpu_ddp_bf16_bucket100", n, ["distributed.grad_reduce_dtype=bf16", "distributed.bucket_cap_mb=100"]),
        # Garbage collection: Python's automatic collection (the trainer's default until gc_every_steps), with
        # the default prefetch of 2 steps and with 16; and collection at fixed steps (the default now).
        (f"{n}gpu_ddp_autogc", n, ["perf.gc_every_steps=0"]),
        (f"{n}gpu_ddp_autogc_prefetch16", n, ["perf.gc_every_steps=0", "data.prefetch=16"]),
        (f"{n}gpu_ddp_gc50", n, ["perf.gc_every_steps=50"]),
    ]
    for name, gpus, extra in configs:
        if args.only and name not in args.only and not (name == "1gpu" and args.reference is None):
            continue
        measure = train_apart if name.endswith("_apart") else train
        report["runs"].append(measure(name, gpus, prepared, args.work / "runs", args.steps, extra))
        (args.out / "bert_scaling.json").write_text(json.dumps(report, indent=1))
        print(json.dumps(report["runs"][-1]), flush=True)
    one = args.reference or report["runs"][0]["samples_per_s"]
    for r in report["runs"]:
        if r["config"] == "1gpu":
            continue
        r["scaling_efficiency"] = r["samples_per_s"] / (r["gpus"] * one)
    (args.out / "bert_scaling.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({r["config"]: r.get("scaling_efficiency") for r in report["runs"]}), flush=True)


if __name__ == "__main__":
    main()
