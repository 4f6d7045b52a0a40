"""One optimizer step: forward and backward of every micro-batch, gradient reduction, the optimizer update."""

from __future__ import annotations

import contextlib

import torch

from trainbench.benchmarks.base import Benchmark
from trainbench.distributed import DistInfo, Placed, all_reduce_sum


class StepTotals:
    """The loss summed over steps since the last log point, and whether any was not finite: both stay on the device,
    since reading them is a host sync."""

    def __init__(self, device: torch.device):
        self.loss_sum = torch.zeros((), device=device)
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=device)


def train_step(bench: Benchmark, placed: Placed, optimizer: torch.optim.Optimizer, micro_batches: list,
               lr: float, info: DistInfo, autocast, totals: StepTotals) -> None:  # fmt: skip
    for group in optimizer.param_groups:
        group["lr"] = lr
    batches = [bench.to_device(mb, info.device) for mb in micro_batches]
    # Normalise by counts over the whole global batch (all micro-batches, all ranks), so the gradient is that of
    # the global-batch loss whatever the split; the data-parallel reduction then averages over ranks, which the
    # factor world_size undoes.
    weights = all_reduce_sum(sum(bench.loss_weights(b) for b in batches), info)
    if placed.before_step is not None:
        placed.before_step(batches)
    for i, batch in enumerate(batches):
        last = i == len(batches) - 1
        if placed.mark_cuda_graph_steps:
            # A new step: the previous replay's outputs are used up.
            torch.compiler.cudagraph_mark_step_begin()
        # Gradients are reduced once per step, with the last micro-batch's backward (where the placement can defer
        # them: Placed.no_sync, around the forward and the backward).
        with contextlib.nullcontext() if last else placed.no_sync():
            with autocast:
                loss = bench.loss(placed.model, batch, weights) * info.world_size
            loss.backward()
        totals.loss_sum += loss.detach() / info.world_size
        totals.nonfinite |= ~torch.isfinite(loss.detach())
    optimizer.step()
    if placed.rearrange is not None:
        placed.rearrange(optimizer, False)
    if placed.after_step is not None:
        placed.after_step()
    optimizer.zero_grad(set_to_none=True)
