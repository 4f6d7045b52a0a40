"""Typed run configuration: dataclasses with documented fields, presets, YAML and key=value overrides.

A run is described by one :class:`RunConfig`. Presets are functions (in each benchmark module) that
return a config changed from a base. Users change it with a YAML file and ``key=value`` arguments; a
key is either its dotted path (``optimizer.lr``) or, where unambiguous, its last part (``lr``).
Every value is checked against the field's type; a mistake is one :class:`ConfigError` naming the
valid keys. The resolved config is saved with every run and loads back to the same object.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trainbench.errors import ConfigError


def option(
    default: Any,
    help: str,
    choices: tuple[str, ...] | None = None,
    at_least: float | None = None,
    above: float | None = None,
    below: float | None = None,
    at_most: float | None = None,
    zero_or_at_least: float | None = None,
) -> Any:
    """A config field with its help text (shown by ``trainbench run --help-config``) and, for numbers, the range a
    value must lie in: ``at_least`` and ``at_most`` (inclusive), ``above`` and ``below`` (exclusive), and
    ``zero_or_at_least`` for a rate where 0 means off and a tiny positive value would mean a wait of ages."""
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    bounds = (("at_least", at_least), ("above", above), ("below", below), ("at_most", at_most),
              ("zero_or_at_least", zero_or_at_least))  # fmt: skip
    for name, bound in bounds:
        if bound is not None:
            meta[name] = bound
    return field(default=default, metadata=meta)


def section(factory: Any, help: str) -> Any:
    return field(default_factory=factory, metadata={"help": help})


@dataclass(kw_only=True)
class DataConfig:
    dir: str | None = option(None, "Dataset folder written by `trainbench prepare` (holds train/ and eval/).")
    seq_length: int = option(512, "Tokens per sample; must match the shards on disk.", at_least=1)
    max_predictions: int = option(76, "Masked-LM predictions per sample (BERT); must match the shards.", at_least=1)
    layout: str = option(
        "fixed",
        "Training data layout: fixed (train/, one sample per row) or packed (train_packed/, several per row; "
        "global_batch_size then counts rows: divide a fixed-row batch by the sequences per row to keep the "
        "samples per step).",
        choices=("fixed", "packed"),
    )
    global_batch_size: int = option(
        256, "Samples per optimizer step, summed over all ranks and accumulation steps.", at_least=1
    )
    micro_batch_size: int = option(
        32, "Samples per rank per forward/backward; accumulation = global / (micro * ranks).", at_least=1
    )
    eval_batch_size: int = option(64, "Samples per rank per eval forward.", at_least=1)
    eval_samples: int | None = option(10000, "Eval samples to use from the eval files (None: all of them).", at_least=1)
    prefetch: int = option(2, "Batches prepared ahead of the training step by a background thread.", at_least=0)
    length_bins: int = option(
        0,
        "Fixed layout: sort each global batch by length and deal it out so every rank's k-th micro-batch has "
        "the same lengths, each cut to the upper edge of its bin (seq_length / length_bins steps). 0: off; "
        "MLPerf-style 4 bins: 4. The samples of every step stay the same.",
        at_least=0,
    )


@dataclass(kw_only=True)
class OptimizerConfig:
    name: str = option(
        "lamb",
        "Optimizer (the benchmark's: lamb for bert, adam/adamw for gpt3/llama31_8b).",
        choices=("lamb", "adam", "adamw"),
    )
    lr: float = option(4e-4, "Base (peak) learning rate: MLPerf `opt_base_learning_rate`.", above=0)
    beta1: float = option(0.9, "First-moment decay.", at_least=0, below=1)
    beta2: float = option(0.999, "Second-moment decay.", at_least=0, below=1)
    epsilon: float = option(1e-6, "Added to the second-moment root.", above=0)
    weight_decay: float = option(
        0.01, "Decoupled weight decay; never applied to biases and LayerNorm.", at_least=0, at_most=1
    )
    max_grad_norm: float = option(
        1.0, "Clip the global gradient norm to this before the update (0: no clipping).", at_least=0
    )
    bias_correction: bool = option(True, "Adam-style bias correction of both moments.")
    clip: str = option(
        "global",
        "Where max_grad_norm applies: global (one norm over the all-reduced gradient, the reference) or bucket "
        "(each DDP bucket of each rank's gradient clipped by its own norm before the all-reduce; multi-rank only).",
        choices=("global", "bucket"),
    )


@dataclass(kw_only=True)
class ScheduleConfig:
    warmup_steps: int = option(0, "Linear warmup steps: MLPerf `opt_learning_rate_warmup_steps`.", at_least=0)
    start_warmup_step: int = option(0, "Step at which warmup begins (negative starts it earlier).")
    total_steps: int = option(10000, "Steps of the decay: MLPerf `opt_learning_rate_training_steps`.", at_least=1)
    poly_power: float = option(1.0, "Power of the polynomial decay after warmup (1.0: linear).", at_least=0)
    end_lr: float | None = option(
        None, "Learning rate at the end of a cosine decay (None: 0.1 x optimizer.lr).", at_least=0
    )
    max_samples: int | None = option(
        None, "Stop, status aborted, after this many samples (None: total_steps x GBS).", at_least=1
    )


@dataclass(kw_only=True)
class EvalConfig:
    target: float = option(0.72, "Quality target; the run succeeds at the first eval that reaches it.")
    every_samples: int | None = option(
        None, "Eval every N training samples (None: the benchmark's MLPerf rule).", at_least=1
    )


@dataclass(kw_only=True)
class DistributedConfig:
    nproc: int = option(1, "Processes (one per GPU, or CPU ranks) on this node; >1 launches torchrun.", at_least=1)
    nodes: int = option(
        1, "Nodes the run spans, each with nproc processes (`trainbench submit` sets it from the system file).",
        at_least=1,
    )  # fmt: skip
    backend: str = option("auto", "torch.distributed backend.", choices=("auto", "gloo", "nccl"))
    timeout_s: float = option(
        600.0,
        "Longest wait in one collective (s): a rank whose peer hangs without dying (a node cut off from the network) "
        "fails after this instead of waiting forever. Longer than the slowest checkpoint save or eval.",
        above=0,
    )
    tp: int = option(
        1, "Tensor-parallel degree (LLM benchmarks): ranks per tensor-parallel group; the rest is FSDP.", at_least=1
    )
    ep: int = option(
        1, "Expert-parallel degree (mixture-of-experts benchmarks): each rank holds num_experts / ep of each block's "
        "experts and sends every token to its experts' ranks by all-to-all; 1 (every rank holds all, sharded by FSDP) "
        "or the run's number of ranks.", at_least=1
    )  # fmt: skip
    expert_rebalance_every: int = option(
        0, "With distributed.ep: every N steps, deal each block's experts out again over the ranks by the tokens "
        "each took since (the model unchanged: a token's expert found by its slot), so that no rank's experts take "
        "far more than the mean and the others wait on it; 0: each rank keeps its contiguous share. Run on one "
        "GPU's kernels (two ranks sharing it), not yet over NCCL on several GPUs (docs/gpt_oss.md).", at_least=0
    )  # fmt: skip
    expert_exchange: str = option(
        "bf16",
        "With distributed.ep and model.precision=fp8 (gpt_oss_20b): the all-to-all's rows: bf16, or fp8 (the rows to "
        "the experts' ranks, and the gradients of the experts' outputs on their way back to them, in e4m3 with a "
        "power-of-two scale a row, as FP8's grouped products cast them: half the bytes of two of the four "
        "all-to-alls; the forward the same to the bit). Run on one GPU's kernels (two ranks sharing it), not yet "
        "over NCCL on several GPUs (docs/gpt_oss.md).",
        choices=("bf16", "fp8"),
    )
    expert_row_casts: str = option(
        "compiled",
        "With distributed.ep and model.precision=fp8 (gpt_oss_20b): how the rows of the experts' FP8 grouped products "
        "are cast to e4m3, outside the compiled blocks under expert parallelism (4 casts a block and micro-batch): "
        "compiled (torch.compile's function, which reads each row twice) or kernel (one Triton pass a row, the same "
        "values: 0.20 against 0.46 ms for 65,536 rows of 2,880 on an H200). Run on one GPU's kernels (two ranks "
        "sharing it), not yet over NCCL on several GPUs (docs/gpt_oss.md).",
        choices=("compiled", "kernel"),
    )
    shard_one_rank: bool = option(
        False, "LLM benchmarks: shard the model with FSDP2 on one rank too (a process group of one), placed as "
        "several ranks place it (bf16 or FP8 gathers, fp32 gradients), to measure that placement on one GPU."
    )  # fmt: skip
    bucket_cap_mb: float = option(
        25.0, "DDP gradient bucket size (MB): each bucket's all-reduce starts while backward goes on.", above=0
    )
    reduce_once_a_step: bool = option(
        False, "FSDP2 with accumulation (llama31_8b, gpt3, gpt_oss_20b, flux1): reduce-scatter the gradients once a "
        "step, with the last micro-batch's backward, instead of once a micro-batch; the micro-batches before it keep "
        "their gradients whole and unreduced on every rank (the whole model's, in fp32) and their weights gathered "
        "after their backward (one gather a micro-batch fewer). Off by default: it needs the whole model's fp32 "
        "gradients and gathered weights on every GPU (flux1 on 2 H200: 9 % faster at truncated depth, and its whole "
        "model out of memory so; docs/flux1.md)."
    )  # fmt: skip
    keep_gathered: bool = option(
        False, "FSDP2 with accumulation (llama31_8b, gpt3, gpt_oss_20b, flux1): keep each block's weights gathered "
        "through a step's micro-batches before the last, so that a step gathers them twice (the first forward, the "
        "last backward) instead of twice a micro-batch; the gradients are still reduce-scattered each micro-batch "
        "(with distributed.reduce_once_a_step, once). Costs every block's gathered weights on every GPU (a byte a "
        "parameter gathered in FP8, two in bf16). Off by default: on 2 H200 the 8B measured 3.2 % slower (its memory "
        "cost the plan a row a micro-batch; docs/llm.md); flux1 at GBS 512, reduced once a step, 0.989 of one GPU a "
        "GPU against 0.91 without it, at a memory the whole model does not fit on 2 H200 (docs/flux1.md)."
    )  # fmt: skip
    keep_outer_gathered: bool = option(
        True, "FSDP2 on a decoder (llama31_8b, gpt3, gpt_oss_20b): the layers outside the blocks (the embedding, the "
        "final norm, the output layer), which no block's compute hides, are gathered once a step and kept gathered "
        "between its micro-batches instead of once a micro-batch (they are held gathered through each micro-batch "
        "anyway: no more memory at the peak); their gradients are still reduce-scattered each micro-batch. false: "
        "gathered each micro-batch (docs/llm.md)."
    )  # fmt: skip
    output_layer_apart: bool = option(
        False, "FSDP2 on a decoder (llama31_8b, gpt3, gpt_oss_20b): the output layer sharded as a unit of its own, so "
        "that its gradient's reduce-scatter runs beside the blocks' backward instead of after the embedding's, at the "
        "backward's end. Off by default: the reduce-scatter then runs at the step's peak of memory (3 GiB more for "
        "the 8B on 2 H200, for 0.25 % over the root kept alone; counting it, the plan fits two rows a micro-batch "
        "with 0.2 GiB to spare; docs/llm.md). "
        "Not with model.output_precision=fp8, whose own function reads the layer's weight."
    )  # fmt: skip
    grad_reduce_dtype: str = option(
        "fp32",
        "Type of the gradients on the wire: fp32, or bf16 (half the traffic). DDP (bert, dlrmv4's dense part): each "
        "bucket rounded to bf16, summed, and cast back. FSDP2 (llama31_8b, gpt3, gpt_oss_20b, flux1): each "
        "micro-batch's gradients reduce-scattered in bf16 and added to the fp32 shard; with "
        "distributed.reduce_once_a_step the micro-batches' whole gradients are summed in bf16 too (docs/llm.md).",
        choices=("fp32", "bf16"),
    )

    @property
    def world_size(self) -> int:
        """Ranks in the whole run: nodes x processes per node."""
        return self.nodes * self.nproc

    overlap_compiled: str = option(
        "auto",
        "With compile and DDP: split the compiled graph at the bucket boundaries, so each bucket's all-reduce "
        "overlaps backward (true), or compile one graph and all-reduce every bucket after backward (false: "
        "more fusion, and backward's GEMMs do not share the GPU with NCCL). auto: false when every rank is on "
        "one node (faster over NVLink, docs/performance.md), true across nodes.",
        choices=("auto", "true", "false"),
    )


@dataclass(kw_only=True)
class PerfConfig:
    compile: bool = option(
        False, "torch.compile the model (forward and backward) and fuse the optimizer update into a few kernels."
    )
    activation_checkpointing: bool = option(
        False, "LLM benchmarks: recompute each block's activations in backward instead of keeping them."
    )
    recompute_blocks: int = option(
        0,
        "With activation_checkpointing: recompute the activations of only the last N blocks (with offload_blocks: N "
        "spread over the depth among the others); the others keep theirs (faster, more memory: the 70B LoRA runs 56 "
        "of 80 on an H200, docs/lora.md). 0: every block.",
        at_least=0,
    )
    offload_blocks: int = option(
        0,
        "Blocks, among those that keep their activations, whose saved activations wait in pinned host memory "
        "between forward and backward, copied on a side stream while the GPU computes (CUDA; llama2_70b_lora with "
        "model.base_precision=fp8): more blocks without recompute where the GPU's memory ends (docs/lora.md).",
        at_least=0,
    )
    offload_recomputed_inputs: bool = option(
        False,
        "The input of each recomputed block (all it keeps between forward and backward) waits in pinned host memory "
        "too (CUDA; llama2_70b_lora with model.base_precision=fp8): 128 MiB a block at the 70B shape.",
    )
    plan: str = option(
        "manual",
        "How recompute, offload and the base's precision are chosen (llama2_70b_lora; llama31_8b: the blocks "
        "recomputed and up to 2 rows a micro-batch where they fit with no more recomputed): manual (the keys as "
        "given) or auto (planned from this GPU's memory, host memory and a probe of one block, cached per machine; "
        "keys given by hand are kept, docs/lora.md, docs/llm.md).",
        choices=("manual", "auto"),
    )
    probe_sustained_s: float = option(
        0.0,
        "perf.plan=auto: seconds of training steps the probe runs before it times its blocks, so that it times them "
        "at the clock the GPU's power cap holds through a run (a probe of a few steps times them at the boost clock: "
        "on an H200 the LoRA's plan then predicted 7.4 % faster than it ran). 0: timed within its first five steps. "
        "The LoRA's MLPerf preset holds 20 s, with perf.probe_blocks=8 (docs/lora.md, 'Layout chosen by the tool').",
        at_least=0,
        at_most=600,
    )
    probe_blocks: int = option(
        2,
        "perf.plan=auto: blocks in the probe's model (at most the model's, at least 2), each step queued while the "
        "one before runs. Held at the power cap with 2, the part of its step outside the blocks (the output layer, "
        "the loss, the optimizer: 12-14 ms of 82 at the 70B LoRA's shape) let the GPU's clock run 7-10 % above a "
        "run's; with 8 (the LoRA's MLPerf preset), the clock a run holds (docs/lora.md, 'Layout chosen by the tool').",
        at_least=2,
        at_most=128,
    )
    gpu_memory_gib: float | None = option(
        None,
        "Use at most this much of each GPU, as if it had this much memory in all (CUDA): the allocator refuses beyond "
        "it and perf.plan=auto plans for it, e.g. 79.6 to plan and run an 80 GB H100's layout on a larger GPU. "
        "None: the whole GPU.",
        above=0,
    )
    cuda_graphs: bool = option(
        False, "With compile: replay the compiled forward and backward as CUDA graphs (static shapes; CUDA only)."
    )
    optimizer_kernel: str = option(
        "auto",
        "The AdamW update of each large fp32 parameter on CUDA (llama31_8b, gpt3, gpt_oss_20b, flux1): own (one pass "
        "of trainbench's kernel, tb_adamw), torch (torch's fused AdamW for every parameter) or auto (own on one rank, "
        "where it measured faster; torch over several ranks, where it did not: docs/performance.md).",
        choices=("auto", "own", "torch"),
    )
    sharded_tables: bool = option(
        False,
        "dlrmv4: shard every embedding table row-wise over the ranks (one all-to-all for all tables' lookups and "
        "their gradients, RowWiseAdagrad on the touched rows alone, the dense parameters under DDP) instead of every "
        "rank holding every table (docs/dlrmv4.md).",
    )
    lookup_once_a_step: bool = option(
        False,
        "dlrmv4 with perf.sharded_tables: every micro-batch of a step looked up in one exchange before the first "
        "forward (a row asked by several micro-batches asked once; two host syncs a step instead of two a "
        "micro-batch), their gradients summed over the step and sent back once, in the last backward. Off by "
        "default: not yet measured or run over NCCL on several GPUs (docs/dlrmv4.md).",
    )
    hstu_attention: str = option(
        "auto",
        "dlrmv4: the HSTU layers' attention: jagged (trainbench's Triton kernel over the valid pairs alone, no score "
        "kept; CUDA), dense (every pair's score computed, kept and masked, torch's operations) or auto (jagged on "
        "CUDA where Triton imports, dense elsewhere; docs/dlrmv4.md).",
        choices=("auto", "jagged", "dense"),
    )
    gc_every_steps: int = option(
        50,
        "N > 0: objects made during set-up are frozen, automatic garbage collection is off, and every rank "
        "collects the young generations at the same step, every N steps, and everything after each eval "
        "(automatic collections stalled 4-GPU runs for ~1.4 s every ~30 steps). 0: Python's automatic collection.",
        at_least=0,
    )


@dataclass(kw_only=True)
class OutputConfig:
    results_dir: str = option("results", "Where run folders are created.")
    gpu_links: bool = option(
        True,
        "Record how the host's GPUs are linked (their active NVLinks, read through NVML) in the run's and bench.json's "
        "system (system.gpu_links), which a comparison of two machines names where they differ (docs/bench.md).",
    )
    log_every_steps: int = option(10, "Steps between loss/throughput records (each is a host sync).", at_least=1)
    profile: bool = option(
        False,
        "Record a torch.profiler window on every rank: profile_<i>_kernels.csv, a Chrome trace and, on a GPU, "
        "where each step's time went (profile_<i>_timeline.json; ranks > 0: profile_<i>_rank<r>_*).",
    )
    profile_start_step: int = option(5, "First profiled step (after warm-up).", at_least=0)
    profile_steps: int = option(3, "Steps in the profiled window.", at_least=1)
    telemetry_hz: float = option(
        1.0,
        "GPU (or CPU) telemetry samples per second into telemetry_<host>_*.csv (0: off; MLPerf Power: >= 1).",
        at_most=100,
        zero_or_at_least=0.01,
    )
    checkpoint_every_steps: int = option(
        0,
        "Save a checkpoint every N steps (0: only when SIGUSR1/SIGTERM asks to stop); resume=true continues.",
        at_least=0,
    )
    run_dir: str | None = option(
        None, "Write into this run folder instead of a new one under results_dir (resume=true: continue it)."
    )
    progress: bool = option(True, "Show a live progress line on rank 0.")
    submission_org: str = option("trainbench", "MLPerf `submission_org`.")
    submission_platform: str = option("", "MLPerf `submission_platform` (empty: derived from the machine).")
    division: str = option("closed", "MLPerf `submission_division`.", choices=("closed", "open"))
    ruleset: str = option(
        "",
        "mlperf-logging ruleset the run's log follows and is checked under (e.g. 6.1.0, 5.1.0; empty: the "
        "benchmark's newest, as `trainbench list` shows); `--ruleset` sets it.",
    )
    config_filename: str = option(
        "", "MLPerf `config_filename`: the --config files' names (set by --config; empty: the preset's name)."
    )
    status: str = option("onprem", "MLPerf `submission_status`.", choices=("onprem", "cloud", "preview", "research"))


@dataclass(kw_only=True)
class RunConfig:
    benchmark: str = option("", "Benchmark name (see `trainbench list`); set by the preset.")
    preset: str = option("tiny", "Preset the config started from.")
    seed: int = option(1234, "Seed of the run (experiment i of --nexp uses seed + i).", at_least=0, below=2**63)
    resume: bool = option(
        False, "Continue unfinished runs from their checkpoints: output.run_dir, else the newest run folder."
    )
    device: str = option("auto", "Where to train (auto: CUDA when present).", choices=("auto", "cpu", "cuda"))
    precision: str = option(
        "auto", "Compute precision (auto: bf16 autocast on CUDA, fp32 on CPU).", choices=("auto", "fp32", "bf16")
    )
    model: Any = section(dict, "Model architecture; its fields depend on the benchmark.")
    data: DataConfig = section(DataConfig, "Data location and batch sizes.")
    optimizer: OptimizerConfig = section(OptimizerConfig, "Optimizer hyperparameters.")
    schedule: ScheduleConfig = section(ScheduleConfig, "Learning-rate schedule and run length.")
    eval: EvalConfig = section(EvalConfig, "Quality target and eval cadence.")
    distributed: DistributedConfig = section(DistributedConfig, "Processes and backend.")
    perf: PerfConfig = section(PerfConfig, "Speed switches that do not change the algorithm.")
    output: OutputConfig = section(OutputConfig, "Results folder and MLPerf submission fields.")


# ---------------------------------------------------------------------------------------------
# Flattened view of a config: dotted key -> (owner dataclass instance, field)


@dataclass(frozen=True)
class Leaf:
    key: str
    owner: Any
    field: dataclasses.Field
    type: Any

    @property
    def help(self) -> str:
        return self.field.metadata.get("help", "")

    @property
    def choices(self) -> tuple[str, ...] | None:
        return self.field.metadata.get("choices")


def leaves(cfg: Any, prefix: str = "") -> dict[str, Leaf]:
    """Every settable field of a (nested) config dataclass, by dotted key."""
    out: dict[str, Leaf] = {}
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            out.update(leaves(value, key + "."))
        else:
            out[key] = Leaf(key, cfg, f, hints[f.name])
    return out


RENAMED = {"perf.layout": "perf.plan"}
"""Keys given a new name, old -> new: the old one still works for one release, with a one-line notice."""
_noticed: set[str] = set()


def _resolve_key(key: str, table: dict[str, Leaf]) -> Leaf:
    if key in RENAMED:
        if key not in _noticed:
            _noticed.add(key)
            from trainbench.console import console

            console.print(f"note: config key '{key}' is now '{RENAMED[key]}'; the old name will stop working in the "
                          "next release", style="yellow")  # fmt: skip
        key = RENAMED[key]
    if key in table:
        return table[key]
    matches = [k for k in table if k.rsplit(".", 1)[-1] == key]
    if len(matches) == 1:
        return table[matches[0]]
    if len(matches) > 1:
        raise ConfigError(f"config key '{key}' is ambiguous; write one of: {', '.join(sorted(matches))}")
    close = difflib.get_close_matches(key, list(table), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise ConfigError(f"unknown config key '{key}'{hint}; valid keys: {', '.join(table)}")


def _type_name(tp: Any) -> str:
    args = typing.get_args(tp)
    if args:
        return " or ".join("None" if a is type(None) else a.__name__ for a in args)
    return tp.__name__


_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def coerce(leaf: Leaf, value: Any) -> Any:
    """Convert a value from the command line (a string) or a YAML file to the field's type, or raise; a number
    outside the field's range is refused with the key, the value and the range."""
    converted = _convert(leaf, value)
    if isinstance(converted, (int, float)) and not isinstance(converted, bool):
        problem = _out_of_range(leaf.field.metadata, converted)
        if problem:
            raise ConfigError(f"config key '{leaf.key}' {problem}; got {value!r}")
    return converted


PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
"""A name that becomes part of a path or a command line (a benchmark, preset, system or organisation): one folder
name, never read as an option (no leading '-') nor as '.' or '..' (no leading '.')."""


def is_plain_name(value: object) -> bool:
    return isinstance(value, str) and PLAIN_NAME.fullmatch(value) is not None


def has_control_character(value: str) -> bool:
    """Whether ``value`` holds a control character (a line break ends a shell line: no quoting makes it data)."""
    return any(ord(c) < 32 or ord(c) == 127 for c in value)


def _out_of_range(meta: Any, number: float) -> str | None:
    if number != number or number in (float("inf"), float("-inf")):
        return "must be a finite number"
    lo, above, below, hi = meta.get("at_least"), meta.get("above"), meta.get("below"), meta.get("at_most")
    off_or = meta.get("zero_or_at_least")
    if off_or is not None and (number < 0 or 0 < number < off_or or hi is not None and number > hi):
        return f"must be 0 (off) or between {off_or:g} and {hi:g}" if hi is not None else f"must be 0 or {off_or:g} up"
    if (lo is not None and number < lo or above is not None and number <= above
            or below is not None and number >= below or hi is not None and number > hi):  # fmt: skip
        parts = ([f"at least {lo:g}"] if lo is not None else []) + ([f"above {above:g}"] if above is not None else [])
        parts += ([f"below {below:g}"] if below is not None else []) + ([f"at most {hi:g}"] if hi is not None else [])
        return "must be " + " and ".join(parts)
    return None


