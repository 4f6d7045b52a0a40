"""What several GPUs of one node add to one GPU's step at the same shape, for the forecast `trainbench bench --nproc N`
makes from one GPU's measured step (measure/forecast.py): the collectives no compute hides and the copies one GPU
does not make, in seconds a step, by what. Each family says which of these its placement pays
(:meth:`~trainbench.families.base.ModelFamily.node_costs`); the rates are the planner's (families/planner.py), so a
family that plans its layout and one that does not count the same collective alike.

Not counted anywhere here: the compute's own slowdown beside NCCL's kernels (on 2 H200, flux1's FP8 GEMMs ran 8 %
slower while FSDP2's gathers ran beside them, docs/flux1.md) and clocks that differ between the GPUs: the forecast is
an upper bound where those are large, and its miss says how large they were.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

from trainbench.families.planner import NODE_COLLECTIVE_BYTES_S, BlockProbe, sharded

# Master weights, their gradients and the optimizer's state are fp32 (4 bytes a parameter) in every family here.
MASTER_BYTES = 4


@dataclasses.dataclass(frozen=True)
class OneGpu:
    """One GPU's measured step at a shape (``trainbench bench`` on one GPU), and the parameters of its model."""

    step_s: float  # a step, as timed
    micro_batches: int  # micro-batches in that step
    block_params: int  # trained parameters in the blocks (what FSDP2 shards a unit each)
    other_params: int  # trained parameters outside the blocks (embeddings, the output layer, norms)
    expert_params: int = 0  # of ``block_params``, those in a mixture's experts (spread by expert parallelism)
    device_copy_bytes_s: float | None = None  # the GPU's own memory copy rate (None: not measured)
    gpu_name: str = "GPU"
    measured_at: str = ""  # when (UTC, ISO 8601)
    # A mixture's tokens each expert got, per block, in the one GPU's untimed eval pass (None: no experts)
    expert_loads: list[list[int]] | None = None
    # What the family timed on this GPU for its own costs on several (ModelFamily.one_gpu_rates), seconds by what
    family_rates: dict[str, float] | None = None


def reduce_bytes(distributed) -> int:
    """Bytes a parameter's gradient takes on the wire under ``distributed`` (the config's section): 2 where
    ``grad_reduce_dtype`` is bf16, else 4 (fp32)."""
    return 2 if distributed.grad_reduce_dtype == "bf16" else 4


def all_reduce_s(nbytes: float, ranks: int) -> float:
    """An all-reduce of ``nbytes`` over ``ranks`` GPUs of one node: each sends 2 (ranks - 1) / ranks of it (a ring) at
    the planner's :data:`~trainbench.families.planner.NODE_COLLECTIVE_BYTES_S`."""
    return nbytes * 2 * (ranks - 1) / ranks / NODE_COLLECTIVE_BYTES_S


def replicated(one: OneGpu, ranks: int, reduce_bytes: int, overlapped_bytes: float | None) -> dict[str, float]:
    """A replica on each GPU (DDP): every trained parameter's gradient all-reduced once a step (the micro-batches
    before the last accumulate without it), ``reduce_bytes`` a parameter (4: fp32, 2: bf16). ``overlapped_bytes``:
    where the all-reduce runs bucket by bucket beside the backward (eager DDP, or a compiled graph split at the
    buckets), what is left after the backward is the last bucket, of that many bytes; None: one compiled graph
    all-reduces every bucket after its backward, all of it exposed. DDP's buckets are views of the gradients
    (``gradient_as_bucket_view``): no copies."""
    total = (one.block_params + one.other_params) * reduce_bytes
    exposed = total if overlapped_bytes is None else min(total, overlapped_bytes)
    return {"exposed communication": all_reduce_s(exposed, ranks)}


