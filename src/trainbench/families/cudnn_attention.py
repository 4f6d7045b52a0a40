"""Attention over packed rows through cuDNN's fused attention (``model.packed_attention=cudnn``).

The packed rows are one stream of variable-length sequences (the same segments as varlen flash attention:
each row gives ``per_row`` sequence slots and one padding slot, some of them empty). cuDNN reads them in
place through *ragged offsets*: query, key and value are taken straight from the fused QKV projection's
output ([tokens, 3, heads, head_dim], no copy), and the backward writes the three gradients into one
[tokens, 3, heads, head_dim] tensor, so nothing stacks them again. Attention dropout runs inside the kernel
(Philox, seeded per call from PyTorch's generator, so runs repeat under a fixed seed).

The graphs are built with the cuDNN frontend's Python API (the optional package ``nvidia-cudnn-frontend``,
``pip install -e '.[cudnn]'`` in trainbench's clone) once per shape and reused. The forward and backward are custom ops
with fake kernels, so ``torch.compile`` traces through them without a graph break.
"""

from __future__ import annotations

import math
import threading
from typing import NamedTuple

import torch

_UID_Q, _UID_K, _UID_V, _UID_O, _UID_STATS = 1, 2, 3, 4, 5
_UID_DO, _UID_DQ, _UID_DK, _UID_DV = 6, 7, 8, 9
_UID_LEN, _UID_OFF_QKV, _UID_OFF_O, _UID_SEED, _UID_OFFSET = 10, 11, 12, 13, 14
_INT32_MAX = 2**31 - 1


def unavailable() -> str | None:
    """Why the cuDNN kernel cannot run in this Python (the frontend package is missing, or its cuDNN library
    would not load), or None."""
    try:
        import cudnn  # noqa: F401
    except ImportError:
        return "model.packed_attention=cudnn needs the cuDNN frontend: pip install -e '.[cudnn]' in trainbench's clone"
    except OSError as e:  # the package is there but libcudnn would not load
        return f"model.packed_attention=cudnn: the cuDNN frontend did not load ({e})"
    return None


class CudnnSegments(NamedTuple):
    """Packed rows as cuDNN sees them: per-sequence lengths [N, 1, 1, 1] (int32) and the element offsets of
    every sequence's first token in the QKV projection ([tokens, 3, heads, head_dim]) and in the attention
    output ([tokens, heads, head_dim]), both [N + 1, 1, 1, 1] (int32). ``max_len`` bounds the lengths."""

    lengths: torch.Tensor
    offsets_qkv: torch.Tensor
    offsets_out: torch.Tensor
    max_len: int


def cudnn_segments(cu_seqlens: torch.Tensor, max_len: int, hidden: int) -> CudnnSegments:
    """cuDNN's segment tensors from the cumulative sequence offsets of
    :func:`trainbench.families.encoder.model.varlen_segments` for a layer of width ``hidden``; computed once per
    forward and shared by every layer."""
    tokens = cu_seqlens.long()
    lengths = (tokens[1:] - tokens[:-1]).to(torch.int32)
    offsets_qkv, offsets_out = (tokens * 3 * hidden).to(torch.int32), (tokens * hidden).to(torch.int32)
    return CudnnSegments(*(t.view(-1, 1, 1, 1) for t in (lengths, offsets_qkv, offsets_out)), max_len)


_handles: dict[int, object] = {}
_graphs: dict[tuple, tuple] = {}
_lock = threading.Lock()


def _handle(device: torch.device):
    """A cuDNN handle for ``device``, bound to PyTorch's current stream there."""
    import cudnn

    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _handles:
        with torch.cuda.device(index):
            _handles[index] = cudnn.create_handle()
    cudnn.set_stream(handle=_handles[index], stream=torch.cuda.current_stream(index).cuda_stream)
    return _handles[index]


