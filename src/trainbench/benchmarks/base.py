"""MLPerf's recipe for a benchmark: the interface every benchmark implements.

A benchmark is a recipe around a model family: its presets, its data, its optimizer and schedule, its loss and
metric, its eval cadence and its MLPerf rules and hyperparameters, and the data preparation behind `trainbench
prepare`. The model itself (architecture, placement, speed paths, layout plan, measurement hooks) is its family's
(:class:`~trainbench.families.base.ModelFamily`, named in ``family``). The loop (``trainbench.train``) asks the
benchmark and its family through these interfaces and never asks which benchmark it runs. This module imports only
the layers below it (config, data, families). docs/extending.md says how to add a benchmark.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainbench.config import DistributedConfig, RunConfig, keys_without_effect, leaves
from trainbench.data.steps import Step
from trainbench.errors import ConfigError, UserError

if TYPE_CHECKING:
    import torch

    from trainbench.families.base import ModelFamily


@dataclass
class BenchmarkData:
    """A rank's view of the data: an endless iterator of optimizer steps (:class:`~trainbench.data.steps.Step`:
    this rank's micro-batches and the global batch's sample count), this rank's eval batches, and the sizes MLPerf
    logs as ``train_samples`` / ``eval_samples``."""

    train: Iterable[Step]
    eval: list[dict[str, Any]]
    train_samples: int
    eval_samples: int


class Benchmark(ABC):
    name: str
    """trainbench's name for it (``trainbench run NAME``): unique among the registered benchmarks."""
    mlperf: bool = True
    """Whether it is one of MLPerf's benchmarks. False for a benchmark of one's own: its log is checked by
    mlperf-logging's rules common to every benchmark and trainbench's own log checks, it is marked as not an MLPerf
    benchmark in the log, the report and ``check``, and no reference convergence is projected for it."""
    mlperf_name: str
    """The log's ``submission_benchmark``. For an MLPerf benchmark, its name in MLPerf (one mlperf-logging's
    ``ruleset`` knows, refused before training otherwise), claimed by one registered benchmark only unless both
    list each other in ``shares_mlperf_name``; for a benchmark of one's own, its ``name``."""
    shares_mlperf_name: tuple[str, ...] = ()
    """Registered benchmarks that log the same ``mlperf_name`` on purpose (e.g. another model size of it)."""
    ruleset: str
    """mlperf-logging's compliance ruleset version (e.g. ``6.1.0``) whose rules a run follows and is checked under
    unless its config picks one of ``older_rulesets``: the newest that knows the benchmark. Several benchmarks may
    share one."""
    older_rulesets: tuple[str, ...] = ()
    """Older rulesets a run may follow instead (``output.ruleset``, ``--ruleset``), newest first."""
    description: str
    metric_name: str
    """Name of the quality metric in metrics.jsonl and on screen."""
    metric_explanation: str = ""
    """One sentence the report gives on what the metric is (kept in summary.json, so a report needs no plugin)."""
    higher_is_better: bool
    optimizer_name: str
    """The only ``optimizer.name`` the benchmark trains with."""
    presets: dict[str, Callable[[], RunConfig]]
    full_preset: str
    """The preset of MLPerf's own shape (what `trainbench submit` starts from unless told)."""
    family: ModelFamily
    """Its model family: the model, its placement and speed paths, its layout plan and its measurement hooks
    (:mod:`trainbench.families`). The loop builds and places the model through it."""
    synthetic_sizes: dict[str, dict[str, int]] = {}
    """Per preset, the size of the data set ``prepare NAME --synthetic --preset P`` writes."""
    unused_keys: dict[str, str] = {}
    """Config keys this benchmark does not read, each with why: setting one away from the preset's value is refused."""
    prepare_examples: str = ""
    """The examples ``trainbench prepare NAME --help`` ends with."""
    cuda_alloc_conf: str | None = None
    """``PYTORCH_CUDA_ALLOC_CONF`` for its processes where the user set none (None: torch's default)."""

    @property
    def rulesets(self) -> tuple[str, ...]:
        """Every ruleset a run of this benchmark may follow, the default first."""
        return (self.ruleset, *self.older_rulesets)

    def ruleset_of(self, cfg: RunConfig | None) -> str:
        """The ruleset ``cfg``'s run follows: its ``output.ruleset``, else the benchmark's default."""
        return (cfg.output.ruleset if cfg is not None else "") or self.ruleset

    def check_ruleset(self, ruleset: str, where: str = "output.ruleset") -> None:
        """One sentence where ``ruleset`` is not one mlperf-logging has, or not one this benchmark follows."""
        from trainbench.mlperf import require_installed, round_benchmarks

        if ruleset in self.rulesets:
            return
        require_installed(ruleset, where, f"; {self.name} follows {', '.join(self.rulesets)}")
        why = (f"the {ruleset} round does not list {self.mlperf_name}" if self.mlperf and self.mlperf_name not in
               round_benchmarks(ruleset) else "its logs are written for those only")  # fmt: skip
        raise ConfigError(f"{where}={ruleset}: {self.name} follows ruleset {', '.join(self.rulesets)} ({why})")

    # -- config ---------------------------------------------------------------------------------
    def config(self, preset: str) -> RunConfig:
        if preset not in self.presets:
            raise ConfigError(f"benchmark '{self.name}' has no preset '{preset}'; presets: {', '.join(self.presets)}")
        return self.presets[preset]()

    def validate(self, cfg: RunConfig) -> None:
        """Raise ConfigError for keys this benchmark ignores and for combinations the loop cannot run."""
        self.check_ruleset(self.ruleset_of(cfg))
        self.check_mlperf_name(self.ruleset_of(cfg))
        self._refuse_keys_without_effect(cfg)
        if cfg.optimizer.name != self.optimizer_name:
            raise ConfigError(f"optimizer.name={cfg.optimizer.name}: {self.name} trains with {self.optimizer_name}")
        ranks, tp = cfg.distributed.world_size, max(1, cfg.distributed.tp)
        unset = DistributedConfig()  # (the experts' keys at their defaults)
        experts_keys = [f"distributed.{k}={v}" for k in ("ep", "expert_rebalance_every", "expert_exchange",
                        "expert_row_casts") if (v := getattr(cfg.distributed, k)) != getattr(unset, k)]  # fmt: skip
        if experts_keys and not self.family.has_experts:
            raise ConfigError(f"{experts_keys[0]}: {self.name} has no mixture of experts to spread")
        if cfg.distributed.shard_one_rank and not self.family.shards_one_rank:
            raise ConfigError(f"distributed.shard_one_rank=true: {self.name}'s placement has no one-rank sharding (the "
                              "LLM benchmarks' FSDP2 has)")  # fmt: skip
        if ranks % tp:
            raise ConfigError(f"distributed.tp={tp} does not divide the {ranks} ranks ({cfg.distributed.nodes} nodes x "
                              f"{cfg.distributed.nproc}); tensor-parallel groups need tp ranks each")  # fmt: skip
        # Data-parallel replicas: tensor-parallel ranks share their replica's batch.
        d, world = cfg.data, cfg.distributed.world_size // max(1, cfg.distributed.tp)
        if d.global_batch_size % world:
            raise ConfigError(
                f"data.global_batch_size={d.global_batch_size} is not divisible by {world} processes "
                f"({cfg.distributed.nodes} nodes x {cfg.distributed.nproc})"
            )
        per_rank = d.global_batch_size // world
        if per_rank < d.micro_batch_size:
            raise ConfigError(
                f"data.micro_batch_size={d.micro_batch_size} is more than each process's share of the global batch "
                f"({d.global_batch_size} / {world} = {per_rank}); set data.micro_batch_size={per_rank} or a divisor "
                "of it"
            )
        if per_rank % d.micro_batch_size:
            raise ConfigError(
                f"data.global_batch_size / processes = {per_rank} is not a multiple of "
                f"data.micro_batch_size={d.micro_batch_size}"
            )
        if cfg.schedule.max_samples is not None and cfg.schedule.max_samples < d.global_batch_size:
            raise ConfigError(f"schedule.max_samples={cfg.schedule.max_samples} is less than one global batch "
                              f"({d.global_batch_size}); set it to at least {d.global_batch_size}")  # fmt: skip
        lo, hi = self.target_range(cfg)
        if not lo < cfg.eval.target <= hi:
            raise ConfigError(f"eval.target={cfg.eval.target:g}: the {self.metric_name} target must be above {lo:g} "
                              f"and at most {hi:.4g} ({self.target_range_why})")  # fmt: skip
        if cfg.perf.cuda_graphs and not cfg.perf.compile:
            raise ConfigError("perf.cuda_graphs=true replays the compiled step: it needs perf.compile=true")
        if cfg.perf.cuda_graphs and cfg.device == "cpu":
            raise ConfigError("perf.cuda_graphs=true needs a GPU (device=cuda or auto)")
        if cfg.perf.gpu_memory_gib is not None and cfg.device == "cpu":
            raise ConfigError(f"perf.gpu_memory_gib={cfg.perf.gpu_memory_gib:g} limits a GPU's memory: it needs a GPU "
                              "(device=cuda or auto)")  # fmt: skip
        if cfg.perf.cuda_graphs and per_rank != d.micro_batch_size:
            # A replay reuses its memory, and with accumulation the gradients of the previous
            # micro-batch live there.
            raise ConfigError(
                "perf.cuda_graphs=true needs one micro-batch per rank per step (no accumulation): "
                f"set data.micro_batch_size={per_rank}"
            )
        self.family.validate(cfg)

    def check_mlperf_name(self, ruleset: str | None = None) -> None:
        """An MLPerf benchmark's name must be one its ruleset's checker knows (``ruleset``: the default one): else
        every log it writes fails the check after the training (a benchmark of one's own sets ``mlperf = False``)."""
        from trainbench.mlperf import known_mlperf_benchmarks

        if not self.mlperf:
            return
        ruleset = ruleset or self.ruleset
        known = known_mlperf_benchmarks(ruleset)
        if self.mlperf_name not in known:
            raise ConfigError(
                f"benchmark {self.name} logs submission_benchmark '{self.mlperf_name}', which mlperf-logging's "
                f"ruleset {ruleset} does not know ({', '.join(sorted(known)) or 'no benchmarks'}); a benchmark "
                "of your own sets mlperf = False (docs/extending.md)"
            )

    def unused_for(self, cfg: RunConfig) -> dict[str, str]:
        """The keys ``cfg`` does not read, with why: ``unused_keys``, and what its family derives from the config."""
        return self.unused_keys | self.family.unused_for(cfg)

    def _refuse_keys_without_effect(self, cfg: RunConfig) -> None:
        """Keys set away from the preset's value that do nothing: one the benchmark never reads (:meth:`unused_for`),
        or one that this config (its ranks, device and compile) gives no effect (``config.keys_without_effect``).
        One sentence each. Every entry point builds its config through :meth:`validate` (the command line, the
        Python API, a job on a system's ranks, which ``launch.local.build_config`` validates at the job's ranks), so
        each refuses them alike."""
        unused, idle = self.unused_for(cfg), keys_without_effect(cfg)
        if not unused and not idle:
            return
        ours, preset = leaves(cfg), leaves(self.config(cfg.preset))

        def changed(key: str):  # (whether it moved from the preset's value, the value as the command line writes it)
            value = getattr(ours[key].owner, ours[key].field.name)
            shown = str(value).lower() if isinstance(value, bool) else value
            return value != getattr(preset[key].owner, preset[key].field.name), shown

        for key, why in unused.items():
            moved, shown = changed(key)
            if moved:
                raise ConfigError(f"{key}={shown} has no effect on {self.name}: {why}")
        for key, why in idle.items():
            moved, shown = changed(key)
            if moved:
                raise ConfigError(f"{key}={shown} has no effect on this run of {self.name}: {why}")

    def target_range(self, cfg: RunConfig) -> tuple[float, float]:
        """The targets that mean something: above the first bound, at most the second. An accuracy lies in (0, 1];
        a loss (nats) above 0 and below ln(vocabulary), what an untrained model that guesses uniformly scores."""
        if self.higher_is_better:
            return 0.0, 1.0
        return 0.0, math.log(cfg.model.vocab_size)

    @property
    def target_range_why(self) -> str:
        if self.higher_is_better:
            return "an accuracy"
        return "a loss in nats; ln(vocabulary size) is what a model that guesses uniformly scores"

    def accumulation_steps(self, cfg: RunConfig) -> int:
        replicas = cfg.distributed.world_size // max(1, cfg.distributed.tp)
        return cfg.data.global_batch_size // (replicas * cfg.data.micro_batch_size)

    @abstractmethod
    def eval_every_samples(self, cfg: RunConfig) -> int:
        """The MLPerf eval cadence for this config (used when eval.every_samples is not set)."""

    def first_eval_samples(self, cfg: RunConfig, every: int) -> int:
        """Samples trained at the first eval (MLPerf rules may skip the first evals); the first cadence point by
        default."""
        return every

    def reached(self, metric: float, target: float) -> bool:
        return metric >= target if self.higher_is_better else metric <= target

    # -- building -------------------------------------------------------------------------------
    @abstractmethod
    def check_data(self, cfg: RunConfig) -> None:
        """Validate the data on disk (cheap: metadata only); raise DataError with what to do."""

    def inputs_identity(self, cfg: RunConfig) -> dict[str, Any]:
        """What the run reads besides its config, each named and described so that a change shows (JSON values):
        recorded when a run starts and compared when it resumes. By default the data set: its ``manifest.json``'s
        hash where it has one, else every file's name and size."""
        return {"data set": data_identity(cfg.data.dir)} if cfg.data.dir else {}

    def describe_input_change(self, name: str, old: Any, new: Any) -> str:
        """A short phrase naming what changed in input ``name`` between two :meth:`inputs_identity` values."""
        if name == "data set":
            return "its manifest.json differs" if "manifest_sha256" in (old or {}) else "its files differ"
        return "it differs"

    @abstractmethod
    def build_optimizer(self, cfg: RunConfig, model: torch.nn.Module) -> torch.optim.Optimizer: ...

    @abstractmethod
    def lr_at(self, cfg: RunConfig, step: int) -> float: ...

    @abstractmethod
    def build_data(self, cfg: RunConfig, rank: int, world_size: int, start_sample: int = 0) -> BenchmarkData: ...

    # -- the step -------------------------------------------------------------------------------
    def to_device(self, batch: dict[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
        """A micro-batch (numpy arrays, or tensors that :func:`~trainbench.data.prefetch.pinned` put in page-locked
        memory, whose copies do not wait for the GPU) on ``device``."""
        import torch

        return {k: torch.as_tensor(v).to(device, non_blocking=True) for k, v in batch.items()}

    @abstractmethod
    def loss_weights(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Counts the loss is normalised by (e.g. masked tokens, samples), as a 1-d tensor. The loop sums
        them over all micro-batches and ranks of a step, so the loss is the same for any split of the
        global batch."""

    @abstractmethod
    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
        """This micro-batch's share of the global-batch loss: its loss sums divided by ``weights``."""

    @abstractmethod
    def eval_sums(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Additive statistics of one eval batch (summed over batches and ranks)."""

    @abstractmethod
    def eval_metric(self, sums: torch.Tensor) -> float: ...

    # -- layout (perf.plan=auto) ----------------------------------------------------------------
    def probe_config(self, cfg: RunConfig) -> RunConfig:
        """The config the layout probe measures: its family's choice, the keys set away from the preset kept."""
        return self.family.probe_config(cfg, self.config(cfg.preset))

    def plan_layout(self, cfg: RunConfig, resources, probe) -> tuple[RunConfig, list[str]]:
        """``cfg`` with the layout keys its family plans for ``resources`` (planner.Resources) from ``probe``
        (planner.BlockProbe), validated as a run's config, and the console lines saying what and why; ConfigError
        where nothing fits."""
        keys, lines = self.family.plan_layout(cfg, self.config(cfg.preset), resources, probe)
        return self.with_layout(cfg, keys), lines

    def with_layout(self, cfg: RunConfig, keys: dict[str, Any]) -> RunConfig:
        """A copy of ``cfg`` with the layout ``keys`` a plan chose (planner.Plan.keys and the like), validated; ``cfg``
        itself is left as it was."""
        from trainbench.config import apply_overrides

        planned = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model), perf=dataclasses.replace(cfg.perf),
                                      data=dataclasses.replace(cfg.data))  # fmt: skip
        apply_overrides(planned, {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in keys.items()})
        self.validate(planned)
        return planned

    # -- throughput (trainbench bench) ----------------------------------------------------------
    def bench_data(self, cfg: RunConfig, rank: int, world_size: int) -> BenchmarkData:
        """Rows shaped like the benchmark's data, made in memory from the seed (no data set needed): what `trainbench
        bench` trains on, through the same placement, step and eval as a run. ``eval`` holds one eval batch of this
        rank (the eval's time per sample is measured on it); ``eval_samples`` is the full eval set's size."""
        raise UserError(f"`trainbench bench` has no synthetic rows for {self.name} yet")

    # -- MLPerf ---------------------------------------------------------------------------------
    @abstractmethod
    def hyperparameters(self, cfg: RunConfig) -> dict[str, Any]:
        """Benchmark-specific MLPerf keys and values logged before run_start."""

    def waived_checks(self, cfg: RunConfig) -> frozenset[str]:
        """Closed-division compliance checks this config cannot pass because they fix the full benchmark's
        shape (sequence length, eval set size, schedule length); none by default."""
        return frozenset()

    def scaled_down(self, cfg: RunConfig) -> bool:
        """A run of another preset than the full benchmark's: its samples to converge say nothing of the reference
        convergence points (mlperf-logging's RCP check), which only the full model can meet."""
        return cfg.preset != self.full_preset

    def eval_metadata(self, samples: int) -> dict[str, Any]:
        """Metadata of the eval events: the samples trained so far."""
        return {"epoch_num": samples, "samples_count": samples}

    # -- the command line -----------------------------------------------------------------------
    @staticmethod
    @abstractmethod
    def add_prepare_arguments(parser: argparse.ArgumentParser) -> None:
        """Add the options of ``trainbench prepare NAME`` that this benchmark's data needs to its own parser (``--out``,
        ``--seed``, ``--force``, ``--no-progress``, ``--synthetic`` and ``--preset`` are every benchmark's;
        ``benchmarks/prepare_common.py`` has the helpers a preparation shares)."""

    @abstractmethod
    def prepare(self, args: argparse.Namespace) -> int:
        """``trainbench prepare NAME``: write the data set; returns the exit code."""

    def convert(self, args: argparse.Namespace) -> int:
        """``trainbench convert NAME``: turn a reference checkpoint into one ``model.init_checkpoint`` reads."""
        raise UserError(f"`trainbench convert {self.name}` is not available: {self.name} has no reference checkpoint "
                        "to convert")  # fmt: skip


def data_identity(folder: str | Path) -> dict[str, Any]:
    """A data set's identity: the sha256 of its ``manifest.json`` (which lists its files), else the names and sizes
    of its files."""
    root = Path(folder)
    manifest = root / "manifest.json"
    if manifest.is_file():
        return {"manifest_sha256": hashlib.sha256(manifest.read_bytes()).hexdigest()}
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else []
    return {"files": {str(p.relative_to(root)): p.stat().st_size for p in files}}
