"""Causal attention in FP8 through cuDNN's fused FP8 attention (``model.attention_precision=fp8``).

Query, key and value are cast to e4m3 with a power-of-two scale a tensor (their largest magnitudes, computed where
they are made, so a compiled block fuses the casts into the rotary embedding's kernel); the kernel keeps the softmax's
probabilities in e4m3 too and multiplies on FP8 tensor cores. Its output is bf16 (``o_dtype``) and the backward
takes the output's gradient in e5m2.

Every scale the kernel needs beyond its inputs' is fixed from bounds, not measured, so no step waits on the last
one's maxima and nothing is carried between calls:
- the probabilities lie in [0, 1];
- the output is an average of the value rows, so it is no larger than the value's largest magnitude;
- the probabilities' gradient dP = dO V^T is at most ``head_dim`` x max|dO| x max|V|;
- the scores' gradient dS = P (dP - D), with D a row's dO . O, sums over a row to at most twice that; so the query's
  gradient is at most ``attn_scale`` x max|K| x that sum, and the key's and the value's at most the number of queries
  (and of query heads sharing a key head) times the same per query.
The gradients come back in ``grad_dtype``: where that is an FP8 format they are written at those bounds' scales and
the caller multiplies them back.

Graphs are built with the cuDNN frontend's Python API (``pip install -e '.[cudnn]'``) once per shape and reused; the
forward and backward are custom ops with fake kernels, so ``torch.compile`` traces through them. cuDNN's FP8
attention on Hopper needs a head width of 128.
"""

from __future__ import annotations

import math
import threading

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FMAX = {E4M3: 448.0, E5M2: 57344.0}
S_SCALE = 256.0  # the probabilities (at most 1) in e4m3: a power of two under 448

# The forward's scalars, in this order in one float32 tensor, and the backward's.
FWD_SCALARS = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
BWD_SCALARS = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP",
               "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP")  # fmt: skip

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
_handles: dict[int, object] = {}
_graphs: dict[tuple, tuple] = {}
_lock = threading.Lock()


def unavailable(device: torch.device | None = None) -> str | None:
    """Why FP8 attention cannot run here (no CUDA GPU of compute capability 9.0 or newer, no cuDNN frontend),
    or None."""
    if not torch.cuda.is_available():
        return "model.attention_precision=fp8 needs a CUDA GPU"
    if torch.cuda.get_device_capability(device) < (9, 0):
        return "model.attention_precision=fp8 needs a GPU of compute capability 9.0 or newer (cuDNN's FP8 attention)"
    try:
        import cudnn  # noqa: F401
    except ImportError:
        return "model.attention_precision=fp8 needs the cuDNN frontend: pip install -e '.[cudnn]' in trainbench's clone"
    except OSError as e:
        return f"model.attention_precision=fp8: the cuDNN frontend did not load ({e})"
    return None


def _handle(device: torch.device):
    import cudnn

    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _handles:
        with torch.cuda.device(index):
            _handles[index] = cudnn.create_handle()
    cudnn.set_stream(handle=_handles[index], stream=torch.cuda.current_stream(index).cuda_stream)
    return _handles[index]


def _cudnn_type(dtype: torch.dtype):
    import cudnn

    return {E4M3: cudnn.data_type.FP8_E4M3, E5M2: cudnn.data_type.FP8_E5M2, torch.bfloat16: cudnn.data_type.BFLOAT16,
            torch.float16: cudnn.data_type.HALF}[dtype]  # fmt: skip


