"""What FP8 matmuls would save in BERT-large's training step on this GPU.

For each linear layer of a BERT-large encoder layer (QKV 1024->3072, output 1024->1024, FFN 1024->4096 and
4096->1024) at M = 48 x 512 tokens, times the three GEMMs of a training step (forward, input gradient, weight
gradient) in bf16 and in FP8 (`torch._scaled_mm`, e4m3 for activations and weights, e5m2 for gradients,
one scale per tensor), and separately the casts FP8 needs (amax, scale, cast, and the transposed copies the
FP8 kernels require), compiled. Sums them over the 24 layers: the GEMM time per step in bf16, in FP8, and
FP8 with its casts.

    python perf/fp8_gemm.py --out OUT

Writes OUT/fp8_gemm.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def bench(fn, reps: int = 50) -> float:
    """Median ms of ``fn`` over ``reps`` calls (CUDA events)."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def to_fp8(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor scaled cast: (x * scale).to(dtype) and the inverse scale _scaled_mm multiplies back."""
    amax = x.abs().amax().float().clamp(min=1e-12)
    scale = torch.finfo(dtype).max / amax
    return (x.float() * scale).to(dtype), scale.reciprocal()


def fp8_casts(x, w, g):
    """The casts of one FP8 linear layer's step: x and w in e4m3 (and their transposes for the gradients),
    g in e5m2 (and its transpose)."""
    x8, sx = to_fp8(x, E4M3)
    w8, sw = to_fp8(w, E4M3)
    g8, sg = to_fp8(g, E5M2)
    return x8, x8.t().contiguous(), w8, w8.t().contiguous(), g8, g8.t().contiguous(), sx, sw, sg


def layer(m: int, k: int, n: int) -> dict:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 1e-3
    bf16 = {
        "forward": bench(lambda: x @ w.t()),
        "input_grad": bench(lambda: g @ w),
        "weight_grad": bench(lambda: g.t() @ x),
    }
    casts = torch.compile(fp8_casts)
    x8, x8t, w8, w8t, g8, g8t, sx, sw, sg = casts(x, w, g)
    mm = torch._scaled_mm
    fp8 = {
        # a row-major, b column-major: b = (row-major [n, k]).t()
        "forward": bench(lambda: mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)),
        # g [m, n] @ w [n, k]: b column-major is w8t [k, n] transposed
        "input_grad": bench(lambda: mm(g8, w8t.t(), scale_a=sg, scale_b=sw, out_dtype=torch.bfloat16)),
        # g.t() [n, m] @ x [m, k]: a row-major is g8t, b column-major is x8t [k, m] transposed
        "weight_grad": bench(lambda: mm(g8t, x8t.t(), scale_a=sg, scale_b=sx, out_dtype=torch.bfloat16)),
    }
    out_f = mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16).float()
    ref = (x @ w.t()).float()
    rel = float((out_f - ref).norm() / ref.norm())
    return {
        "shape": [m, k, n],
        "bf16_ms": bf16,
        "fp8_ms": fp8,
        "casts_ms": bench(lambda: casts(x, w, g)),
        "forward_relative_error": rel,
        "bf16_tflops": {key: 2 * m * k * n / v / 1e9 for key, v in bf16.items()},
        "fp8_tflops": {key: 2 * m * k * n / v / 1e9 for key, v in fp8.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tokens", type=int, default=48 * 512)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    m = args.tokens
    shapes = {
        "qkv": (m, 1024, 3072),
        "attn_out": (m, 1024, 1024),
        "ffn_in": (m, 1024, 4096),
        "ffn_out": (m, 4096, 1024),
    }
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": {}}
    for name, shape in shapes.items():
        report["layers"][name] = layer(*shape)
        print(name, json.dumps(report["layers"][name]), flush=True)
    per_layer = report["layers"].values()
    total = {
        "bf16_gemms_ms": 24 * sum(sum(r["bf16_ms"].values()) for r in per_layer),
        "fp8_gemms_ms": 24 * sum(sum(r["fp8_ms"].values()) for r in per_layer),
        "fp8_casts_ms": 24 * sum(r["casts_ms"] for r in per_layer),
    }
    total["fp8_with_casts_ms"] = total["fp8_gemms_ms"] + total["fp8_casts_ms"]
    report["encoder_per_step"] = total
    print(json.dumps(total), flush=True)
    (args.out / "fp8_gemm.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
