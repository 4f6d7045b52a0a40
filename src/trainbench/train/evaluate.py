"""Eval: the benchmark's additive statistics over this rank's eval batches, summed over ranks, as one metric."""

from __future__ import annotations

import torch

from trainbench.benchmarks.base import Benchmark
from trainbench.distributed import DistInfo, all_reduce_sum
from trainbench.train.record import MLPerfRecord


@torch.no_grad()
def evaluate(bench: Benchmark, model, batches, info: DistInfo, autocast, record: MLPerfRecord, samples: int) -> float:
    model.eval()
    meta = bench.eval_metadata(samples)
    record.eval_start(meta)
    sums = None
    for batch in batches:
        with autocast:
            part = bench.eval_sums(model, bench.to_device(batch, info.device))
        sums = part if sums is None else sums + part
    metric = bench.eval_metric(all_reduce_sum(sums, info))
    record.eval_result(metric, meta)
    return metric
