"""The benchmarks trainbench runs, by name: its own, those registered in the process (:func:`register`) and those
installed packages declare under the entry-point group ``trainbench.benchmarks`` (loaded on the first lookup, in
every process of a run: a rank started by torchrun or Slurm finds a benchmark of an installed package too).

A built-in benchmark's module imports torch, its model and its placement only inside the methods that build or run
something (type hints under ``TYPE_CHECKING``), and its presets take their model's config from ``families/configs.py``:
the registry, `trainbench list` and `--help` load without torch (tests/test_train.py holds this)."""

from __future__ import annotations

from pathlib import Path

from trainbench.benchmarks.base import Benchmark
from trainbench.benchmarks.bert import BertBenchmark
from trainbench.benchmarks.dlrmv4 import Dlrmv4Benchmark
from trainbench.benchmarks.flux1 import Flux1Benchmark
from trainbench.benchmarks.gpt_oss import GptOssBenchmark
from trainbench.benchmarks.llm import Gpt3Benchmark, Llama31Benchmark
from trainbench.benchmarks.lora import LoraBenchmark
from trainbench.config import is_plain_name
from trainbench.errors import ConfigError, UserError

BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        BertBenchmark(),
        Llama31Benchmark(),
        Gpt3Benchmark(),
        LoraBenchmark(),
        GptOssBenchmark(),
        Flux1Benchmark(),
        Dlrmv4Benchmark(),
    )
}
BUILT_IN = "built in"
ORIGINS: dict[str, str] = dict.fromkeys(BENCHMARKS, BUILT_IN)
"""Where each registered benchmark comes from: built in, an installed package, or :func:`register` in this process."""
ENTRY_POINTS = "trainbench.benchmarks"
PLUGIN_ERRORS: list[str] = []
"""One sentence per entry point that did not load (the others still do)."""
_plugins_loaded = False


def load_plugins() -> list[str]:
    """Register the benchmarks installed packages declare under the entry-point group ``trainbench.benchmarks``
    (``name = "module:attr"``: a :class:`Benchmark` subclass or an instance of one), once per process. An entry
    point that fails to import, names something else, or clashes with a registered benchmark is left out and named
    in :data:`PLUGIN_ERRORS`; the others still load. Returns those sentences."""
    global _plugins_loaded
    if _plugins_loaded:
        return PLUGIN_ERRORS
    _plugins_loaded = True
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINTS):
        dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else "an installed package"
        where = f"entry point {ep.name} = {ep.value} of {dist}"
        try:
            obj = ep.load()
            bench = obj() if isinstance(obj, type) and issubclass(obj, Benchmark) else obj
            if not isinstance(bench, Benchmark):
                raise ConfigError(f"it names a {type(obj).__name__}, not a Benchmark subclass or instance")
            if bench.name in BENCHMARKS and ORIGINS.get(bench.name, "").endswith(f"of {dist}"):
                continue  # one package declaring its benchmark twice
            register(bench, origin=f"{dist}, entry point {ep.name}")
        except KeyboardInterrupt:
            raise
        # A package that calls sys.exit (SystemExit) or raises anything else while it loads must stop neither the
        # other benchmarks nor trainbench: every command would otherwise end with its exit status and no word.
        except BaseException as e:  # noqa: BLE001
            PLUGIN_ERRORS.append(f"benchmark plugin not loaded ({where}): {plugin_failure(e)}")
    return PLUGIN_ERRORS


def plugin_failure(e: BaseException) -> str:
    """What a plugin's import or hook raised, in words (``SystemExit: 3`` says less than that it exited)."""
    if isinstance(e, SystemExit):
        return f"it called sys.exit({e.code!r})"
    return f"{type(e).__name__}: {e}"


def check_definition(bench: Benchmark) -> None:
    """The attributes every command reads of a benchmark before running it, of the types they need: a plugin's
    mistake is one sentence when it registers, not a crash of `trainbench list` or of every command."""
    name = getattr(bench, "name", None)
    if not is_plain_name(name):
        raise ConfigError(f"a benchmark's name must be a plain name (letters, digits, '_', '-', '.'; not empty), not "
                          f"{name!r}")  # fmt: skip
    presets = getattr(bench, "presets", None)
    if not isinstance(presets, dict) or not presets:
        raise ConfigError(f"benchmark {name}: presets must be a non-empty dict of preset name to a function that "
                          f"returns its config, not {presets!r}")  # fmt: skip
    for preset, make in presets.items():
        if not is_plain_name(preset) or not callable(make):
            raise ConfigError(f"benchmark {name}: preset {preset!r} must be a plain name mapped to a function that "
                              f"returns its config, not {make!r}")  # fmt: skip
    for attr in ("description", "mlperf_name", "metric_name"):
        if not isinstance(getattr(bench, attr, None), str):
            raise ConfigError(f"benchmark {name}: {attr} must be a str, not {getattr(bench, attr, None)!r}")
    if getattr(bench, "full_preset", None) not in presets:
        raise ConfigError(f"benchmark {name}: full_preset must name one of its presets ({', '.join(presets)}), not "
                          f"{getattr(bench, 'full_preset', None)!r}")  # fmt: skip


def registry() -> dict[str, Benchmark]:
    """Every registered benchmark by name, installed packages' included."""
    load_plugins()
    return BENCHMARKS


def register(bench: Benchmark, origin: str = "registered in this process") -> Benchmark:
    """Add a benchmark (an instance of a :class:`Benchmark` subclass) to the registry that ``trainbench`` commands
    look names up in; refused where its name is taken, or where it claims another benchmark's ``mlperf_name``
    without both saying so in ``shares_mlperf_name``, and where an attribute every command reads is missing or of the
    wrong type (:func:`check_definition`). ``origin`` is what `trainbench list` says it comes from."""
    check_definition(bench)
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
    ORIGINS[bench.name] = origin
    return bench


def unregister(name: str) -> None:
    """Take a benchmark :func:`register` added out of the registry again."""
    BENCHMARKS.pop(name, None)
    ORIGINS.pop(name, None)


def get_benchmark(name: str) -> Benchmark:
    if name not in registry():
        broken = "".join(f"; {e}" for e in PLUGIN_ERRORS)
        raise ConfigError(f"unknown benchmark '{name}'; available: {', '.join(BENCHMARKS)} (see `trainbench list`)"
                          f"{broken}")  # fmt: skip
    return BENCHMARKS[name]


def by_mlperf_name(mlperf_name: str) -> Benchmark | None:
    """The benchmark whose logs carry ``submission_benchmark`` ``mlperf_name``, if trainbench has it."""
    return next((b for b in registry().values() if b.mlperf_name == mlperf_name), None)


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
