"""A mixture-of-experts feed-forward layer (gpt_oss_20b's): a top-k router over SwiGLU experts, the experts' matrix
products grouped (tokens sorted by expert, one grouped product for all experts at once; never a loop over experts).

Two expert activations, by config:
- ``silu`` (the MLCommons reference's): ``silu(gate) * up``, no biases;
- ``gpt_oss`` (GPT-OSS's own, as NVIDIA submitted it and as ``transformers`` defines it): gate clamped above at
  ``limit``, up clamped to [-limit, limit], ``(up + 1) * gate * sigmoid(alpha * gate)``, with biases on the router
  and the experts.

The router's softmax is taken over the chosen top-k logits (after top-k), as both the reference and GPT-OSS do. The
expert weights keep ``transformers``' layout (``gate_up_proj`` [experts, hidden, 2 x ffn] with gate and up
interleaved, ``down_proj`` [experts, ffn, hidden]), so a GPT-OSS checkpoint's tensors load as they are.

The grouped product is torch's ``_grouped_mm`` on CUDA (bf16, Hopper and newer); elsewhere the groups are padded to
the largest and multiplied as one batched product. With ``fp8`` (``model.precision=fp8``) the forward and the input's
gradient are FP8 grouped products (torch's ``_scaled_grouped_mm``: e4m3, a power-of-two scale per row and per
expert's output column), and the weights' gradient one too, with a scale per expert (``model.expert_weight_grad=fp8``,
:func:`fp8_weight_grad`), or a bf16 one (:class:`_FP8Grouped`); FP8's grouped product needs
each expert's rows to start on a multiple of 16, so the rows are then laid out with each expert's group padded by
zero rows (``align_rows``), in a buffer of a size fixed by the token count (no wait on the GPU for the counts). With
expert parallelism each rank pads the rows that arrive for its experts, whose counts its all-to-all already brought
to the host.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainbench.families.decoder.glu_kernel import BiasGLU, glu, group_sums
from trainbench.families.fp8 import (
    E4M3,
    E4M3_MAX,
    add_grad_into,
    cast_transpose_e4m3,
    grad_adders,
    grad_as_fp32,
    grad_leaf,
    min_capability,
    once_a_step,
)


@dataclasses.dataclass(frozen=True)
class MoEShape:
    hidden: int
    ffn: int  # each expert's intermediate width
    experts: int
    top_k: int
    activation: str = "silu"  # silu (the reference's) or gpt_oss
    bias: bool = False  # router and expert biases (GPT-OSS)
    alpha: float = 1.702  # gpt_oss: the sigmoid's slope
    limit: float = 7.0  # gpt_oss: the clamp


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, k], experts [tokens, k]): the top-k logits' softmax (in fp32 at least) and their experts."""
    top, experts = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(top if top.dtype == torch.float64 else top.float(), dim=-1), experts


def _grouped(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, fp8: bool = False,
             casts: tuple[torch.Tensor, ...] | None = None, group: torch.Tensor | None = None,
             compiled_casts: bool = False) -> torch.Tensor:  # fmt: skip
    """Rows of ``x`` [n, a], sorted by group with ``counts`` [groups] rows each, times their group's ``w`` [groups,
    a, b]: [n, b]. ``fp8``: in FP8 (:class:`_FP8Grouped`: CUDA, bf16 rows, every count a multiple of 16; ``casts``:
    ``w``'s, made beforehand; ``group`` [n], each row's group: the weights' gradient in FP8 too, else in bf16;
    ``compiled_casts``: the rows' casts compiled where they run outside a compiled block, :func:`_rows_e4m3`)."""
    if fp8:
        return _FP8Grouped.apply(x, w, torch.cumsum(counts, 0, dtype=torch.int32), casts, group, compiled_casts)
    if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        return torch._grouped_mm(x, w.to(x.dtype), offs=offsets)
    groups, width = w.shape[0], int(counts.max()) if counts.numel() else 0
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(x.shape[0], device=x.device) - torch.repeat_interleave(starts, counts)
    group = torch.repeat_interleave(torch.arange(groups, device=x.device), counts)
    padded = x.new_zeros(groups, width, x.shape[1])
    padded[group, slot] = x
    return torch.bmm(padded, w.to(x.dtype))[group, slot]


