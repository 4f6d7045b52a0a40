"""The experts' gated activation, forward and backward, each in one pass (``trainbench::glu_forward``,
``trainbench::glu_backward``).

The experts' first product gives ``h`` [rows, 2 x ffn] with gate and up interleaved (``transformers``' layout), plus
each row's expert's bias where the block has biases. Two activations:
- ``silu`` (the MLCommons reference's): ``silu(gate) * up``;
- ``gpt_oss`` (GPT-OSS's): gate clamped above at ``limit``, up clamped to [-limit, limit],
  ``(up + 1) * gate * sigmoid(alpha * gate)``.

Compiled as tensor operations, the activation's backward (two strided slices' gradients, the clamps' masks, the bias
recomputed by its expert index) fused with the FP8 cast of its result into a two-pass row reduction that recomputed
all of it twice: 8 ms a micro-batch of 131,584 rows on an H200, about six times its bytes' time; the forward, fused
with the FP8 cast of the activation the same way, took 2 ms. Here each is one opaque op: on CUDA a Triton kernel that
reads ``h`` (with the bias) and, backward, the output's gradient once, and writes its result once, in fp32
arithmetic; elsewhere (and for float64) the same formulas in torch.

In FP8 (``trainbench::glu_forward_fp8``, ``glu_backward_fp8``) the same kernels, one program a row, also write their
result cast to e4m3 with a power-of-two scale a row, which the experts' FP8 products read next: the forward's for
the down product, the backward's for the gate-and-up product's input gradient. A cast after the kernel reads the
whole result back from memory (1.5 GB a micro-batch in the backward at the 20B shape); here each program reads its
own row back while it is still in the cache.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from trainbench.models.fp8 import E4M3, E4M3_MAX, cast_e4m3_pow2
from trainbench.models.triton_kernels import lazy_kernel


def glu(h: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    """The activation of ``h`` [..., 2 x ffn] (gate and up interleaved): [..., ffn]."""
    gate, up = h[..., ::2], h[..., 1::2]
    if activation == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def _glu_backward_torch(h, bias, group, grad, activation: str, alpha: float, limit: float) -> torch.Tensor:
    """:func:`glu_backward` in torch: ``h``'s gradient, computed in fp32 (or the inputs' wider type)."""
    wide = torch.promote_types(h.dtype, torch.float32)
    x = h.to(wide) if bias is None else h.to(wide) + bias[group].to(h.dtype).to(wide)
    gate, up, g = x[..., ::2], x[..., 1::2], grad.to(wide)
    if activation == "silu":
        s = torch.sigmoid(gate)
        silu = gate * s
        d_gate, d_up = g * up * (s + silu * (1 - s)), g * silu
    else:
        clamped_gate, clamped_up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        s = torch.sigmoid(alpha * clamped_gate)
        gated = clamped_gate * s
        d_gate = torch.where(gate <= limit, g * (clamped_up + 1) * (s + alpha * gated * (1 - s)), 0)
        d_up = torch.where((up >= -limit) & (up <= limit), g * gated, 0)
    return torch.stack([d_gate, d_up], dim=-1).reshape(h.shape).to(h.dtype)


@functools.cache
def _device_functions(triton, tl):
    """The Triton functions the kernels share: ``BLOCK`` pairs of a row, forward (the activation in ``h``'s dtype)
    and backward ((gate, up)'s gradients [BLOCK, 2] in ``h``'s dtype, and where they go), computed in fp32; and the
    power-of-two e4m3 scale of a row's largest magnitude and its reciprocal (the formula of
    :func:`.fp8.cast_e4m3_pow2`, with IEEE division and libdevice's log2, floor and exp2, as torch's CUDA kernels
    compute it)."""
    from triton.language.extra import libdevice

    @triton.jit
    def load_pairs(h, bias, group, row, j, mask, ffn, HAS_BIAS: tl.constexpr, ROUND_BIASED: tl.constexpr):
        pair = 2 * j[:, None] + tl.arange(0, 2)[None, :]  # [BLOCK, 2]: gate, up
        both = tl.load(h + row * 2 * ffn + pair, mask=mask[:, None], other=0.0).to(tl.float32)
        if HAS_BIAS:
            expert = tl.load(group + row).to(tl.int64)
            b = tl.load(bias + expert * 2 * ffn + pair, mask=mask[:, None], other=0.0)
            both += b.to(h.dtype.element_ty).to(tl.float32)
            if ROUND_BIASED:  # h + bias[group].to(h.dtype), in h's precision
                both = both.to(h.dtype.element_ty).to(tl.float32)
        return pair, both

    @triton.jit
    def forward(h, bias, group, row, j, mask, ffn, alpha, limit, HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr):
        _, both = load_pairs(h, bias, group, row, j, mask, ffn, HAS_BIAS, True)
        gate, up = tl.split(both)
        if CLAMPED:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            act = (up + 1.0) * gate * tl.sigmoid(gate * alpha)
        else:
            act = gate * tl.sigmoid(gate) * up
        return act.to(h.dtype.element_ty)

    @triton.jit
    def backward(h, bias, group, grad, row, j, mask, ffn, alpha, limit, HAS_BIAS: tl.constexpr,
                 CLAMPED: tl.constexpr):  # fmt: skip
        pair, both = load_pairs(h, bias, group, row, j, mask, ffn, HAS_BIAS, False)
        gate, up = tl.split(both)
        g = tl.load(grad + row * ffn + j, mask=mask, other=0.0).to(tl.float32)
        if CLAMPED:
            clamped_gate = tl.minimum(gate, limit)
            clamped_up = tl.minimum(tl.maximum(up, -limit), limit)
            s = tl.sigmoid(alpha * clamped_gate)
            gated = clamped_gate * s
            d_gate = tl.where(gate <= limit, g * (clamped_up + 1.0) * (s + alpha * gated * (1.0 - s)), 0.0)
            d_up = tl.where((up >= -limit) & (up <= limit), g * gated, 0.0)
        else:
            s = tl.sigmoid(gate)
            silu = gate * s
            d_gate = g * up * (s + silu * (1.0 - s))
            d_up = g * silu
        return pair, tl.join(d_gate, d_up).to(h.dtype.element_ty)

    @triton.jit
    def e4m3_scale(amax, qmax):  # (the scale, its reciprocal): both powers of two
        power = libdevice.floor(libdevice.log2(tl.div_rn(qmax, tl.maximum(amax, 1e-12))))
        return libdevice.exp2(power), libdevice.exp2(-power)

    return forward, backward, e4m3_scale


# The kernels' programs: one a row and BLOCK pairs, or, with the row's FP8 cast (CAST), one a row, looping over its
# blocks twice: first the result, stored, and the row's largest magnitude; then the stored result read back (from
# the cache: the same program wrote it) and cast. A masked pair's result is zero, which moves no largest magnitude.


def _define_backward(triton, tl):
    """The activation's backward: the gradients of gate and up from the output's, h's bias added as in the forward
    but not rounded; with ``CAST``, the gradient in e4m3 with a power-of-two scale a row and its reciprocal too."""
    _, backward, e4m3_scale = _device_functions(triton, tl)

    @triton.jit
    def kernel(h, bias, group, grad, out, q, recip, ffn, alpha, limit, qmax, HAS_BIAS: tl.constexpr,
               CLAMPED: tl.constexpr, CAST: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        if CAST:
            largest = tl.zeros([BLOCK, 2], tl.float32)  # each thread's own, reduced across the program once
            for start in tl.range(0, ffn, BLOCK, num_stages=STAGES):
                j = start + tl.arange(0, BLOCK)
                pair, d = backward(h, bias, group, grad, row, j, j < ffn, ffn, alpha, limit, HAS_BIAS, CLAMPED)
                tl.store(out + row * 2 * ffn + pair, d, mask=(j < ffn)[:, None])
                largest = tl.maximum(largest, tl.abs(d.to(tl.float32)))
            tl.debug_barrier()
            scale, reciprocal = e4m3_scale(tl.max(tl.max(largest, axis=1), axis=0), qmax)
            for start in tl.range(0, 2 * ffn, 2 * BLOCK, num_stages=STAGES):
                k = start + tl.arange(0, 2 * BLOCK)
                d = tl.load(out + row * 2 * ffn + k, mask=k < 2 * ffn, other=0.0).to(tl.float32)
                cast = tl.clamp(d * scale, -qmax, qmax).to(q.dtype.element_ty)
                tl.store(q + row * 2 * ffn + k, cast, mask=k < 2 * ffn)
            tl.store(recip + row, reciprocal)
        else:
            j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            pair, d = backward(h, bias, group, grad, row, j, j < ffn, ffn, alpha, limit, HAS_BIAS, CLAMPED)
            tl.store(out + row * 2 * ffn + pair, d, mask=(j < ffn)[:, None])

    return kernel


_backward_kernel = lazy_kernel(_define_backward)


def _define_forward(triton, tl):
    """The activation's forward, h's bias added in h's precision; ``CAST`` as the backward's."""
    forward, _, e4m3_scale = _device_functions(triton, tl)

    @triton.jit
    def kernel(h, bias, group, out, q, recip, ffn, alpha, limit, qmax, HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr,
               CAST: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        if CAST:
            largest = tl.zeros([BLOCK], tl.float32)
            for start in tl.range(0, ffn, BLOCK, num_stages=STAGES):
                j = start + tl.arange(0, BLOCK)
                act = forward(h, bias, group, row, j, j < ffn, ffn, alpha, limit, HAS_BIAS, CLAMPED)
                tl.store(out + row * ffn + j, act, mask=j < ffn)
                largest = tl.maximum(largest, tl.abs(act.to(tl.float32)))
            tl.debug_barrier()
            scale, reciprocal = e4m3_scale(tl.max(largest, axis=0), qmax)
            for start in tl.range(0, ffn, BLOCK, num_stages=STAGES):
                j = start + tl.arange(0, BLOCK)
                act = tl.load(out + row * ffn + j, mask=j < ffn, other=0.0).to(tl.float32)
                tl.store(q + row * ffn + j, tl.clamp(act * scale, -qmax, qmax).to(q.dtype.element_ty), mask=j < ffn)
            tl.store(recip + row, reciprocal)
        else:
            j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            act = forward(h, bias, group, row, j, j < ffn, ffn, alpha, limit, HAS_BIAS, CLAMPED)
            tl.store(out + row * ffn + j, act, mask=j < ffn)

    return kernel


_forward_kernel = lazy_kernel(_define_forward)


def _on_triton(h: torch.Tensor) -> bool:
    return h.is_cuda and h.dtype in (torch.bfloat16, torch.float16, torch.float32)


def _launch(kernel, cdiv, h, bias, group, tensors, ffn, config, cast: tuple[int, int, int] | None = None):
    """The kernel's programs over ``h``'s rows and blocks of 1,024 pairs, or with ``cast`` (pairs a turn, warps,
    pipeline stages) one a row that also casts it; ``tensors``: its operands after ``group``; ``config`` the
    activation's (name, alpha, limit)."""
    activation, alpha, limit = config
    block, warps, stages = cast or (1024, 4, 1)
    has_bias = bias is not None
    kernel[(h.shape[0], 1 if cast else cdiv(ffn, block))](
        h, bias.contiguous() if has_bias else h, group if has_bias else h, *tensors, ffn, alpha, limit, E4M3_MAX,
        HAS_BIAS=has_bias, CLAMPED=activation == "gpt_oss", CAST=cast is not None, BLOCK=block, STAGES=stages,
        num_warps=warps)  # fmt: skip


