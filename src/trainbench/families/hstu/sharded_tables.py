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

With ``perf.lookup_once_a_step``, steps 1-2 run once a step for every micro-batch's keys together, before the first
forward (:meth:`ShardedLookup.prepare`: a key asked by several micro-batches asked once, two host syncs a step instead
of two a micro-batch), each micro-batch's forward takes its rows from them, and step 3 runs once, in the last
micro-batch's backward, on the gradients summed over the step's micro-batches (:class:`_StepRows`). The tables do not
change within a step (the optimizer updates them after it), so the rows are the same; the gradients are summed in
another order.

The dense parameters stay under DDP, with the tables excluded from it. The rows travel in fp32 whatever the autocast.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from trainbench.distributed import DistInfo, exchange_rows, single_rank_group
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
        # The step's micro-batches looked up ahead (:meth:`prepare`), until the last of them has run its forward.
        self.step: _StepRows | None = None

    @torch.compiler.disable  # collectives of sizes known only at run time: left out of a compiled graph
    def __call__(self, tables: nn.ModuleDict, requests: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        with torch.profiler.record_function("tb.embedding_lookup"):  # bench's profile counts it apart
            if self.step is not None and torch.is_grad_enabled():
                return _as_requests(self.step.next(requests), requests)
            keys, ids, table_of, bad = self._keys(requests)
            return _as_requests(_Exchange.apply(self, keys, ids, table_of, bad, self.anchor), requests)

    def prepare(self, step_requests: list[list[tuple[str, torch.Tensor]]]) -> None:
        """Look up every micro-batch's requests of a training step at once (``perf.lookup_once_a_step``), before the
        first forward; each training forward then takes the next micro-batch's rows, in this order."""
        with torch.profiler.record_function("tb.embedding_lookup"):
            self.step = _StepRows(self, step_requests)

    def _keys(self, requests: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
        """(keys, ids, their tables, which ids lie outside their table) of the requests, flattened in order."""
        index = {n: i for i, n in enumerate(self.names)}
        ids = torch.cat([ids.reshape(-1) for _, ids in requests])
        table_of = torch.cat([torch.full((i.numel(),), index[n], device=i.device) for n, i in requests])
        # Ids outside their table are refused after the exchange's sizes reach the host (no sync of their own);
        # until then they stand in as their table's row 0.
        bad = (ids < 0) | (ids >= self.offsets[table_of + 1] - self.offsets[table_of])
        return self.offsets[table_of] + torch.where(bad, 0, ids), ids, table_of, bad

    def owner_of(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(table, owning rank, row within the owner's block) of each key."""
        table = torch.searchsorted(self.offsets, keys, right=True) - 1
        row = keys - self.offsets[table]
        owner = torch.div(row, self.blocks_of[table], rounding_mode="floor")
        return table, owner, row - owner * self.blocks_of[table]

    def exchange(self, tensor: torch.Tensor, out_sizes: list[int], in_sizes: list[int]) -> torch.Tensor:
        """``tensor``'s parts (``in_sizes`` rows to each rank) sent to their ranks; what each rank sent here
        (``out_sizes`` rows from each), in rank order."""
        return tensor if self.world == 1 else exchange_rows(tensor, out_sizes, in_sizes)


def _as_requests(rows: torch.Tensor, requests: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
    """``rows`` [lookups, D] cut into each request's, shaped as its ids. One split, whose backward concatenates the
    parts' gradients once: slices of ``rows`` would each give back a zero-filled gradient of all the rows, added up
    request by request (on one H200 at the reference's layers, 400 ms of a 1.42 s step)."""
    parts = rows.split([i.numel() for _, i in requests])
    return [part.view(*i.shape, rows.shape[-1]) for part, (_, i) in zip(parts, requests, strict=True)]


class _Fetched:
    """Steps 1-2 for ``keys``: ``rows`` [unique keys, D], ``inverse`` (each key's row), and what step 3 needs."""

    def __init__(self, lookup: ShardedLookup, keys, ids, table_of, bad) -> None:
        unique, self.inverse = torch.unique(keys, return_inverse=True)
        tables, world = len(lookup.names), lookup.world
        table_u, owner, _ = lookup.owner_of(unique)
        self.by_owner = torch.argsort(owner, stable=True)
        # [owner, table]: the keys this rank asks each owner for, table by table (an owner's keys go in key order, so
        # table by table); one host sync for them and the ids' check together.
        asking = torch.bincount(owner.clamp(0, world - 1) * tables + table_u, minlength=world * tables)
        counts = torch.cat([asking, bad.sum().view(1)]).tolist()
        self.send_sizes = [sum(counts[r * tables : (r + 1) * tables]) for r in range(world)]
        wrong = counts[-1]
        if wrong:
            first = int(bad.nonzero()[0, 0])
            name, rows = lookup.names[int(table_of[first])], lookup.rows[int(table_of[first])]
            key = f"model.{name}_rows" if name in ("uid", "item", "artist", "album") else "model.cross_features"
            raise DataError(f"{wrong:,} looked-up ids lie outside their table, e.g. id {int(ids[first]):,} of the "
                            f"{name} table, which has {rows:,} rows ({key})")  # fmt: skip
        asked_counts = lookup.exchange(asking.view(world, tables), [1] * world, [1] * world).tolist()
        self.recv_sizes = [sum(row) for row in asked_counts]
        self.per_table = [sum(row[t] for row in asked_counts) for t in range(tables)]
        asked = lookup.exchange(unique[self.by_owner], self.recv_sizes, self.send_sizes)
        # The owner's side: the asked rows gathered table by table (sorted by table, stably: each table's keys in the
        # order asked), then put back in the order asked.
        table, _, self.local = lookup.owner_of(asked)
        self.order = torch.argsort(table, stable=True)
        local_by_table = self.local.index_select(0, self.order).split(self.per_table)
        blocks = [lookup.tables[n].weight.to_local() for n in lookup.names]
        gathered = torch.cat([block.index_select(0, rows) for block, rows in zip(blocks, local_by_table, strict=True)])
        found = torch.empty_like(gathered).index_copy_(0, self.order, gathered)
        sent_back = lookup.exchange(found, self.send_sizes, self.recv_sizes)
        self.rows: torch.Tensor | None = torch.empty_like(sent_back).index_copy_(0, self.by_owner, sent_back)

    def send_gradients(self, lookup: ShardedLookup, summed: torch.Tensor) -> None:
        """Step 3: ``summed`` [unique keys, D], each key's gradient, sent to its owner, who appends it (rows and
        gradients of its block) to the table's ``ROW_GRADS``."""
        arrived = lookup.exchange(summed.index_select(0, self.by_owner), self.recv_sizes, self.send_sizes)
        if lookup.world > 1:  # the step scales each rank's loss by the ranks; DDP's average of the rest undoes it
            arrived = arrived / lookup.world
        rows_by_table = self.local.index_select(0, self.order).split(self.per_table)
        grads_by_table = arrived.index_select(0, self.order).split(self.per_table)
        for name, rows, grads in zip(lookup.names, rows_by_table, grads_by_table, strict=True):
            getattr(lookup.tables[name].weight, ROW_GRADS).append((rows, grads))


class _Exchange(torch.autograd.Function):
    """The module docstring's steps 1-3 for one lookup. Two host syncs a micro-batch, both in the forward: the counts
    this rank asks of each owner, table by table (with the ids' check), and those the owners are asked; the owner's
    rows are then gathered table by table in one sort, and the backward reuses both counts (no sync)."""

    @staticmethod
    def forward(ctx, lookup: ShardedLookup, keys, ids, table_of, bad, anchor):
        fetched = _Fetched(lookup, keys, ids, table_of, bad)
        ctx.lookup, ctx.fetched = lookup, fetched
        rows, fetched.rows = fetched.rows.index_select(0, fetched.inverse), None  # (the backward needs no rows)
        return rows

    @staticmethod
    def backward(ctx, grad):
        fetched = ctx.fetched
        summed = torch.zeros(fetched.by_owner.numel(), grad.shape[-1], dtype=grad.dtype, device=grad.device)
        summed.index_add_(0, fetched.inverse, grad)
        fetched.send_gradients(ctx.lookup, summed)
        return (None,) * 6


class _StepRows:
    """A training step's lookups made at once (``perf.lookup_once_a_step``): every micro-batch's keys fetched in one
    exchange; :meth:`next` gives each micro-batch's forward its rows, in order; each backward adds its gradients into
    the step's, per key, and the last micro-batch's sends them (step 3 once a step)."""

    def __init__(self, lookup: ShardedLookup, step_requests: list[list[tuple[str, torch.Tensor]]]) -> None:
        flat = [lookup._keys(requests) for requests in step_requests]
        self.lookup, self.fetched = lookup, _Fetched(lookup, *(torch.cat(part) for part in zip(*flat, strict=True)))
        self.sizes = [[ids.numel() for _, ids in requests] for requests in step_requests]
        self.inverses = self.fetched.inverse.split([sum(sizes) for sizes in self.sizes])
        self.summed: torch.Tensor | None = None
        self.taken = self.backwards = 0

    def next(self, requests: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
        """The next micro-batch's rows [its lookups, D], for ``requests`` (which must be that micro-batch's)."""
        i = self.taken
        if [ids.numel() for _, ids in requests] != self.sizes[i]:
            raise RuntimeError(f"micro-batch {i} of the step asked for other lookups than were made for it "
                               "ahead (perf.lookup_once_a_step): the step's forwards must run in its micro-batches' "
                               "order")  # fmt: skip
        rows = _StepPart.apply(self, i, self.lookup.anchor)
        self.taken += 1
        if self.taken == len(self.sizes):  # every forward has its rows: the step's are no longer needed
            self.lookup.step, self.fetched.rows = None, None
        return rows

    def add_gradients(self, i: int, grad: torch.Tensor) -> None:
        if self.summed is None:
            keys = self.fetched.by_owner.numel()
            self.summed = torch.zeros(keys, grad.shape[-1], dtype=grad.dtype, device=grad.device)
        self.summed.index_add_(0, self.inverses[i], grad)
        self.backwards += 1
        if self.backwards == len(self.sizes):
            self.fetched.send_gradients(self.lookup, self.summed)
            self.summed = None


class _StepPart(torch.autograd.Function):
    """Micro-batch ``i``'s rows from the step's lookups (:class:`_StepRows`), its gradients back into the step's."""

    @staticmethod
    def forward(ctx, step: _StepRows, i: int, anchor):
        ctx.step, ctx.i = step, i
        return step.fetched.rows.index_select(0, step.inverses[i])

    @staticmethod
    def backward(ctx, grad):
        ctx.step.add_gradients(ctx.i, grad)
        return None, None, None
