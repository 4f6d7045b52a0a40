"""What a decoder's blocks keep for their backward, applied by the placement from outside the blocks.

A block keeps its activations (autograd's saved tensors) on the GPU from its forward until its backward; or is
recomputed (activation checkpointing: it keeps its input and runs its forward again in the backward); or keeps them
in pinned host memory (:mod:`trainbench.families.decoder.offload`); a recomputed block's input may wait there too.
The placement chooses for each block from the perf keys (``perf.activation_checkpointing``,
``perf.recompute_blocks``, ``perf.offload_blocks``, ``perf.offload_recomputed_inputs``: :func:`recompute_and_offload`).

The block's module stays the architecture alone: :func:`~trainbench.families.decoder.offload.run_from_outside` sets
its ``forward`` as an instance attribute (a ``functools.partial`` of ``offload._run`` around the block's own
forward), so its parameter names and state-dict keys are unchanged, and ``torch.compile`` of the block
(``nn.Module.compile``, which compiles the call that looks ``forward`` up) and FSDP2's hooks (around that call) see it
as they saw the block's own forward: the recomputed region lies inside the sharding wrapper's gather and cast, which
run again for the recomputation. Two instance attributes say what a block does: ``checkpointing`` (recomputed) and
``saved_to_host`` (the :class:`~trainbench.families.decoder.offload.HostOffload` keeping its saved tensors in host
memory, or None).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from trainbench.config import PerfConfig
from trainbench.distributed import Placed
from trainbench.families.decoder.offload import offload_blocks, placed_from_outside, run_from_outside


def _blocks(model_or_blocks: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    blocks = list(model_or_blocks.model.layers) if isinstance(model_or_blocks, nn.Module) else list(model_or_blocks)
    for block in blocks:
        if not placed_from_outside(block):
            run_from_outside(block)
    return blocks


def recompute(model: nn.Module, flags: Sequence[bool]) -> None:
    """Activation checkpointing on the blocks of ``model`` (a :class:`~trainbench.families.decoder.model.DecoderLM`)
    whose flag is set, none on the others."""
    blocks = _blocks(model)
    for block, flag in zip(blocks, flags, strict=True):
        block.checkpointing = flag


def recompute_all(model: nn.Module, checkpointing: bool) -> None:
    """Activation checkpointing on every block of ``model``, or on none."""
    recompute(model, [checkpointing] * len(model.model.layers))


def recompute_last(model: nn.Module, count: int) -> None:
    """Activation checkpointing on the last ``count`` blocks only; the others keep their activations (faster, more
    memory). The first ones keep theirs: backward frees them last, and nothing is gained by which ones."""
    layers = len(model.model.layers)
    recompute(model, [i >= layers - count for i in range(layers)])


def recompute_spread(model: nn.Module, count: int) -> list[int]:
    """Activation checkpointing on ``count`` blocks chosen so that the others are spread evenly over the depth (the
    k-th of them at k x blocks / others); returns the recomputed blocks. For host offload: the blocks whose saved
    tensors cross the host link are then spread over the whole forward and backward, not packed into their first
    part (where the copies outrun the link and stall the step)."""
    layers = len(model.model.layers)
    others = layers - count
    keep = {k * layers // others for k in range(others)}
    recompute(model, [i not in keep for i in range(layers)])
    return [i for i in range(layers) if i not in keep]


def recompute_and_offload(placed: Placed, perf: PerfConfig, device: torch.device) -> Placed:
    """``perf.recompute_blocks``: activation checkpointing on the last N blocks only, or with ``perf.offload_blocks``
    on N blocks spread over the depth among the others; ``perf.offload_blocks``: of the others, N (spread evenly)
    keep their saved activations in host memory. (``perf.activation_checkpointing`` alone, on every block, the
    placement applies with the blocks' compilation.)"""
    count, layers = perf.recompute_blocks, len(placed.module.model.layers)
    if perf.activation_checkpointing and count:
        if perf.offload_blocks:
            chosen = recompute_spread(placed.module, count)
            placed.notes.append(f"activation checkpointing on {count} of {layers} blocks, spread among "
                                f"those offloaded: {_ranges(chosen)}")  # fmt: skip
        else:
            recompute_last(placed.module, count)
            placed.notes.append(f"activation checkpointing on the last {count} of {layers} blocks")
    if perf.offload_blocks or perf.offload_recomputed_inputs:
        inputs = perf.offload_recomputed_inputs
        offload = offload_blocks(_blocks(placed.module), perf.offload_blocks, device, inputs)
        which = " (of the recomputed ones, their input)" if inputs else ""
        placed.notes.append(f"saved activations of blocks {_ranges(offload.offloaded)} kept in host memory between "
                            f"forward and backward{which}")  # fmt: skip
    return placed


def _ranges(indices: list[int]) -> str:
    """0, 2, 4-9: sorted block indices, runs of consecutive ones as a range."""
    out: list[str] = []
    for i in indices:
        if out and "-" not in out[-1] and int(out[-1]) == i - 1:
            out[-1] = f"{out[-1]}-{i}"
        elif out and "-" in out[-1] and int(out[-1].split("-")[1]) == i - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out)


def kept_blocks(perf: PerfConfig, num_layers: int) -> int:
    """How many of ``num_layers`` blocks keep their activations (are not recomputed) under ``perf``."""
    if not perf.activation_checkpointing:
        return num_layers
    return num_layers - (perf.recompute_blocks or num_layers)