def _build(backward: bool, dtype: torch.dtype, sequences: int, heads: int, dim: int, max_len: int, tokens: int,
           dropout_p: float, handle) -> tuple:  # fmt: skip
    """Build the forward or backward cuDNN graph for one shape: returns (graph, workspace bytes)."""
    import cudnn

    io = {torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float16: cudnn.data_type.HALF}[dtype]
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)  # fmt: skip
    b, h, s, d = sequences, heads, max_len, dim
    qkv_stride, out_stride = [s * 3 * h * d, d, 3 * h * d, 1], [s * h * d, d, h * d, 1]

    def column(name, uid, rows, kind=cudnn.data_type.INT32):
        return g.tensor(name=name, dim=[rows, 1, 1, 1], stride=[1, 1, 1, 1], data_type=kind, uid=uid)

    lengths = column("lengths", _UID_LEN, b)
    off_qkv, off_o = column("offsets_qkv", _UID_OFF_QKV, b + 1), column("offsets_out", _UID_OFF_O, b + 1)

    def operand(name, uid, stride, offsets):
        t = g.tensor(name=name, dim=[b, h, s, d], stride=stride, data_type=io, uid=uid)
        t.set_ragged_offset(offsets)
        return t

    q, k, v = (operand(n, u, qkv_stride, off_qkv) for n, u in (("q", _UID_Q), ("k", _UID_K), ("v", _UID_V)))
    common = dict(attn_scale=1.0 / math.sqrt(d), use_padding_mask=True, seq_len_q=lengths, seq_len_kv=lengths)
    if dropout_p > 0:
        seed = column("seed", _UID_SEED, 1, cudnn.data_type.INT64)
        common["dropout"] = (dropout_p, seed, column("offset", _UID_OFFSET, 1, cudnn.data_type.INT64))
    stats_dims, stats_stride = [b, h, s, 1], [h * s, s, 1, 1]  # padded per sequence, fp32
    if not backward:
        o, stats = g.sdpa(name="attention", q=q, k=k, v=v, generate_stats=True, **common)
        o.set_output(True).set_dim([b, h, s, d]).set_stride(out_stride).set_data_type(io).set_uid(_UID_O)
        o.set_ragged_offset(off_o)
        stats.set_output(True).set_dim(stats_dims).set_stride(stats_stride).set_uid(_UID_STATS)
        stats.set_data_type(cudnn.data_type.FLOAT)
    else:
        o, do = operand("o", _UID_O, out_stride, off_o), operand("do", _UID_DO, out_stride, off_o)
        stats = g.tensor(name="stats", dim=stats_dims, stride=stats_stride, data_type=cudnn.data_type.FLOAT,
                         uid=_UID_STATS)  # fmt: skip
        grads = g.sdpa_backward(name="attention_backward", q=q, k=k, v=v, o=o, dO=do, stats=stats,
                                max_total_seq_len_q=tokens, max_total_seq_len_kv=tokens, **common)  # fmt: skip
        for grad, uid in zip(grads, (_UID_DQ, _UID_DK, _UID_DV), strict=True):
            grad.set_output(True).set_dim([b, h, s, d]).set_stride(qkv_stride).set_data_type(io).set_uid(uid)
            grad.set_ragged_offset(off_qkv)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return g, g.get_workspace_size()


def _graph(backward: bool, qkv: torch.Tensor, segments_n: int, max_len: int, dropout_p: float):
    tokens, _, heads, dim = qkv.shape
    if tokens * 3 * heads * dim > _INT32_MAX:
        raise ValueError(f"model.packed_attention=cudnn: {tokens} tokens are too many for int32 offsets")
    handle = _handle(qkv.device)
    key = (backward, qkv.device, qkv.dtype, segments_n, heads, dim, max_len, tokens, dropout_p)
    if key not in _graphs:
        with _lock:
            if key not in _graphs:
                _graphs[key] = _build(backward, qkv.dtype, segments_n, heads, dim, max_len, tokens, dropout_p, handle)
    return (*_graphs[key], handle)


def _thirds(t: torch.Tensor, uids) -> dict:
    """uid -> device pointer of each third of a [tokens, 3, heads, head_dim] tensor (query, key, value, or their
    gradients): the three start one [heads, head_dim] block apart within a token."""
    step = t.shape[2] * t.shape[3] * t.element_size()
    return {uid: t.data_ptr() + i * step for i, uid in enumerate(uids)}


def _bindings(qkv: torch.Tensor, segments: tuple, rng: torch.Tensor, dropout_p: float) -> dict:
    """uid -> device buffer for what both graphs read: query, key and value in ``qkv``, the segment tensors
    and, with dropout, the seed and offset."""
    lengths, offsets_qkv, offsets_out = segments
    bound = _thirds(qkv, (_UID_Q, _UID_K, _UID_V))
    bound.update({_UID_LEN: lengths, _UID_OFF_QKV: offsets_qkv, _UID_OFF_O: offsets_out})
    if dropout_p > 0:
        bound.update({_UID_SEED: rng[0:1], _UID_OFFSET: rng[1:2]})
    return bound


