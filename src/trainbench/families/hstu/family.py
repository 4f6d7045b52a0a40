"""The HSTU ranker family (dlrmv4): embedding tables for the user, the items and their crosses, and HSTU layers over
a user's history and one candidate. By default every rank holds every table and DDP averages all gradients; with
``perf.sharded_tables`` the tables are sharded row-wise over the ranks (sharded_tables.py: one all-to-all for every
table's lookups and their gradients) and DDP averages the dense parameters' gradients alone."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from trainbench.config import RunConfig
from trainbench.errors import ConfigError
from trainbench.families.base import ModelFamily

if TYPE_CHECKING:
    import torch

    from trainbench.distributed import DistInfo, Placed


JAGGED_ON_CPU = "perf.hstu_attention=jagged is a CUDA kernel: on the CPU use dense or auto"


def _row_bytes(cfg: RunConfig) -> int:
    """A table row's fp32 weights and its RowWiseAdagrad accumulator."""
    return (cfg.model.embedding_dim + 1) * 4


def tables_need(cfg: RunConfig) -> tuple[int, int]:
    """A lower bound of what one rank's embedding tables take: (bytes on its device, bytes of host memory while they
    are built). Whole tables: their fp32 rows, drawn on the host first, and on the device the rows, their dense
    gradient and RowWiseAdagrad's accumulator a row. Sharded: the rank's block of rows and their accumulators (its
    rows are drawn a chunk at a time: no host copy of a whole block)."""
    rows = sum(cfg.model.table_rows().values())
    if cfg.perf.sharded_tables:
        return math.ceil(rows / cfg.distributed.world_size) * _row_bytes(cfg), 0
    weights = rows * cfg.model.embedding_dim * 4
    return weights + rows * _row_bytes(cfg), weights


def check_tables_fit(cfg: RunConfig, gpu_bytes: int | None, host_bytes: int) -> None:
    """Refuse in one sentence, before a byte of them is allocated, embedding tables that cannot fit a rank's GPU
    (``gpu_bytes``: its memory, on a GPU run; None where unknown: not compared) or the host memory this node's ranks
    share (``host_bytes``: all of it, not what is free now, which the node's other ranks may already be filling with
    theirs; on the CPU the ranks' tables live there). A lower bound (:func:`tables_need`): the dense layers, the
    activations and the allocator's slack come on top."""
    from trainbench.families.planner import gib

    device_need, host_need = tables_need(cfg)
    per_node, ranks = cfg.distributed.nproc, cfg.distributed.world_size
    tables = cfg.model.table_rows()
    rows = sum(tables.values())
    what = f"dlrmv4's {len(tables)} embedding tables ({rows:,} rows of {cfg.model.embedding_dim})"
    cut = "or cut them for a throughput measurement (trainbench bench dlrmv4 --table-rows N)"
    on_cpu = cfg.device == "cpu"
    if on_cpu:  # the ranks' tables share the host's memory, and are drawn there
        need, room, host_need = device_need * per_node, host_bytes, 0
        where = f"host memory this node's {per_node} rank(s) share"
    else:
        need, room, where = device_need, gpu_bytes, "this GPU's memory"
    if room is not None and need > room:
        held = "their rows and accumulators" if cfg.perf.sharded_tables else "their rows, gradient and accumulators"
        layout = f"sharded over {ranks} rank(s)" if cfg.perf.sharded_tables else "whole on every rank"
        if on_cpu:
            key = "" if cfg.perf.sharded_tables else " perf.sharded_tables=true"
            fix = f"run them sharded on GPUs (device=cuda{key})"
        else:  # the least number of such GPUs whose memory holds every row and accumulator once
            gpus = math.ceil(rows * _row_bytes(cfg) / gpu_bytes)
            fix = (
                f"shard them over at least {gpus} GPUs of this size (perf.sharded_tables=true, --nproc, "
                "distributed.nodes)"
            )
        raise ConfigError(f"{what} {layout} need at least {gib(need)} for {held} against the {gib(room)} of "
                          f"{where}: {fix}, {cut}")  # fmt: skip
    if host_need * per_node > host_bytes:
        raise ConfigError(f"{what} whole on each of this node's {per_node} rank(s) are first drawn in host memory, "
                          f"{gib(host_need * per_node)} in all, more than the {gib(host_bytes)} this node has: "
                          f"shard them over the ranks (perf.sharded_tables=true), {cut}")  # fmt: skip


