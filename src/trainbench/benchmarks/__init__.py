"""The benchmarks trainbench runs, by name."""

from __future__ import annotations

from pathlib import Path

from trainbench.benchmarks.base import Benchmark
from trainbench.benchmarks.bert import BertBenchmark
from trainbench.benchmarks.llm import Gpt3Benchmark, Llama31Benchmark
from trainbench.benchmarks.lora import LoraBenchmark
from trainbench.errors import ConfigError, UserError

BENCHMARKS: dict[str, Benchmark] = {
    b.name: b for b in (BertBenchmark(), Llama31Benchmark(), Gpt3Benchmark(), LoraBenchmark())
}


def get_benchmark(name: str) -> Benchmark:
    if name not in BENCHMARKS:
        raise ConfigError(f"unknown benchmark '{name}'; available: {', '.join(BENCHMARKS)} (see `trainbench list`)")
    return BENCHMARKS[name]


def by_mlperf_name(mlperf_name: str) -> Benchmark | None:
    """The benchmark whose logs carry ``submission_benchmark`` ``mlperf_name``, if trainbench has it."""
    return next((b for b in BENCHMARKS.values() if b.mlperf_name == mlperf_name), None)


def ruleset_of(mlperf_name: str | None, log: Path, fix: str) -> str:
    """The compliance ruleset of the benchmark whose logs carry ``submission_benchmark`` ``mlperf_name``; where
    trainbench has none, one sentence naming ``log`` and what the user can do (``fix``)."""
    bench = by_mlperf_name(mlperf_name) if mlperf_name else None
    if bench is None:
        raise UserError(f"{log}: no known submission_benchmark in the log; {fix}")
    return bench.ruleset
