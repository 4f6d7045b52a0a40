"""What a model family gives the loop and the measurements: the model, where it runs and how fast.

A family owns everything about one kind of model: its architecture (``model.py`` beside this file's packages), its
placement over the ranks (DDP, FSDP2, tensor and expert parallelism), its speed paths (FP8, host offload,
recomputation, kernels of its own), its layout plan (``perf.plan=auto``) and the hooks `trainbench bench` needs to
cut it to fewer blocks and count its work. A :class:`~trainbench.benchmarks.base.Benchmark` is MLPerf's recipe around
a family (presets, data, optimizer, loss and metric, eval cadence, rules) and names its family in ``family``; the
loop reaches the model through ``benchmark.family`` and never asks which family it runs. docs/extending.md says how
to add one.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from trainbench.config import RunConfig
from trainbench.errors import ConfigError, UserError

if TYPE_CHECKING:
    import torch

    from trainbench.distributed import DistInfo, Placed


class ModelFamily(ABC):
    """One kind of model: built, placed, checked, planned and measured. Stateless apart from what its constructor
    takes; one instance may serve several benchmarks."""

    name: str
    """The family's name, for messages (``decoder``, ``encoder``, ``mmdit``, ``hstu``)."""
    has_experts = False
    """Whether its model has a mixture of experts that ``distributed.ep`` can spread over the ranks."""
    shards_one_rank = False
    """Whether its placement can shard the model with FSDP2 on one rank too (``distributed.shard_one_rank``)."""
    plans_layout = False
    """Whether ``perf.plan=auto`` chooses its layout keys (:meth:`plan_layout`)."""
    peer_elsewhere: str | None = None
    """Where ``hf_twin`` is None: what users would run instead and why `bench --compare` cannot time it, for the
    refusal's sentence."""
    hf_twin: str | None = None
    """The module of this family that builds HF's model of its architecture for `bench --compare hf`
    (``trainbench.families.<family>.hf``: peer, check, packages, build, loss, kernels; measure/compare_hf.py); None:
    HF has no model of it."""

    # -- checks ---------------------------------------------------------------------------------------------------
    @abstractmethod
    def validate(self, cfg: RunConfig) -> None:
        """ConfigError, one sentence, for a shape, placement or speed path this family cannot run as configured."""

    shards_tables = False
    """Whether its placement can shard embedding tables over the ranks (``perf.sharded_tables``)."""
    step_parts: tuple[tuple[str, str], ...] = ()
    """Parts of a step that ``bench``'s profile counts apart, each a name and a regular expression over the host ranges
    (operators, autograd functions and their backward, ``torch.profiler.record_function``) that launch its kernels;
    the optimizer, the collectives and the rest (the model) are counted without it (train/profiling.kernels_by_part)."""

    def unused_for(self, cfg: RunConfig) -> dict[str, str]:
        """Config keys this family's model does not read for ``cfg`` (e.g. those of another architecture), with why."""
        unused = {"perf.hstu_attention": f"the {self.name} family has no HSTU layers"}  # (the hstu family reads it)
        if not self.shards_tables:
            unused["perf.sharded_tables"] = f"the {self.name} family has no tables to shard"
            unused["perf.lookup_once_a_step"] = f"the {self.name} family has no tables to shard"
        return unused

    # -- model and placement --------------------------------------------------------------------------------------
    @abstractmethod
    def build_model(self, cfg: RunConfig) -> torch.nn.Module:
        """The model, on the CPU or the meta device; :meth:`place` puts it on the rank's devices."""

    @abstractmethod
    def place(self, model: torch.nn.Module, cfg: RunConfig, info: DistInfo, bf16: bool) -> Placed:
        """Put ``model`` on the rank's device with the family's parallelism, compilation and speed paths, applied
        from outside the architecture."""

    def data_rank(self, cfg: RunConfig, info: DistInfo) -> tuple[int, int]:
        """(rank, ranks) among the data-parallel replicas: which share of each global batch this rank reads."""
        return info.rank, info.world_size

    def model_notes(self, cfg: RunConfig, device: torch.device, bf16: bool) -> list[str]:
        """Lines for the run's console on choices made for this machine (e.g. which kernel ``auto`` picked)."""
        return []

    # -- layout (perf.plan=auto) --------------------------------------------------------------------------------
    def probe_config(self, cfg: RunConfig, preset: RunConfig) -> RunConfig:
        """The config the layout probe measures: the run's, with what the plan may choose set to be probed (keys
        moved from ``preset``, the config of ``cfg``'s preset, are the user's)."""
        return cfg

    def plan_layout(self, cfg: RunConfig, preset: RunConfig, resources, probe) -> tuple[dict[str, Any], list[str]]:
        """The layout keys chosen for ``resources`` (planner.Resources) from ``probe`` (planner.BlockProbe), as
        ``{key: value}``, and the console lines saying what and why; ``preset`` is the config of ``cfg``'s preset
        (keys moved from it are the user's, kept as given). ConfigError where nothing fits."""
        raise ConfigError(f"perf.plan=auto: the {self.name} family has no layout to plan")

    # -- throughput (trainbench bench) ----------------------------------------------------------------------------
    def depth(self, cfg: RunConfig) -> int | None:
        """The model's depth in the blocks `trainbench bench --blocks` truncates it by (None: none to truncate). A
        block is the unit the step time grows by in a straight line, so that a few truncated depths extrapolate to
        the model's own: a decoder's layer by default."""
        return getattr(cfg.model, "num_layers", None)

    def block_period(self, cfg: RunConfig) -> tuple[int, str]:
        """After how many blocks the model's blocks repeat (1: all alike), and what alternates, for a sentence: the
        depths `trainbench bench --blocks` measures must lie a multiple of it apart, so that each difference between
        them adds whole repeats and the slope is that of the model's average block."""
        return 1, ""

    def truncated(self, cfg: RunConfig, depth: int) -> RunConfig:
        """``cfg`` with its model cut to ``depth`` of :meth:`depth`'s blocks (UserError, one sentence, where it cannot
        be cut that way)."""
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=depth))

    def tables_truncated(self, cfg: RunConfig, rows: int) -> RunConfig:
        """``cfg`` with every embedding table cut to at most ``rows`` rows (`trainbench bench --table-rows`: a model
        whose tables do not fit, measured with smaller ones; UserError, one sentence, where it has none)."""
        raise UserError(f"--table-rows: the {self.name} family's model has no embedding tables to truncate")

    def tokens_per_sample(self, cfg: RunConfig) -> int:
        """Tokens one sample of the global batch counts (a row of the sequence length by default)."""
        return cfg.data.seq_length

    def lookups_per_sample(self, cfg: RunConfig) -> int | None:
        """Embedding-table rows one sample reads (a recommender's cost); None for a model without tables."""
        return None

    def flops_per_sample(self, cfg: RunConfig) -> float | None:
        """Floating-point operations of one sample's forward and backward as NVIDIA counts them for its MLPerf
        submissions (recompute excluded), for the MFU; None where no count is defined."""
        return None

    # -- several GPUs of one node, forecast from one (trainbench bench --nproc N) ------------------------------------
    def blocks_of(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The model's blocks, those :meth:`depth` counts and FSDP2 shards a unit each: the first ``layers`` list in
        the model by default (none where it has no such list)."""
        import torch

        for module in model.modules():
            if isinstance(layers := getattr(module, "layers", None), torch.nn.ModuleList):
                return list(layers)
        return []

    def expert_params(self, model: torch.nn.Module) -> int:
        """Of the blocks' trained parameters, those in a mixture's experts (spread over the ranks by expert
        parallelism, not sharded by FSDP2): none by default."""
        return 0

    def one_gpu_rates(self, cfg: RunConfig, device) -> dict[str, float]:
        """What this family times on one GPU (``device``), before its model is built, for :meth:`node_costs` on
        several: seconds by what, kept with the one GPU's step (families/node_costs.OneGpu.family_rates). None by
        default."""
        return {}

    def node_costs(self, cfg: RunConfig, ranks: int, one) -> dict[str, float] | str:
        """Seconds a step that ``ranks`` GPUs of one node add to ``one``'s (families/node_costs.OneGpu: one GPU's
        measured step at this shape and its parameters), by what (families/node_costs.py's models), for the forecast
        of `trainbench bench --nproc N` (measure/forecast.py); or one sentence saying why this family has none."""
        return f"the {self.name} family has no model of what several GPUs add to one GPU's step"
