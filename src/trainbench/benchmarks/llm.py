"""MLPerf `gpt3` and `llama31_8b`: decoder-only pretraining with Adam(W) to a target log perplexity.

One model (:mod:`trainbench.families.decoder.model`), one data path (Megatron indexed datasets cut into fixed-length
samples), one loop. Rules followed:

- `llama31_8b` (MLPerf Training 5.1): Llama 3.1 8B from scratch on C4, seq 8192, AdamW beta 0.9/0.95,
  eps 1e-5, weight decay 0.1, clip 1.0, cosine decay with linear warmup over 1.2 M steps, eval on 1,024
  sequences every 12,288 sequences, target log perplexity <= 3.3.
- `gpt3` (MLPerf Training 4.1): GPT-3 175B on C4, seq 2048, Adam beta 0.9/0.95, eps 1e-8, weight decay 0.1,
  clip 1.0, eval every 24,576 sequences, target log perplexity <= 2.69 (MLPerf starts from its step-4000
  checkpoint; trainbench loads no GPT-3 checkpoint, so a GPT-3 run here starts from scratch and is not compliant).

The eval metric is the mean next-token cross entropy (nats) over every token of the eval sequences.
"""

from __future__ import annotations

import dataclasses
import json
from abc import abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trainbench.benchmarks import llm_prepare
from trainbench.benchmarks.base import Benchmark, BenchmarkData
from trainbench.config import DataConfig, EvalConfig, OptimizerConfig, RunConfig, ScheduleConfig
from trainbench.data import checks
from trainbench.data.indexed import IndexedDataset, PackedSamples, find_prefixes
from trainbench.data.steps import CycledSteps, Step, batched, eval_share, rank_share
from trainbench.errors import DataError
from trainbench.families.base import ModelFamily
from trainbench.families.configs import DecoderConfig
from trainbench.families.decoder.family import DecoderFamily
from trainbench.mlperf import constants
from trainbench.optim.schedules import cosine_warmup_lr

if TYPE_CHECKING:
    import torch


def run_config(name: str, preset: str, model: DecoderConfig, data: DataConfig, optimizer: OptimizerConfig,
         schedule: ScheduleConfig, target: float, every: int | None = None) -> RunConfig:  # fmt: skip
    """A preset's config for an LLM-family benchmark: its model, data, optimizer and schedule, the target log
    perplexity and how often to evaluate (samples; None: the benchmark's cadence). Part of the family's public API
    (docs/extending.md), with TINY_MODEL, TINY_DATA and :func:`tiny`."""
    # A copy: overrides change the run's config, never the module's shapes.
    model = dataclasses.replace(model)
    return RunConfig(benchmark=name, preset=preset, model=model, data=data, optimizer=optimizer, schedule=schedule,
                     eval=EvalConfig(target=target, every_samples=every))  # fmt: skip


TINY_MODEL = DecoderConfig(
    vocab_size=512, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=384,
    max_seq_length=128, rope_theta=10000.0,
)  # fmt: skip
TINY_DATA = DataConfig(seq_length=128, global_batch_size=32, micro_batch_size=32, eval_batch_size=64, eval_samples=256)


def tiny(name: str, arch: str, optimizer: str, epsilon: float) -> RunConfig:
    """2 blocks, width 128, on the synthetic Markov language of `prepare <bench> --synthetic --preset tiny`:
    reaches log perplexity 1.6 (the language's floor is about 1.27) in about a minute on 2 CPU cores."""
    model = TINY_MODEL if arch == TINY_MODEL.arch else dataclasses.replace(TINY_MODEL, arch=arch, num_kv_heads=None)
    opt = OptimizerConfig(name=optimizer, lr=3e-3, beta1=0.9, beta2=0.95, epsilon=epsilon, weight_decay=0.1,
                          max_grad_norm=1.0)  # fmt: skip
    sched = ScheduleConfig(warmup_steps=20, total_steps=1000)
    return run_config(name, "tiny", model, dataclasses.replace(TINY_DATA), opt, sched, target=1.6, every=3200)


