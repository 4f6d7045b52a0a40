"""The CTR model's family: how trainbench builds, checks and places it (DDP and ``torch.compile``, the shared
data-parallel placement)."""

from __future__ import annotations

import torch

from trainbench.config import RunConfig
from trainbench.distributed import DistInfo, Placed
from trainbench.errors import ConfigError
from trainbench.families.base import ModelFamily
from trainbench.families.data_parallel import place_data_parallel
from trainbench_ctr.model import CtrModel


class CtrFamily(ModelFamily):
    name = "ctr"

    def validate(self, cfg: RunConfig) -> None:
        if cfg.distributed.tp != 1:
            raise ConfigError(f"{cfg.benchmark} is data-parallel only: distributed.tp must be 1")

    def build_model(self, cfg: RunConfig) -> torch.nn.Module:
        return CtrModel(cfg.model)

    def place(self, model: torch.nn.Module, cfg: RunConfig, info: DistInfo, bf16: bool) -> Placed:
        return place_data_parallel(model, info, cfg.distributed, cfg.perf, bucket_clip_norm=None)

    def depth(self, cfg: RunConfig) -> int | None:
        return None  # no blocks to cut `trainbench bench --blocks` by
