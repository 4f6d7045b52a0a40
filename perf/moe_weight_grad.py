"""gpt_oss_20b's expert weight gradients alone on this GPU, for one micro-batch: the bf16 grouped product against the
FP8 one (`trainbench.families.decoder.moe_fp8.fp8_weight_grad`, with fast and with full fp32 accumulation), its
operands' cast and transpose (`trainbench.families.fp8.cast_transpose_e4m3`) against the compiler's, and each
product's error against float64 for two experts.

    python perf/moe_weight_grad.py --out OUT

At the 20B shape (32 experts, width 2,880, each expert's SwiGLU 2,880: the gate and up weights 2,880 x 5,760, the
down ones 2,880 x 2,880), 4 x 8,192 tokens routed to 4 experts each: 4,096 rows an expert (`even`), or one expert
with 32,768 rows and the others sharing the rest (`skewed`). Writes OUT/moe_weight_grad.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from trainbench.families.decoder.moe_fp8 import _e4m3, _group_scaled_transpose, fp8_weight_grad  # noqa: E402
from trainbench.families.fp8 import E4M3, E4M3_MAX, cast_transpose_e4m3  # noqa: E402


def timed(fn, repeats: int = 10) -> float:
    """Milliseconds a call, from CUDA events over ``repeats`` calls after 3 warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.double() - exact).norm() / exact.norm())


def measure(counts: torch.Tensor, a: int, b: int, compare_casts: bool) -> dict:
    """One weight's gradient for rows routed by ``counts`` [experts]: ``x`` [rows, a] and ``grad`` [rows, b]."""
    experts, rows = counts.numel(), int(counts.sum())
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    group = torch.repeat_interleave(torch.arange(experts, device=counts.device), counts)
    x = torch.randn(rows, a, device=counts.device, dtype=torch.bfloat16)
    grad = (torch.randn(rows, b, device=counts.device) * torch.rand(rows, 1, device=counts.device)).bfloat16()
    sx, sg = _e4m3(x, -1)[1], _e4m3(grad, -1)[1]
    row = {"shape": [a, b], "rows": rows, "largest_expert_rows": int(counts.max())}
    products = {
        "bf16": lambda: torch._grouped_mm(x.t(), grad, offs=offsets),
        "fp8_fast": lambda: fp8_weight_grad(x, sx, grad, sg, group, experts, offsets, fast_accum=True),
        "fp8_full": lambda: fp8_weight_grad(x, sx, grad, sg, group, experts, offsets, fast_accum=False),
    }
    outputs = {}
    for key, fn in products.items():
        row[f"{key}_ms"] = round(timed(fn), 3)
        outputs[key] = fn()
    for e in (0, 5):
        part = slice(int(offsets[e] - counts[e]), int(offsets[e]))
        exact = x[part].double().t() @ grad[part].double()
        for key, out in outputs.items():
            row[f"{key}_error_expert_{e}"] = round(relative_error(out[e], exact), 5)
    if compare_casts:
        divisors = _group_scaled_transpose(grad, sg, group, experts)[1][group]
        compiled = torch.compile(
            lambda t, d: (t.float() / d[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).t().contiguous()
        )
        ours, theirs = cast_transpose_e4m3(grad, divisors), compiled(grad, divisors)
        row["cast_equal_bytes"] = torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))
        row["cast_transpose_x_ms"] = round(timed(lambda: cast_transpose_e4m3(x, divisors)), 3)
        row["cast_transpose_grad_ms"] = round(timed(lambda: cast_transpose_e4m3(grad, divisors)), 3)
        row["compiled_cast_transpose_grad_ms"] = round(timed(lambda: compiled(grad, divisors)), 3)
        row["copy_grad_ms"] = round(timed(lambda: grad.clone()), 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--rows", type=int, default=4 * 8192 * 4, help="(token, expert) pairs of a micro-batch")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("moe_weight_grad.py: needs a CUDA GPU")
    torch.manual_seed(0)
    experts, rows = args.experts, args.rows
    results = []
    for routing in ("even", "skewed"):
        counts = torch.full((experts,), rows // experts, device="cuda")
        if routing == "skewed":
            counts[0] = rows // 4
            counts[1:] = (rows - rows // 4) // (experts - 1) // 16 * 16  # FP8's groups: multiples of 16 rows
            counts[-1] += rows - int(counts.sum())
        for name, a, b in (("gate_up", 2880, 5760), ("down", 2880, 2880)):
            row = {"routing": routing, "weights": name} | measure(counts, a, b, routing == "even")
            print(json.dumps(row), flush=True)
            results.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "moe_weight_grad.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