def _build(backward: bool, layouts: tuple, dtypes: tuple, handle, all_plans: bool = False) -> tuple:
    """The forward or backward graph for ``layouts``, the (shape, strides) of query, key and value ([batch, heads,
    seq, head_dim] each), and in the backward of the output and its gradient; ``dtypes``: the output's, the output
    gradient's and the input gradients' formats. Each gradient takes its input's layout. ``all_plans``: build every
    plan cuDNN offers (to time them), not only the heuristics' first. Returns (graph, uids, workspace bytes)."""
    import cudnn

    g = cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)  # fmt: skip
    uid = iter(range(1, 100))
    uids: dict[str, int] = {}

    def tensor(name, layout, dtype):
        uids[name] = next(uid)
        return g.tensor(name=name, dim=list(layout[0]), stride=list(layout[1]), data_type=dtype, uid=uids[name])

    def output(t, name, layout, dtype):
        uids[name] = next(uid)
        t.set_output(True).set_dim(list(layout[0])).set_stride(list(layout[1])).set_data_type(dtype)
        t.set_uid(uids[name])

    o_dtype, do_dtype, grad_dtype = dtypes
    b, hq, s, d = layouts[0][0]
    f32, e4m3 = cudnn.data_type.FLOAT, cudnn.data_type.FP8_E4M3
    q, k, v = (tensor(n, layout, e4m3) for n, layout in zip("qkv", layouts[:3], strict=True))
    stats_layout = ((b, hq, s, 1), (hq * s, s, 1, 1))
    scalar = ((1, 1, 1, 1), (1, 1, 1, 1))
    scalars = {n: tensor(n, scalar, f32) for n in (BWD_SCALARS if backward else FWD_SCALARS)}
    common = dict(attn_scale=1.0 / math.sqrt(d), use_causal_mask=True)
    if not backward:
        o, stats, amax_s, amax_o = g.sdpa_fp8(name="fp8_attention", q=q, k=k, v=v, generate_stats=True,
                                              **scalars, **common)  # fmt: skip
        output(o, "o", layouts[0], _cudnn_type(o_dtype))
        output(stats, "stats", stats_layout, f32)
        output(amax_s, "amax_s", scalar, f32)
        output(amax_o, "amax_o", scalar, f32)
    else:
        o = tensor("o", layouts[3], _cudnn_type(o_dtype))
        do = tensor("dO", layouts[4], _cudnn_type(do_dtype))
        stats = tensor("stats", stats_layout, f32)
        grads = g.sdpa_fp8_backward(name="fp8_attention_backward", q=q, k=k, v=v, o=o, dO=do, stats=stats,
                                    **scalars, **common)  # fmt: skip
        for grad, name, layout in zip(grads[:3], ("dQ", "dK", "dV"), layouts[:3], strict=True):
            output(grad, name, layout, _cudnn_type(grad_dtype))
        for amax, name in zip(grads[3:], ("amax_dQ", "amax_dK", "amax_dV", "amax_dP"), strict=True):
            output(amax, name, scalar, f32)
    g.validate()
    g.build_operation_graph()
    modes = [cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK]
    g.create_execution_plans([*modes, cudnn.heur_mode.B] if all_plans else modes)
    g.check_support()
    if all_plans:
        g.build_plans(cudnn.build_plan_policy.ALL)
    else:
        g.build_plans()
    return g, uids, g.get_workspace_size()


def _graph(backward: bool, tensors: tuple, dtypes: tuple):
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError("FP8 attention reads rows of head_dim contiguous elements")
    handle = _handle(tensors[0].device)
    layouts = tuple((tuple(t.shape), tuple(t.stride())) for t in tensors)
    key = (backward, tensors[0].device, layouts, dtypes)
    if key not in _graphs:
        with _lock:
            if key not in _graphs:
                _graphs[key] = _build(backward, layouts, dtypes, handle)
    return (*_graphs[key], handle)


def _like(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor of ``t``'s shape and strides in ``dtype``."""
    return torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=t.device)


def _scalar_bindings(uids: dict, scalars: torch.Tensor, names: tuple) -> dict:
    step = scalars.element_size()
    return {uids[n]: scalars.data_ptr() + i * step for i, n in enumerate(names)}


