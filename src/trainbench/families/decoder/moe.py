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
the largest and multiplied as one batched product. A placement may swap in another grouped product of the same
signature (:attr:`MoE.expert_product`): under ``model.precision=fp8``, FP8's (``families/decoder/moe_fp8.py``). A
product may need each expert's rows to start on a multiple of some count (16 for FP8's): the rows are then laid out
with each expert's group padded by zero rows (``align_rows``), in a buffer of a size fixed by the token count (no
wait on the GPU for the counts). With expert parallelism each rank pads the rows that arrive for its experts, whose
counts its all-to-all already brought to the host. The activation of the first product's rows and their experts'
biases may be swapped the same way for one op (:attr:`MoE.biased_activation`): on CUDA the placement sets the fused
kernel's (``families/decoder/glu_kernel.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def glu(h: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    """The experts' activation of ``h`` [..., 2 x ffn] (gate and up interleaved): [..., ffn]."""
    gate, up = h[..., ::2], h[..., 1::2]
    if activation == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def group_sums(rows: torch.Tensor, group: torch.Tensor, groups: int) -> torch.Tensor:
    """The sum of ``rows`` [n, width] over each group (``group`` [n]): [groups, width], as a product of the groups'
    indicator [groups, n] and the rows, in the rows' precision with the product's fp32 accumulation. Indexing's own
    backward adds every row into its group with an atomic add, thousands of rows onto the same addresses."""
    members = torch.arange(groups, device=group.device)[:, None] == group[None, :]
    return members.to(rows.dtype) @ rows


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


def _grouped(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` [n, a], sorted by group with ``counts`` [groups] rows each, times their group's ``w`` [groups,
    a, b]: [n, b]."""
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


class MoE(nn.Module):
    # The stacked experts' tensors (a bias None where the shape has none): what expert parallelism cuts by expert
    EXPERT_TENSORS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")

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
        # The activation of the first product's rows plus their experts' biases as one op of the signature
        # (h, bias or None, group or None, activation, alpha, limit), set by a placement (on CUDA the fused kernel's,
        # glu_kernel.BiasGLU.apply); None: the bias added and the activation's tensor operations under autograd (the
        # CPU's, whose sums the golden runs keep).
        self.biased_activation: Callable[..., torch.Tensor] | None = None
        # The row alignment of each expert's group that expert_product needs (16 for FP8's, set with it by the
        # placement; 1: the groups packed back to back)
        self.align_rows = 1
        # The experts placed by their load over the ranks (families/decoder/expert_placement): ``slot_of``, a buffer
        # set there (None: each expert in its own slot), gives each expert's slot (rank j holds the j-th contiguous
        # share of the slots, each slot its expert's weights); ``slot_loads`` counts the rows this rank sent to each
        # slot in training's forwards.
        self.slot_of: torch.Tensor | None
        self.register_buffer("slot_of", None, persistent=False)
        self.slot_loads: torch.Tensor | None = None
        if s.bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(s.experts, 2 * s.ffn))
            self.down_proj_bias = nn.Parameter(torch.empty(s.experts, s.hidden))
        else:
            self.gate_up_proj_bias = self.down_proj_bias = None

    @staticmethod
    def to_experts(rows: torch.Tensor, out_splits: list[int], in_splits: list[int],
                   group: dist.ProcessGroup) -> torch.Tensor:  # fmt: skip
        """Expert parallelism's exchange of ``rows`` [n, width] over ``group`` by all-to-all: ``in_splits[j]`` rows to
        rank j, ``out_splits[j]`` from it; the gradient goes back the same way. The rows to their experts' ranks; a
        placement may set another of this signature on the layer (an instance attribute): FP8's on the wire
        (moe_fp8.exchange_in_fp8)."""
        return _all_to_all(rows, out_splits, in_splits, group)

    @staticmethod
    def from_experts(rows: torch.Tensor, out_splits: list[int], in_splits: list[int],
                     group: dist.ProcessGroup) -> torch.Tensor:  # fmt: skip
        """:meth:`to_experts`'s exchange for the experts' outputs on their way back (and so for their gradients on
        the way to the experts)."""
        return _all_to_all(rows, out_splits, in_splits, group)

    @staticmethod
    def expert_product(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, group: torch.Tensor,
                       name: str) -> torch.Tensor:  # fmt: skip
        """The experts' grouped product (:func:`_grouped`) of rows ``x`` sorted by expert (``counts`` a group;
        ``group`` each row's expert) and the weight ``w`` (the parameter ``name``, or this rank's share of it). A
        placement may set another of this signature on the layer (an instance attribute): FP8's (moe_fp8)."""
        return _grouped(x, w, counts)

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
        h = self.expert_product(rows, gate_up, counts, group, "gate_up_proj")
        if self.biased_activation is not None:
            s = self.shape
            act = self.biased_activation(h, gate_up_bias, group if gate_up_bias is not None else None, s.activation,
                                         s.alpha, s.limit)  # fmt: skip
        else:
            if gate_up_bias is not None:
                h = _add_group_bias(h, gate_up_bias, group, product)
            act = self.activation(h)
        out = self.expert_product(act, down, counts, group, "down_proj")
        if down_bias is not None:
            out = _add_group_bias(out, down_bias, group, product)
        return out

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
        ranks = dist.get_world_size(self.ep_group)
        local = self.shape.experts // ranks
        if self.slot_loads is not None and torch.is_grad_enabled():
            self.slot_loads += counts
        send = counts.view(ranks, local)  # rows for [rank, its expert]
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send.contiguous(), group=self.ep_group)  # rows from [rank, my expert]
        sent, received = send.sum(1).tolist(), recv.sum(1).tolist()
        arrived = self.to_experts(rows, received, sent, self.ep_group)
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
        return self.from_experts(out, sent, received, self.ep_group)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(output like ``x``, the router's logits [tokens, experts] for a load-balancing loss)."""
        shape, tokens = x.shape, x.reshape(-1, x.shape[-1])
        logits = self.router_logits(tokens)
        weights, experts = route(logits, self.shape.top_k)
        flat = experts.reshape(-1)
        if self.slot_of is not None:  # the experts placed by their load: each choice by its slot
            flat = self.slot_of[flat]
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


def _all_to_all(rows: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:  # fmt: skip
    """:meth:`MoE.to_experts`: ``rows`` by torch's all-to-all with autograd (its gradient goes back the same way)."""
    from torch.distributed.nn.functional import all_to_all_single

    return all_to_all_single(rows.new_empty(sum(out_splits), rows.shape[1]), rows, out_splits, in_splits, group=group)


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
