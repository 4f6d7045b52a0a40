"""A decoder's output layer over the vocabulary and its cross entropy in FP8, as one autograd function of our own
(``model.output_precision=fp8``).

The three products are FP8 products (``torch._scaled_mm``, one scale a tensor, as torchao's tensorwise recipe of the
blocks): the logits from the final hidden states and the weight, both in e4m3; the hidden states' gradient and the
weight's, from the logits' gradient in e5m2. What torchao's float8 layer cannot know, and this function does, is the
logits' gradient's range: the summed cross entropy's gradient with respect to a logit is ``g * (softmax - onehot)``
(``g`` the loss's own gradient), so every element lies within ``[-|g|, |g|]``. Its FP8 scale is therefore fixed and
needs no pass to find an amax, and one kernel computes ``softmax - onehot`` from the bf16 logits and their
log-sum-exp and writes it in e5m2 in both layouts the two products take (row-major, and transposed for the weight's:
FP8 products on Hopper take both operands with the summed dimension contiguous). The bf16 gradient of the logits is
never made: the layer through torchao made it (12.3 GiB for 4 x 8,192 rows over 201,088 words), found its amax, and
cast it twice, once transposed.

Because ``g`` only scales the result, the gradients are taken in the forward, for ``g = 1``, a chunk of rows at a
time (``CHUNK_ROWS``): each chunk's logits exist only until their gradient is cast, and what waits for the backward
is the two gradients themselves (the hidden states', and the weight's in bf16), which the backward multiplies by
``g``. The bf16 logits of a whole micro-batch are never held, as the compiled bf16 loss holds them for its backward.
On one unsharded rank (:func:`cache_output_casts`) the backward adds ``g`` times the weight's bf16 gradient into the
fp32 ``.grad`` in one compiled pass (:func:`grad_into`), where autograd takes a scaled fp32 copy (two passes) and
adds that in a third: 10 bytes a weight in a micro-batch after the first instead of 26 (5.8 and 15.1 GB over 201,088
x 2,880).

On CUDA the log-sum-exp and the gradient's casts are Triton kernels; elsewhere (tests) torch's operations give the same
values, and the products are taken with the casts' values in fp32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from trainbench.families.fp8 import (
    E4M3,
    E4M3_MAX,
    add_micro_batch_grad,
    cast_transpose_e4m3,
    grad_adders,
    once_a_step,
    scaled_mm,
    transpose_fp8,
)
from trainbench.families.triton_kernels import lazy_kernel

E5M2 = torch.float8_e5m2
E5M2_MAX = torch.finfo(E5M2).max
IGNORE = -100  # a target that counts nothing, as F.cross_entropy's ignore_index
ROWS_MULTIPLE = 16  # FP8 products sum over a multiple of 16: the weight's gradient sums over the rows


def _define_lse(triton, tl):
    """Each row's log-sum-exp over its bf16 logits in fp32 (one program a row, one pass, an online maximum), and its
    summed cross entropy's term: the log-sum-exp less the target's logit, 0 for an ignored target."""

    @triton.jit
    def tb_output_lse(logits, targets, lse, loss, cols, ignore, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * cols
        m = tl.full([BLOCK], -1e30, tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        for start in range(0, cols, BLOCK):
            c = start + tl.arange(0, BLOCK)
            x = tl.load(base + c, mask=c < cols, other=float("-inf")).to(tl.float32)
            top = tl.maximum(m, x)
            s = s * tl.exp(m - top) + tl.exp(x - top)
            m = top
        peak = tl.max(m, axis=0)
        total = tl.log(tl.sum(s * tl.exp(m - peak), axis=0)) + peak
        t = tl.load(targets + row)
        kept = t != ignore
        picked = tl.load(base + tl.where(kept, t, 0)).to(tl.float32)
        tl.store(lse + row, total)
        tl.store(loss + row, tl.where(kept, total - picked, 0.0))

    return tb_output_lse


def _define_grad(triton, tl):
    """The logits' gradient at a loss gradient of 1, ``softmax - onehot`` (0 for an ignored target's row), times
    ``limit``, in e5m2, written row-major and transposed (into rows ``stride_t`` apart) from one tile."""

    @triton.jit
    def tb_output_grad(logits, lse, targets, dst, dst_t, rows, cols, stride_t, ignore, limit,
               BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
        c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
        mask = (r[:, None] < rows) & (c[None, :] < cols)
        x = tl.load(logits + r[:, None] * cols + c[None, :], mask=mask, other=0.0).to(tl.float32)
        total = tl.load(lse + r, mask=r < rows, other=0.0)
        t = tl.load(targets + r, mask=r < rows, other=ignore)
        p = tl.exp(x - total[:, None]) - tl.where(c[None, :] == t[:, None], 1.0, 0.0)
        p = tl.where((t != ignore)[:, None], p, 0.0)
        q = tl.clamp(p * limit, -limit, limit).to(dst.dtype.element_ty)
        tl.store(dst + r[:, None] * cols + c[None, :], q, mask=mask)
        tl.store(dst_t + c[:, None] * stride_t + r[None, :], tl.trans(q), mask=tl.trans(mask))

    return tb_output_grad


_lse_kernel = lazy_kernel(_define_lse)
_grad_kernel = lazy_kernel(_define_grad)
GRAD_TILE = (64, 128)  # rows x columns of the gradient's tiles (perf/output_loss.py)
LSE_BLOCK = 2048  # the columns of a row the log-sum-exp reads at a time (perf/output_loss.py)
GRAD_SCALE = 1.0 / E5M2_MAX  # what the logits' gradient cast at a loss gradient of 1 is multiplied back by
CHUNK_ROWS = 8192  # rows whose logits exist at a time: 3.1 GiB of bf16 logits over 201,088 words


def rows_lse(logits: torch.Tensor, targets: torch.Tensor,
             block: int = LSE_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(lse, terms)`` [rows] fp32 for bf16 ``logits`` [rows, vocab] and ``targets`` [rows]: each row's
    log-sum-exp, and its term of the summed cross entropy (``lse`` less the target's logit; 0 where the target is
    ignored, -100). ``block``: the columns a CUDA program reads at a time."""
    built = _lse_kernel() if logits.is_cuda else None
    if built is None:
        lse = torch.logsumexp(logits.float(), dim=-1)
        kept = targets != IGNORE
        picked = logits.gather(1, torch.where(kept, targets, 0)[:, None])[:, 0].float()
        return lse, torch.where(kept, lse - picked, 0.0)
    kernel, _ = built
    rows, cols = logits.shape
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    terms = torch.empty_like(lse)
    kernel[(rows,)](logits, targets, lse, terms, cols, IGNORE, BLOCK=block, num_warps=8)
    return lse, terms