def llama(preset: str, model: DecoderConfig, gbs: int, micro: int, lr: float) -> RunConfig:
    return run_config(
        "llama31_8b", preset, model,
        DataConfig(seq_length=8192, global_batch_size=gbs, micro_batch_size=micro, eval_batch_size=1,
                   eval_samples=1024),
        OptimizerConfig(name="adamw", lr=lr, beta1=0.9, beta2=0.95, epsilon=1e-5, weight_decay=0.1, max_grad_norm=1.0),
        ScheduleConfig(warmup_steps=16, total_steps=1_200_000), target=3.3,
    )  # fmt: skip


# The defaults are Llama 3.1 8B. One qkv_proj, as the reference (Megatron's linear_qkv): in FP8 the attention's
# input is then cast once, not three times (docs/notes/llm.md, "Where a block's time goes").
LLAMA31_8B = DecoderConfig(fused_qkv=True)
LLAMA_1B = DecoderConfig(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, intermediate_size=8192,
                         tie_embeddings=True)  # the Llama 3.2 1B shape: one GPU  # fmt: skip

# GPT-3 paper, table 2.1: (layers, d_model, heads). The paper gives 24 heads of 128 for 1.3B, which does not
# multiply to 2048, and d_model 5140 for 13B; we use 16 heads of 128 and 5120, as Megatron does.
GPT3_SHAPES = {
    "gpt3-125m": (12, 768, 12),
    "gpt3-350m": (24, 1024, 16),
    "gpt3-760m": (24, 1536, 16),
    "gpt3-1.3b": (24, 2048, 16),
    "gpt3-2.7b": (32, 2560, 32),
    "gpt3-6.7b": (32, 4096, 32),
    "gpt3-13b": (40, 5120, 40),
    "gpt3-175b": (96, 12288, 96),
}


def gpt3(preset: str) -> RunConfig:
    layers, width, heads = GPT3_SHAPES[preset]
    model = DecoderConfig(arch="gpt3", vocab_size=50257, hidden_size=width, num_layers=layers, num_heads=heads,
                          num_kv_heads=None, intermediate_size=4 * width, max_seq_length=2048)  # fmt: skip
    return run_config(
        "gpt3", preset, model,
        DataConfig(seq_length=2048, global_batch_size=1536, micro_batch_size=1, eval_batch_size=1, eval_samples=24567),
        OptimizerConfig(name="adam", lr=2e-5, beta1=0.9, beta2=0.95, epsilon=1e-8, weight_decay=0.1, max_grad_norm=1.0),
        ScheduleConfig(warmup_steps=265, total_steps=108_600), target=2.69,
    )  # fmt: skip


EVAL_SEQUENCES = 1024  # MLPerf's C4 validation sequences (llama31_8b; a throughput run's eval set where none is set)


def read_manifest(data_dir: str) -> dict:
    """The manifest of a folder made by `prepare` (read once: the end-of-document token and the vocabulary come
    from it)."""
    path = Path(data_dir) / "manifest.json"
    if path.exists():
        checks.inside(data_dir, path)
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: cannot read it ({e}); make the folder with `trainbench prepare`") from None
    if not isinstance(manifest, dict):
        raise DataError(f"{path} is not a data set's manifest; make the folder with `trainbench prepare`")
    return manifest | {"path": str(path)}


