"""Does an FP8 frozen base train LoRA to the same eval loss as a bf16 one? The tiny preset on the GPU, both bases,
several seeds, the same samples: `trainbench run` (eager, bf16 autocast) to a fixed number of samples (the target
set out of reach), every eval recorded.

    python perf/lora_fp8_quality.py --out OUT/quality.json [--seeds 1234 1235] [--samples 3072]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def trainbench(*args: str) -> None:
    path = os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])
    subprocess.run([sys.executable, "-m", "trainbench", *args], check=False, cwd=REPO,
                   env={**os.environ, "PYTHONPATH": path})  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[1234, 1235])
    p.add_argument("--samples", type=int, default=3072)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp())
    trainbench("prepare", "llama2_70b_lora", "--synthetic", "--preset", "tiny", "--out", str(work / "data"))
    results = []
    for seed in args.seeds:
        for base in ("auto", "fp8"):
            out = work / f"{base}_{seed}"
            trainbench("run", "llama2_70b_lora", f"data.dir={work / 'data'}", f"output.results_dir={out}",
                       "device=cuda", "progress=false", f"seed={seed}", f"model.base_precision={base}",
                       "eval.target=0.0001", f"schedule.max_samples={args.samples}")  # fmt: skip
            run_dir = next(out.iterdir())
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            evals = {r["samples"]: r["eval_loss"] for r in rows if "eval_loss" in r}
            results.append({"base": "bf16" if base == "auto" else "fp8", "seed": seed, "eval_loss": evals})
            print(json.dumps(results[-1]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
