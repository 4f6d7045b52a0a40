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


def window_mask(seq: int, window: int | None, device=None) -> torch.Tensor:
    """[seq, seq] True where query i may attend key j: causal, and within the last ``window`` positions (itself
    included) where a window is given."""
    i = torch.arange(seq, device=device)[:, None]
    j = torch.arange(seq, device=device)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= j > i - window
    return allowed


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``out`` [batch, heads, seq, dim] of attention without sinks, and its ``lse`` [batch, heads, seq], as
    attention with the per-head ``sinks`` [heads] among the keys."""
    wide = torch.promote_types(out.dtype, torch.float32)  # fp32 at least
    scale = torch.sigmoid(lse.to(wide) - sinks.to(wide)[None, :, None])
    return (out.to(wide) * scale[..., None]).to(out.dtype)


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
