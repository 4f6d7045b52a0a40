"""The HSTU ranker's embedding tables sharded row-wise over the ranks (``perf.sharded_tables``), applied from outside
the architecture: :func:`shard_tables` replaces each table's weight by this rank's block of rows and the model's
lookup seam (``HstuRanker.lookup``) by :class:`ShardedLookup`.

Every table, however small, is cut the same way: rank r owns rows [r * block, (r + 1) * block) with block = ceil(rows
/ ranks) (the last rank's block shorter, possibly empty), torch's ``chunk`` of the rows, so the weight is a DTensor
sharded on its rows and a checkpoint saves each block once and loads on another number of ranks (torch distributed
checkpoint re-shards it).

One step of the lookups, for every table together (one exchange, not one per table):

1. each rank numbers its lookups' distinct (table, row) keys, in the order of the rank that owns them, and sends
   each owner how many it asks for, table by table, then the keys (``all_to_all_single``, sizes first);
2. each owner gathers those rows of its blocks and sends them back in the order asked (``all_to_all_single``);
3. in backward, each rank sums its lookups' gradients per key and sends them to the keys' owners (the same exchange
   reversed), averaged over the ranks as DDP averages the dense gradients; the owner appends (rows, gradients) of its
   block to the table's ``ROW_GRADS`` list, over the micro-batches of a step, for the optimizer's update of the
   touched rows (optim/rowwise_adagrad.py). The table's parameter gets no gradient.

The dense parameters stay under DDP, with the tables excluded from it. The rows travel in fp32 whatever the autocast.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from trainbench.distributed import DistInfo, single_rank_group
from trainbench.errors import DataError
from trainbench.families.hstu.model import init_table_rows
from trainbench.optim.rowwise_adagrad import ROW_GRADS


def shard_tables(model: nn.Module, info: DistInfo, seed: int) -> list[str]:
    """Replace ``model.tables``' weights (on the meta device: no rank holds a whole table) by this rank's blocks of
    rows on its device, drawn from ``seed`` as the whole tables draw them (``init_table_rows``), and ``model.lookup``
    by a :class:`ShardedLookup` of them. Returns the tables' parameter names, for DDP to leave alone."""
    if info.world_size == 1:
        single_rank_group(info.device)  # a DTensor needs a process group, of this rank alone here
    mesh = DeviceMesh(info.device.type, list(range(info.world_size)))
    names = []
    for index, (name, table) in enumerate(model.tables.items()):
        rows = table.num_embeddings
        block = math.ceil(rows / info.world_size)
        start, stop = min(rows, info.rank * block), min(rows, (info.rank + 1) * block)
        local = torch.empty(stop - start, table.embedding_dim, device=info.device)
        init_table_rows(local, start, rows, seed, index)
        shard = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=table.weight.shape,
                                   stride=table.weight.stride())  # fmt: skip
        table.weight = nn.Parameter(shard)
        names.append(f"tables.{name}.weight")
    model.lookup = ShardedLookup(model.tables, info)
    return names


def start_row_gradients(model: nn.Module) -> None:
    """An empty ``ROW_GRADS`` list on each sharded table's parameter as placed (moving the model to its device may
    have made new parameter objects): the optimizer keeps state for every table shard, touched or not."""
    for table in model.tables.values():
        setattr(table.weight, ROW_GRADS, [])