def _convert(leaf: Leaf, value: Any) -> Any:
    tp = leaf.type
    args = typing.get_args(tp)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), tp)

    def bad() -> ConfigError:
        return ConfigError(f"config key '{leaf.key}' expects {_type_name(tp)}, got {value!r}")

    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null", "")):
        if optional:
            return None
        raise bad()
    if base is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise bad()
    if base is int:
        if isinstance(value, bool):
            raise bad()
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            return _parse_int(value, bad)
        raise bad()
    if base is float:
        if isinstance(value, bool):
            raise bad()
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise bad() from None
        raise bad()
    if base is str:
        if isinstance(value, bool) and leaf.choices and {"true", "false"} <= set(leaf.choices):
            value = "true" if value else "false"  # YAML's true/false for a switch that also takes auto
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise bad()
        value = str(value)
        if has_control_character(value):
            raise ConfigError(f"config key '{leaf.key}' holds a control character ({value!r}); give it on one line")
        if leaf.choices and value not in leaf.choices:
            raise ConfigError(f"config key '{leaf.key}' must be one of {', '.join(leaf.choices)}; got '{value}'")
        return value
    raise bad()


def _parse_int(text: str, bad: Any) -> int:
    """An integer from its text, exactly: ``9007199254740993`` stays itself (through a float it would become
    ...992), and ``1e3`` or ``64.0`` are whole numbers written otherwise."""
    from decimal import Decimal, InvalidOperation

    digits = text.strip().replace("_", "")
    try:
        return int(digits)
    except ValueError:
        pass
    try:
        number = Decimal(digits)
    except InvalidOperation:
        raise bad() from None
    # A finite, whole number of at most 100 digits (int() of 1e999999999 would take the machine's memory).
    if not number.is_finite() or number.adjusted() > 100 or number != number.to_integral_value():
        raise bad()
    return int(number)


