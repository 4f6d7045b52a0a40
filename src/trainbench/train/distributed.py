"""Process-group set-up. One rank is the same code path as many: every helper is a no-op at world size 1."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainbench.errors import ConfigError


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda was asked for but no CUDA device is visible; use device=cpu")
    return requested


def available_slots(device: str) -> int:
    """How many ranks this node can hold: GPUs on CUDA, usable cores on CPU."""
    if device == "cuda":
        return torch.cuda.device_count()
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def init_distributed(device_kind: str, backend: str) -> DistInfo:
    """Read torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE), or Slurm's (SLURM_PROCID, SLURM_LOCALID,
    SLURM_NTASKS) for a task started by srun, and join the process group (MASTER_ADDR/MASTER_PORT)."""
    env = os.environ
    world = int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", "1")))
    rank = int(env.get("RANK", env.get("SLURM_PROCID", "0")))
    local_rank = int(env.get("LOCAL_RANK", env.get("SLURM_LOCALID", "0")))
    nodes = int(env.get("SLURM_NNODES", "1"))
    local_world = int(env.get("LOCAL_WORLD_SIZE", str(max(1, world // nodes))))
    if world > 1:
        # torch reads these from the environment; under srun they come from SLURM_* instead.
        env.setdefault("RANK", str(rank))
        env.setdefault("WORLD_SIZE", str(world))
        env.setdefault("LOCAL_RANK", str(local_rank))
    if device_kind == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        # Ranks on one node share its cores; without this each would start a thread per core.
        torch.set_num_threads(max(1, available_slots("cpu") // local_world))
    if world > 1 and not dist.is_initialized():
        if backend == "auto":
            backend = "nccl" if device_kind == "cuda" else "gloo"
        dist.init_process_group(backend=backend, device_id=device if device_kind == "cuda" else None)
    return DistInfo(rank, local_rank, world, device)


def all_reduce_sum(tensor: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
