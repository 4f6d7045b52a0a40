"""What every benchmark's data hands the training loop: optimizer steps of micro-batches, cut the same way.

The sample order is a function of the seed alone: global batch k is samples [k*B, (k+1)*B) of the run's stream,
rank r of R data-parallel ranks owns the contiguous share [r*B/R, (r+1)*B/R) of it, cut into micro-batches in
order. So 1 rank at batch B and R ranks at B/R train on the same samples. The eval set is split the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


class Step(list):
    """One optimizer step: this rank's micro-batches (dicts of arrays), and ``samples``, the number of samples in
    the whole global batch (all ranks; a packed row holds several)."""

    def __init__(self, micro_batches: Iterable[dict[str, Any]] = (), samples: int = 0):
        super().__init__(micro_batches)
        self.samples = samples

    @classmethod
    def split(cls, arrays: dict[str, Any], micro_batch_size: int, samples: int) -> Step:
        """This rank's share of a global batch (arrays of equal length) cut into micro-batches, in order."""
        n = len(next(iter(arrays.values())))
        return cls(({k: v[i : i + micro_batch_size] for k, v in arrays.items()} for i in range(0, n, micro_batch_size)),
                   samples)  # fmt: skip


def rank_share(global_batch_size: int, rank: int, world_size: int) -> range:
    """The positions of a global batch that data-parallel ``rank`` owns (rank-major)."""
    per_rank, remainder = divmod(global_batch_size, world_size)
    assert remainder == 0, "the config checks that the ranks divide the global batch"
    return range(rank * per_rank, (rank + 1) * per_rank)


def eval_share(total: int, rank: int, world_size: int) -> range:
    """The eval samples of ``rank``: a contiguous share of ``total``, the remainder spread over the ranks."""
    return range(total * rank // world_size, total * (rank + 1) // world_size)


def batched(indices: Sequence[int], batch_size: int) -> list[range]:
    """``indices`` (a range) in consecutive batches of ``batch_size``, the last one shorter."""
    return [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]


class CycledSteps:
    """Optimizer steps forever over a few global batches made up front (``pool``: arrays of ``global_batch`` rows
    each), taken in turn: the throughput measurement's data, shaped like the benchmark's and cut like every reader's
    (this rank's share, in micro-batches), with no reading from disk in the timed steps. ``samples``: the samples a
    global batch holds (default: one a row; a packed row holds several)."""

    def __init__(self, pool: list[dict[str, Any]], global_batch: int, micro_batch: int, rank: int, world_size: int,
                 samples: int | None = None) -> None:  # fmt: skip
        share = rank_share(global_batch, rank, world_size)
        self.pool = [{k: v[share.start : share.stop] for k, v in batch.items()} for batch in pool]
        self.micro_batch, self.samples = micro_batch, global_batch if samples is None else samples

    def __iter__(self):
        k = 0
        while True:
            yield Step.split(self.pool[k % len(self.pool)], self.micro_batch, self.samples)
            k += 1