def apply_overrides(cfg: Any, overrides: dict[str, Any]) -> list[str]:
    """Set each key (dotted or unambiguous leaf name) to its value, checking types, in ``cfg`` (mutated). Returns
    the dotted keys set."""
    table = leaves(cfg)
    done = []
    for key, value in overrides.items():
        leaf = _resolve_key(key, table)
        setattr(leaf.owner, leaf.field.name, coerce(leaf, value))
        done.append(leaf.key)
    return done


def parse_key_values(args: list[str]) -> dict[str, str]:
    """``["a.b=1", "lr=2e-4"]`` -> ``{"a.b": "1", "lr": "2e-4"}``; a malformed argument is a ConfigError."""
    out: dict[str, str] = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{arg}' is not of the form key=value (for example optimizer.lr=1e-3)")
        out[key.strip()] = value
    return out


def _flatten(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def read_yaml_file(path: Path, what: str) -> Any:
    """A YAML file's value, or one sentence naming the file: not UTF-8 text, not YAML, or an alias that refers to
    itself (PyYAML builds such a value, and reading it recurses without end)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {path} is not UTF-8 text; save it as UTF-8") from None
    try:
        data = yaml.safe_load(text)
        _finite_depth(data)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {path} is not valid YAML: {' '.join(str(exc).split())}") from None
    except RecursionError:
        raise ConfigError(f"{what} {path} nests too deep, or holds an alias that refers to itself; write its "
                          "values out") from None  # fmt: skip
    return data


def _finite_depth(value: Any, depth: int = 0) -> None:
    """Raise RecursionError for a value nested deeper than any config (a recursive alias is infinitely deep)."""
    if depth > 50:
        raise RecursionError
    if isinstance(value, dict):
        for v in value.values():
            _finite_depth(v, depth + 1)
    elif isinstance(value, list):
        for v in value:
            _finite_depth(v, depth + 1)


def read_yaml_overrides(path: str | Path) -> dict[str, Any]:
    """A YAML file of (possibly nested) overrides, flattened to dotted keys."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    data = read_yaml_file(path, "config file")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys to values")
    return _flatten(data)


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config(cfg: Any, path: str | Path, comment: str | None = None) -> None:
    """The config as YAML that :func:`load_config` reads back the same; ``comment`` first, as a YAML comment."""
    head = "".join(f"# {line}\n" for line in comment.splitlines()) if comment else ""
    Path(path).write_text(head + yaml.safe_dump(to_dict(cfg), sort_keys=False))


