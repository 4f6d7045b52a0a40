"""The FP8 frozen base's backward needs each weight transposed (Hopper's FP8 GEMMs take only the "TN" layout): how
fast each way of making that copy is, at Llama-2-70B's shapes, against the GPU's copy bandwidth.

Ways timed (each makes a contiguous [in, out] e4m3 copy of an [out, in] e4m3 weight):
- ``torch-fp8``: ``w.t().contiguous()`` on the float8 tensor (what the FP8 linear does today);
- ``torch-u8``: the same on the bytes (``w.view(torch.uint8)``), then viewed back as e4m3;
- ``triton``: :func:`trainbench.families.fp8.transpose_fp8`, a tiled transpose through shared memory;
- ``copy``: a plain contiguous copy of the same bytes (the bandwidth ceiling: read n + write n bytes).

    python perf/fp8_transpose.py --out OUT/fp8_transpose.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from trainbench.families import fp8  # noqa: E402

SHAPES = {  # Llama-2-70B's frozen linears, [out, in]
    "qkv_proj": (10240, 8192),
    "o_proj": (8192, 8192),
    "gate_proj": (28672, 8192),
    "up_proj": (28672, 8192),
    "down_proj": (8192, 28672),
}


def timed(fn, reps: int = 50, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write the rows as JSON here too")
    args = parser.parse_args()
    rows = []
    block_ms = {k: 0.0 for k in ("torch-fp8", "torch-u8", "triton", "triton-32", "triton-128", "copy")}
    for name, (n, k) in SHAPES.items():
        w, _ = fp8.quantize_rows(torch.randn(n, k, device="cuda"))
        ref = w.t().contiguous()
        ways = {
            "torch-fp8": lambda w=w: w.t().contiguous(),
            "torch-u8": lambda w=w: w.view(torch.uint8).t().contiguous().view(fp8.E4M3),
            "triton": lambda w=w: fp8.transpose_fp8(w),
            "triton-32": lambda w=w: fp8.transpose_fp8(w, 32),
            "triton-128": lambda w=w: fp8.transpose_fp8(w, 128),
            "copy": lambda w=w: w.view(torch.uint8).clone(),
        }
        for b in (32, 64, 128):
            assert torch.equal(fp8.transpose_fp8(w, b).view(torch.uint8), ref.view(torch.uint8)), (name, b)
        for way, fn in ways.items():
            s = timed(fn)
            row = {"layer": name, "shape": [n, k], "way": way, "ms": round(s * 1e3, 4),
                   "gb_per_s": round(2 * n * k / s / 1e9, 1)}  # fmt: skip
            block_ms[way] += s * 1e3
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {"per_block_ms": {k: round(v, 3) for k, v in block_ms.items()}, "device": torch.cuda.get_device_name()}
    print(json.dumps(summary), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "summary": summary}, indent=2) + "\n")


if __name__ == "__main__":
    main()
