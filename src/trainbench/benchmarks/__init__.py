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


def register(bench: Benchmark) -> Benchmark:
    """Add a benchmark (an instance of a :class:`Benchmark` subclass) to the registry that ``trainbench`` commands
    look names up in; refused where its name is taken, or where it claims another benchmark's ``mlperf_name``
    without both saying so in ``shares_mlperf_name``."""
    if bench.name in BENCHMARKS and BENCHMARKS[bench.name] is not bench:
        raise ConfigError(f"a benchmark named {bench.name} is already registered")
    for other in BENCHMARKS.values():
        if (
            other is not bench
            and other.mlperf_name == bench.mlperf_name
            and not (other.name in bench.shares_mlperf_name and bench.name in other.shares_mlperf_name)
        ):
            raise ConfigError(f"benchmark {bench.name} logs submission_benchmark '{bench.mlperf_name}', which "
                              f"{other.name} logs too; give it its own mlperf_name, or list each in the other's "
                              "shares_mlperf_name")  # fmt: skip
    BENCHMARKS[bench.name] = bench
    return bench


def get_benchmark(name: str) -> Benchmark:
    if name not in BENCHMARKS:
        raise ConfigError(f"unknown benchmark '{name}'; available: {', '.join(BENCHMARKS)} (see `trainbench list`)")
    return BENCHMARKS[name]


def by_mlperf_name(mlperf_name: str) -> Benchmark | None:
    """The benchmark whose logs carry ``submission_benchmark`` ``mlperf_name``, if trainbench has it."""
    return next((b for b in BENCHMARKS.values() if b.mlperf_name == mlperf_name), None)


def is_own(mlperf_name: str | None) -> bool:
    """Whether logs carrying ``submission_benchmark`` ``mlperf_name`` come from a registered benchmark of one's own
    (``mlperf = False``)."""
    bench = by_mlperf_name(mlperf_name) if mlperf_name else None
    return bench is not None and not bench.mlperf


def ruleset_of(mlperf_name: str | None, log: Path, fix: str) -> str:
    """The compliance ruleset of the benchmark whose logs carry ``submission_benchmark`` ``mlperf_name``; where
    trainbench has none, one sentence naming ``log`` and what the user can do (``fix``)."""
    bench = by_mlperf_name(mlperf_name) if mlperf_name else None
    if bench is None:
        raise UserError(f"{log}: no known submission_benchmark in the log; {fix}")
    return bench.ruleset
