"""cuDNN's FP8 causal attention (trainbench.families.cudnn_fp8_attention) against its bf16 attention.

For each combination of formats (the kernel's output, the output gradient's, the input gradients'): whether cuDNN
builds it on this GPU, its error against float64 at a small shape beside the bf16 kernel's on the same inputs, and
the time of the forward and of the forward and backward together at the 8B's and the 70B's shapes (compiled, the
casts included), beside torch's SDPA through cuDNN in bf16.

    python perf/fp8_attention.py --out OUT/fp8_attention.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from trainbench.families import cudnn_fp8_attention as fa

FORMATS = {"bf16": torch.bfloat16, "e4m3": fa.E4M3, "e5m2": fa.E5M2}
SHAPES = {"llama31_8b": (2, 32, 8, 8192), "llama2_70b": (1, 64, 8, 8192)}


def inputs(batch, heads, kv_heads, seq, seed=0, requires_grad=True):
    """q, k, v as the decoder makes them: [batch, heads, seq, 128] views of [batch, seq, heads, 128]."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def one(h):
        t = torch.randn(batch, seq, h, 128, device="cuda", generator=g, dtype=torch.bfloat16).transpose(1, 2)
        return t.requires_grad_(requires_grad)

    return one(heads), one(kv_heads), one(kv_heads)


def bf16_attention(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def reference(q, k, v, grad):
    """Output and gradients in float64."""
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    kk, vv = k64.repeat_interleave(g, 1), v64.repeat_interleave(g, 1)
    s = q64 @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
    o = s.masked_fill(mask, float("-inf")).softmax(-1) @ vv
    o.backward(grad.double())
    return o.detach(), q64.grad, k64.grad, v64.grad


def errors(fn, q, k, v, grad, ref):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    o = fn(q, k, v)
    o.backward(grad)
    got = (o.detach(), q.grad, k.grad, v.grad)
    out = {}
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, ref, strict=True):
        a = a.double()
        out[name] = float((a - b).norm() / b.norm()) if torch.isfinite(a).all() else float("nan")
    return out


