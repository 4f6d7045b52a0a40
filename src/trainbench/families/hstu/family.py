"""The HSTU ranker family (dlrmv4): embedding tables for the user, the items and their crosses, and HSTU layers over
a user's history and one candidate. Every rank holds every table and DDP averages all gradients (the sharded tables
of the GPU path, with all-to-all between the ranks, are not built)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainbench.config import RunConfig
from trainbench.errors import ConfigError
from trainbench.families.base import ModelFamily

if TYPE_CHECKING:
    import torch

    from trainbench.distributed import DistInfo, Placed


class HstuFamily(ModelFamily):
    name = "hstu"

    def validate(self, cfg: RunConfig) -> None:
        m = cfg.model
        if cfg.distributed.tp != 1:
            raise ConfigError(f"{cfg.benchmark} is data-parallel only here: distributed.tp must be 1")
        crosses = m.crosses  # one sentence where the spec is malformed or names a missing column
        if len({c.name for c in crosses}) != len(crosses):
            raise ConfigError("model.cross_features names one cross twice")
        if m.num_heads * m.linear_dim < 1 or m.attention_dim < 1:
            raise ConfigError("model: the heads need a width")

    def build_model(self, cfg: RunConfig) -> torch.nn.Module:
        from trainbench.families.hstu.model import HstuRanker

        return HstuRanker(cfg.model)

    def place(self, model: torch.nn.Module, cfg: RunConfig, info: DistInfo, bf16: bool) -> Placed:
        from trainbench.families.data_parallel import place_data_parallel

        return place_data_parallel(model, info, cfg.distributed, cfg.perf, bucket_clip_norm=None)

    def tokens_per_sample(self, cfg: RunConfig) -> int:
        return cfg.model.sequence_length