def grad_casts(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, q_t: torch.Tensor | None = None,
               tile: tuple[int, int] = GRAD_TILE) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The logits' gradient at a loss gradient of 1, ``softmax - onehot``, as e5m2 at its fixed scale: ``(q [rows,
    vocab], q_t)``, the gradient being ``q * GRAD_SCALE``, and ``q_t`` its transpose [vocab, rows]: written into
    ``q_t`` where given (a column slice of a larger [vocab, n] tensor, its rows contiguous), else made."""
    if q_t is None:
        q_t = torch.empty(logits.shape[1], logits.shape[0], dtype=E5M2, device=logits.device)
    built = _grad_kernel() if logits.is_cuda else None
    if built is None:
        kept = (targets != IGNORE)[:, None]
        onehot = torch.zeros_like(logits, dtype=torch.float32)
        onehot.scatter_(1, torch.where(kept[:, 0], targets, 0)[:, None], 1.0)
        p = torch.where(kept, torch.exp(logits.float() - lse[:, None]) - onehot, 0.0)
        q = (p * E5M2_MAX).clamp(-E5M2_MAX, E5M2_MAX).to(E5M2)
        q_t.copy_(q.t())
        return q, q_t
    kernel, cdiv = built
    rows, cols = logits.shape
    q = torch.empty(rows, cols, dtype=E5M2, device=logits.device)
    kernel[(cdiv(rows, tile[0]), cdiv(cols, tile[1]))](logits, lse, targets, q, q_t, rows, cols, q_t.stride(0), IGNORE,
                                                       E5M2_MAX, BLOCK_R=tile[0], BLOCK_C=tile[1],
                                                       num_warps=8)  # fmt: skip
    return q, q_t


def tensor_e4m3(t: torch.Tensor, transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``t`` [rows, cols] in e4m3 with one scale for the whole tensor (its amax brought to 448, as torchao's
    tensorwise recipe): ``(q, scale, q transposed or None)``, ``t ~ q * scale``; ``transposed``: its transpose too,
    [cols, rows] row-major, cast from ``t`` in one tiled pass on CUDA (:func:`fp8.cast_transpose_e4m3`)."""
    t = t.detach()
    scale = (t.abs().amax().float().clamp(min=1e-12) / E4M3_MAX).reshape(())
    q = (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    if not transposed:
        return q, scale, None
    return q, scale, cast_transpose_e4m3(t, scale.expand(t.shape[0]))


def weight_casts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The output layer's weight [vocab, width] as the three products read it: ``(q, q transposed, scale)``, e4m3
    with one scale, the transpose a tiled copy of ``q``'s bytes (:func:`fp8.transpose_fp8`)."""
    q, scale, _ = tensor_e4m3(weight)
    return q, transpose_fp8(q), scale


def scaled_as_fp32(grad: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """A micro-batch's bf16 gradient for a loss gradient of 1, times the loss's gradient ``g``, as the first fp32
    ``.grad``."""
    return grad.float() * g


def add_scaled_into(total: torch.Tensor, grad: torch.Tensor, g: torch.Tensor) -> None:
    """``g`` times a micro-batch's bf16 gradient (for a loss gradient of 1) added into the fp32 ``.grad`` ``total`` in
    one pass: autograd's way casts and scales a copy in two and adds it in a third."""
    total.add_(grad.float() * g)


def grad_into(compiled: bool) -> tuple[Callable, Callable]:
    """:func:`scaled_as_fp32` and :func:`add_scaled_into`, compiled where ``compiled`` (``fp8.grad_adders``: torch's
    eager kernels for mixed dtypes run below the bandwidth of the compiled ones)."""
    return grad_adders(compiled, (scaled_as_fp32, add_scaled_into))


class _Fp8OutputLoss(torch.autograd.Function):
    """The summed cross entropy of ``hidden`` [rows, width] through the output layer ``weight`` [vocab, width]
    against ``targets`` [rows], the products in FP8 (module docstring), taken ``chunk`` rows at a time. ``casts``: the
    weight's (:func:`weight_casts`), made beforehand, else made here. Where gradients are wanted the forward takes
    them too, for a loss gradient of 1 (each chunk's logits are dropped once their gradient is cast, and only the
    hidden states' and the weight's gradients, bf16, are kept); the backward multiplies them by the loss's gradient.
    ``into``: :func:`grad_into`'s pair, with which the backward adds the weight's gradient into ``weight.grad`` itself
    (one unsharded rank) and hands autograd none. The forward products accumulate fast, the gradients' do not, as
    torchao's defaults."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                casts: tuple[torch.Tensor, ...] | None, chunk: int,
                into: tuple[Callable, Callable] | None = None) -> torch.Tensor:  # fmt: skip
        wq, wq_t, w_scale = casts if casts is not None else weight_casts(weight)
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        hq, h_scale, hq_t = tensor_e4m3(hidden, transposed=want_weight)
        out_dtype = hidden.dtype if hidden.dtype != torch.float32 or not hidden.is_cuda else torch.bfloat16
        rows, vocab = hidden.shape[0], wq.shape[0]
        unit = torch.full((), GRAD_SCALE, device=hidden.device)
        q_t = torch.empty(vocab, rows, dtype=E5M2, device=hidden.device) if want_weight else None
        grad_hidden, total = [], torch.zeros((), device=hidden.device)
        for start in range(0, rows, chunk):
            part = slice(start, min(start + chunk, rows))
            logits = scaled_mm(hq[part], h_scale, wq, w_scale, out_dtype, fast_accum=True)
            lse, terms = rows_lse(logits, targets[part])
            total += terms.sum()
            if want_hidden or want_weight:
                q, _ = grad_casts(logits, lse, targets[part], q_t[:, part] if want_weight else None)
                del logits
                grad_hidden += [scaled_mm(q, unit, wq_t, w_scale, out_dtype)] if want_hidden else []
        grad_weight = scaled_mm(q_t, unit, hq_t, h_scale, out_dtype) if want_weight else None
        ctx.save_for_backward(torch.cat(grad_hidden) if want_hidden else None, grad_weight)
        ctx.dtypes = hidden.dtype, weight.dtype
        ctx.into = (weight, *into) if into is not None and want_weight else None  # (a leaf parameter: no cycle)
        return total

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        # (a copy in the parameter's precision scaled in place: the same rounding as an fp32 product cast back, one
        # pass and one allocation fewer; the saved gradients stay as they are, for a backward run again)
        if grad_hidden is not None:
            grad_hidden = grad_hidden.to(ctx.dtypes[0], copy=True).mul_(g)
        if grad_weight is not None and ctx.into is not None:
            weight, as_fp32, add_into = ctx.into
            add_micro_batch_grad(weight, grad_weight, lambda grad: as_fp32(grad, g),
                                 lambda total, grad: add_into(total, grad, g))  # fmt: skip
            grad_weight = None
        elif grad_weight is not None:
            grad_weight = grad_weight.to(ctx.dtypes[1], copy=True).mul_(g)
        return grad_hidden, grad_weight, None, None, None, None


def lm_loss_fp8(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor) -> torch.Tensor:
    """:func:`trainbench.families.decoder.model.lm_loss` with the output layer's products in FP8
    (:class:`_Fp8OutputLoss`): the summed next-token cross entropy of ``head`` (an ``nn.Linear`` without bias) on
    ``hidden`` [batch, seq, width]. The weight's casts made once a step (:func:`cache_output_casts`) are used where
    there are some. Rows are padded with ignored targets to a multiple of 16, which the weight's FP8 product sums
    over."""
    rows = hidden.reshape(-1, hidden.shape[-1])
    flat = targets.reshape(-1)
    pad = -rows.shape[0] % ROWS_MULTIPLE
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
        flat = torch.cat([flat, flat.new_full((pad,), IGNORE)])
    casts = getattr(head, "_fp8_casts", None)
    into = getattr(head, "_fp8_grad_into", None)
    return _Fp8OutputLoss.apply(rows.contiguous(), head.weight, flat.contiguous(), casts, CHUNK_ROWS, into)


lm_loss_fp8.output_in_fp8 = True  # fp8.finish_placement names the output layer among the FP8 ones


def cache_output_casts(model: nn.Module, compiled: bool = True) -> Callable[[], None]:
    """The output layer (``model.lm_head``) of a model on one unsharded rank casts its weight once a step instead of
    in each micro-batch: before a forward of ``model``, where the weight changed since its last cast
    (``fp8.once_a_step``: the step marks it, as does a checkpoint's load), its casts (:func:`weight_casts`) are made
    and kept on the layer for :func:`lm_loss_fp8`. They hold 2 bytes a weight. The weight's gradient then goes into
    its ``.grad`` by :func:`grad_into` (compiled where ``compiled`` and the weight is on CUDA): on one rank no data
    parallelism's hook waits on autograd's accumulation. Returns what must run after every optimizer step."""
    head = model.lm_head
    head._fp8_grad_into = grad_into(compiled and head.weight.is_cuda)

    def recast() -> None:
        head._fp8_casts = weight_casts(head.weight)

    refresh, after_step = once_a_step(lambda: [head.weight], recast)
    model.register_forward_pre_hook(lambda module, args: refresh())
    return after_step
