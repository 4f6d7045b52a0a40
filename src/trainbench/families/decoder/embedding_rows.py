"""An embedding whose gradient goes into its ``.grad`` by the rows a micro-batch touches.

torch's embedding backward writes a dense gradient the size of the whole table ([vocab, width] in the weight's
precision, every untouched row a zero) and autograd then adds that into ``.grad``: 16 bytes a weight in every
micro-batch for fp32 weights (the zeroed table written, then read with ``.grad`` and the sum written), 9.3 GB for
``gpt_oss_20b``'s 201,088 x 2,880, though a micro-batch of 8,192 tokens touches at most 8,192 rows. Here the backward
sums each distinct token's rows with torch's own embedding backward over a compact table (one row a distinct token,
numbered in the order of their ids, so the sums are torch's, in torch's order) and adds those rows into ``.grad``:
no two of them land on the same row (the compact table's unused rows are zeros added into row 0), so the sums are
the same whatever order the adds run in.

Used on one unsharded rank (``decoder_parallel.place_decoder``): sharded, FSDP2's reduce-scatter takes the whole
gradient, and several ranks' replicas need theirs through autograd's accumulation for data parallelism's hooks.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn


def distinct_rows(ids: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For token ``ids`` [n] and their output gradient ``grad`` [n, width]: ``(rows, sums)`` [n] and [n, width], the
    distinct ids in increasing order with each one's summed gradient, then zero sums for row 0 (no host sync: the
    count of distinct ids is not needed)."""
    sorted_ids, order = torch.sort(ids, stable=True)
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    first[1:] = sorted_ids[1:] != sorted_ids[:-1]
    slot = torch.cumsum(first, 0) - 1  # each sorted token's row of the compact table
    compact = torch.empty_like(slot).scatter_(0, order, slot)
    sums = torch.ops.aten.embedding_dense_backward(grad, compact, ids.numel(), -1, False)
    rows = torch.zeros_like(ids).scatter_(0, slot, sorted_ids)  # (the same id written by each of its tokens)
    return rows, sums


def add_rows_into_grad(weight: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor) -> None:
    """The embedding gradient of ``ids`` [n] with output gradient ``grad`` [n, width] added into ``weight.grad`` (a
    zeroed one made where there is none)."""
    rows, sums = distinct_rows(ids, grad.to(weight.dtype))
    with torch.no_grad():
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        weight.grad.index_add_(0, rows, sums)


class _RowsIntoGrad(torch.autograd.Function):
    """``F.embedding(ids, weight)`` whose backward adds the gradient into ``weight.grad`` itself
    (:func:`add_rows_into_grad`) and hands autograd none."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight = weight  # (a leaf parameter: no reference cycle through the graph)
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        add_rows_into_grad(ctx.weight, ids.reshape(-1), grad.reshape(-1, grad.shape[-1]))
        return None, None


def _forward(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    if not (torch.is_grad_enabled() and self.weight.requires_grad):
        return F.embedding(ids, self.weight)
    return _RowsIntoGrad.apply(ids, self.weight)


def rows_into_grad(embedding: nn.Embedding) -> None:
    """Make ``embedding``'s gradient go into its ``.grad`` by the rows each micro-batch touches (module docstring).
    Refused for an embedding with a padding row, a norm limit or scaling by frequency, whose backward differs."""
    if embedding.padding_idx is not None or embedding.max_norm is not None or embedding.scale_grad_by_freq:
        raise ValueError("rows_into_grad takes a plain embedding (no padding row, norm limit or frequency scaling)")
    if embedding.sparse:
        raise ValueError("rows_into_grad takes a dense embedding")
    embedding.forward = types.MethodType(_forward, embedding)