@torch.library.custom_op("trainbench::cudnn_varlen_attention", mutates_args=(), device_types="cuda")
def _forward(qkv: torch.Tensor, lengths: torch.Tensor, offsets_qkv: torch.Tensor, offsets_out: torch.Tensor,
             rng: torch.Tensor, max_len: int, dropout_p: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    tokens, _, heads, dim = qkv.shape
    graph, workspace, handle = _graph(False, qkv, lengths.shape[0], max_len, dropout_p)
    out = torch.empty(tokens, heads, dim, dtype=qkv.dtype, device=qkv.device)
    stats = torch.empty(lengths.shape[0], heads, max_len, 1, dtype=torch.float32, device=qkv.device)
    bound = _bindings(qkv, (lengths, offsets_qkv, offsets_out), rng, dropout_p)
    bound.update({_UID_O: out, _UID_STATS: stats})
    graph.execute(bound, torch.empty(max(workspace, 1), dtype=torch.uint8, device=qkv.device), handle=handle)
    return out, stats


@_forward.register_fake
def _(qkv, lengths, offsets_qkv, offsets_out, rng, max_len, dropout_p):
    tokens, _, heads, dim = qkv.shape
    return qkv.new_empty(tokens, heads, dim), qkv.new_empty(lengths.shape[0], heads, max_len, 1, dtype=torch.float32)


@torch.library.custom_op("trainbench::cudnn_varlen_attention_backward", mutates_args=(), device_types="cuda")
def _backward(grad_out: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor, stats: torch.Tensor,
              lengths: torch.Tensor, offsets_qkv: torch.Tensor, offsets_out: torch.Tensor, rng: torch.Tensor,
              max_len: int, dropout_p: float) -> torch.Tensor:  # fmt: skip
    graph, workspace, handle = _graph(True, qkv, lengths.shape[0], max_len, dropout_p)
    grad_qkv = torch.empty_like(qkv)
    bound = _bindings(qkv, (lengths, offsets_qkv, offsets_out), rng, dropout_p)
    bound.update(_thirds(grad_qkv, (_UID_DQ, _UID_DK, _UID_DV)))
    bound.update({_UID_O: out, _UID_DO: grad_out.contiguous(), _UID_STATS: stats})
    graph.execute(bound, torch.empty(max(workspace, 1), dtype=torch.uint8, device=qkv.device), handle=handle)
    return grad_qkv


@_backward.register_fake
def _(grad_out, qkv, out, stats, lengths, offsets_qkv, offsets_out, rng, max_len, dropout_p):
    return torch.empty_like(qkv)


def _setup_context(ctx, inputs, output):
    qkv, lengths, offsets_qkv, offsets_out, rng, max_len, dropout_p = inputs
    ctx.save_for_backward(qkv, output[0], output[1], lengths, offsets_qkv, offsets_out, rng)
    ctx.max_len, ctx.dropout_p = max_len, dropout_p


def _autograd_backward(ctx, grad_out, _grad_stats):
    qkv, out, stats, lengths, offsets_qkv, offsets_out, rng = ctx.saved_tensors
    grad_qkv = _backward(grad_out, qkv, out, stats, lengths, offsets_qkv, offsets_out, rng, ctx.max_len, ctx.dropout_p)
    return grad_qkv, None, None, None, None, None, None


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def cudnn_varlen_attention(qkv: torch.Tensor, segments: CudnnSegments, dropout_p: float) -> torch.Tensor:
    """Attention within each sequence of ``segments`` for the fused projection ``qkv`` [tokens, 3, heads,
    head_dim] (contiguous, bf16 or fp16, CUDA): returns [tokens, heads, head_dim]. ``dropout_p`` is the
    attention-probability dropout; its Philox seed and offset come from PyTorch's CUDA generator."""
    if dropout_p > 0:
        rng = torch.randint(0, 2**62, (2,), device=qkv.device, dtype=torch.int64)
    else:  # not read
        rng = torch.empty(2, device=qkv.device, dtype=torch.int64)
    lengths, offsets_qkv, offsets_out, max_len = segments
    return _forward(qkv.contiguous(), lengths, offsets_qkv, offsets_out, rng, max_len, float(dropout_p))[0]
