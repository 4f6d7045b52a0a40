"""From what the user named to the config a run trains with: a benchmark's preset, then YAML files, then key=value
overrides, validated (:func:`build_config`); a saved config.yaml read back (:func:`load_run_config`); the micro-batch
cut to the ranks; each experiment's seed; paths made absolute; the benchmark's CUDA allocator settings. Nothing here
starts a process or makes a folder: the launchers (launch/), `trainbench bench` (measure/), the report and the CLI
all resolve a config here."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Protocol

from trainbench.benchmarks import get_benchmark
from trainbench.benchmarks.base import Benchmark
from trainbench.config import RunConfig, apply_overrides, keys_without_effect, leaves, read_yaml_overrides
from trainbench.errors import ConfigError, UserError


class Nodes(Protocol):
    """What :func:`build_config` and :func:`fit_micro_batch` read of a system (launch/systems.System)."""

    nodes: int
    ranks_per_node: int


def build_config(
    benchmark: str,
    preset: str,
    yaml_files: list[str] | None = None,
    overrides: dict | None = None,
    system: Nodes | None = None,
    defaults: dict | None = None,
) -> tuple[Benchmark, RunConfig]:
    """Preset, then YAML files in order, then key=value overrides; validated. Where neither sets the micro-batch,
    the preset's is cut to fit each process's share of the global batch. ``system`` (`submit`, `bench --system`):
    the job's ranks (its nodes x ranks per node) and the largest micro-batch that splits the global batch over them
    are set before the config is validated, so that it is judged at the job's ranks (a key that takes effect on
    several ranks only is refused on one and accepted on the system's). ``defaults``: a command's own values of keys
    that neither the YAML files nor the overrides set (`bench` samples the telemetry faster than a run)."""
    bench = get_benchmark(benchmark)
    cfg = bench.config(preset)
    for key in ("benchmark", "preset"):
        if key in (overrides or {}):
            raise ConfigError(f"{key} is not a key to set: name the benchmark and preset on the command line "
                              f"(`trainbench run BENCHMARK --preset PRESET`), not {key}={overrides[key]}")  # fmt: skip
    explicit: set[str] = set()
    for path in yaml_files or []:
        values = read_yaml_overrides(path)
        values.pop("benchmark", None)
        values.pop("preset", None)
        explicit |= set(apply_overrides(cfg, values))
    explicit |= set(apply_overrides(cfg, overrides or {}))
    apply_overrides(cfg, {k: v for k, v in (defaults or {}).items() if k not in explicit})
    if yaml_files and "output.config_filename" not in explicit:  # MLPerf's config_filename: what the run read
        cfg.output.config_filename = ",".join(Path(f).name for f in yaml_files)
    if "data.micro_batch_size" not in explicit:
        replicas = max(1, cfg.distributed.world_size // max(1, cfg.distributed.tp))
        micro = largest_micro_batch(cfg.data.global_batch_size, replicas, cfg.data.micro_batch_size)
        cfg.data.micro_batch_size = micro or cfg.data.micro_batch_size  # None: validate says what does not split
    if system is not None:
        cfg = fit_micro_batch(cfg, system)
        cfg.distributed = dataclasses.replace(cfg.distributed, nproc=system.ranks_per_node, nodes=system.nodes)
    bench.validate(cfg)
    cfg.output.ruleset = bench.ruleset_of(cfg)  # named in the saved config: a later default never changes the run's
    return bench, cfg


def load_run_config(path: Path) -> tuple[Benchmark, RunConfig]:
    """Load a saved config.yaml back into the same RunConfig; one sentence where it names no benchmark and preset (a
    file trainbench did not save, or one damaged since)."""
    values = read_yaml_overrides(path)
    benchmark, preset = values.pop("benchmark", None), values.pop("preset", None)
    if not all(isinstance(v, str) and v for v in (benchmark, preset)):
        raise UserError(f"{path} names no benchmark and preset at its top, so it is not a config trainbench saved; "
                        "restore it from the run, or remove it")  # fmt: skip
    # A key that did nothing in the saved run is taken at the preset's value: the run is the same, and a default
    # changed since then (the file holds every key, those without effect at the default of their day) does not make
    # the saved run's config one to refuse.
    bench = get_benchmark(benchmark)
    as_saved = bench.config(preset)
    apply_overrides(as_saved, values)
    idle = bench.unused_for(as_saved).keys() | keys_without_effect(as_saved).keys()
    return build_config(benchmark, preset, overrides={k: v for k, v in values.items() if k not in idle})


def experiment_config(cfg: RunConfig, index: int) -> RunConfig:
    return dataclasses.replace(cfg, seed=cfg.seed + index)


def allocator_settings(bench: Benchmark) -> None:
    """The benchmark's CUDA allocator settings for this process and the ranks it starts, unless the user set some
    (read by torch at the first CUDA allocation, which comes later)."""
    if bench.cuda_alloc_conf:
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", bench.cuda_alloc_conf)


# Config keys that name files or folders: saved absolute, so a resume (or a job) started elsewhere reads the same.
PATH_KEYS = ("data.dir", "model.init_checkpoint", "model.base_weights", "output.run_dir")


def path_values(cfg: RunConfig) -> dict[str, str]:
    """The paths the config sets (PATH_KEYS that the benchmark's config has and gives a value), by key."""
    table = leaves(cfg)
    return {k: v for k in PATH_KEYS if k in table and (v := getattr(table[k].owner, table[k].field.name))}


def absolute_paths(cfg: RunConfig) -> RunConfig:
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data), model=dataclasses.replace(cfg.model),
                              output=dataclasses.replace(cfg.output))  # fmt: skip
    table = leaves(cfg)
    for key, value in path_values(cfg).items():
        setattr(table[key].owner, table[key].field.name, str(Path(value).expanduser().absolute()))
    return cfg


def fit_micro_batch(cfg: RunConfig, system: Nodes) -> RunConfig:
    """The config with the largest micro-batch (at most the preset's) that splits the global batch over
    the system's ranks; the rest is gradient accumulation."""
    world = system.nodes * system.ranks_per_node
    micro = largest_micro_batch(cfg.data.global_batch_size, world, cfg.data.micro_batch_size)
    if micro is None:
        raise ConfigError(
            f"global batch {cfg.data.global_batch_size} does not split over {world} ranks "
            f"({system.nodes} nodes x {system.ranks_per_node}); change data.global_batch_size or --nodes"
        )
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, micro_batch_size=micro))


def largest_micro_batch(global_batch: int, ranks: int, limit: int) -> int | None:
    """The largest micro-batch, at most ``limit``, that divides each of ``ranks`` data-parallel ranks' share of the
    global batch; None where the ranks do not split it."""
    per_rank, rest = divmod(global_batch, ranks)
    if rest or per_rank == 0:
        return None
    return max(d for d in range(1, min(per_rank, limit) + 1) if per_rank % d == 0)
