"""Placement of flux1's MMDiT (:class:`~trainbench.families.mmdit.model.Flux`), applied from outside the model: the
model's module keeps the architecture only, and its parameter names stay the reference's.

- One rank, no checkpointing: the whole model compiled as one graph (:func:`place_data_parallel`).
- Several ranks, or checkpointing: block by block, in the order FSDP2 expects: activation checkpointing
  (``perf.activation_checkpointing``: each block's activations recomputed in its backward), then ``torch.compile``
  per block, then FSDP2 (``fully_shard`` per block, then the whole) over all ranks, with bf16 parameters gathered
  and fp32 gradients reduced on CUDA. The whole model's training state (about 190 GB at FLUX.1-schnell's shape)
  then spreads over the ranks, and each block's parameters are whole only while it runs.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from trainbench.config import DistributedConfig, PerfConfig
from trainbench.distributed import DistInfo, Placed
from trainbench.families import fp8
from trainbench.families.data_parallel import place_data_parallel
from trainbench.families.decoder.placement import (
    BF16_REDUCE_NOTE,
    make_mesh,
    shard_blocks,
    sharded_comm_precision,
)
from trainbench.families.mmdit.model import Flux


def blocks_of(model: Flux) -> list[nn.Module]:
    return [*model.double_blocks, *model.single_blocks]


def _recomputed(forward, *args):
    return checkpoint(forward, *args, use_reentrant=False)


def checkpoint_blocks(model: Flux) -> None:
    """Each block's activations recomputed in its backward: the block's own ``forward`` run under non-reentrant
    checkpointing (an instance attribute, so the module and its parameter names are unchanged)."""
    for block in blocks_of(model):
        block.forward = functools.partial(_recomputed, block.forward)


def by_blocks(info: DistInfo, perf: PerfConfig) -> bool:
    """Whether the model is placed block by block (FSDP2 over several ranks, or checkpointing), not as one graph."""
    return perf.activation_checkpointing or info.world_size > 1


def in_fp8(name: str) -> bool:
    """The linear layers that train in FP8 under ``model.precision=fp8``: the blocks' attention and MLP layers, not
    their modulation (a row per sample: a cast of its weight would cost more than the product saves)."""
    return name.startswith(("double_blocks.", "single_blocks.")) and not name.endswith(("_mod.lin", "modulation.lin"))


def place_flux(model: Flux, info: DistInfo, dist_cfg: DistributedConfig, perf: PerfConfig, bf16: bool) -> Placed:
    """``model`` (on the CPU, initialised) placed on ``info``'s device as the module docstring says; under
    ``model.precision=fp8`` its blocks' layers (:func:`in_fp8`) swapped for torchao's float8 training first, before
    compilation and FSDP2, as torchao expects."""
    sharded, in_fp8_blocks = info.world_size > 1, model.cfg.precision == "fp8"
    if in_fp8_blocks:
        fp8.min_capability(info.device)
        fp8.train_blocks_in_fp8(model, sharded=sharded, in_blocks=in_fp8)
    if not by_blocks(info, perf):
        placed = place_data_parallel(model, info, dist_cfg, perf, bucket_clip_norm=None)
    else:
        notes = []
        if perf.activation_checkpointing:
            checkpoint_blocks(model)
            notes.append(f"activation checkpointing on all {len(blocks_of(model))} blocks")
        if perf.compile:
            for block in blocks_of(model):
                block.compile(dynamic=False)
        mixed = bf16 and info.device.type == "cuda"
        reduce_bf16 = sharded and dist_cfg.grad_reduce_dtype == "bf16"
        if sharded:
            mesh = make_mesh(info.device.type, info.world_size, 1)["dp"]
            shard_blocks(model, blocks_of(model), mesh, mixed, reduce_bf16=reduce_bf16)
            notes.append(f"FSDP2 over {info.world_size} ranks, each block's parameters gathered as it runs "
                         f"({'bf16' if mixed else 'fp32'} gathers, {'bf16' if reduce_bf16 else 'fp32'} gradient "
                         "reduction)")  # fmt: skip
            if reduce_bf16:
                notes.append(BF16_REDUCE_NOTE)
        module = model.to(info.device)
        comm = sharded_comm_precision(info.world_size, mixed, sharded and in_fp8_blocks, reduce_bf16)
        placed = Placed(module=module, model=module, notes=notes, comm_precision=comm)
    if in_fp8_blocks:
        fp8.finish_placement(placed, sharded, "the modulation, the embedders and the last layer")
        if not sharded and not perf.cuda_graphs:  # (sharded: FSDP2's gathers cast once a step, fp8.precompute_scales)
            # (the hook on placed.model: the compiled wrapper where the whole model is one graph)
            fp8.cast_placed_weights_once_a_step(placed, placed.model, perf.compile and info.device.type == "cuda")
    return placed
