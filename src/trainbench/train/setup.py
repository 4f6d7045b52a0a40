"""Building a run: seed, model, its placement, optimizer, schedule bounds, resume state and data."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainbench.benchmarks.base import Benchmark, BenchmarkData
from trainbench.config import RunConfig
from trainbench.distributed import DistInfo, Placed, keep_gathered, reduce_once_a_step
from trainbench.errors import ConfigError
from trainbench.mlperf import constants
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
    disclosure: dict[str, Any]  # what the run ran in and how it was laid out (run_disclosure)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def uses_bf16(cfg: RunConfig, device: torch.device) -> bool:
    return cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")


# Modules whose matrix products run in FP8: torchao's float8 training, and the FP8 frozen base (families/fp8.py).
FP8_LINEAR_CLASSES = ("Float8Linear", "Fp8Linear")
PRECISION_NAMES = {torch.float32: "fp32", torch.bfloat16: "bfloat16", torch.float16: "fp16", torch.float64: "fp64"}


def limit_gpu_memory(cfg: RunConfig, device: torch.device) -> None:
    """``perf.gpu_memory_gib``: the allocator may hold no more than a GPU of that size would have free, what this
    GPU has taken outside the allocator (the CUDA context, libraries' buffers) counted as taken there too."""
    cap = cfg.perf.gpu_memory_gib
    if cap is None:
        return
    if device.type != "cuda":
        raise ConfigError(f"perf.gpu_memory_gib={cap:g} limits a GPU's memory, and this run is on {device.type}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    if cap * 2**30 > total:
        raise ConfigError(f"perf.gpu_memory_gib={cap:g} is more than this GPU has ({total / 2**30:.1f} GiB); leave it "
                          "unset to use the whole GPU")  # fmt: skip
    outside = total - free - torch.cuda.memory_reserved(index)
    torch.cuda.set_per_process_memory_fraction(max(0.0, cap * 2**30 - outside) / total, index)


def run_disclosure(cfg: RunConfig, placed: Placed, bf16: bool, info: DistInfo) -> dict[str, Any]:
    """MLPerf's keys of what the run ran in and how it was laid out (ruleset 6.x), read off the placed model: the
    lowest precision of its linear layers (fp8 where a layer of FP8_LINEAR_CLASSES runs, the autocast type under
    bf16, else the weights' own), of its attention (the autocast type, else the weights'), of its collectives (what
    the placement set up; fp32 on one rank); the parallel degrees it was placed with (trainbench has tensor
    and expert parallelism; no pipeline or context parallelism); the micro-batch each rank trains; the config file."""
    modules = list(placed.module.modules())
    weights = {w.dtype for m in modules if isinstance(w := getattr(m, "weight", None), torch.Tensor)
               and isinstance(m, torch.nn.Linear) and w.is_floating_point()}  # fmt: skip
    # (an FP8 base's weights are parameters where they are sharded: attention never runs in them)
    floats = {p.dtype for p in placed.module.parameters() if p.is_floating_point() and p.dtype in PRECISION_NAMES}
    lowest = lambda dtypes: PRECISION_NAMES[min(dtypes or {torch.float32}, key=lambda t: t.itemsize)]  # noqa: E731
    if any(type(m).__name__ in FP8_LINEAR_CLASSES for m in modules):
        linear = "fp8"
    else:
        linear = "bfloat16" if bf16 else lowest(weights)
    return {
        constants.LOWEST_NUMERICAL_PRECISION_IN_LINEAR: linear,
        constants.LOWEST_NUMERICAL_PRECISION_IN_ATTN: "bfloat16" if bf16 else lowest(floats),
        constants.LOWEST_NUMERICAL_PRECISION_IN_COMM: placed.comm_precision if info.world_size > 1 else "fp32",
        constants.TENSOR_PARALLELISM: max(1, cfg.distributed.tp) if info.world_size > 1 else 1,
        constants.PIPELINE_PARALLELISM: 1,
        constants.CONTEXT_PARALLELISM: 1,
        constants.EXPERT_PARALLELISM: cfg.distributed.ep if info.world_size > 1 else 1,
        constants.MICRO_BATCH_SIZE: cfg.data.micro_batch_size,
        constants.CONFIG_FILENAME: cfg.output.config_filename or cfg.preset,
    }


def build_run(cfg: RunConfig, bench: Benchmark, info: DistInfo, ckpt: Path | None, synthetic: bool = False) -> RunSetup:
    """Everything a run trains with, from the config (and the checkpoint ``ckpt`` it continues, if any);
    ``synthetic``: on the benchmark's rows made in memory (``bench_data``, a throughput measurement's)."""
    if info.world_size != cfg.distributed.world_size:
        d = cfg.distributed
        raise ConfigError(
            f"the config says {d.world_size} ranks ({d.nodes} nodes x distributed.nproc={d.nproc}) but this job runs "
            f"{info.world_size}; set distributed.nodes and nproc to its layout"
        )
    limit_gpu_memory(cfg, info.device)
    bf16 = uses_bf16(cfg, info.device)
    seed_everything(cfg.seed)
    placed = bench.family.place(bench.family.build_model(cfg), cfg, info, bf16)
    if cfg.distributed.reduce_once_a_step:  # any family's FSDP2 (a layout without it says so)
        reduce_once_a_step(placed)
    if cfg.distributed.keep_gathered:  # (over reduce_once_a_step's context, where both are on)
        keep_gathered(placed)
    optimizer = bench.build_optimizer(cfg, placed.module)
    eval_every = cfg.eval.every_samples or bench.eval_every_samples(cfg)
    first_eval = bench.first_eval_samples(cfg, eval_every)
    state = checkpoint.LoopState(next_eval=first_eval)
    if ckpt is not None:
        state = checkpoint.load(ckpt, placed.module, optimizer, info)
        state.resumed += 1
    # The data stream is in rows: step x GBS of them were consumed (a packed row holds several samples).
    data_rank, data_ranks = bench.family.data_rank(cfg, info)
    if synthetic:
        data = bench.bench_data(cfg, data_rank, data_ranks)
    else:
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
        disclosure=run_disclosure(cfg, placed, bf16, info),
    )
