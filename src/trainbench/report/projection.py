"""Projected time to train: samples to target from mlperf-logging's reference convergence points at a global batch,
divided by a measured training rate, plus every eval the MLPerf cadence runs on the way at a measured eval time.

A projection, not a result: a real run's samples to target vary from seed to seed around the reference mean (and a
submission's mean must not beat it by more than the RCP check allows).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from trainbench.benchmarks import get_benchmark
from trainbench.mlperf import reference_convergence, reference_means


@dataclass(frozen=True)
class Projection:
    benchmark: str
    global_batch_size: int
    samples_to_target: float
    """The reference mean at this batch (interpolated between ``between`` where there is no point at it)."""
    between: tuple[int, int] | None
    evals: int
    """Evals run until the one that sees the target: the first at ``first_eval_samples``, then every
    ``eval_every_samples``."""
    first_eval_samples: int
    eval_every_samples: int
    train_minutes: float
    eval_minutes: float

    @property
    def minutes(self) -> float:
        return self.train_minutes + self.eval_minutes


def project(benchmark: str, global_batch_size: int, samples_per_s: float, eval_seconds: float,
            ruleset: str | None = None) -> Projection | None:  # fmt: skip
    """Minutes to train ``benchmark`` at ``global_batch_size`` on a machine that trains ``samples_per_s`` and takes
    ``eval_seconds`` per eval, by the reference convergence points of ``ruleset`` (the benchmark's default where
    None); None where mlperf-logging has no reference points around that batch."""
    if samples_per_s <= 0 or eval_seconds < 0:
        raise ValueError(f"a projection needs samples_per_s > 0 and eval_seconds >= 0, got {samples_per_s}, "
                         f"{eval_seconds}")  # fmt: skip
    bench = get_benchmark(benchmark)
    if not bench.mlperf:  # a benchmark of one's own has no MLPerf reference runs
        return None
    point = reference_convergence(bench.mlperf_name, ruleset or bench.ruleset, global_batch_size)
    if point is None:
        return None
    base = bench.presets[bench.full_preset]()
    cfg = dataclasses.replace(base, data=dataclasses.replace(base.data, global_batch_size=global_batch_size))
    every = bench.eval_every_samples(cfg)
    first = bench.first_eval_samples(cfg, every)
    evals = 1 + math.ceil(max(0.0, point.mean_samples - first) / every)
    return Projection(
        benchmark=bench.name,
        global_batch_size=global_batch_size,
        samples_to_target=point.mean_samples,
        between=point.between,
        evals=evals,
        first_eval_samples=first,
        eval_every_samples=every,
        train_minutes=point.mean_samples / samples_per_s / 60,
        eval_minutes=evals * eval_seconds / 60,
    )


# What a report says of a measurement with no projection whose bench.json does not say why (written before
# ``projection_none``)
NONE_UNSAID = "a scaled-down preset, or no reference convergence points at this batch"


def why_none(benchmark: str, global_batch_size: int, ruleset: str | None, scaled_down: bool) -> str:
    """Why :func:`project` gives no projection for this measurement, in a clause (the console, bench.json and the
    report say it where the projected time would be)."""
    bench = get_benchmark(benchmark)
    if not bench.mlperf:
        return "a benchmark of one's own has no MLPerf reference runs"
    if scaled_down:
        return "a scaled-down preset: the reference runs' samples to target are the full model's"
    ruleset = ruleset or bench.ruleset
    means = reference_means(bench.mlperf_name, ruleset)
    if not means:
        return f"mlperf-logging has no reference convergence points of {bench.mlperf_name} for ruleset {ruleset}"
    batches = sorted(means)
    return (f"the reference convergence points of {bench.mlperf_name} (ruleset {ruleset}) span global batches "
            f"{batches[0]:,} to {batches[-1]:,}, and {global_batch_size:,} is outside them")  # fmt: skip
