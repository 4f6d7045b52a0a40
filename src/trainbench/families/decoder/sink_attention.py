"""Attention with learned sinks and an optional sliding window (GPT-OSS's block, as NVIDIA submitted gpt_oss_20b).

A sink is one learned logit per head that joins every query's softmax as an extra key with no value: it takes part of
the probability mass and gives nothing back. With the log-sum-exp ``lse`` of a query's scores over its real keys,

    out_with_sink = out_without_sink x Z / (Z + e^sink) = out_without_sink x sigmoid(lse - sink),

so any fused kernel that returns the log-sum-exp (FlexAttention, cuDNN's) gives sink attention by one scale of its
output, differentiable through ``lse``; :func:`with_sinks` is that step. :func:`sink_attention` is the dense form
(every score in memory, fp32 softmax): the definition the fused paths are checked against, and the CPU's path.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention


def window_mask(seq: int, window: int | None, device=None) -> torch.Tensor:
    """[seq, seq] True where query i may attend key j: causal, and within the last ``window`` positions (itself
    included) where a window is given."""
    i = torch.arange(seq, device=device)[:, None]
    j = torch.arange(seq, device=device)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= j > i - window
    return allowed


def _sink_scale(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """sigmoid(lse - sink) [batch, heads, seq, 1] in fp32: what each query keeps of its attention beside its sink."""
    return torch.sigmoid(_wide(lse) - _wide(sinks)[None, :, None])[..., None]


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32 at least."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``out`` [batch, heads, seq, dim] of attention without sinks, and its ``lse`` [batch, heads, seq], as
    attention with the per-head ``sinks`` [heads] among the keys."""
    return (_wide(out) * _sink_scale(lse, sinks)).to(out.dtype)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, window: int | None = None,
                   scale: float | None = None) -> torch.Tensor:  # fmt: skip
    """Causal attention of ``q`` [batch, heads, seq, dim] over ``k``, ``v`` [batch, kv_heads, seq, dim] (grouped
    queries: heads a multiple of kv_heads) with learned ``sinks`` [heads] and a sliding ``window``; the softmax in
    fp32. Returns [batch, heads, seq, dim]."""
    b, h, s, d = q.shape
    groups = h // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    wide = torch.promote_types(q.dtype, torch.float32)  # the softmax in fp32 at least
    scores = (q.to(wide) @ k.to(wide).transpose(-1, -2)) * (scale if scale is not None else d**-0.5)
    scores = scores.masked_fill(~window_mask(s, window, q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ v.to(wide)
    return with_sinks(out, lse, sinks).to(q.dtype)


def flex_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
                        mask: BlockMask) -> torch.Tensor:  # fmt: skip
    """:func:`sink_attention` through FlexAttention (compiled) with ``mask``, its block mask for the window; the sinks
    from its log-sum-exp (:func:`with_sinks`), differentiable through it. ``sinks`` None: no sinks."""
    gqa = q.shape[1] != k.shape[1]
    if sinks is None:
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)
    out, aux = flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa, return_aux=AuxRequest(lse=True))
    return with_sinks(out, aux.lse, sinks)


def _flash_window(window: int | None) -> dict:
    """Flash attention's window arguments: the ``window`` last keys, the query's own included."""
    return {"window_size_left": window - 1, "window_size_right": 0} if window is not None else {}


def _kernel_forward(kernel: str, q, k, v, window):
    """(out, lse [batch, heads, seq] fp32, what the backward needs) of attention without sinks; q, k, v and out
    [batch, heads, seq, dim]."""
    seq = q.shape[2]
    if kernel == "flash":
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, seq, seq, 0.0, True, False,
            **_flash_window(window))  # fmt: skip
        return out.transpose(1, 2), lse, (rng, unused)
    out, lse, _, _, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, True, False
    )
    return out, lse.view(lse.shape[:3]), (seed, offset)


def _kernel_backward(kernel: str, grad, q, k, v, out, lse, aux, window):
    seq = q.shape[2]
    if kernel == "flash":
        grads = torch.ops.aten._flash_attention_backward(
            *(t.transpose(1, 2) for t in (grad, q, k, v, out)), lse, None, None, seq, seq, 0.0, True, *aux,
            **_flash_window(window))  # fmt: skip
        return tuple(g.transpose(1, 2) for g in grads)
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        grad, q, k, v, out, lse[..., None], *aux, None, None, None, seq, seq, 0.0, True
    )


class _FusedSinks(torch.autograd.Function):
    """Sink attention through a fused kernel's own forward and backward (flash attention's, which has grouped
    queries and the sliding window, or cuDNN's, causal only), the sinks applied outside it.

    The forward scales the kernel's output O by s = sigmoid(lse - sink). The backward needs no gradient through
    ``lse``: with P the kernel's probabilities without the sink (recomputed from its ``lse``), O' = s O the output
    and dO' its gradient, the true score gradient is s P (dO' v - D'), D' = rowsum(dO' O'). The kernel's own
    backward, given the gradient s dO' and the output O', computes P (s dO' v - rowsum(s dO' O')): the same. Each
    sink's gradient is -sum over its queries of (1 - s) D'."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, window, kernel):
        out, lse, aux = _kernel_forward(kernel, q, k, v, window)
        if sinks is not None:
            out = with_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks, *aux)
        ctx.window, ctx.kernel = window, kernel
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, out, lse, sinks, *aux = ctx.saved_tensors
        if sinks is None:
            return *_kernel_backward(ctx.kernel, grad, q, k, v, out, lse, aux, ctx.window), None, None, None
        scale = _sink_scale(lse, sinks)
        grad = _wide(grad)
        dq, dk, dv = _kernel_backward(ctx.kernel, (grad * scale).to(q.dtype), q, k, v, out, lse, aux, ctx.window)
        rowsum = (grad * _wide(out)).sum(-1, keepdim=True)  # D' [batch, heads, seq, 1]
        dsinks = -((1.0 - scale) * rowsum).sum((0, 2, 3))
        return dq, dk, dv, dsinks.to(sinks.dtype), None, None


def fused_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
                         window: int | None = None, kernel: str = "flash") -> torch.Tensor:  # fmt: skip
    """:func:`sink_attention` through a fused kernel (CUDA, 16-bit ``q``, ``k``, ``v``), the same arguments and
    layout (``sinks`` None: causal attention without sinks): ``kernel`` "flash" (flash attention, any window) or
    "cudnn" (cuDNN's, no window)."""
    if kernel == "cudnn" and window is not None:
        raise ValueError("cuDNN's fused attention here has no sliding window")
    return _FusedSinks.apply(q, k, v, sinks, window, kernel)
