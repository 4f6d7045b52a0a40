"""Building a run: seed, model, its placement, optimizer, schedule bounds, resume state and data."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trainbench.benchmarks.base import Benchmark, BenchmarkData
from trainbench.config import RunConfig
from trainbench.distributed import DistInfo, Placed
from trainbench.errors import ConfigError
from trainbench.train import checkpoint


@dataclass
class RunSetup:
    placed: Placed
    optimizer: torch.optim.Optimizer
    data: BenchmarkData
    state: checkpoint.LoopState
    accumulation: int
    eval_every: int
    first_eval: int  # samples at the first eval (a benchmark may skip the first ones)
    max_samples: int
    bf16: bool


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def uses_bf16(cfg: RunConfig, device: torch.device) -> bool:
    return cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")


def build_run(cfg: RunConfig, bench: Benchmark, info: DistInfo, ckpt: Path | None) -> RunSetup:
    """Everything a run trains with, from the config (and the checkpoint ``ckpt`` it continues, if any)."""
    if info.world_size != cfg.distributed.world_size:
        d = cfg.distributed
        raise ConfigError(
            f"the config says {d.world_size} ranks ({d.nodes} nodes x distributed.nproc={d.nproc}) but this job runs "
            f"{info.world_size}; set distributed.nodes and nproc to its layout"
        )
    bf16 = uses_bf16(cfg, info.device)
    seed_everything(cfg.seed)
    placed = bench.place(bench.build_model(cfg), cfg, info, bf16)
    optimizer = bench.build_optimizer(cfg, placed.module)
    eval_every = cfg.eval.every_samples or bench.eval_every_samples(cfg)
    first_eval = bench.first_eval_samples(cfg, eval_every)
    state = checkpoint.LoopState(next_eval=first_eval)
    if ckpt is not None:
        state = checkpoint.load(ckpt, placed.module, optimizer, info)
        state.resumed += 1
    # The data stream is in rows: step x GBS of them were consumed (a packed row holds several samples).
    data_rank, data_ranks = bench.data_rank(cfg, info)
    data = bench.build_data(cfg, data_rank, data_ranks, start_sample=state.step * cfg.data.global_batch_size)
    return RunSetup(
        placed=placed,
        optimizer=optimizer,
        data=data,
        state=state,
        accumulation=bench.accumulation_steps(cfg),
        eval_every=eval_every,
        first_eval=first_eval,
        max_samples=cfg.schedule.total_steps * cfg.data.global_batch_size
        if cfg.schedule.max_samples is None
        else cfg.schedule.max_samples,
        bf16=bf16,
    )
