"""gpt_oss_20b's mixture-of-experts layer alone on this GPU: forward and backward time, and its kernels.

The layer is the product's own (`trainbench.families.decoder.moe.MoE`, built by the benchmark's block from the preset's
model config), compiled as the blocks are (`compile(dynamic=False)` in place, called through a parent module), under
bf16 autocast with fp32 weights, at one micro-batch of the preset at micro-batches of 4 (4 x 8,192 tokens).
- `--fp8`: the experts' FP8 grouped products (`experts_in_fp8`, as `model.precision=fp8` does);
- `--cast-once`: with `--fp8`, the experts' weights cast once a step (`cache_fp8_weight_casts`);
- `--weight-grad bf16`: with `--fp8`, the experts' weight gradient a bf16 grouped product (FP8 by default);
- `--micro-batches N`: N forward/backward passes a step, the weights' gradients accumulated as the loop does.
Prints the step's time (median of CUDA-event timings) and the longest kernels by GPU time a step (torch.profiler).

    python perf/moe_layer.py --preset gpt-oss-20b-hf --fp8 --out OUT

Writes OUT/moe_layer_<preset>[_fp8][_once][_wgrad_<fp8|bf16>].json; with TORCHINDUCTOR_CACHE_DIR set, the compiled
kernels' sources are there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from trainbench.benchmarks import get_benchmark  # noqa: E402
from trainbench.families.decoder.gpt_oss import GptOssBlock  # noqa: E402
from trainbench.families.decoder.moe_fp8 import cache_fp8_weight_casts, experts_in_fp8  # noqa: E402


def layer(preset: str, fp8: bool, device: torch.device, weight_grad: str = "fp8") -> torch.nn.Module:
    cfg = get_benchmark("gpt_oss_20b").config(preset)
    moe = GptOssBlock(cfg.model, 0).mlp.to(device)
    moe.init_parameters(cfg.model.init_std, cfg.model.init_std)
    torch.nn.init.normal_(moe.router.weight, std=cfg.model.init_std)
    if fp8:
        experts_in_fp8(moe, device, weight_grad)
    return moe


def step_fn(moe: torch.nn.Module, cast_once: bool):
    """One step: each micro-batch's forward and backward through the layer compiled as the blocks compile (in place),
    called through a parent module as the model calls its blocks; ``cast_once``: the experts' FP8 weight casts
    made once a step (``cache_fp8_weight_casts``, as the placement on one unsharded rank does)."""
    root = torch.nn.ModuleDict({"moe": moe})
    root.forward = lambda x: moe(x)
    moe.compile(dynamic=False)
    after_step = cache_fp8_weight_casts(root) if cast_once else None

    def step(xs, directions):
        for x, d in zip(xs, directions, strict=True):
            with torch.autocast("cuda", torch.bfloat16):
                out, _ = root(x)
            (out.float() * d).sum().backward()
        if after_step is not None:  # (no optimizer here: the weights do not change, the casts are made again)
            after_step()

    return step


def kernels(prof, steps: int, top: int) -> list[dict]:
    rows = []
    for e in prof.key_averages():
        ms = e.self_device_time_total / 1e3 / steps
        if ms > 0 and e.device_type == torch.autograd.DeviceType.CUDA:
            rows.append({"name": e.key, "ms": round(ms, 3), "calls": e.count / steps})
    return sorted(rows, key=lambda r: -r["ms"])[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="gpt-oss-20b-hf")
    parser.add_argument("--fp8", action="store_true")
    parser.add_argument("--tokens", type=int, default=4 * 8192, help="tokens a micro-batch")
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--cast-once", action="store_true", help="with --fp8: the weights' casts once a step")
    parser.add_argument("--weight-grad", default="fp8", choices=("fp8", "bf16"),
                        help="with --fp8: the experts' weight gradient (model.expert_weight_grad)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("moe_layer.py: needs a CUDA GPU")
    device = torch.device("cuda")
    torch.manual_seed(0)
    moe = layer(args.preset, args.fp8, device, args.weight_grad)
    hidden = moe.shape.hidden
    xs = [torch.randn(args.tokens, hidden, device=device, dtype=torch.bfloat16) for _ in range(args.micro_batches)]
    directions = [torch.randn(args.tokens, hidden, device=device) for _ in range(args.micro_batches)]
    step = step_fn(moe, args.cast_once)
    for _ in range(3):  # compile and warm up
        step(xs, directions)
        moe.zero_grad(set_to_none=True)
    times = []
    for _ in range(args.steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(xs, directions)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        moe.zero_grad(set_to_none=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step(xs, directions)
            moe.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    result = {
        "preset": args.preset, "fp8": args.fp8, "cast_once": args.cast_once, "weight_grad": args.weight_grad,
        "tokens": args.tokens,
        "micro_batches": args.micro_batches,
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "step_ms": sorted(times)[len(times) // 2], "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "kernels": kernels(prof, 2, args.top),
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    wgrad = f"_wgrad_{args.weight_grad}" if args.fp8 else ""
    name = f"moe_layer_{args.preset}{'_fp8' if args.fp8 else ''}{'_once' if args.cast_once else ''}{wgrad}.json"
    (args.out / name).write_text(json.dumps(result, indent=2))
    print(f"{args.preset} {'fp8' if args.fp8 else 'bf16'}: {result['step_ms']:.2f} ms a step of {args.micro_batches} "
          f"micro-batches of {args.tokens} tokens, peak {result['peak_gib']:.1f} GiB")  # fmt: skip
    for k in result["kernels"]:
        print(f"  {k['ms']:8.3f} ms  {k['calls']:5g}  {k['name'][:150]}")


if __name__ == "__main__":
    main()