def fully_sharded(one: OneGpu, ranks: int, micro_batches: int, reduce_bytes: int, gathered_as: int,
                  reduce_once_a_step: bool = False, keep_gathered: bool = False, outer_kept: bool = False,
                  head_apart: bool = False, params: int | None = None) -> dict[str, float]:  # fmt: skip
    """FSDP2 over the ``ranks`` GPUs, a unit a block: the planner's model of a sharded step
    (:func:`~trainbench.families.planner.sharded`) over the blocks' ``params`` trained parameters (all of them where
    None) and the rest outside them: the rest's gathers and reduce-scatters, which no block's compute hides, and
    FSDP2's own copies, casts and adds of every block's, which one GPU does not make; ``micro_batches`` a step of
    each rank. The blocks' own collectives overlap their neighbours' compute and are not counted."""
    blocks = one.block_params if params is None else params
    probe = BlockProbe(kept_bytes=0, input_bytes=0, block_weight_bytes=blocks * MASTER_BYTES,
                       other_weight_bytes=one.other_params * MASTER_BYTES, optimizer_bytes_per_block=0,
                       working_bytes=0, forward_s=0.0, backward_s=0.0, head_s=0.0, to_host_bytes_s=1.0,
                       to_gpu_bytes_s=1.0, device_copy_bytes_s=one.device_copy_bytes_s)  # fmt: skip
    s = sharded(probe, ranks, reduce_once_a_step, reduce_bytes, micro_batches, gathered_as if keep_gathered else 0,
                gathered_as, outer_kept, head_apart)  # fmt: skip
    out = {"exposed communication": s.exposed_comm_s * micro_batches}
    if one.device_copy_bytes_s:
        out["FSDP2's copies"] = s.shard_copy_s * micro_batches
    return out


# The bytes a cast of the experts' bf16 weights to FP8 moves a parameter (moe_fp8.fp8_weight_casts, made in the
# forward and again in the backward where no cast is kept): the forward's amax read (2), the cast's read and write
# (2 + 1) and its column-major copy (1 + 1); the backward's amax read, read and write (2 + 2 + 1).
EXPERT_CAST_BYTES = 12


def weight_casts_s(params: int, casts: float, copy_bytes_s: float, nbytes: int = EXPERT_CAST_BYTES) -> float:
    """``casts`` casts of ``params`` weights, ``nbytes`` read or written a parameter each, at a GPU's memory rate (twice
    its ``copy_bytes_s``: a copy reads and writes each byte)."""
    return params * nbytes * casts / (2 * copy_bytes_s)


def all_to_all_s(rows: int, width: int, top_k: int, blocks: int, ranks: int, nbytes: int = 2,
                 fp8_halves: bool = False) -> float:  # fmt: skip
    """A mixture's exchange over ``ranks`` GPUs of one node, a micro-batch: in each of ``blocks`` blocks each of the
    rank's ``rows`` tokens goes to ``top_k`` experts and comes back (two all-to-alls forward, two again in the
    backward), ``width`` values of ``nbytes`` each (``fp8_halves``: two of the four at a byte a value and one a row);
    with the experts spread evenly, (ranks - 1) / ranks of them leave the GPU. Nothing computes beside the exchange
    (the experts wait for their rows): all of it exposed."""
    row_bytes = 4 * width * nbytes if not fp8_halves else 2 * width * nbytes + 2 * (width + 1)
    sent = rows * top_k * row_bytes * (ranks - 1) / ranks
    return blocks * sent / NODE_COLLECTIVE_BYTES_S


def micro_batches(cfg, ranks: int) -> int:
    """Micro-batches a step of each of ``ranks`` ranks."""
    return max(1, cfg.data.global_batch_size // (cfg.data.micro_batch_size * ranks))


def busiest_rank_s(loads: list[list[int]], ranks: int, experts_s: float,
                   deal: Callable[[list[int], int], list[int]] | None = None) -> float:  # fmt: skip
    """The wait for a mixture's busiest rank, a step: with the experts spread evenly over ``ranks`` GPUs (rank j holds
    the j-th contiguous share of each block's slots: expert i in slot i, or in ``deal(block's loads, ranks)[i]``),
    each block's exchange waits for the rank whose experts got the most of the tokens ``loads`` counts (per block, per
    expert), and every other rank waits that much beyond the mean. ``experts_s``: the experts' compute of one GPU's
    step at the mean load, spread evenly over the blocks."""
    waits = [busiest_over_mean(block, deal(block, ranks) if deal else range(len(block)), ranks) - 1 for block in loads]
    return experts_s * sum(waits) / len(loads) if loads else 0.0


def busiest_over_mean(loads: Sequence[float], slot_of: Iterable[int], ranks: int) -> float:
    """The most loaded rank's tokens over the ranks' mean, with expert i of ``loads`` in slot ``slot_of[i]`` (rank j
    holds the j-th contiguous share of the slots); 1: even, or no token at all."""
    share, per_rank = len(loads) // ranks, [0.0] * ranks
    for expert, slot in enumerate(slot_of):
        per_rank[slot // share] += loads[expert]
    mean = sum(per_rank) / ranks
    return max(per_rank) / mean if mean else 1.0
