"""Does a switch change what BERT learns? Train the same runs with it off and on, through `trainbench run`.

Prepares packed rows from WikiText-2 with MLPerf's vocab (as bert_scaling.py does), then trains the `base` preset
(12 x 768, head size 64, dropout 0.1 as in MLPerf) on packed rows on one GPU, compiled, bf16, with each
configuration and two seeds. Every run reports its masked-LM accuracy at each eval (same samples for all runs)
and its training loss. The seed-to-seed spread of one configuration is the noise a switch's difference is judged
against: the attention kernels draw their dropout masks differently, so no two configurations match step by step.

Configurations: `varlen` (flash attention, `model.packed_attention=varlen`) and `cudnn` (cuDNN's attention,
`model.packed_attention=cudnn`).

    python benchmarks/bert_convergence.py --out OUT [--data DIR] [--samples 38400] [--only NAME ...]

Writes OUT/bert_convergence.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from bert_scaling import prepare, run  # noqa: E402

CONFIGS = {"varlen": ["model.packed_attention=varlen"], "cudnn": ["model.packed_attention=cudnn"]}
SEEDS = (1, 2)


def read_history(results: Path) -> dict:
    """Eval accuracy by samples, and the mean training loss of the last quarter of the logged intervals."""
    (run_dir,) = [d for d in results.iterdir() if d.is_dir()]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = {r["samples"]: r["masked_lm_accuracy"] for r in rows if "masked_lm_accuracy" in r}
    losses = [r["loss"] for r in rows if "loss" in r]
    tail = losses[-max(1, len(losses) // 4) :]
    return {"evals": evals, "final_loss": sum(tail) / len(tail), "run_dir": str(run_dir)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data")
    p.add_argument("--work", type=Path, default=Path("/tmp/tb-scaling"))
    p.add_argument("--samples", type=int, default=38_400, help="training samples per run (packed rows)")
    p.add_argument("--every", type=int, default=6_400, help="samples between evals")
    p.add_argument("--only", nargs="*", help="run only these configurations")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    prepared = prepare(args.work, args.data)
    report = {"runs": []}
    for name, overrides in CONFIGS.items():
        if args.only and name not in args.only:
            continue
        for seed in SEEDS:
            results = args.work / "convergence" / f"{name}_seed{seed}"
            shutil.rmtree(results, ignore_errors=True)
            # exit code 1: the target was not reached, which these short runs do not aim at
            run([sys.executable, "-m", "trainbench", "run", "bert", "--preset", "base", f"data.dir={prepared}",
                 "data.layout=packed", "global_batch_size=64", "micro_batch_size=64", "schedule.warmup_steps=100",
                 f"schedule.max_samples={args.samples}", f"eval.every_samples={args.every}", "eval_samples=256",
                 "perf.compile=true", "log_every_steps=20", "progress=false", "telemetry_hz=0", f"seed={seed}",
                 f"output.results_dir={results}", *overrides], ok=(0, 1))  # fmt: skip
            report["runs"].append({"config": name, "seed": seed} | read_history(results))
            print(json.dumps(report["runs"][-1]), flush=True)
            (args.out / "bert_convergence.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
