"""Does an FP8 frozen base train LoRA to the same eval loss as a bf16 one? The tiny preset's data on the GPU, both
bases, several seeds, the same samples: `trainbench run` (eager, bf16 autocast) to a fixed number of samples (the
target set out of reach), every eval recorded.

With ``--width W --layers L`` the base is wider and deeper than the tiny preset's (a random Llama-shaped model of
that width, heads of 128, a quarter as many key-value heads, SwiGLU of 2.75 W, written as sharded safetensors and
given as model.base_weights); the data stays the tiny preset's.

    python perf/lora_fp8_quality.py --out OUT/quality.json [--seeds 1234 1235] [--samples 3072]
    python perf/lora_fp8_quality.py --out OUT/quality.json --width 1024 --layers 8
"""

from __future__ import annotations

import argparse
import dataclasses
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


def wider_base(folder: Path, width: int, layers: int, seed: int) -> list[str]:
    """A random base of ``width`` and ``layers`` with the tiny preset's vocabulary; returns the run's overrides."""
    import torch

    from trainbench.families.decoder.hf_checkpoint import save_sharded
    from trainbench.families.decoder.model import DecoderLM
    from trainbench.resolve import build_config

    shape = {"model.hidden_size": width, "model.num_layers": layers, "model.num_heads": width // 128,
             "model.num_kv_heads": max(1, width // 512), "model.intermediate_size": width * 11 // 4}  # fmt: skip
    _, cfg = build_config("llama2_70b_lora", "tiny", overrides={k: str(v) for k, v in shape.items()})
    torch.manual_seed(seed)
    model = DecoderLM(dataclasses.replace(cfg.model, init_std=0.02))  # the tiny preset's 0.1 is for width 128
    model.init_weights(seed)
    save_sharded(model.state_dict(), folder, 1 << 30)
    return [f"{k}={v}" for k, v in shape.items()] + [f"model.base_weights={folder}"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[1234, 1235])
    p.add_argument("--samples", type=int, default=3072)
    p.add_argument("--width", type=int, help="a base of this width instead of the tiny preset's (a multiple of 512)")
    p.add_argument("--layers", type=int, default=8, help="with --width: its blocks")
    p.add_argument("--lr", type=float, help="optimizer.lr (the tiny preset's 1e-2 is unstable at width 1024)")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp())
    trainbench("prepare", "llama2_70b_lora", "--synthetic", "--preset", "tiny", "--out", str(work / "data"))
    sys.path.insert(0, str(REPO / "src"))
    shape = wider_base(work / "wide_base", args.width, args.layers, 0) if args.width else []
    shape += [f"optimizer.lr={args.lr}"] if args.lr else []
    results = []
    for seed in args.seeds:
        for base in ("auto", "fp8"):
            out = work / f"{base}_{seed}"
            trainbench("run", "llama2_70b_lora", f"data.dir={work / 'data'}", f"output.results_dir={out}",
                       "device=cuda", "progress=false", f"seed={seed}", f"model.base_precision={base}",
                       "eval.target=0.0001", f"schedule.max_samples={args.samples}", *shape)  # fmt: skip
            run_dir = next(out.iterdir())
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            evals = {r["samples"]: r["eval_loss"] for r in rows if "eval_loss" in r}
            results.append({"base": "bf16" if base == "auto" else "fp8", "seed": seed, "eval_loss": evals,
                            "width": args.width or 128, "layers": args.layers if args.width else 2,
                            "lr": args.lr or 1e-2})  # fmt: skip
            print(json.dumps(results[-1]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