# The casting kernels' launches, forward and backward: pairs a loop's turn, warps, the loop's pipeline stages. At the
# 20B shape on an H200 (131,584 rows of 2,880 pairs) the fastest of 1,024 down to 256 pairs, 1 to 16 warps, 1 or 2
# stages; a turn of 1,024 pairs took the backward 2.9 ms against 1.7 (registers: 140 against 64 a thread).
CAST_LAUNCH = ((512, 2, 1), (512, 4, 1))


@torch.library.custom_op("trainbench::glu_forward", mutates_args=())
def glu_forward(h: torch.Tensor, bias: torch.Tensor | None, group: torch.Tensor | None, activation: str,
                alpha: float, limit: float) -> torch.Tensor:  # fmt: skip
    """:func:`glu` of ``h + bias[group]`` (``bias`` [experts, 2 x ffn] or None): [rows, ffn] in ``h``'s dtype."""
    built = _forward_kernel() if _on_triton(h) and h.numel() else None
    if built is None:
        return glu(h if bias is None else h + bias[group].to(h.dtype), activation, alpha, limit)
    h = h.contiguous()
    out = h.new_empty(h.shape[0], h.shape[1] // 2)
    _launch(*built, h, bias, group, (out, out, out), out.shape[1], (activation, alpha, limit))
    return out


@glu_forward.register_fake
def _(h, bias, group, activation, alpha, limit):
    return h.new_empty(h.shape[0], h.shape[1] // 2)


@torch.library.custom_op("trainbench::glu_forward_fp8", mutates_args=())
def glu_forward_fp8(h: torch.Tensor, bias: torch.Tensor | None, group: torch.Tensor | None, activation: str,
                    alpha: float, limit: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`glu_forward`, and its result cast to e4m3 as :func:`.fp8.cast_e4m3_pow2` casts it along the rows
    (with the scales' reciprocals [rows]); on CUDA in the same kernel, which reads its row's result back from the
    cache rather than from memory."""
    built = _forward_kernel() if _on_triton(h) and h.numel() else None
    if built is None:
        act = glu_forward(h, bias, group, activation, alpha, limit)
        return act, *cast_e4m3_pow2(act, -1)
    h = h.contiguous()
    rows, ffn = h.shape[0], h.shape[1] // 2
    out, q = h.new_empty(rows, ffn), torch.empty(rows, ffn, dtype=E4M3, device=h.device)
    recip = torch.empty(rows, dtype=torch.float32, device=h.device)
    _launch(*built, h, bias, group, (out, q, recip), ffn, (activation, alpha, limit), CAST_LAUNCH[0])
    return out, q, recip


@glu_forward_fp8.register_fake
def _(h, bias, group, activation, alpha, limit):
    rows, ffn = h.shape[0], h.shape[1] // 2
    return h.new_empty(rows, ffn), h.new_empty(rows, ffn, dtype=E4M3), h.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op("trainbench::glu_backward", mutates_args=())
def glu_backward(h: torch.Tensor, bias: torch.Tensor | None, group: torch.Tensor | None, grad: torch.Tensor,
                 activation: str, alpha: float, limit: float) -> torch.Tensor:  # fmt: skip
    """The gradient of ``h`` [rows, 2 x ffn] through :func:`glu` of ``h + bias[group]`` (``bias`` [experts, 2 x ffn]
    or None), given the activation's gradient ``grad`` [rows, ffn]; in ``h``'s dtype."""
    built = _backward_kernel() if _on_triton(h) and h.numel() else None
    if built is None:
        return _glu_backward_torch(h, bias, group, grad, activation, alpha, limit)
    h, grad = h.contiguous(), grad.contiguous()
    out = torch.empty_like(h)
    _launch(*built, h, bias, group, (grad, out, out, out), grad.shape[1], (activation, alpha, limit))
    return out


@glu_backward.register_fake
def _(h, bias, group, grad, activation, alpha, limit):
    return torch.empty_like(h)


@torch.library.custom_op("trainbench::glu_backward_fp8", mutates_args=())
def glu_backward_fp8(h: torch.Tensor, bias: torch.Tensor | None, group: torch.Tensor | None, grad: torch.Tensor,
                     activation: str, alpha: float,
                     limit: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`glu_backward`, and the gradient cast to e4m3 along the rows as :func:`glu_forward_fp8` casts its result,
    in the same kernel on CUDA."""
    built = _backward_kernel() if _on_triton(h) and h.numel() else None
    if built is None:
        grad_h = glu_backward(h, bias, group, grad, activation, alpha, limit)
        return grad_h, *cast_e4m3_pow2(grad_h, -1)
    h, grad = h.contiguous(), grad.contiguous()
    out, q = torch.empty_like(h), torch.empty(h.shape, dtype=E4M3, device=h.device)
    recip = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
    _launch(*built, h, bias, group, (grad, out, q, recip), grad.shape[1], (activation, alpha, limit), CAST_LAUNCH[1])
    return out, q, recip


@glu_backward_fp8.register_fake
def _(h, bias, group, grad, activation, alpha, limit):
    return torch.empty_like(h), h.new_empty(h.shape, dtype=E4M3), h.new_empty(h.shape[0], dtype=torch.float32)


def group_sums(rows: torch.Tensor, group: torch.Tensor, groups: int) -> torch.Tensor:
    """The sum of ``rows`` [n, width] over each group (``group`` [n]): [groups, width], as a product of the groups'
    indicator [groups, n] and the rows, in the rows' precision with the product's fp32 accumulation. Indexing's own
    backward adds every row into its group with an atomic add, thousands of rows onto the same addresses."""
    members = torch.arange(groups, device=group.device)[:, None] == group[None, :]
    return members.to(rows.dtype) @ rows


class BiasGLU(torch.autograd.Function):
    """:func:`glu` of ``h + bias[group]`` (``bias`` None: of ``h``), its backward one :func:`glu_backward` (which adds
    the bias again itself, so the biased rows are never stored) and, for the bias, a product of the experts'
    indicator [experts, rows] and ``h``'s gradient: no atomic scatter."""

    @staticmethod
    def forward(ctx, h, bias, group, activation: str, alpha: float, limit: float):
        ctx.save_for_backward(h, bias, group)
        ctx.config = (activation, alpha, limit)
        return glu_forward(h, bias, group, activation, alpha, limit)

    @staticmethod
    def backward(ctx, grad):
        h, bias, group = ctx.saved_tensors
        grad_h = glu_backward(h, bias, group, grad, *ctx.config)
        grad_bias = None if bias is None else group_sums(grad_h, group, bias.shape[0]).to(bias.dtype)
        return grad_h, grad_bias, None, None, None, None
