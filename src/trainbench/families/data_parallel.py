"""Data parallelism and compilation for a model every rank holds whole (BERT's, or a benchmark's of one's own that
fits on one device), applied from outside the model: the model's module keeps the architecture only.

:func:`place_data_parallel` moves the model to its rank's device, wraps it in DDP where there are several ranks
(buckets of ``distributed.bucket_cap_mb``, bucket-wise clipping or a bf16 all-reduce through a comm hook) and compiles
it: one graph that all-reduces after backward, or the graph split at the buckets so each all-reduce overlaps
backward (``distributed.overlap_compiled``), with CUDA graphs on request (``perf.cuda_graphs``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from trainbench.config import DistributedConfig, PerfConfig
from trainbench.distributed import DistInfo, Placed
from trainbench.errors import ConfigError


def place_data_parallel(model: torch.nn.Module, info: DistInfo, dist_cfg: DistributedConfig, perf: PerfConfig,
                     bucket_clip_norm: float | None) -> Placed:  # fmt: skip
    """``model`` (on the CPU) placed on ``info``'s device, DDP-wrapped across ranks and compiled as ``perf`` asks.
    ``bucket_clip_norm``: clip each DDP bucket to this norm before its all-reduce (None: the optimizer clips)."""
    if bucket_clip_norm is not None and info.world_size == 1:
        raise ConfigError("optimizer.clip=bucket clips before the all-reduce: it needs more than one rank")
    module = model.to(info.device)
    ddp = None
    if info.world_size > 1:
        reduce = ReduceSettings(clip_norm=bucket_clip_norm, bf16=dist_cfg.grad_reduce_dtype == "bf16")
        ddp = wrap_ddp(module, info, dist_cfg.bucket_cap_mb, reduce)
    called = ddp or module
    notes = []
    if perf.compile:
        # Under DDP, dynamo splits the graph at bucket boundaries (so each bucket's all-reduce overlaps backward)
        # unless told not to. Static shapes: one graph per shape (packed rows: one; length bins: one per bin).
        split = split_compiled_graph(dist_cfg.overlap_compiled, info)
        torch._dynamo.config.optimize_ddp = split
        if ddp is not None:
            how = ("the compiled graph split at the DDP buckets, each all-reduce overlapping backward" if split
                   else "one compiled graph, the DDP buckets all-reduced after backward")  # fmt: skip
            notes.append(f"{how} (distributed.overlap_compiled={dist_cfg.overlap_compiled})")
        called = torch.compile(called, mode="reduce-overhead" if perf.cuda_graphs else None, dynamic=False)
    return Placed(
        module=module,
        model=called,
        no_sync=ddp.no_sync if ddp is not None else contextlib.nullcontext,
        mark_cuda_graph_steps=perf.cuda_graphs,
        notes=notes,
        comm_precision="bfloat16" if ddp is not None and reduce.bf16 else "fp32",
    )


def split_compiled_graph(overlap: str, info: DistInfo) -> bool:
    """Whether dynamo splits a compiled DDP model at its bucket boundaries (``distributed.overlap_compiled``).
    Split, each bucket's all-reduce overlaps the rest of backward, but backward's GEMMs then run beside NCCL's
    kernels and the graph's fusions stop at every split; over one node's NVLink one graph that all-reduces after
    backward is faster (2 and 4 H200, docs/performance.md). Across nodes the all-reduce is slower and overlapping
    it is kept."""
    if overlap == "auto":
        return not info.one_node
    return overlap == "true"


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