@torch.library.custom_op("trainbench::cudnn_fp8_attention", mutates_args=(), device_types="cuda")
def fp8_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scalars: torch.Tensor,
                          o_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Causal attention of e4m3 ``q``, ``k``, ``v`` ([batch, heads, seq, 128], key and value heads dividing the
    query's), with ``scalars`` the float32 :data:`FWD_SCALARS`: returns the output in ``o_dtype`` (``q``'s layout),
    the softmax's log-sum-exp statistics [batch, heads, seq, 1] (float32) and the maxima of the probabilities and of
    the output (float32 [2])."""
    graph, uids, workspace, handle = _graph(False, (q, k, v), (o_dtype, None, None))
    b, h, s, _ = q.shape
    out = _like(q, o_dtype)
    stats = torch.empty(b, h, s, 1, dtype=torch.float32, device=q.device)
    amax = torch.empty(2, dtype=torch.float32, device=q.device)
    bound = {uids["q"]: q, uids["k"]: k, uids["v"]: v, uids["o"]: out, uids["stats"]: stats,
             uids["amax_s"]: amax.data_ptr(), uids["amax_o"]: amax.data_ptr() + 4}  # fmt: skip
    bound.update(_scalar_bindings(uids, scalars, FWD_SCALARS))
    graph.execute(bound, torch.empty(max(workspace, 1), dtype=torch.uint8, device=q.device), handle=handle)
    return out, stats, amax


@fp8_attention_forward.register_fake
def _(q, k, v, scalars, o_dtype):
    b, h, s, _ = q.shape
    return _like(q, o_dtype), q.new_empty(b, h, s, 1, dtype=torch.float32), q.new_empty(2, dtype=torch.float32)


@torch.library.custom_op("trainbench::cudnn_fp8_attention_backward", mutates_args=(), device_types="cuda")
def fp8_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           out: torch.Tensor, stats: torch.Tensor, scalars: torch.Tensor,
                           grad_dtype: torch.dtype) -> Grads:  # fmt: skip
    """The gradients of :func:`fp8_attention_forward` for the output's gradient ``grad_out`` (``out``'s layout,
    FP8), with ``scalars`` the float32 :data:`BWD_SCALARS`: returns the query's, key's and value's gradients in
    ``grad_dtype`` (their inputs' layouts) and the maxima of dQ, dK, dV and dP (float32 [4])."""
    tensors, dtypes = (q, k, v, out, grad_out), (out.dtype, grad_out.dtype, grad_dtype)
    graph, uids, workspace, handle = _graph(True, tensors, dtypes)
    dq, dk, dv = _like(q, grad_dtype), _like(k, grad_dtype), _like(v, grad_dtype)
    amax = torch.empty(4, dtype=torch.float32, device=q.device)
    bound = {uids["q"]: q, uids["k"]: k, uids["v"]: v, uids["o"]: out, uids["dO"]: grad_out, uids["stats"]: stats,
             uids["dQ"]: dq, uids["dK"]: dk, uids["dV"]: dv}  # fmt: skip
    bound.update({uids[n]: amax.data_ptr() + 4 * i for i, n in enumerate(("amax_dQ", "amax_dK", "amax_dV", "amax_dP"))})
    bound.update(_scalar_bindings(uids, scalars, BWD_SCALARS))
    graph.execute(bound, torch.empty(max(workspace, 1), dtype=torch.uint8, device=q.device), handle=handle)
    return dq, dk, dv, amax


@fp8_attention_backward.register_fake
def _(grad_out, q, k, v, out, stats, scalars, grad_dtype):
    return _like(q, grad_dtype), _like(k, grad_dtype), _like(v, grad_dtype), q.new_empty(4, dtype=torch.float32)


def pow2_scale(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """The largest power of two that keeps ``amax`` (float32, > 0) within ``fmax``."""
    return torch.exp2(torch.floor(torch.log2(fmax / amax.float().clamp(min=1e-30))))


def cast(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``t`` in ``dtype`` at a power-of-two scale (its layout kept), the scale's reciprocal and ``t``'s largest
    magnitude (float32 scalars)."""
    amax = t.detach().abs().amax().float().clamp(min=1e-30)
    scale = pow2_scale(amax, FMAX[dtype])
    return (t.detach().float() * scale).clamp(-FMAX[dtype], FMAX[dtype]).to(dtype), scale.reciprocal(), amax


class FP8Attention(torch.autograd.Function):
    """Causal attention of bf16 ``q``, ``k``, ``v`` ([batch, heads, seq, 128], any layout whose rows are
    contiguous) through cuDNN's FP8 kernels; the output in ``q``'s dtype and layout. ``o_dtype``: the kernel's
    output format (bf16, or e4m3 at the value's scale, multiplied back here); ``do_dtype``: the output gradient's
    FP8 format; ``grad_dtype``: the kernel's gradients' format (bf16, or an FP8 format written at the bounds of the
    module's docstring and multiplied back here)."""

    @staticmethod
    def forward(ctx, q, k, v, o_dtype: torch.dtype, do_dtype: torch.dtype, grad_dtype: torch.dtype):
        q8, dq_, amax_q = cast(q, E4M3)
        k8, dk_, amax_k = cast(k, E4M3)
        v8, dv_, amax_v = cast(v, E4M3)
        one = torch.ones_like(dq_)
        scale_o = dv_.reciprocal() if o_dtype in FMAX else one  # |O| <= max|V|
        scalars = torch.stack([dq_, dk_, dv_, one / S_SCALE, one * S_SCALE, scale_o])
        out, stats, _ = fp8_attention_forward(q8, k8, v8, scalars, o_dtype)
        ctx.save_for_backward(q8, k8, v8, out, stats, torch.stack([dq_, dk_, dv_, amax_q, amax_k, amax_v]))
        ctx.dtypes, ctx.dtype = (do_dtype, grad_dtype), q.dtype
        ctx.groups = q.shape[1] // k.shape[1]
        if o_dtype in FMAX:
            return (out.float() * dv_).to(q.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q8, k8, v8, out, stats, saved = ctx.saved_tensors
        dq_, dk_, dv_, amax_q, amax_k, amax_v = saved.unbind(0)
        do_dtype, grad_dtype = ctx.dtypes
        do8, ddo_, amax_do = cast(grad_out, do_dtype)
        d, seq = q8.shape[-1], q8.shape[-2]
        attn_scale = 1.0 / math.sqrt(d)
        one = torch.ones_like(dq_)
        bound_dp = d * amax_do * amax_v
        per_query = attn_scale * 2 * bound_dp  # times max|K| (dQ) or max|Q| (dK), summed over a row of P
        bounds = (per_query * amax_k, per_query * amax_q * seq * ctx.groups, amax_do * seq * ctx.groups)
        fmax = FMAX.get(grad_dtype)
        grad_scales = [one, one, one] if fmax is None else [pow2_scale(bnd, fmax) for bnd in bounds]
        scale_dp = pow2_scale(bound_dp, FMAX[do_dtype])
        descale_o = dv_ if out.dtype in FMAX else one
        scalars = torch.stack([dq_, dk_, dv_, descale_o, ddo_, one / S_SCALE, scale_dp.reciprocal(), one * S_SCALE,
                               *grad_scales, scale_dp])  # fmt: skip
        dq, dk, dv, _ = fp8_attention_backward(do8, q8, k8, v8, out, stats, scalars, grad_dtype)
        if fmax is not None:
            dq, dk, dv = ((g.float() / s).to(ctx.dtype) for g, s in zip((dq, dk, dv), grad_scales, strict=True))
        return dq, dk, dv, None, None, None


def fp8_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o_dtype: torch.dtype = torch.bfloat16,
                         do_dtype: torch.dtype = E5M2, grad_dtype: torch.dtype = E5M2) -> torch.Tensor:  # fmt: skip
    """Causal attention in FP8 (:class:`FP8Attention`) of bf16 [batch, heads, seq, 128] query, key and value."""
    return FP8Attention.apply(q, k, v, o_dtype, do_dtype, grad_dtype)