class HstuFamily(ModelFamily):
    name = "hstu"
    shards_tables = True
    peer_elsewhere = ("what users run instead is the reference's TorchRec and fbgemm_gpu, which trainbench cannot "
                      "time: fbgemm_gpu's CUDA build is made for each torch, and its CPU wheel does not load with this "
                      "one; docs/dlrmv4.md")  # fmt: skip
    step_parts = (  # (with perf.sharded_tables: whole tables are looked up inside the model's compiled graph)
        ("embedding lookup", r"^(tb\.embedding_lookup|_ExchangeBackward|_StepPartBackward)$"),
        ("tables' optimizer", r"^tb\.rowwise_adagrad$"),
    )

    def validate(self, cfg: RunConfig) -> None:
        m = cfg.model
        if cfg.distributed.tp != 1:
            raise ConfigError(f"{cfg.benchmark} is data-parallel only here: distributed.tp must be 1")
        crosses = m.crosses  # one sentence where the spec is malformed or names a missing column
        if len({c.name for c in crosses}) != len(crosses):
            raise ConfigError("model.cross_features names one cross twice")
        if m.num_heads * m.linear_dim < 1 or m.attention_dim < 1:
            raise ConfigError("model: the heads need a width")
        if cfg.perf.hstu_attention == "jagged" and cfg.device == "cpu":
            raise ConfigError(JAGGED_ON_CPU)
        if cfg.perf.sharded_tables and cfg.perf.cuda_graphs:
            raise ConfigError("perf.sharded_tables exchanges rows in sizes known only at run time, which CUDA graphs "
                              "cannot replay: leave perf.cuda_graphs=false")  # fmt: skip
        if cfg.perf.lookup_once_a_step and not cfg.perf.sharded_tables:
            raise ConfigError("perf.lookup_once_a_step looks up the sharded tables' rows once a step: it needs "
                              "perf.sharded_tables=true")  # fmt: skip

    def unused_for(self, cfg: RunConfig) -> dict[str, str]:
        return {k: why for k, why in super().unused_for(cfg).items() if k != "perf.hstu_attention"}

    def build_model(self, cfg: RunConfig) -> torch.nn.Module:
        from trainbench.families.hstu.model import HstuRanker
        from trainbench.families.planner import GIB, host_total_bytes

        # A GPU's size: perf.gpu_memory_gib where given (a smaller GPU stood in for), else this rank's GPU's own.
        gpu_bytes = None
        if cfg.device == "cuda":
            import torch

            own = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
            gpu_bytes = own if cfg.perf.gpu_memory_gib is None else int(cfg.perf.gpu_memory_gib * GIB)
        check_tables_fit(cfg, gpu_bytes, host_total_bytes())

        return HstuRanker(cfg.model, cfg.seed, whole_tables=not cfg.perf.sharded_tables)

    def place(self, model: torch.nn.Module, cfg: RunConfig, info: DistInfo, bf16: bool) -> Placed:
        from trainbench.families.data_parallel import place_data_parallel

        attention = self.attention_note(model, cfg, info)
        if not cfg.perf.sharded_tables:
            placed = place_data_parallel(model, info, cfg.distributed, cfg.perf, bucket_clip_norm=None)
            placed.notes.append(attention)
            return placed
        from torch.nn.parallel import DistributedDataParallel

        from trainbench.families.hstu.sharded_tables import shard_tables, start_row_gradients

        tables = shard_tables(model, info, cfg.seed)
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, tables)
        placed = place_data_parallel(model, info, cfg.distributed, cfg.perf, bucket_clip_norm=None)
        start_row_gradients(model)
        placed.notes.append(attention)
        placed.notes.append(f"{len(tables)} embedding tables sharded row-wise over {info.world_size} rank(s), looked "
                            "up through one all-to-all; DDP over the dense parameters only")  # fmt: skip
        if cfg.perf.lookup_once_a_step:
            lookup = model.lookup
            placed.before_step = lambda batches: lookup.prepare([model.requests(b) for b in batches])
            placed.notes.append("every micro-batch of a step looked up in one exchange before its first forward, the "
                                "gradients sent back once (perf.lookup_once_a_step): not yet run over NCCL on "
                                "several GPUs")  # fmt: skip
        return placed

    @staticmethod
    def attention_note(model: torch.nn.Module, cfg: RunConfig, info: DistInfo) -> str:
        """Sets the HSTU layers' attention ``perf.hstu_attention`` asks for on this device; says which in a note."""
        choice = cfg.perf.hstu_attention
        if choice == "auto":
            from trainbench.families.triton_kernels import triton_available

            choice = "jagged" if info.device.type == "cuda" and triton_available() else "dense"
        if choice == "dense":
            return "HSTU attention dense: every pair's score computed and masked (perf.hstu_attention)"
        if info.device.type != "cuda":
            raise ConfigError(JAGGED_ON_CPU)
        from trainbench.families.hstu.attention_kernel import use_jagged_attention

        use_jagged_attention(model)
        return "HSTU attention jagged: the valid pairs alone, trainbench's Triton kernel (perf.hstu_attention)"

    def tables_truncated(self, cfg: RunConfig, rows: int) -> RunConfig:
        import dataclasses

        m = cfg.model
        crosses = ",".join(f"{'*'.join(c.keys)}:{min(c.rows, rows)}" for c in m.crosses)
        model = dataclasses.replace(m, uid_rows=min(m.uid_rows, rows), item_rows=min(m.item_rows, rows),
                                    artist_rows=min(m.artist_rows, rows), album_rows=min(m.album_rows, rows),
                                    cross_features=crosses)  # fmt: skip
        return dataclasses.replace(cfg, model=model)

    def tokens_per_sample(self, cfg: RunConfig) -> int:
        return cfg.model.sequence_length

    def lookups_per_sample(self, cfg: RunConfig) -> int:
        """model.HstuRanker's requests: the user's row, one a cross, and the track, artist and album of every history
        position (the padding's too) and of the candidate."""
        return 1 + len(cfg.model.crosses) + 3 * (cfg.model.history + 1)
