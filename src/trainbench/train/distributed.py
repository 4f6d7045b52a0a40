"""Process-group set-up. One rank is the same code path as many: every helper is a no-op at world size 1."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from trainbench.errors import ConfigError


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    local_world_size: int = 1  # ranks on this node

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def one_node(self) -> bool:
        return self.local_world_size >= self.world_size


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


def ranks_on_this_node(env: Mapping[str, str], world: int) -> int:
    """Ranks of a job of ``world`` that share this node: torchrun's LOCAL_WORLD_SIZE, or under srun the job's tasks
    over its nodes."""
    nodes = int(env.get("SLURM_NNODES", "1"))
    return min(world, int(env.get("LOCAL_WORLD_SIZE", str(max(1, world // nodes)))))


def init_distributed(device_kind: str, backend: str) -> DistInfo:
    """Read torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE), or Slurm's (SLURM_PROCID, SLURM_LOCALID,
    SLURM_NTASKS) for a task started by srun, and join the process group (MASTER_ADDR/MASTER_PORT)."""
    env = os.environ
    world = int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", "1")))
    rank = int(env.get("RANK", env.get("SLURM_PROCID", "0")))
    local_rank = int(env.get("LOCAL_RANK", env.get("SLURM_LOCALID", "0")))
    local_world = ranks_on_this_node(env, world)
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
    return DistInfo(rank, local_rank, world, device, local_world)


def split_compiled_graph(overlap: str, info: DistInfo) -> bool:
    """Whether dynamo splits a compiled DDP model at its bucket boundaries (``distributed.overlap_compiled``).
    Split, each bucket's all-reduce overlaps the rest of backward, but backward's GEMMs then run beside NCCL's
    kernels and the graph's fusions stop at every split; over one node's NVLink one graph that all-reduces after
    backward is faster (2 and 4 H200, docs/performance.md). Across nodes the all-reduce is slower and overlapping
    it is kept."""
    if overlap == "auto":
        return not info.one_node
    return overlap == "true"


def all_reduce_sum(tensor: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


@dataclass(frozen=True)
class ReduceSettings:
    clip_norm: float | None  # bucket-wise clipping threshold; None: no clipping in the hook
    bf16: bool  # all-reduce in bf16


def reduce_gradients(settings, bucket):  # no annotations: DDP checks them and these would be strings
    """DDP comm hook (settings: ReduceSettings, bucket: dist.GradBucket) -> Future: optional bucket-wise
    clipping (:func:`clip_bucket`), then the average over the ranks in fp32 or bf16."""
    if settings.clip_norm:
        clip_bucket(bucket.buffer(), settings.clip_norm)
    if settings.bf16:
        return default_hooks.bf16_compress_hook(None, bucket)
    return default_hooks.allreduce_hook(None, bucket)


def clip_bucket(grad: torch.Tensor, max_norm: float) -> None:
    """Clip this rank's bucket to L2 norm ``max_norm`` before the all-reduce, in place.

    Bucket-wise clipping before all-reduce (Kim et al., "Breaking MLPerf Training: A Case Study on
    Optimizing BERT", 2024). The reference clips the averaged gradient by its global norm, which has to
    wait for the last bucket; here every bucket is clipped on its own as soon as backward fills it, so the
    all-reduce keeps overlapping backward and the optimizer needs no norm over everything. Each rank's
    gradient is scaled to be its own estimate of the full-batch gradient, so where no bucket exceeds
    ``max_norm`` on any rank this is exactly the average the reference clips; it differs in what is
    clipped (a part of one rank's estimate, not the whole average) whenever a bucket is over.
    """
    norm = torch.linalg.vector_norm(grad, dtype=torch.float32)
    grad.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0).to(grad.dtype))


def wrap_ddp(model: torch.nn.Module, info: DistInfo, bucket_cap_mb: float, reduce: ReduceSettings):
    """DDP with ``bucket_cap_mb`` buckets (each all-reduced while backward goes on), and our comm hook
    where clipping or bf16 reduction is asked for (:func:`reduce_gradients`)."""
    ddp = DistributedDataParallel(
        model,
        device_ids=[info.device.index] if info.device.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=True,
    )
    if reduce.clip_norm or reduce.bf16:
        ddp.register_comm_hook(reduce, reduce_gradients)
    return ddp


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
