"""The FP8 LoRA base's SwiGLU casts at the 70B's shape (8,192 rows of 28,672): the Triton passes of
``fp8.swiglu_fp8_forward`` / ``swiglu_fp8_backward`` at several launch shapes, beside their torch stand-ins compiled
(what the compiled blocks run without them). Median ms of 20 calls each.

    python perf/swiglu_fp8.py --out OUT/swiglu.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

from trainbench.families import fp8


def median_ms(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--width", type=int, default=28672)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    gate = torch.randn(args.rows, args.width, device="cuda", generator=g).bfloat16()
    up = torch.randn(args.rows, args.width, device="cuda", generator=g).bfloat16()
    grad = torch.randn(args.rows, args.width, device="cuda", generator=g).bfloat16()
    ws = [torch.rand(args.width, 1, device="cuda", generator=g) * 0.01 + 1e-3 for _ in range(2)]
    casts = fp8.swiglu_fp8_forward_torch(gate, up)[:4]
    fwd_c, bwd_c = torch.compile(fp8.swiglu_fp8_forward_torch), torch.compile(fp8.swiglu_fp8_backward_torch)
    result = {
        "gpu": torch.cuda.get_device_name(),
        "compiled": {
            "forward_ms": median_ms(lambda: fwd_c(gate, up)),
            "backward_ms": median_ms(lambda: bwd_c(grad, *casts, *ws)),
        },
    }
    print(result, flush=True)
    result["triton"] = []
    for per_sm, warps, block in itertools.product((2, 8, 32), (4, 8), (1024, 2048)):
        fp8.ROWS_IN_FLIGHT_PER_SM, fp8.ROW_WARPS, fp8.ROW_BLOCK = per_sm, warps, block
        row = {"per_sm": per_sm, "warps": warps, "block": block,
               "forward_ms": median_ms(lambda: fp8.swiglu_fp8_forward(gate, up)),
               "backward_ms": median_ms(lambda: fp8.swiglu_fp8_backward(grad, *casts, *ws))}  # fmt: skip
        result["triton"].append(row)
        print(row, flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