class LLMBenchmark(Benchmark):
    """The decoder-only language-model family (llama or gpt3 architecture): a new member subclasses it and gives its
    name, presets and target; model, placement, data, optimizer, loss and eval come from here (docs/extending.md)."""

    metric_name = "log_perplexity"
    metric_explanation = ("log_perplexity is the mean next-token cross entropy over the eval tokens, in nats (the "
                          "log of the perplexity); lower is better.")  # fmt: skip
    higher_is_better = False
    family: ModelFamily = DecoderFamily()
    eval_every: int
    unused_keys = {
        "data.max_predictions": "it predicts every next token, not masked ones",
        "data.layout": "its samples are fixed-length token windows, never packed rows",
        "data.length_bins": "its samples are fixed-length token windows: every one has seq_length tokens",
        "optimizer.bias_correction": "Adam(W) always corrects both moments",
        "optimizer.clip": "it clips the global gradient norm (FSDP shards the gradients; no DDP buckets)",
        "schedule.start_warmup_step": "its warmup starts at step 0",
        "schedule.poly_power": "its schedule is a cosine decay to schedule.end_lr",
        "distributed.bucket_cap_mb": "FSDP2 reduce-scatters per block, not in DDP buckets",
        "distributed.overlap_compiled": "it compiles each block, and FSDP2 overlaps its collectives itself",
        "perf.cuda_graphs": "its blocks are compiled without CUDA graphs",
    }

    def eval_every_samples(self, cfg: RunConfig) -> int:
        return self.eval_every

    # -- data -----------------------------------------------------------------------------------
    def _split(self, cfg: RunConfig, split: str) -> list[IndexedDataset]:
        if not cfg.data.dir:
            raise DataError(f"no dataset given: set data.dir=DIR to a folder made by `trainbench prepare {self.name} "
                            f"--synthetic --preset {cfg.preset} --out DIR` or `--source C4_DIR`")  # fmt: skip
        root = Path(cfg.data.dir)
        return [IndexedDataset(p) for p in find_prefixes(root / split, f"{split} data")]

    def check_data(self, cfg: RunConfig, manifest: dict | None = None) -> None:
        """The folder's shards, every token of them, and its manifest's end-of-document token; ``manifest``: the
        folder's manifest where a subclass has read it already (else it is read here, where there is one)."""
        train, evals = self._split(cfg, "train"), self._split(cfg, "eval")
        vocab = cfg.model.vocab_size
        for d in train + evals:  # every shard's every token: a bad id in the last shard would stop the run mid-way
            d.check_ids(vocab)
        if manifest is None and (Path(cfg.data.dir) / "manifest.json").is_file():
            manifest = read_manifest(cfg.data.dir)
        # the manifest's end-of-document token, where it names one, is a token of the vocabulary
        if manifest is not None and "eod_id" in manifest:
            checks.token_id(manifest["eod_id"], vocab, manifest["path"], "eod_id (the end-of-document token)")
        n_eval = PackedSamples(evals, cfg.data.seq_length, 0).samples_per_epoch
        if cfg.data.eval_samples and cfg.data.eval_samples > n_eval:
            raise DataError(f"data.eval_samples={cfg.data.eval_samples} but the eval data holds {n_eval} sequences "
                            f"of {cfg.data.seq_length + 1} tokens")  # fmt: skip

    def build_data(self, cfg: RunConfig, rank: int, world_size: int, start_sample: int = 0) -> BenchmarkData:
        d = cfg.data
        train = PackedSamples(self._split(cfg, "train"), d.seq_length, cfg.seed)
        evals = PackedSamples(self._split(cfg, "eval"), d.seq_length, 0)
        n_eval = min(d.eval_samples or evals.samples_per_epoch, evals.samples_per_epoch)
        rows = self.batch_rows(cfg)
        eval_batches = [rows(evals.batch(b)) for b in batched(eval_share(n_eval, rank, world_size), d.eval_batch_size)]
        return BenchmarkData(
            train=TokenSteps(train, d.global_batch_size, d.micro_batch_size, rank, world_size, start_sample, rows),
            eval=eval_batches,
            train_samples=train.samples_per_epoch,
            eval_samples=n_eval,
        )

    def batch_rows(self, cfg: RunConfig):
        """A batch's arrays from its token windows [rows, seq_length + 1] (here the windows alone)."""
        return lambda tokens: {"tokens": tokens}

    # -- optimizer ------------------------------------------------------------------------------
    def build_optimizer(self, cfg: RunConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
        from trainbench.optim.adamw import AdamClipped, own_kernel_chosen
        from trainbench.optim.groups import weight_decay_split

        o = cfg.optimizer
        decay, plain = weight_decay_split(model)
        groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": plain, "weight_decay": 0.0}]
        # Fused on the CPU too: its square root is PyTorch's own vector code, the same bits on every CPU, where the
        # foreach update's goes through MKL, whose float32 root differs between Intel and AMD (optim/sqrt.py).
        return AdamClipped(
            groups,
            o.max_grad_norm,
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.epsilon,
            fused=True,
            own_kernel=own_kernel_chosen(cfg.perf.optimizer_kernel, cfg.distributed.world_size),
        )

    def end_lr(self, cfg: RunConfig) -> float:
        return cfg.schedule.end_lr if cfg.schedule.end_lr is not None else 0.1 * cfg.optimizer.lr

    def lr_at(self, cfg: RunConfig, step: int) -> float:
        s = cfg.schedule
        return cosine_warmup_lr(step, cfg.optimizer.lr, self.end_lr(cfg), s.warmup_steps, s.total_steps)

    # -- step -----------------------------------------------------------------------------------
    def loss_weights(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        import torch

        tokens = batch["tokens"]
        return torch.tensor([tokens.shape[0] * (tokens.shape[1] - 1)], dtype=torch.float32, device=tokens.device)

    def _token_losses(self, model, batch) -> torch.Tensor:
        tokens = batch["tokens"]
        return model(tokens[:, :-1], targets=tokens[:, 1:])

    def loss(self, model, batch, weights):
        return self._token_losses(model, batch) / weights[0]

    def eval_sums(self, model, batch) -> torch.Tensor:
        import torch

        count = torch.tensor(batch["tokens"][:, 1:].numel(), dtype=torch.float64, device=batch["tokens"].device)
        return torch.stack([self._token_losses(model, batch).double(), count])

    def eval_metric(self, sums: torch.Tensor) -> float:
        return float(sums[0] / sums[1].clamp(min=1))

    # -- throughput -----------------------------------------------------------------------------
    def bench_data(self, cfg: RunConfig, rank: int, world_size: int) -> BenchmarkData:
        """Windows of seq_length + 1 random token ids (C4's windows are full: every token counts)."""
        d = cfg.data
        rng = np.random.default_rng(cfg.seed)
        rows = self.batch_rows(cfg)
        pool = [rows(rng.integers(0, cfg.model.vocab_size, (d.global_batch_size, d.seq_length + 1)))
                for _ in range(2)]  # fmt: skip
        evals = rng.integers(0, cfg.model.vocab_size, (d.eval_batch_size, d.seq_length + 1))
        return BenchmarkData(train=CycledSteps(pool, d.global_batch_size, d.micro_batch_size, rank, world_size),
                             eval=[rows(evals)], train_samples=0,
                             eval_samples=d.eval_samples or EVAL_SEQUENCES)  # fmt: skip

    # -- MLPerf ---------------------------------------------------------------------------------
    @abstractmethod
    def optimizer_keys(self, cfg: RunConfig) -> dict[str, Any]:
        """The benchmark's own optimizer keys (opt_adamw_* or opt_adam_*)."""

    def hyperparameters(self, cfg: RunConfig) -> dict[str, Any]:
        o, s = cfg.optimizer, cfg.schedule
        return {
            "max_sequence_length": cfg.data.seq_length,
            constants.OPT_NAME: o.name,
            constants.OPT_BASE_LR: o.lr,
            constants.OPT_END_LR: self.end_lr(cfg),
            constants.OPT_LR_WARMUP_STEPS: s.warmup_steps,
            constants.OPT_LR_DECAY_STEPS: s.total_steps - s.warmup_steps,
            constants.OPT_LR_DECAY_SCHEDULE: "cosine with linear warmup",
            constants.OPT_GRADIENT_CLIP_NORM: o.max_grad_norm,
        } | self.optimizer_keys(cfg)

    # -- the command line -----------------------------------------------------------------------
    add_prepare_arguments = staticmethod(llm_prepare.add_arguments)

    @property
    def prepare_examples(self) -> str:
        return llm_prepare.EXAMPLES.format(name=self.name)

    def prepare(self, args) -> int:
        return llm_prepare.prepare(args, self)


class TokenSteps:
    """Optimizer steps of token windows: global batch k is samples [k*B, (k+1)*B) of the seeded order; data-
    parallel rank r takes its contiguous share, split into micro-batches."""

    def __init__(self, samples: PackedSamples, gbs: int, micro: int, rank: int, world: int, start_sample: int,
                 rows=lambda tokens: {"tokens": tokens}):  # fmt: skip
        self.samples, self.gbs, self.micro = samples, gbs, micro
        self.rank, self.world, self.start = rank, world, start_sample
        self.rows = rows  # a batch's arrays from its token windows

    def __iter__(self):
        k = self.start
        while True:
            share = rank_share(self.gbs, self.rank, self.world)
            tokens = self.samples.batch(range(k + share.start, k + share.stop))
            yield Step.split(self.rows(tokens), self.micro, self.gbs)
            k += self.gbs


class Llama31Benchmark(LLMBenchmark):
    name = "llama31_8b"
    mlperf_name = constants.LLAMA31_8B
    ruleset = "6.1.0"
    older_rulesets = ("6.0.0", "5.1.0")
    description = "Llama 3.1 8B pretraining on C4 (AdamW, seq 8192), target log perplexity 3.3"
    optimizer_name = "adamw"
    eval_every = 12_288
    full_preset = "llama31-8b"
    # Llama's rotary positions need no position table.
    presets = {
        "tiny": lambda: tiny("llama31_8b", arch="llama", optimizer="adamw", epsilon=1e-5),
        "llama-1b": lambda: llama("llama-1b", LLAMA_1B, gbs=32, micro=1, lr=1e-3),
        "llama31-8b": lambda: llama("llama31-8b", LLAMA31_8B, gbs=32, micro=1, lr=1e-3),
    }
    family = DecoderFamily(plans_layout=True)

    def waived_checks(self, cfg: RunConfig) -> frozenset[str]:
        waived = set()
        if cfg.data.seq_length != 8192:
            waived.add("max_sequence_length")
        if cfg.data.eval_samples != 1024:
            waived.add("eval_samples")
        if cfg.schedule.total_steps != 1_200_000:
            waived |= {"max_steps", "opt_learning_rate_decay_steps"}
        return frozenset(waived)

    def optimizer_keys(self, cfg: RunConfig) -> dict[str, Any]:
        o = cfg.optimizer
        return {
            constants.OPT_ADAMW_BETA_1: o.beta1,
            constants.OPT_ADAMW_BETA_2: o.beta2,
            constants.OPT_ADAMW_EPSILON: o.epsilon,
            constants.OPT_ADAMW_WEIGHT_DECAY: o.weight_decay,
            "max_steps": cfg.schedule.total_steps,
        }


class Gpt3Benchmark(LLMBenchmark):
    name = "gpt3"
    mlperf_name = constants.GPT3
    ruleset = "4.1.0"
    description = "GPT-3 175B pretraining on C4 (Adam, seq 2048), target log perplexity 2.69"
    optimizer_name = "adam"
    eval_every = 24_576
    full_preset = "gpt3-175b"
    presets = {"tiny": lambda: tiny("gpt3", arch="gpt3", optimizer="adam", epsilon=1e-8)} | {
        name: (lambda n=name: gpt3(n)) for name in GPT3_SHAPES
    }
    # GPT-3's learned positions take the place of RoPE.

    def waived_checks(self, cfg: RunConfig) -> frozenset[str]:
        # Only the shape: the target window (2.6-2.69) and init_checkpoint_step (MLPerf's step-4000 checkpoint)
        # are never waived, so a run from scratch is not compliant, as it should not be.
        waived = set()
        if cfg.data.seq_length != 2048:
            waived.add("max_sequence_length")
        if cfg.optimizer.lr not in (2e-5, 3e-5):
            waived.add("opt_base_learning_rate")
        return frozenset(waived)

    def optimizer_keys(self, cfg: RunConfig) -> dict[str, Any]:
        o = cfg.optimizer
        return {
            constants.OPT_ADAM_BETA_1: o.beta1,
            constants.OPT_ADAM_BETA_2: o.beta2,
            constants.OPT_ADAM_EPSILON: o.epsilon,
        }
