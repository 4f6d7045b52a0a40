"""gpt_oss_20b's attention kernels on this GPU: forward and backward time at the benchmark's shape, and agreement.

The shape of one micro-batch of `gpt-oss-20b` at micro-batches of 4: 4 rows of 8,192 tokens, 64 query heads and 8
key/value heads of 64, bf16; causal, and causal within the last 128 keys (the windowed blocks). With GPT-OSS's learned
sinks (one logit per head) and without them (the reference's block). Each kernel is the product's own function in
`trainbench.families.decoder.sink_attention`:

- `flex`: `flex_sink_attention`, FlexAttention with the window's block mask, the sinks from its log-sum-exp through
  autograd (the blocks' kernel before `model.attention`), compiled;
- `flash`: `fused_sink_attention(kernel="flash")`, flash attention's forward and backward with its own window, the
  sinks applied outside them (no gradient through the log-sum-exp), compiled;
- `cudnn`: the same through cuDNN's fused attention (no window: the causal blocks only), compiled.

Times are medians of CUDA-event timings of one call (forward) and of forward + backward. Agreement: outputs and every
input gradient (sinks included) against `sink_attention` (every score in memory) in float64, at 2,048 tokens, as the
norm of the difference over the norm of the float64 result; bf16's own rounding shows in `dense_bf16` (the dense form
on the same bf16 inputs, its softmax in fp32).

    python perf/sink_attention.py --out OUT

Writes OUT/sink_attention.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch._dynamo

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "perf"))

from fp8_gemm import bench  # noqa: E402

from trainbench.families.decoder.gpt_oss import window_block_mask  # noqa: E402
from trainbench.families.decoder.sink_attention import flex_sink_attention, fused_sink_attention, sink_attention  # noqa: E402

HEADS, KV_HEADS, DIM = 64, 8, 64


def kernels(seq: int, window: int | None, device: torch.device) -> dict:
    """name -> fn(q, k, v, sinks) for every kernel that runs this window."""
    mask = window_block_mask(seq, window, device)
    out = {
        "flex": torch.compile(lambda q, k, v, s: flex_sink_attention(q, k, v, s, mask), dynamic=False),
        "flash": torch.compile(lambda q, k, v, s: fused_sink_attention(q, k, v, s, window, "flash"), dynamic=False),
    }
    if window is None:
        out["cudnn"] = torch.compile(lambda q, k, v, s: fused_sink_attention(q, k, v, s, None, "cudnn"),
                                     dynamic=False)  # fmt: skip
    return out


def inputs(batch: int, seq: int, sinks: bool, dtype, device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, seq, HEADS, DIM, generator=g, device=device, dtype=dtype).transpose(1, 2)
    k = torch.randn(batch, seq, KV_HEADS, DIM, generator=g, device=device, dtype=dtype).transpose(1, 2)
    v = torch.randn(batch, seq, KV_HEADS, DIM, generator=g, device=device, dtype=dtype).transpose(1, 2)
    s = torch.randn(HEADS, generator=g, device=device, dtype=torch.float32) if sinks else None
    tensors = [t.detach().requires_grad_() for t in (q, k, v)] + ([s.requires_grad_()] if sinks else [])
    return tensors


def time_kernel(fn, batch: int, seq: int, sinks: bool, device) -> dict:
    """Median ms of one forward and of one forward + backward of ``fn``."""
    q, k, v, *s = inputs(batch, seq, sinks, torch.bfloat16, device)
    sk = s[0] if s else None
    grad = torch.randn_like(q)
    with torch.no_grad():
        forward = bench(lambda: fn(q, k, v, sk), reps=20)
    return {"forward_ms": forward, "forward_backward_ms": bench(lambda: fn(q, k, v, sk).backward(grad), reps=20)}


def timing(batch: int, seq: int, windows: list[int | None], device) -> list[dict]:
    rows = []
    for window in windows:
        for sinks in (True, False):
            for name, fn in kernels(seq, window, device).items():
                row = {"kernel": name, "window": window, "sinks": sinks}
                try:
                    row |= time_kernel(fn, batch, seq, sinks, device)
                except Exception as e:  # a kernel that does not run here is reported, not fatal
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def agreement(seq: int, device) -> list[dict]:
    rows = []
    for window in (None, 128):
        for sinks in (True, False):
            ref_in = inputs(1, seq, sinks, torch.float64, device, seed=1)
            ref_sinks = ref_in[3] if sinks else torch.full((HEADS,), -torch.inf, device=device, dtype=torch.float64)
            out = sink_attention(*ref_in[:3], ref_sinks, window)
            grad = torch.randn_like(out)
            out.backward(grad)
            ref = [out.detach()] + [t.grad for t in ref_in]
            candidates = dict(kernels(seq, window, device))
            candidates["dense_bf16"] = lambda q, k, v, s, w=window: sink_attention(
                q, k, v, s if s is not None else torch.full((HEADS,), -torch.inf, device=device), w
            )
            for name, fn in candidates.items():
                half = [t.detach().to(torch.bfloat16 if i < 3 else torch.float32).requires_grad_()
                        for i, t in enumerate(ref_in)]  # fmt: skip
                row = {"kernel": name, "window": window, "sinks": sinks}
                try:
                    o = fn(*half[:3], half[3] if sinks else None)
                    o.backward(grad.to(o.dtype))
                    got = [o.detach()] + [t.grad for t in half]
                    for label, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, ref, strict=False):
                        row[label] = float((a.double() - b).norm() / b.norm())
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--check-seq", type=int, default=2048, help="tokens of the agreement check (0: no check)")
    p.add_argument("--windows", default="none,128", help="the windows timed, comma-separated (none: causal only)")
    args = p.parse_args()
    windows = [None if w == "none" else int(w) for w in args.windows.split(",")]
    if not torch.cuda.is_available():
        sys.exit("perf/sink_attention.py needs a CUDA GPU")
    device = torch.device("cuda")
    torch._dynamo.config.recompile_limit = 64  # every kernel, window, sink choice and grad mode compiles once
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": args.batch, "seq": args.seq}
    result["agreement"] = agreement(args.check_seq, device) if args.check_seq else []
    result["timing"] = timing(args.batch, args.seq, windows, device)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sink_attention.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
