"""The HSTU layers' attention over the valid (query, key) pairs alone: one Triton kernel forward and two backward
(``trainbench::hstu_attention``), set on every layer by the family's CUDA placement (``perf.hstu_attention``).

The attention (model.py's equations) is ``out_i = sum_j valid(i, j) SiLU(alpha q_i . k_j) / T v_j`` with ``valid``
the causal pairs whose key is not padding, and a sample's padding one run of keys ``[start, stop)`` (the history is
right-aligned: contextual tokens, padding, the events, the candidate). The dense form in model.py computes and keeps
every one of the ``T x T`` scores of every head ([batch, heads, T, T], 34 MB a sample at the reference's T = 2,055 in
bf16) and masks them after. Here no score is kept: each program takes a block of queries (forward, the queries'
gradient) or of keys (the keys' and values' gradients), walks the key (or query) blocks that hold a valid pair, skipping
the causal upper triangle and the blocks of padding, and recomputes the scores in fp32 from q and k. There is no
softmax, so no running maximum or sum: the backward needs q, k, v and the output's gradient alone.

torch has no kernel for it: FlexAttention and cuDNN's fused attention both end in a softmax, which HSTU's pointwise
SiLU replaces. Elsewhere (CPU, float64, no Triton) the op computes model.py's dense form.
"""

from __future__ import annotations

import torch

from trainbench.families.triton_kernels import lazy_kernel

BLOCK_M, BLOCK_N = 64, 64  # queries, keys a program's tile


def dense_reference(q, k, v, stop: torch.Tensor, start: int, alpha: float) -> torch.Tensor:
    """The attention in torch over [batch, heads, T, width] views, [batch, heads, T, value width] out: the scores of
    every pair, masked after (model.py's :func:`~trainbench.families.hstu.model.dense_attention` with its mask)."""
    from trainbench.families.hstu.model import KeyPadding, dense_attention

    return dense_attention(q, k, v, KeyPadding(start, stop), alpha)


def _dense_backward(grad, q, k, v, stop, start: int, alpha: float):
    """:func:`hstu_attention_backward` in torch, from the dense form's equations (s = alpha q k^T, P = SiLU(s) / T
    masked): dV = P^T dO, dS = (dO V^T) SiLU'(s) alpha / T masked, dQ = dS K, dK = dS^T Q."""
    from trainbench.families.hstu.model import KeyPadding

    t = q.shape[-2]
    mask = KeyPadding(start, stop).mask(t).unsqueeze(-3).to(q.dtype)
    s = alpha * (q @ k.transpose(-1, -2))
    sig = torch.sigmoid(s)
    p = s * sig / t * mask
    ds = (grad @ v.transpose(-1, -2)) * sig * (1 + s * (1 - sig)) * (alpha / t) * mask
    return (ds @ k).contiguous(), (ds.transpose(-1, -2) @ q).contiguous(), (p.transpose(-1, -2) @ grad).contiguous()