def _e4m3(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` in e4m3 with a scale per slice along ``dim`` (a power of two: the slice's largest magnitude brought
    just under 448), and the scales' reciprocals (what multiplies the product back), ``dim`` squeezed out."""
    amax = t.detach().abs().amax(dim=dim, keepdim=True).float().clamp(min=1e-12)
    scale = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax)))
    q = (t.detach().float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale.reciprocal().squeeze(dim)


@functools.cache
def _compiled_row_cast() -> Callable:
    """:func:`_e4m3` compiled for a fixed row width and any number of rows (:func:`_rows_e4m3` marks the rows
    dynamic): one graph a width. With every dimension dynamic, as first written, the width was unknown to the
    compiler and the cast ran at about a fifth of the memory's bandwidth (docs/notes/node.md)."""
    return torch.compile(_e4m3, dynamic=False)


def _rows_e4m3(t: torch.Tensor, compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_e4m3` along the rows of ``t`` [rows, n]. Inside a compiled block the plain tensor operations, which
    the compiler fuses into the kernels that make ``t``. Outside one on CUDA, where ``compiled`` (the run compiles
    its blocks, and the expert-parallel dispatch runs outside them), one compiled function for every number of rows:
    torch's eager operations made a float32 copy of the rows and took 5 passes over it, the largest cost of FP8's
    experts under expert parallelism (docs/notes/node.md)."""
    if not compiled or not t.is_cuda or torch.compiler.is_compiling():
        return _e4m3(t, -1)
    torch._dynamo.maybe_mark_dynamic(t, 0)
    return _compiled_row_cast()(t, -1)


def _weight_for_forward(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' weights ``w`` [groups, a, b] in e4m3 with a scale per (group, output column), each group's matrix
    column-major, as the FP8 grouped product requires; and the scales' reciprocals."""
    qw, sw = _e4m3(w, -2)
    return qw.transpose(-2, -1).contiguous().transpose(-2, -1), sw


def _weight_for_input_grad(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` in e4m3 with a scale per (group, row): ``w^T``'s output columns are ``w``'s rows, and row-major ``w`` is
    column-major ``w^T``; and the scales' reciprocals."""
    return _e4m3(w, -1)


def fp8_weight_casts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The experts' weights ``w`` as :class:`_FP8Grouped` multiplies them, for the forward and for the input's
    gradient (each cast with its scales' reciprocals)."""
    return *_weight_for_forward(w), *_weight_for_input_grad(w)


def _group_scaled_transpose(t: torch.Tensor, row_scales: torch.Tensor, group: torch.Tensor,
                            groups: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``t`` [rows, n] (rows sorted by group, ``group`` [rows] each one's) transposed into e4m3 [n, rows], row-major,
    with one power-of-two scale a group: that of its largest row, whose reciprocal ``row_scales`` [rows] (from
    :func:`_e4m3` along the rows) holds; and the groups' reciprocals [groups] (1 for a group of no rows)."""
    recip = row_scales.new_ones(groups).scatter_reduce(0, group, row_scales, "amax", include_self=False)
    return cast_transpose_e4m3(t.detach(), recip[group]), recip


def fp8_weight_grad(x: torch.Tensor, x_scales: torch.Tensor, grad: torch.Tensor, grad_scales: torch.Tensor,
                    group: torch.Tensor, groups: int, offsets: torch.Tensor,
                    fast_accum: bool = True) -> torch.Tensor:  # fmt: skip
    """The experts' weights' gradient [groups, a, b], each group's ``x^T grad`` over its rows (``x`` [rows, a],
    ``grad`` [rows, b], sorted by group, ``offsets`` the groups' ends) as one FP8 grouped product: both operands in
    e4m3 with a power-of-two scale per group (the sum runs along the rows, so the scale cannot vary along them),
    found from the rows' own scales (``x_scales``, ``grad_scales``: the reciprocals the row casts made). Fast
    accumulation (``fast_accum``), as the other products: against full fp32 sums it measured the same error at 4,096
    and 32,768 rows a group (docs/gpt_oss.md), the operands' rounding being most of it."""
    qx, rx = _group_scaled_transpose(x, x_scales, group, groups)
    qg, rg = _group_scaled_transpose(grad, grad_scales, group, groups)
    a, b = x.shape[1], grad.shape[1]
    return torch._scaled_grouped_mm(qx, qg.t(), rx[:, None].expand(groups, a).reshape(-1),
                                    rg[:, None].expand(groups, b).reshape(-1), offs=offsets,
                                    out_dtype=torch.bfloat16, use_fast_accum=fast_accum)  # fmt: skip


class _FP8Grouped(torch.autograd.Function):
    """``x`` [rows, a] (bf16, sorted by group, each group's rows ending at ``offsets``, every group a multiple of 16
    rows) times its group's ``w`` [groups, a, b]: the forward and the input's gradient as FP8 grouped products
    (torch's ``_scaled_grouped_mm``; e4m3, a scale per row of the left operand and per output column of each group's
    right one). The weights' gradient is one too where ``group`` (each row's group) is given
    (:func:`fp8_weight_grad`), else a bf16 grouped product. The casts are plain tensor operations, which a compiled
    block fuses into the kernels that make their inputs (the rows' gather, the activation, the gradients' gathers).
    ``casts``: ``w``'s casts (:func:`fp8_weight_casts`) made once a step rather than in every micro-batch's forward
    and backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                casts: tuple[torch.Tensor, ...] | None = None, group: torch.Tensor | None = None,
                compiled_casts: bool = False) -> torch.Tensor:  # fmt: skip
        qx, sx = _rows_e4m3(x, compiled_casts)
        ctx.cast_weights, ctx.compiled_casts = casts is None, compiled_casts
        if casts is None:
            qw, sw = _weight_for_forward(w)
            weight = ()
        else:
            qw, sw = casts[:2]
            weight = casts[2:]
        ctx.fp8_weight_grad = group is not None
        rows = (sx, group) if group is not None else ()
        ctx.save_for_backward(x, w, offsets, *rows, *weight)
        return torch._scaled_grouped_mm(qx, qw, sx, sw, offs=offsets, out_dtype=torch.bfloat16, use_fast_accum=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w, offsets, *rest = ctx.saved_tensors
        sx, group = rest[:2] if ctx.fp8_weight_grad else (None, None)
        cast = rest[2:] if ctx.fp8_weight_grad else rest
        grad = grad.contiguous()
        qg, sg = _rows_e4m3(grad, ctx.compiled_casts)
        qw, sw = _weight_for_input_grad(w) if ctx.cast_weights else cast
        grad_x = torch._scaled_grouped_mm(qg, qw.transpose(-2, -1), sg, sw, offs=offsets, out_dtype=torch.bfloat16,
                                          use_fast_accum=True)  # fmt: skip
        if ctx.fp8_weight_grad:
            grad_w = fp8_weight_grad(x, sx, grad, sg, group, w.shape[0], offsets)
        else:
            grad_w = torch._grouped_mm(x.transpose(0, 1), grad.to(x.dtype), offs=offsets)
        return grad_x, grad_w, None, None, None, None


class MoE(nn.Module):
    def __init__(self, shape: MoEShape):
        super().__init__()
        self.shape = shape
        s = shape
        self.router = nn.Linear(s.hidden, s.experts, bias=s.bias)
        self.gate_up_proj = nn.Parameter(torch.empty(s.experts, s.hidden, 2 * s.ffn))
        self.down_proj = nn.Parameter(torch.empty(s.experts, s.ffn, s.hidden))
        # Expert parallelism (families/decoder/placement.apply_expert_parallel): the ranks that share the experts,
        # and the scale of the experts' gradients (1 / ranks: the loop scales each rank's loss by the ranks, which
        # FSDP's mean undoes for the other parameters but nothing undoes for these).
        self.ep_group: dist.ProcessGroup | None = None
        self.expert_grad_scale = 1.0
        # How rows go to their experts and back: by gathers both ways (_Dispatch, _Combine: no atomic scatter in the
        # forward or the backward; the experts' biases take their gradient by a product, _GroupBias), or by
        # indexing and index_add_ (the CPU's, whose sums the golden runs keep). None: gathers on CUDA.
        self.gather_rows: bool | None = None
        # The activation's backward (and the first bias's gradient) as one kernel (glu_kernel.BiasGLU), or through
        # autograd of the activation's tensor operations (the CPU's, whose sums the golden runs keep). None: on CUDA.
        self.glu_kernel: bool | None = None
        # The experts' products in FP8 (set by the placement for model.precision=fp8), and the row alignment of each
        # expert's group (16 for FP8; 1: the groups packed back to back)
        self.fp8 = False
        self.align_rows = 1
        # With fp8: the weights' gradient an FP8 grouped product too (fp8_weight_grad), else a bf16 one; the rows'
        # casts outside a compiled block compiled (_rows_e4m3) where the run compiles its blocks
        self.fp8_weight_grad = False
        self.compiled_casts = False
        # With the weights' FP8 casts made once a step (cache_fp8_weight_casts): for each weight, where this forward
        # takes gradients, the tensor its products take the place of the weight with (_fp32_grad_stand_in)
        self._grad_standins: dict[str, torch.Tensor] = {}
        if s.bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(s.experts, 2 * s.ffn))
            self.down_proj_bias = nn.Parameter(torch.empty(s.experts, s.hidden))
        else:
            self.gate_up_proj_bias = self.down_proj_bias = None

    @torch.no_grad()
    def init_parameters(self, std: float, out_std: float) -> None:
        """The stacked experts as a decoder's matrices: normal(0, std) into the expert, ``out_std`` for the
        projection back into the residual stream, zero biases (the router is a Linear the model initialises)."""
        nn.init.normal_(self.gate_up_proj, std=std)
        nn.init.normal_(self.down_proj, std=out_std)
        for bias in (self.gate_up_proj_bias, self.down_proj_bias):
            if bias is not None:
                nn.init.zeros_(bias)

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        return glu(gate_up, self.shape.activation, self.shape.alpha, self.shape.limit)

    def router_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """[tokens, experts] in fp32 at least, also under bf16 autocast (the reference's router runs in fp32: its
        top-k is not left to bf16's rounding)."""
        wide = torch.promote_types(tokens.dtype, torch.float32)
        bias = self.router.bias
        with torch.autocast(tokens.device.type, enabled=False):
            return F.linear(tokens.to(wide), self.router.weight.to(wide), None if bias is None else bias.to(wide))

    def _gathers(self, device: torch.device) -> bool:
        """Whether rows move by gathers (and the experts' biases take their gradient by a product) rather than by
        indexing and atomic adds: :attr:`gather_rows`, or None: on CUDA."""
        return device.type == "cuda" if self.gather_rows is None else self.gather_rows

    def _experts(self, rows, group, counts, gate_up, down, gate_up_bias, down_bias) -> torch.Tensor:
        """Each row of ``rows`` (sorted by expert, ``counts`` a group; ``group`` its expert among those of the
        weights given) through its expert."""
        product = self._gathers(rows.device)
        wgrad_group = group if self.fp8_weight_grad else None
        gate_up_casts, down_casts = self._casts("gate_up_proj", gate_up), self._casts("down_proj", down)
        # Where the weights are read through their casts, their gradients go to their stand-ins (if this forward
        # takes gradients)
        if gate_up_casts is not None:
            gate_up = self._grad_standins.get("gate_up_proj", gate_up)
        if down_casts is not None:
            down = self._grad_standins.get("down_proj", down)
        h = _grouped(rows, gate_up, counts, self.fp8, gate_up_casts, wgrad_group, self.compiled_casts)
        if rows.is_cuda if self.glu_kernel is None else self.glu_kernel:
            s = self.shape
            act = BiasGLU.apply(h, gate_up_bias, group if gate_up_bias is not None else None, s.activation, s.alpha,
                                s.limit)  # fmt: skip
        else:
            if gate_up_bias is not None:
                h = _add_group_bias(h, gate_up_bias, group, product)
            act = self.activation(h)
        out = _grouped(act, down, counts, self.fp8, down_casts, wgrad_group, self.compiled_casts)
        if down_bias is not None:
            out = _add_group_bias(out, down_bias, group, product)
        return out

    def _casts(self, name: str, weight: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """The FP8 casts of the weight ``name`` made once a step (:func:`cache_fp8_weight_casts`), where ``weight`` is
        that parameter itself or, under expert parallelism, this rank's share of it (what :meth:`_experts_parallel`
        hands on; the casts are of that share), and they exist; else None (cast in each call)."""
        if not self.fp8 or f"_fp8_{name}_0" not in self._buffers:
            return None
        if weight is not self.get_parameter(name) and self.ep_group is None:
            return None
        return tuple(self._buffers[f"_fp8_{name}_{i}"] for i in range(4))

    def _experts_padded(self, rows, group, counts, host_counts: list[int], *weights) -> torch.Tensor:
        """:meth:`_experts` with each expert's group of ``rows`` padded with zero rows to a multiple of
        ``align_rows``: the groups' sizes ``host_counts`` are known on the host (expert parallelism learns them to
        size its all-to-all). A padding row's output is read by nothing."""
        sizes = [-(-c // self.align_rows) * self.align_rows for c in host_counts]
        padded, size = torch.tensor(sizes, device=rows.device), sum(sizes)
        slot = _padded_slots(counts, padded, group)
        buffer = rows.new_zeros(size, rows.shape[1]).index_copy(0, slot, rows)
        experts = torch.repeat_interleave(torch.arange(len(host_counts), device=rows.device), padded,
                                          output_size=size)  # fmt: skip
        return self._experts(buffer, experts, padded, *weights)[slot]

    @torch.compiler.disable
    def _experts_parallel(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """:meth:`_experts` with the experts spread over the ranks of ``ep_group`` (rank j holds the j-th contiguous
        share, as DTensors sharded by expert): each row goes to its expert's rank by all-to-all, through the expert,
        and back, in the order it left. Never compiled: the rows a rank receives, and each of its experts', are
        known only on the host and change every call, so a compiled block (fixed shapes) compiled this anew for
        each call until dynamo's limit and then ran it uncompiled anyway (docs/notes/node.md)."""
        from torch.distributed.nn.functional import all_to_all_single

        ranks = dist.get_world_size(self.ep_group)
        local = self.shape.experts // ranks
        send = counts.view(ranks, local)  # rows for [rank, its expert]
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send.contiguous(), group=self.ep_group)  # rows from [rank, my expert]
        sent, received = send.sum(1).tolist(), recv.sum(1).tolist()
        arrived = all_to_all_single(rows.new_empty(sum(received), rows.shape[1]), rows, received, sent,
                                    group=self.ep_group)  # fmt: skip
        # Arrived by rank, then expert: sorted by expert (stable), through the experts, and back into that order.
        expert_of = torch.repeat_interleave(torch.arange(local, device=rows.device).repeat(ranks), recv.reshape(-1))
        by_expert = torch.argsort(expert_of, stable=True)
        mine = (self.gate_up_proj, self.down_proj, self.gate_up_proj_bias, self.down_proj_bias)
        mine = [None if w is None else _ScaleGrad.apply(w.to_local(), self.expert_grad_scale) for w in mine]
        rows, group, counts = arrived[by_expert], expert_of[by_expert], recv.sum(0)
        if self.align_rows > 1:  # each expert's rows padded to a multiple of align_rows (FP8's grouped product)
            out = self._experts_padded(rows, group, counts, counts.tolist(), *mine)
        else:
            out = self._experts(rows, group, counts, *mine)
        out = out[torch.argsort(by_expert)]
        return all_to_all_single(out.new_empty(sum(sent), out.shape[1]), out, sent, received, group=self.ep_group)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(output like ``x``, the router's logits [tokens, experts] for a load-balancing loss)."""
        shape, tokens = x.shape, x.reshape(-1, x.shape[-1])
        logits = self.router_logits(tokens)
        weights, experts = route(logits, self.shape.top_k)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the (token, choice) pairs sorted by expert
        counts = torch.bincount(flat, minlength=self.shape.experts)
        token_of = order // self.shape.top_k
        if self.align_rows > 1 and self.ep_group is None:  # with expert parallelism: _experts_padded
            return self._forward_aligned(x, tokens, weights, flat, order, counts, token_of), logits
        gather = self._gathers(tokens.device)
        if gather:
            position = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
            rows = _Dispatch.apply(tokens, token_of, position, self.shape.top_k)
        else:
            rows = tokens[token_of]
        if torch.is_autocast_enabled(rows.device.type):  # the grouped product is on no autocast list: cast here
            rows = rows.to(torch.get_autocast_dtype(rows.device.type))
        if self.ep_group is None:
            out = self._experts(rows, flat[order], counts, self.gate_up_proj, self.down_proj, self.gate_up_proj_bias,
                                self.down_proj_bias)  # fmt: skip
        else:
            out = self._experts_parallel(rows, counts)
        out = out * weights.reshape(-1)[order, None].to(out.dtype)
        if gather:
            combined = _Combine.apply(out, position, token_of, self.shape.top_k)
        else:
            combined = torch.zeros_like(tokens, dtype=out.dtype).index_add_(0, token_of, out)
        return combined.to(x.dtype).reshape(shape), logits

    def _forward_aligned(self, x, tokens, weights, flat, order, counts, token_of) -> torch.Tensor:
        """:meth:`forward`'s experts with each expert's group of rows padded with zero rows to a multiple of
        ``align_rows`` (the last group takes the buffer's slack), in a buffer of ``pairs`` rounded up plus
        ``experts x align_rows`` rows: its size follows from the token count alone. Rows go there and back by
        gathers; a padding row reads a zero row, weighs nothing and is read by no token."""
        align, experts, pairs = self.align_rows, self.shape.experts, flat.numel()
        size = -(-pairs // align) * align + experts * align
        padded = (counts + align - 1) // align * align
        groups = torch.cat([padded[:-1], (size - padded[:-1].sum()).reshape(1)])  # the slack in the last group
        slot = _padded_slots(counts, padded, flat[order])
        slot_token = torch.full((size,), tokens.shape[0], dtype=token_of.dtype, device=flat.device)
        slot_token = slot_token.scatter(0, slot, token_of)  # the row each slot reads; a padding slot the zero row
        position = torch.empty_like(order).scatter_(0, order, slot)  # each (token, choice) pair's slot
        slot_weight = weights.new_zeros(size).scatter(0, slot, weights.reshape(-1)[order])
        rows = _Dispatch.apply(tokens, slot_token, position, self.shape.top_k, True)
        if torch.is_autocast_enabled(rows.device.type):
            rows = rows.to(torch.get_autocast_dtype(rows.device.type))
        group = torch.repeat_interleave(torch.arange(experts, device=flat.device), groups, output_size=size)
        out = self._experts(rows, group, groups, self.gate_up_proj, self.down_proj, self.gate_up_proj_bias,
                            self.down_proj_bias)  # fmt: skip
        out = out * slot_weight[:, None].to(out.dtype)
        combined = _Combine.apply(out, position, slot_token, self.shape.top_k, True)
        return combined.to(x.dtype).reshape(x.shape)


def _padded_slots(counts: torch.Tensor, padded: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Where each of the rows sorted by ``group`` (``counts`` a group) goes when each group takes ``padded`` rows,
    its own first, in the same order."""
    start, padded_start = torch.cumsum(counts, 0) - counts, torch.cumsum(padded, 0) - padded
    return torch.arange(group.numel(), device=group.device) - start[group] + padded_start[group]


def _with_zero_row(t: torch.Tensor) -> torch.Tensor:
    """``t`` [n, width] and a row of zeros after it: what index n reads."""
    return torch.cat([t, t.new_zeros(1, t.shape[1])])


class _Dispatch(torch.autograd.Function):
    """``tokens[token_of]``: each (token, choice) pair's row, in the experts' order (``padded``: index n, the token
    count, reads a zero row). Its gradient is a gather too:
    each pair's gradient read back at its ``position`` in that order and summed over the token's k choices, where
    indexing's own backward scatters with atomic adds."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, token_of: torch.Tensor, position: torch.Tensor, top_k: int,
                padded: bool = False):  # fmt: skip
        ctx.save_for_backward(position)
        ctx.top_k = top_k
        return (_with_zero_row(tokens) if padded else tokens)[token_of]  # padded: index n reads zeros

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (position,) = ctx.saved_tensors
        return grad[position].view(-1, ctx.top_k, grad.shape[-1]).sum(1), None, None, None, None


class _Combine(torch.autograd.Function):
    """Each token's k weighted expert outputs (``out`` in the experts' order) summed: a gather at each pair's
    ``position`` and a sum over the k choices; the gradient is each pair's token's gradient, gathered by
    ``token_of`` (``padded``: where it is the token count, a padding row's, zero)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, position: torch.Tensor, token_of: torch.Tensor, top_k: int,
                padded: bool = False):  # fmt: skip
        ctx.save_for_backward(token_of)
        ctx.padded = padded
        return out[position].view(-1, top_k, out.shape[-1]).sum(1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (token_of,) = ctx.saved_tensors
        return (_with_zero_row(grad) if ctx.padded else grad)[token_of], None, None, None, None


def _add_group_bias(h: torch.Tensor, bias: torch.Tensor, group: torch.Tensor, product: bool) -> torch.Tensor:
    """``h`` [rows, width] plus each row's group's ``bias`` [groups, width] (``group`` [rows]); ``product``: the
    bias's gradient as one matrix product (:class:`_GroupBias`) instead of indexing's atomic adds."""
    if product:
        return _GroupBias.apply(h, bias, group)
    return h + bias[group].to(h.dtype)


class _GroupBias(torch.autograd.Function):
    """``h + bias[group]``, with the bias's gradient the rows' gradient summed by group through a product
    (:func:`group_sums`) rather than indexing's atomic adds, which on a GPU cost several times the pass over the rows
    that they are."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, bias: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(group)
        ctx.groups, ctx.bias_dtype = bias.shape[0], bias.dtype
        return h + bias[group].to(h.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (group,) = ctx.saved_tensors
        return grad, group_sums(grad, group, ctx.groups).to(ctx.bias_dtype), None


class _ScaleGrad(torch.autograd.Function):
    """The identity, its gradient scaled by ``scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def load_balancing_loss(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch-style auxiliary loss: experts x sum over experts of (share of tokens routed to it) x (its mean router
    probability); 1 where routing is uniform (GPT-OSS's optional loss; the reference trains without it)."""
    experts = logits.shape[-1]
    probs = torch.softmax(logits.float(), dim=-1)
    chosen = torch.topk(logits, top_k, dim=-1).indices
    share = torch.bincount(chosen.reshape(-1), minlength=experts).float() / chosen.numel()
    return experts * (share * probs.mean(0)).sum()


def _fp32_grad_stand_in(w: torch.Tensor, as_fp32: Callable = grad_as_fp32,
                        add_into: Callable = add_grad_into) -> torch.Tensor:  # fmt: skip
    """What stands in for an fp32 weight ``w`` in products that read it through casts made beforehand and give its
    gradient in bf16 (:class:`_FP8Grouped` with ``casts``): a bf16 tensor of ``w``'s shape with no storage of its own
    (zero strides), a leaf whose gradient is added into ``w.grad`` in one pass as soon as autograd has it, reading the
    bf16 values as they are (:func:`fp8.grad_leaf`; the first micro-batch's gradient cast into ``w.grad`` by
    ``as_fp32``, the next added by ``add_into``). Compile the two functions on CUDA: torch's eager kernels for mixed
    dtypes run at about 60 % of the bandwidth of the compiled ones."""
    values = torch.empty_strided(w.shape, (0,) * w.dim(), dtype=torch.bfloat16, device=w.device)
    return grad_leaf(values, w, as_fp32, add_into)


def _own_share(w: torch.Tensor) -> torch.Tensor:
    """``w`` itself, or this rank's share of it where expert parallelism spread it (a DTensor), without autograd."""
    return w.to_local().detach() if hasattr(w, "to_local") else w.detach()


def cache_fp8_weight_casts(model: nn.Module, compiled: bool = True) -> Callable[[], None]:
    """The FP8 experts of ``model`` cast their weights once a step instead of in each micro-batch's forward and
    backward: before a forward of ``model``, each :class:`MoE`'s weights (on one unsharded rank, or each rank's share
    of the experts under expert parallelism, which FSDP2 leaves alone) are cast (:func:`fp8_weight_casts`, compiled
    where ``compiled``) into buffers that its grouped products read, where the weights changed since the last casts.
    On one rank a forward that takes gradients hands the products a stand-in for each weight
    (:func:`_fp32_grad_stand_in`), through which their bf16 gradients are added into the fp32 ``.grad`` directly;
    under expert parallelism the gradients take autograd's way back to the shared weight, as uncached. Returns what
    must run after every optimizer step: the fused optimizer updates the weights without touching their version
    counters, so the step itself marks the casts stale (a weight's version or storage that changed otherwise, as a
    checkpoint's load does, marks them too)."""
    layers = [m for m in model.modules() if isinstance(m, MoE) and m.fp8]
    names = ("gate_up_proj", "down_proj")
    cast = torch.compile(fp8_weight_casts, dynamic=False) if compiled else fp8_weight_casts
    gradients = grad_adders(compiled)

    def refresh(module: nn.Module, args) -> None:
        refresh_casts()
        grads = torch.is_grad_enabled()
        for m in layers:  # new stand-ins for each forward: the hook of each adds that micro-batch's gradient
            standins = grads and m.ep_group is None
            m._grad_standins = {n: _fp32_grad_stand_in(w, *gradients) for n in names
                                if standins and (w := m.get_parameter(n)).requires_grad}  # fmt: skip

    def recast() -> None:
        for m in layers:
            for name in names:
                for i, t in enumerate(cast(_own_share(m.get_parameter(name)))):
                    key = f"_fp8_{name}_{i}"
                    if key in m._buffers:
                        m._buffers[key].copy_(t)
                    else:
                        m.register_buffer(key, t, persistent=False)

    refresh_casts, after_step = once_a_step(
        lambda: [_own_share(m.get_parameter(n)) for m in layers for n in names], recast
    )

    model.register_forward_pre_hook(refresh)
    return after_step


def experts_in_fp8(model: nn.Module, device: torch.device, weight_grad: str = "fp8",
                   compiled_casts: bool = False) -> int:  # fmt: skip
    """Every :class:`MoE` of ``model`` multiplies its experts in FP8 (:func:`_grouped`), its groups aligned to 16
    rows, the weights' gradient in ``weight_grad`` (fp8 or bf16), the rows' casts outside a compiled block compiled
    where ``compiled_casts`` (the run compiles its blocks); returns how many. torch's FP8 grouped product runs on
    Hopper (compute capability 9.0) and newer."""
    if weight_grad not in ("fp8", "bf16"):
        raise ValueError(f"the experts' weight gradient is fp8 or bf16, not {weight_grad!r}")
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if layers:
        min_capability(device, (9, 0), "the experts' FP8 grouped products", "Hopper, Blackwell")
    for moe in layers:
        moe.fp8, moe.align_rows, moe.fp8_weight_grad = True, 16, weight_grad == "fp8"
        moe.compiled_casts = compiled_casts
    return len(layers)
