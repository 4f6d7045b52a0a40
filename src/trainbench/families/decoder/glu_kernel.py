"""The experts' gated activation, forward and backward, each in one pass (``trainbench::glu_forward``,
``trainbench::glu_backward``).

The experts' first product gives ``h`` [rows, 2 x ffn] with gate and up interleaved (``transformers``' layout), plus
each row's expert's bias where the block has biases. Two activations:
- ``silu`` (the MLCommons reference's): ``silu(gate) * up``;
- ``gpt_oss`` (GPT-OSS's): gate clamped above at ``limit``, up clamped to [-limit, limit],
  ``(up + 1) * gate * sigmoid(alpha * gate)``.

Compiled as tensor operations, the activation's backward (two strided slices' gradients, the clamps' masks, the bias
recomputed by its expert index) fused with the FP8 cast of its result into a two-pass row reduction that recomputed all
of it twice, several times its bytes' time, and the forward, fused with the FP8 cast of the activation the same way, was
slow too (the figures: docs/gpt_oss.md, "The activation and the weights' casts"). Here each is one opaque op: on CUDA a
Triton kernel that reads ``h`` (with the bias) and, backward, the output's gradient once, and writes its result once, in
fp32 arithmetic; elsewhere (and for float64) the same formulas in torch. The FP8 casts that follow read the result.
"""

from __future__ import annotations

import torch

from trainbench.families.decoder.moe import MoE, glu, group_sums
from trainbench.families.triton_kernels import lazy_kernel


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


def _define_backward(triton, tl):
    """The activation's backward: the gradients of gate and up from the output's, h's bias added as in the forward."""

    @triton.jit
    def tb_glu_backward(h, bias, group, grad, out, ffn, alpha, limit, HAS_BIAS: tl.constexpr,
                        CLAMPED: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = j < ffn
        pair = 2 * j[:, None] + tl.arange(0, 2)[None, :]  # [BLOCK, 2]: gate, up
        both = tl.load(h + row * 2 * ffn + pair, mask=mask[:, None], other=0.0).to(tl.float32)
        if HAS_BIAS:
            expert = tl.load(group + row).to(tl.int64)
            b = tl.load(bias + expert * 2 * ffn + pair, mask=mask[:, None], other=0.0)
            both += b.to(h.dtype.element_ty).to(tl.float32)
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
        tl.store(out + row * 2 * ffn + pair, tl.join(d_gate, d_up).to(out.dtype.element_ty), mask=mask[:, None])

    return tb_glu_backward


_backward_kernel = lazy_kernel(_define_backward)


def _define_forward(triton, tl):
    """The activation's forward, h's bias added in h's precision."""

    @triton.jit
    def tb_glu_forward(h, bias, group, out, ffn, alpha, limit, HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr,
                       BLOCK: tl.constexpr):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = j < ffn
        pair = 2 * j[:, None] + tl.arange(0, 2)[None, :]  # [BLOCK, 2]: gate, up
        both = tl.load(h + row * 2 * ffn + pair, mask=mask[:, None], other=0.0)
        if HAS_BIAS:  # added in h's precision, as h + bias[group].to(h.dtype) is
            expert = tl.load(group + row).to(tl.int64)
            b = tl.load(bias + expert * 2 * ffn + pair, mask=mask[:, None], other=0.0)
            both = (both.to(tl.float32) + b.to(h.dtype.element_ty).to(tl.float32)).to(h.dtype.element_ty)
        gate, up = tl.split(both.to(tl.float32))
        if CLAMPED:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            act = (up + 1.0) * gate * tl.sigmoid(gate * alpha)
        else:
            act = gate * tl.sigmoid(gate) * up
        tl.store(out + row * ffn + j, act.to(out.dtype.element_ty), mask=mask)

    return tb_glu_forward


_forward_kernel = lazy_kernel(_define_forward)


def _on_triton(h: torch.Tensor) -> bool:
    return h.is_cuda and h.dtype in (torch.bfloat16, torch.float16, torch.float32)


@torch.library.custom_op("trainbench::glu_forward", mutates_args=())
def glu_forward(h: torch.Tensor, bias: torch.Tensor | None, group: torch.Tensor | None, activation: str,
                alpha: float, limit: float) -> torch.Tensor:  # fmt: skip
    """:func:`glu` of ``h + bias[group]`` (``bias`` [experts, 2 x ffn] or None): [rows, ffn] in ``h``'s dtype."""
    built = _forward_kernel() if _on_triton(h) and h.numel() else None
    if built is None:
        return glu(h if bias is None else h + bias[group].to(h.dtype), activation, alpha, limit)
    kernel, cdiv = built
    rows, ffn = h.shape[0], h.shape[1] // 2
    h = h.contiguous()
    out = h.new_empty(rows, ffn)
    block, has_bias = 1024, bias is not None
    kernel[(rows, cdiv(ffn, block))](h, bias.contiguous() if has_bias else h, group if has_bias else h, out, ffn,
                                     alpha, limit, HAS_BIAS=has_bias, CLAMPED=activation == "gpt_oss", BLOCK=block,
                                     num_warps=4)  # fmt: skip
    return out


@glu_forward.register_fake
def _(h, bias, group, activation, alpha, limit):
    return h.new_empty(h.shape[0], h.shape[1] // 2)


@torch.library.custom_op("trainbench::glu_backward", mutates_args=())
def glu_backward(h: torch.Tensor, bias: torch.Tensor | None, group: torch.Tensor | None, grad: torch.Tensor,
                 activation: str, alpha: float, limit: float) -> torch.Tensor:  # fmt: skip
    """The gradient of ``h`` [rows, 2 x ffn] through :func:`glu` of ``h + bias[group]`` (``bias`` [experts, 2 x ffn]
    or None), given the activation's gradient ``grad`` [rows, ffn]; in ``h``'s dtype."""
    built = _backward_kernel() if _on_triton(h) and h.numel() else None
    if built is None:
        return _glu_backward_torch(h, bias, group, grad, activation, alpha, limit)
    kernel, cdiv = built
    rows, ffn = grad.shape
    h, grad = h.contiguous(), grad.contiguous()
    out = torch.empty_like(h)
    block = 1024
    has_bias = bias is not None
    kernel[(rows, cdiv(ffn, block))](h, bias.contiguous() if has_bias else h, group if has_bias else h, grad, out,
                                     ffn, alpha, limit, HAS_BIAS=has_bias, CLAMPED=activation == "gpt_oss",
                                     BLOCK=block, num_warps=4)  # fmt: skip
    return out


@glu_backward.register_fake
def _(h, bias, group, grad, activation, alpha, limit):
    return torch.empty_like(h)


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


def fuse_activations(model: torch.nn.Module) -> int:
    """Every expert layer of ``model`` with its activation (and its first bias, forward and backward) as one op,
    :class:`BiasGLU`, set as its ``biased_activation``: the CUDA placement's. Returns how many layers."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for layer in layers:
        layer.biased_activation = BiasGLU.apply
    return len(layers)