def _define_forward(triton, tl):
    @triton.jit
    def tb_hstu_attention_forward(q, k, v, stop, out, t, heads, start, alpha, inv_t,
                                  sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot,
                                  A: tl.constexpr, D: tl.constexpr, BA: tl.constexpr, BD: tl.constexpr,
                                  BM: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
        block_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = (bh // heads).to(tl.int64)
        h = (bh % heads).to(tl.int64)
        pad_stop = tl.load(stop + b).to(tl.int32)
        offs_m = block_m * BM + tl.arange(0, BM)
        offs_a = tl.arange(0, BA)
        offs_d = tl.arange(0, BD)
        q_tile = tl.load(q + b * sqb + h * sqh + offs_m[:, None].to(tl.int64) * sqt + offs_a[None, :],
                         mask=(offs_m[:, None] < t) & (offs_a[None, :] < A), other=0.0)  # fmt: skip
        acc = tl.zeros([BM, BD], dtype=tl.float32)
        hi = tl.minimum((block_m + 1) * BM, t)  # causal: no key after the block's last query
        # Two runs of key blocks: those before the padding's first full block, those from its last partial one.
        first_end = tl.minimum(tl.cdiv(start, BN) * BN, hi)
        second = tl.maximum((pad_stop // BN) * BN, first_end)
        for part in tl.static_range(2):
            lo_n = 0 if part == 0 else second
            hi_n = first_end if part == 0 else hi
            for start_n in range(lo_n, hi_n, BN):
                offs_n = start_n + tl.arange(0, BN)
                k_tile = tl.load(k + b * skb + h * skh + offs_n[:, None].to(tl.int64) * skt + offs_a[None, :],
                                 mask=(offs_n[:, None] < t) & (offs_a[None, :] < A), other=0.0)  # fmt: skip
                s = tl.dot(q_tile, tl.trans(k_tile), input_precision=PRECISION) * alpha
                valid = (offs_n[None, :] <= offs_m[:, None]) & (offs_n[None, :] < t)
                valid = valid & ((offs_n[None, :] < start) | (offs_n[None, :] >= pad_stop))
                p = tl.where(valid, s * tl.sigmoid(s) * inv_t, 0.0)
                v_tile = tl.load(v + b * svb + h * svh + offs_n[:, None].to(tl.int64) * svt + offs_d[None, :],
                                 mask=(offs_n[:, None] < t) & (offs_d[None, :] < D), other=0.0)  # fmt: skip
                acc += tl.dot(p.to(v_tile.dtype), v_tile, input_precision=PRECISION)
        tl.store(out + b * sob + h * soh + offs_m[:, None].to(tl.int64) * sot + offs_d[None, :],
                 acc.to(out.dtype.element_ty), mask=(offs_m[:, None] < t) & (offs_d[None, :] < D))  # fmt: skip

    return tb_hstu_attention_forward


def _define_backward_keys(triton, tl):
    """The keys' and values' gradients: a program a block of keys, over the queries at or after it."""

    @triton.jit
    def tb_hstu_attention_backward_kv(q, k, v, do, stop, dk, dv, t, heads, start, alpha, inv_t,
                                      sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdb, sdh, sdt,
                                      skb_out, skh_out, skt_out, svb_out, svh_out, svt_out,
                                      A: tl.constexpr, D: tl.constexpr, BA: tl.constexpr, BD: tl.constexpr,
                                      BM: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
        block_n = tl.program_id(0)
        bh = tl.program_id(1)
        b = (bh // heads).to(tl.int64)
        h = (bh % heads).to(tl.int64)
        pad_stop = tl.load(stop + b).to(tl.int32)
        offs_n = block_n * BN + tl.arange(0, BN)
        offs_a = tl.arange(0, BA)
        offs_d = tl.arange(0, BD)
        key_ok = (offs_n < t) & ((offs_n < start) | (offs_n >= pad_stop))
        k_tile = tl.load(k + b * skb + h * skh + offs_n[:, None].to(tl.int64) * skt + offs_a[None, :],
                         mask=(offs_n[:, None] < t) & (offs_a[None, :] < A), other=0.0)  # fmt: skip
        v_tile = tl.load(v + b * svb + h * svh + offs_n[:, None].to(tl.int64) * svt + offs_d[None, :],
                         mask=(offs_n[:, None] < t) & (offs_d[None, :] < D), other=0.0)  # fmt: skip
        dk_acc = tl.zeros([BN, BA], dtype=tl.float32)
        dv_acc = tl.zeros([BN, BD], dtype=tl.float32)
        all_padding = (block_n * BN >= start) & ((block_n + 1) * BN <= pad_stop)
        lo_m = tl.where(all_padding, t, (block_n * BN // BM) * BM)  # a block of padding keys: nothing to add
        for start_m in range(lo_m, t, BM):
            offs_m = start_m + tl.arange(0, BM)
            q_tile = tl.load(q + b * sqb + h * sqh + offs_m[:, None].to(tl.int64) * sqt + offs_a[None, :],
                             mask=(offs_m[:, None] < t) & (offs_a[None, :] < A), other=0.0)  # fmt: skip
            do_tile = tl.load(do + b * sdb + h * sdh + offs_m[:, None].to(tl.int64) * sdt + offs_d[None, :],
                              mask=(offs_m[:, None] < t) & (offs_d[None, :] < D), other=0.0)  # fmt: skip
            s_t = tl.dot(k_tile, tl.trans(q_tile), input_precision=PRECISION) * alpha  # [BN, BM]
            sig = tl.sigmoid(s_t)
            valid = key_ok[:, None] & (offs_m[None, :] >= offs_n[:, None]) & (offs_m[None, :] < t)
            p_t = tl.where(valid, s_t * sig * inv_t, 0.0)
            dv_acc += tl.dot(p_t.to(do_tile.dtype), do_tile, input_precision=PRECISION)
            dp_t = tl.dot(v_tile, tl.trans(do_tile), input_precision=PRECISION)
            ds_t = tl.where(valid, dp_t * sig * (1.0 + s_t * (1.0 - sig)) * (alpha * inv_t), 0.0)
            dk_acc += tl.dot(ds_t.to(q_tile.dtype), q_tile, input_precision=PRECISION)
        rows = offs_n[:, None].to(tl.int64)
        tl.store(dk + b * skb_out + h * skh_out + rows * skt_out + offs_a[None, :], dk_acc.to(dk.dtype.element_ty),
                 mask=(offs_n[:, None] < t) & (offs_a[None, :] < A))  # fmt: skip
        tl.store(dv + b * svb_out + h * svh_out + rows * svt_out + offs_d[None, :], dv_acc.to(dv.dtype.element_ty),
                 mask=(offs_n[:, None] < t) & (offs_d[None, :] < D))  # fmt: skip

    return tb_hstu_attention_backward_kv


def _define_backward_queries(triton, tl):
    """The queries' gradient: a program a block of queries, over the key blocks the forward walks."""

    @triton.jit
    def tb_hstu_attention_backward_q(q, k, v, do, stop, dq, t, heads, start, alpha, inv_t,
                                     sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdb, sdh, sdt,
                                     sqb_out, sqh_out, sqt_out,
                                     A: tl.constexpr, D: tl.constexpr, BA: tl.constexpr, BD: tl.constexpr,
                                     BM: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
        block_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = (bh // heads).to(tl.int64)
        h = (bh % heads).to(tl.int64)
        pad_stop = tl.load(stop + b).to(tl.int32)
        offs_m = block_m * BM + tl.arange(0, BM)
        offs_a = tl.arange(0, BA)
        offs_d = tl.arange(0, BD)
        q_tile = tl.load(q + b * sqb + h * sqh + offs_m[:, None].to(tl.int64) * sqt + offs_a[None, :],
                         mask=(offs_m[:, None] < t) & (offs_a[None, :] < A), other=0.0)  # fmt: skip
        do_tile = tl.load(do + b * sdb + h * sdh + offs_m[:, None].to(tl.int64) * sdt + offs_d[None, :],
                          mask=(offs_m[:, None] < t) & (offs_d[None, :] < D), other=0.0)  # fmt: skip
        dq_acc = tl.zeros([BM, BA], dtype=tl.float32)
        hi = tl.minimum((block_m + 1) * BM, t)
        first_end = tl.minimum(tl.cdiv(start, BN) * BN, hi)
        second = tl.maximum((pad_stop // BN) * BN, first_end)
        for part in tl.static_range(2):
            lo_n = 0 if part == 0 else second
            hi_n = first_end if part == 0 else hi
            for start_n in range(lo_n, hi_n, BN):
                offs_n = start_n + tl.arange(0, BN)
                k_tile = tl.load(k + b * skb + h * skh + offs_n[:, None].to(tl.int64) * skt + offs_a[None, :],
                                 mask=(offs_n[:, None] < t) & (offs_a[None, :] < A), other=0.0)  # fmt: skip
                v_tile = tl.load(v + b * svb + h * svh + offs_n[:, None].to(tl.int64) * svt + offs_d[None, :],
                                 mask=(offs_n[:, None] < t) & (offs_d[None, :] < D), other=0.0)  # fmt: skip
                s = tl.dot(q_tile, tl.trans(k_tile), input_precision=PRECISION) * alpha
                sig = tl.sigmoid(s)
                valid = (offs_n[None, :] <= offs_m[:, None]) & (offs_n[None, :] < t)
                valid = valid & ((offs_n[None, :] < start) | (offs_n[None, :] >= pad_stop))
                dp = tl.dot(do_tile, tl.trans(v_tile), input_precision=PRECISION)
                ds = tl.where(valid, dp * sig * (1.0 + s * (1.0 - sig)) * (alpha * inv_t), 0.0)
                dq_acc += tl.dot(ds.to(k_tile.dtype), k_tile, input_precision=PRECISION)
        tl.store(dq + b * sqb_out + h * sqh_out + offs_m[:, None].to(tl.int64) * sqt_out + offs_a[None, :],
                 dq_acc.to(dq.dtype.element_ty), mask=(offs_m[:, None] < t) & (offs_a[None, :] < A))  # fmt: skip

    return tb_hstu_attention_backward_q


_forward_kernel = lazy_kernel(_define_forward)
_backward_kv_kernel = lazy_kernel(_define_backward_keys)
_backward_q_kernel = lazy_kernel(_define_backward_queries)


def _on_triton(*tensors: torch.Tensor) -> bool:
    return all(x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32) for x in tensors)


def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _tiles(q: torch.Tensor, v: torch.Tensor) -> dict:
    import triton

    a, d = q.shape[-1], v.shape[-1]
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 inputs: exact products, as torch's matmul
    return dict(A=a, D=d, BA=max(16, triton.next_power_of_2(a)), BD=max(16, triton.next_power_of_2(d)), BM=BLOCK_M,
                BN=BLOCK_N, PRECISION=precision, num_warps=4, num_stages=2)  # fmt: skip


@torch.library.custom_op("trainbench::hstu_attention", mutates_args=())
def hstu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, stop: torch.Tensor, start: int,
                   alpha: float) -> torch.Tensor:  # fmt: skip
    """The attention of q, k [batch, heads, T, A] and v [batch, heads, T, D] (any strides), keys ``[start, stop[b])``
    of sample b padding: [batch, heads, T, D], contiguous."""
    built = _forward_kernel() if _on_triton(q, k, v) and q.numel() else None
    if built is None:
        return dense_reference(q, k, v, stop, start, alpha).contiguous()
    kernel, cdiv = built
    q, k, v = (_last_contiguous(x) for x in (q, k, v))
    b, h, t, _ = q.shape
    out = v.new_empty(b, h, t, v.shape[-1])
    kernel[(cdiv(t, BLOCK_M), b * h)](q, k, v, stop, out, t, h, start, alpha, 1.0 / t, *_strides(q), *_strides(k),
                                      *_strides(v), *_strides(out), **_tiles(q, v))  # fmt: skip
    return out


@hstu_attention.register_fake
def _(q, k, v, stop, start, alpha):
    return v.new_empty(*q.shape[:3], v.shape[-1])


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


@torch.library.custom_op("trainbench::hstu_attention_backward", mutates_args=())
def hstu_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, stop: torch.Tensor,
                            start: int, alpha: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The gradients of q, k and v (contiguous, each of its input's shape) from the output's ``grad``."""
    built = (_backward_kv_kernel(), _backward_q_kernel()) if _on_triton(q, k, v, grad) and q.numel() else None
    if built is None or built[0] is None:
        return _dense_backward(grad, q, k, v, stop, start, alpha)
    (kv_kernel, cdiv), (q_kernel, _) = built
    q, k, v, grad = (_last_contiguous(x) for x in (q, k, v, grad))
    b, h, t, _ = q.shape
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    tiles = _tiles(q, v)
    args = (t, h, start, alpha, 1.0 / t, *_strides(q), *_strides(k), *_strides(v), *_strides(grad))
    kv_kernel[(cdiv(t, BLOCK_N), b * h)](q, k, v, grad, stop, dk, dv, *args, *_strides(dk), *_strides(dv), **tiles)
    q_kernel[(cdiv(t, BLOCK_M), b * h)](q, k, v, grad, stop, dq, *args, *_strides(dq), **tiles)
    return dq, dk, dv


@hstu_attention_backward.register_fake
def _(grad, q, k, v, stop, start, alpha):
    return tuple(x.new_empty(x.shape) for x in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, stop, start, alpha = inputs
    ctx.save_for_backward(q, k, v, stop)
    ctx.start, ctx.alpha = start, alpha


def _backward(ctx, grad):
    q, k, v, stop = ctx.saved_tensors
    dq, dk, dv = hstu_attention_backward(grad, q, k, v, stop, ctx.start, ctx.alpha)
    return dq, dk, dv, None, None, None


hstu_attention.register_autograd(_backward, setup_context=_setup_context)


def jagged_attention(q, k, v, padding, alpha: float) -> torch.Tensor:
    """model.py's attention seam (:func:`~trainbench.families.hstu.model.dense_attention`'s signature) through
    :func:`hstu_attention`."""
    return hstu_attention(q, k, v, padding.stop, padding.start, alpha)


def use_jagged_attention(model: torch.nn.Module) -> int:
    """Every HSTU layer of ``model`` attends through :func:`jagged_attention`; the number of layers changed."""
    from trainbench.families.hstu.model import HstuLayer

    layers = [m for m in model.modules() if isinstance(m, HstuLayer)]
    for layer in layers:
        layer.attend = jagged_attention
    return len(layers)