def describe(cfg: Any) -> str:
    """One line per key: name, type, current value, help. Used by --help-config."""
    rows = []
    for key, leaf in leaves(cfg).items():
        value = getattr(leaf.owner, leaf.field.name)
        choices = f" [{'|'.join(leaf.choices)}]" if leaf.choices else ""
        rows.append(f"  {key} ({_type_name(leaf.type)}{choices}) = {value!r}\n      {leaf.help}")
    return "\n".join(rows)


def keys_without_effect(cfg: RunConfig) -> dict[str, str]:
    """Keys that only some configurations read, with why this one does not: DDP's settings on one rank (nothing is
    all-reduced), the compiled graph's split without compile, the recomputed blocks' offload with nothing
    recomputed. A benchmark that never reads one says so in its ``unused_keys`` instead."""
    out: dict[str, str] = {}
    if cfg.distributed.world_size == 1:
        one = "one rank all-reduces no gradients (it applies with --nproc or distributed.nodes above 1)"
        for key in ("distributed.bucket_cap_mb", "distributed.overlap_compiled"):
            out[key] = one
        if not cfg.distributed.shard_one_rank:  # (FSDP2 over a group of one reduce-scatters: what it measures)
            for key in ("distributed.reduce_once_a_step", "distributed.grad_reduce_dtype", "distributed.keep_gathered",
                        "distributed.keep_outer_gathered", "distributed.output_layer_apart"):  # fmt: skip
                out[key] = one
    if not cfg.perf.compile:
        out.setdefault("distributed.overlap_compiled", "it splits the compiled graph, and perf.compile=false")
    if cfg.device == "cpu":
        out["perf.optimizer_kernel"] = "the CPU takes torch's AdamW update for every parameter (device=cpu)"
        out["output.gpu_links"] = "a run on the CPU records no GPU's links (device=cpu)"
    if not cfg.perf.activation_checkpointing:
        out["perf.offload_recomputed_inputs"] = "no block is recomputed (perf.activation_checkpointing=false)"
    if cfg.perf.plan != "auto":
        out["perf.probe_sustained_s"] = out["perf.probe_blocks"] = (
            "only perf.plan=auto probes the GPU (perf.plan=manual)"
        )
    return out
