"""What a benchmark supplies to the one training loop.

A benchmark differs from another by its model, data, optimizer and MLPerf rules — never by its loop.
The loop (``trainbench.train.loop``) asks the benchmark for each of these through this interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from trainbench.config import RunConfig
from trainbench.errors import ConfigError


@dataclass
class BenchmarkData:
    """A rank's view of the data: an endless iterator of steps (each a list of micro-batches), this
    rank's eval batches, and the sizes MLPerf logs as ``train_samples`` / ``eval_samples``."""

    train: Iterable[list[dict[str, Any]]]
    eval: list[dict[str, Any]]
    train_samples: int
    eval_samples: int


class Benchmark(ABC):
    name: str
    """trainbench's name for it (``trainbench run NAME``)."""
    mlperf_name: str
    """MLPerf ``submission_benchmark``."""
    ruleset: str
    """mlperf-logging compliance ruleset the logs are checked against."""
    description: str
    metric_name: str
    """Name of the quality metric in metrics.jsonl and on screen."""
    higher_is_better: bool
    presets: dict[str, Callable[[], RunConfig]]

    # -- config ---------------------------------------------------------------------------------
    def config(self, preset: str) -> RunConfig:
        if preset not in self.presets:
            raise ConfigError(f"benchmark '{self.name}' has no preset '{preset}'; presets: {', '.join(self.presets)}")
        return self.presets[preset]()

    def validate(self, cfg: RunConfig) -> None:
        """Raise ConfigError for combinations the loop cannot run."""
        # Data-parallel replicas: tensor-parallel ranks share their replica's batch.
        d, world = cfg.data, cfg.distributed.nproc // max(1, cfg.distributed.tp)
        if d.global_batch_size % world:
            raise ConfigError(f"data.global_batch_size={d.global_batch_size} is not divisible by {world} processes")
        per_rank = d.global_batch_size // world
        if per_rank % d.micro_batch_size:
            raise ConfigError(
                f"data.global_batch_size / processes = {per_rank} is not a multiple of "
                f"data.micro_batch_size={d.micro_batch_size}"
            )
        if cfg.perf.cuda_graphs and not cfg.perf.compile:
            raise ConfigError("perf.cuda_graphs=true replays the compiled step: it needs perf.compile=true")
        if cfg.perf.cuda_graphs and cfg.device == "cpu":
            raise ConfigError("perf.cuda_graphs=true needs a GPU (device=cuda or auto)")
        if cfg.perf.cuda_graphs and per_rank != d.micro_batch_size:
            # A replay reuses its memory, and with accumulation the gradients of the previous
            # micro-batch live there.
            raise ConfigError(
                "perf.cuda_graphs=true needs one micro-batch per rank per step (no accumulation): "
                f"set data.micro_batch_size={per_rank}"
            )

    def accumulation_steps(self, cfg: RunConfig) -> int:
        replicas = cfg.distributed.nproc // max(1, cfg.distributed.tp)
        return cfg.data.global_batch_size // (replicas * cfg.data.micro_batch_size)

    @abstractmethod
    def eval_every_samples(self, cfg: RunConfig) -> int:
        """The MLPerf eval cadence for this config (used when eval.every_samples is not set)."""

    def reached(self, metric: float, target: float) -> bool:
        return metric >= target if self.higher_is_better else metric <= target

    # -- building -------------------------------------------------------------------------------
    @abstractmethod
    def check_data(self, cfg: RunConfig) -> None:
        """Validate the data on disk (cheap: metadata only); raise DataError with what to do."""

    @abstractmethod
    def build_model(self, cfg: RunConfig) -> torch.nn.Module: ...

    def place(self, model: torch.nn.Module, cfg: RunConfig, info, bf16: bool) -> torch.nn.Module | None:
        """Put ``model`` on the rank's device with the benchmark's own parallelism (sharding, tensor
        parallelism) and return it; None (the default) lets the loop move it and wrap it in DDP."""
        return None

    def data_rank(self, cfg: RunConfig, info) -> tuple[int, int]:
        """(rank, ranks) among the data-parallel replicas: which share of each global batch this rank reads."""
        return info.rank, info.world_size

    @abstractmethod
    def build_optimizer(self, cfg: RunConfig, model: torch.nn.Module) -> torch.optim.Optimizer: ...

    @abstractmethod
    def lr_at(self, cfg: RunConfig, step: int) -> float: ...

    @abstractmethod
    def build_data(self, cfg: RunConfig, rank: int, world_size: int, start_sample: int = 0) -> BenchmarkData: ...

    # -- the step -------------------------------------------------------------------------------
    def to_device(self, batch: dict[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
        """A micro-batch (numpy arrays, or tensors that :func:`~trainbench.data.prefetch.pinned` put in page-locked
        memory, whose copies do not wait for the GPU) on ``device``."""
        return {k: torch.as_tensor(v).to(device, non_blocking=True) for k, v in batch.items()}

    @abstractmethod
    def loss_weights(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Counts the loss is normalised by (e.g. masked tokens, samples), as a 1-d tensor. The loop sums
        them over all micro-batches and ranks of a step, so the loss is the same for any split of the
        global batch."""

    @abstractmethod
    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
        """This micro-batch's share of the global-batch loss: its loss sums divided by ``weights``."""

    @abstractmethod
    def eval_sums(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Additive statistics of one eval batch (summed over batches and ranks)."""

    @abstractmethod
    def eval_metric(self, sums: torch.Tensor) -> float: ...

    def model_notes(self, cfg: RunConfig, device: torch.device, bf16: bool) -> list[str]:
        """Lines for the run's console on choices made for this machine (e.g. which kernel ``auto`` picked)."""
        return []

    # -- MLPerf ---------------------------------------------------------------------------------
    @abstractmethod
    def hyperparameters(self, cfg: RunConfig) -> dict[str, Any]:
        """Benchmark-specific MLPerf keys and values logged before run_start."""

    def waived_checks(self, cfg: RunConfig) -> frozenset[str]:
        """Closed-division compliance checks this config cannot pass because they fix the full benchmark's
        shape (sequence length, eval set size, schedule length); none by default."""
        return frozenset()

    def eval_metadata(self, samples: int) -> dict[str, Any]:
        return {"epoch_num": samples, "samples_count": samples}