def timed(fn, q, k, v, grad, iters):
    """Median ms of the forward alone and of the forward and backward."""

    def median(step):
        for _ in range(3):
            step()
        times = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        return sorted(times)[len(times) // 2]

    def forward():
        with torch.no_grad():
            fn(q, k, v)

    def both():
        fn(q, k, v).backward(grad)

    return {"forward_ms": median(forward), "forward_backward_ms": median(both)}


def tune(shape, iters) -> dict:
    """Every plan cuDNN builds for the FP8 forward and backward (e4m3 output, e5m2 gradients) at ``shape``, each
    timed alone (median ms): whether another engine than the heuristics' first is faster."""
    q, k, v = inputs(*shape, requires_grad=False)
    (q8, dq_, _), (k8, dk_, _), (v8, dv_, _) = (fa.cast(t, fa.E4M3) for t in (q, k, v))
    fwd_scalars = torch.stack([dq_, dk_, dv_, dq_ * 0 + 1 / 256, dq_ * 0 + 256, dv_.reciprocal()])
    out, stats, _ = fa.fp8_attention_forward(q8, k8, v8, fwd_scalars, fa.E4M3)
    do8, ddo_, _ = fa.cast(torch.randn_like(q), fa.E5M2)
    bwd_scalars = torch.ones(len(fa.BWD_SCALARS), device="cuda")
    amax = torch.zeros(8, device="cuda")
    handle = fa._handle(q.device)
    result = {}
    for backward, tensors in ((False, (q8, k8, v8)), (True, (q8, k8, v8, out, do8))):
        layouts = tuple((tuple(t.shape), tuple(t.stride())) for t in tensors)
        dtypes = (fa.E4M3, fa.E5M2, fa.E5M2) if backward else (fa.E4M3, None, None)
        g, uids, _ = fa._build(backward, layouts, dtypes, handle, all_plans=True)
        pack = {uids["q"]: q8, uids["k"]: k8, uids["v"]: v8}
        if backward:
            grads = [torch.empty_like(t, dtype=fa.E5M2) for t in (q8, k8, v8)]
            pack.update({uids["o"]: out, uids["dO"]: do8, uids["stats"]: stats})
            pack.update(dict(zip((uids["dQ"], uids["dK"], uids["dV"]), grads, strict=True)))
            names, amaxes, scalars = fa.BWD_SCALARS, ("amax_dQ", "amax_dK", "amax_dV", "amax_dP"), bwd_scalars
        else:
            pack.update({uids["o"]: torch.empty_like(q8), uids["stats"]: torch.empty_like(stats)})
            names, amaxes, scalars = fa.FWD_SCALARS, ("amax_s", "amax_o"), fwd_scalars
        pack.update({uids[n]: amax.data_ptr() + 4 * i for i, n in enumerate(amaxes)})
        pack.update({uids[n]: scalars.data_ptr() + 4 * i for i, n in enumerate(names)})
        plans = []
        for i in range(g.get_execution_plan_count()):
            try:
                ws = torch.empty(max(g.get_workspace_size_plan_at_index(i), 1), dtype=torch.uint8, device="cuda")
                name = g.get_plan_name_at_index(i)
                for _ in range(3):
                    g.execute_plan_at_index(pack, ws, i, handle=handle)
                times = []
                for _ in range(iters):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    g.execute_plan_at_index(pack, ws, i, handle=handle)
                    b.record()
                    torch.cuda.synchronize()
                    times.append(a.elapsed_time(b))
                plans.append({"plan": name, "ms": sorted(times)[len(times) // 2]})
            except Exception as e:  # noqa: BLE001 - a plan that will not run is the finding
                plans.append({"plan": i, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            print("backward" if backward else "forward", plans[-1], flush=True)
        result["backward" if backward else "forward"] = plans
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--check-seq", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--combos", default="bf16:e5m2:bf16,bf16:e5m2:e5m2,e4m3:e5m2:e5m2,e4m3:e4m3:e4m3,bf16:e4m3:e4m3",
                    help="output:output-gradient:gradients formats, comma-separated")  # fmt: skip
    ap.add_argument("--tune", action="store_true", help="time every plan cuDNN builds, at the 8B's shape, alone")
    args = ap.parse_args()
    why = fa.unavailable()
    if why:
        print(why, file=sys.stderr)
        return 2
    import cudnn

    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn": cudnn.backend_version_string(),
              "frontend": cudnn.__version__, "combos": {}, "bf16": {}}  # fmt: skip
    if args.tune:
        result["tune"] = tune(SHAPES["llama31_8b"], args.iters)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        return 0
    q, k, v = inputs(2, 8, 2, args.check_seq)
    grad = torch.randn_like(q.detach())
    ref = reference(q, k, v, grad)
    result["bf16"]["error"] = errors(bf16_attention, q, k, v, grad, ref)
    print("bf16 cuDNN error", result["bf16"]["error"], flush=True)
    for combo in args.combos.split(","):
        o_f, do_f, g_f = (FORMATS[x] for x in combo.split(":"))

        def fn(q, k, v, o_f=o_f, do_f=do_f, g_f=g_f):
            return fa.fp8_causal_attention(q, k, v, o_f, do_f, g_f)

        entry = result["combos"].setdefault(combo, {})
        try:
            entry["error"] = errors(fn, q, k, v, grad, ref)
        except Exception as e:  # noqa: BLE001 - what cuDNN refuses is the finding
            entry["refused"] = f"{type(e).__name__}: {str(e)[:400]}"
        print(combo, entry, flush=True)
    compiled_bf16 = torch.compile(bf16_attention)
    for shape_name, shape in SHAPES.items():
        big = inputs(*shape)
        g = torch.randn_like(big[0].detach())
        t0 = time.time()
        result["bf16"][shape_name] = timed(compiled_bf16, *big, g, args.iters)
        print(shape_name, "bf16", result["bf16"][shape_name], f"{time.time() - t0:.0f} s", flush=True)
        for combo, entry in result["combos"].items():
            if "refused" in entry:
                continue
            o_f, do_f, g_f = (FORMATS[x] for x in combo.split(":"))
            fn = torch.compile(
                lambda q, k, v, o_f=o_f, do_f=do_f, g_f=g_f: fa.fp8_causal_attention(q, k, v, o_f, do_f, g_f)
            )
            try:
                entry[shape_name] = timed(fn, *big, g, args.iters)
            except Exception as e:  # noqa: BLE001
                entry[shape_name] = f"{type(e).__name__}: {str(e)[:400]}"
            print(shape_name, combo, entry[shape_name], flush=True)
        del big, g
        torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