class ShardedLookup:
    """The rows of every request through one exchange between the ranks (the module docstring's steps 1-3)."""

    def __init__(self, tables: nn.ModuleDict, info: DistInfo) -> None:
        self.tables, self.names = tables, list(tables)
        self.rows = [t.num_embeddings for t in tables.values()]
        self.blocks = [math.ceil(r / info.world_size) for r in self.rows]
        self.world, self.rank, self.device = info.world_size, info.rank, info.device
        # A key is a table's offset in all the tables' rows, plus the row: one int64 for (table, row).
        offsets = [0]
        for rows in self.rows:
            offsets.append(offsets[-1] + rows)
        self.offsets = torch.tensor(offsets, dtype=torch.int64, device=info.device)
        self.blocks_of = torch.tensor(self.blocks, dtype=torch.int64, device=info.device)
        # What makes the exchange's rows require a gradient, so that autograd reaches its backward: an empty leaf of
        # its own. Handed the tables' weights (their to_local()) instead, torch 2.11's DTensor gave each table a
        # gradient of zeros of all its rows every micro-batch (its to_local backward makes zeros of the None the
        # exchange returns), which the optimizer then applied to every row (docs/dlrmv4.md, the figures).
        self.anchor = torch.empty(0, device=info.device, requires_grad=True)

    @torch.compiler.disable  # collectives of sizes known only at run time: left out of a compiled graph
    def __call__(self, tables: nn.ModuleDict, requests: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        with torch.profiler.record_function("tb.embedding_lookup"):  # bench's profile counts it apart
            return self._lookup(requests)

    def _lookup(self, requests: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        index = {n: i for i, n in enumerate(self.names)}
        ids = torch.cat([ids.reshape(-1) for _, ids in requests])
        table_of = torch.cat([torch.full((i.numel(),), index[n], device=i.device) for n, i in requests])
        # Ids outside their table are refused after the exchange's sizes reach the host (no sync of their own);
        # until then they stand in as their table's row 0.
        bad = (ids < 0) | (ids >= self.offsets[table_of + 1] - self.offsets[table_of])
        keys = self.offsets[table_of] + torch.where(bad, 0, ids)
        rows = _Exchange.apply(self, keys, ids, table_of, bad, self.anchor)
        # One split, whose backward concatenates the parts' gradients once: slices of ``rows`` would each give back a
        # zero-filled gradient of all the rows, added up request by request (on one H200 at the reference's layers,
        # 400 ms of a 1.42 s step).
        parts = rows.split([i.numel() for _, i in requests])
        return [part.view(*i.shape, rows.shape[-1]) for part, (_, i) in zip(parts, requests, strict=True)]

    def owner_of(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(table, owning rank, row within the owner's block) of each key."""
        table = torch.searchsorted(self.offsets, keys, right=True) - 1
        row = keys - self.offsets[table]
        owner = torch.div(row, self.blocks_of[table], rounding_mode="floor")
        return table, owner, row - owner * self.blocks_of[table]

    def exchange(self, tensor: torch.Tensor, out_sizes: list[int], in_sizes: list[int]) -> torch.Tensor:
        """``tensor``'s parts (``in_sizes`` rows to each rank) sent to their ranks; what each rank sent here
        (``out_sizes`` rows from each), in rank order."""
        if self.world == 1:
            return tensor
        out = tensor.new_empty((sum(out_sizes), *tensor.shape[1:]))
        dist.all_to_all_single(out, tensor.contiguous(), out_sizes, in_sizes)
        return out


class _Exchange(torch.autograd.Function):
    """The module docstring's steps 1-3. Two host syncs a micro-batch, both in the forward: the counts this rank asks
    of each owner, table by table (with the ids' check), and those the owners are asked; the owner's rows are then
    gathered table by table in one sort, and the backward reuses both counts (no sync)."""

    @staticmethod
    def forward(ctx, lookup: ShardedLookup, keys, ids, table_of, bad, anchor):
        unique, inverse = torch.unique(keys, return_inverse=True)
        tables, world = len(lookup.names), lookup.world
        table_u, owner, _ = lookup.owner_of(unique)
        by_owner = torch.argsort(owner, stable=True)
        # [owner, table]: the keys this rank asks each owner for, table by table (an owner's keys go in key order, so
        # table by table); one host sync for them and the ids' check together.
        asking = torch.bincount(owner.clamp(0, world - 1) * tables + table_u, minlength=world * tables)
        counts = torch.cat([asking, bad.sum().view(1)]).tolist()
        send_sizes = [sum(counts[r * tables : (r + 1) * tables]) for r in range(world)]
        wrong = counts[-1]
        if wrong:
            first = int(bad.nonzero()[0, 0])
            name, rows = lookup.names[int(table_of[first])], lookup.rows[int(table_of[first])]
            key = f"model.{name}_rows" if name in ("uid", "item", "artist", "album") else "model.cross_features"
            raise DataError(f"{wrong:,} looked-up ids lie outside their table, e.g. id {int(ids[first]):,} of the "
                            f"{name} table, which has {rows:,} rows ({key})")  # fmt: skip
        asked_counts = lookup.exchange(asking.view(world, tables), [1] * world, [1] * world).tolist()
        recv_sizes = [sum(row) for row in asked_counts]
        per_table = [sum(row[t] for row in asked_counts) for t in range(tables)]
        asked = lookup.exchange(unique[by_owner], recv_sizes, send_sizes)
        # The owner's side: the asked rows gathered table by table (sorted by table, stably: each table's keys in the
        # order asked), then put back in the order asked.
        table, _, local = lookup.owner_of(asked)
        order = torch.argsort(table, stable=True)
        local_by_table = local.index_select(0, order).split(per_table)
        blocks = [lookup.tables[n].weight.to_local() for n in lookup.names]
        gathered = torch.cat([block.index_select(0, rows) for block, rows in zip(blocks, local_by_table, strict=True)])
        found = torch.empty_like(gathered).index_copy_(0, order, gathered)
        sent_back = lookup.exchange(found, send_sizes, recv_sizes)
        rows = torch.empty_like(sent_back).index_copy_(0, by_owner, sent_back)
        ctx.lookup, ctx.sizes = lookup, (send_sizes, recv_sizes, per_table)
        ctx.save_for_backward(inverse, by_owner, order, local)
        return rows.index_select(0, inverse)

    @staticmethod
    def backward(ctx, grad):
        lookup, (send_sizes, recv_sizes, per_table) = ctx.lookup, ctx.sizes
        inverse, by_owner, order, local = ctx.saved_tensors
        summed = torch.zeros(by_owner.numel(), grad.shape[-1], dtype=grad.dtype, device=grad.device)
        summed.index_add_(0, inverse, grad)
        arrived = lookup.exchange(summed.index_select(0, by_owner), recv_sizes, send_sizes)
        if lookup.world > 1:  # the step scales each rank's loss by the ranks; DDP's average of the rest undoes it
            arrived = arrived / lookup.world
        rows_by_table = local.index_select(0, order).split(per_table)
        grads_by_table = arrived.index_select(0, order).split(per_table)
        for name, rows, grads in zip(lookup.names, rows_by_table, grads_by_table, strict=True):
            getattr(lookup.tables[name].weight, ROW_GRADS).append((rows, grads))
        return (None,) * 6
