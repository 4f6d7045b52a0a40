"""MLPerf `llama2_70b_lora`: LoRA fine-tuning of a frozen Llama-2-70B on GovReport to an eval loss of 0.925.

Rules followed (mlcommons/training `llama2_70b_lora`, MLPerf Training 5.1, mlperf-logging 5.1.0):

- Model: Llama-2-70B (80 layers, width 8192, 64 query and 8 KV heads, MLP 28672, vocab 32000), frozen, read from
  HF safetensors (``model.base_weights``; MLPerf's checkpoint fuses q, k and v in ``qkv_proj``).
- LoRA: rank 16, alpha 32, dropout 0.1, no bias, on ``qkv_proj`` and ``o_proj``; adapters and their AdamW
  state in fp32.
- Data: GovReport, prompt masked from the loss, packed into 8192-token rows (:mod:`trainbench.data.sft`); a
  global batch counts rows.
- AdamW (beta 0.9/0.999, eps 1e-8), lr 4e-4, weight decay 1e-4, no warm-up, cosine to 0 over 1024 steps, global
  gradient-norm clip 0.3, GBS 8.
- Eval every 384 samples rounded up to a multiple of GBS; the first FLOOR(0.125 x GBS + 2) evals are skipped; on
  every validation sequence; the metric is the mean over sequences of each sequence's mean answer-token loss (the
  reference evaluates one sequence per batch and averages the batches); target <= 0.925.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trainbench.benchmarks import lora_prepare
from trainbench.benchmarks.base import BenchmarkData
from trainbench.benchmarks.llm import LLMBenchmark
from trainbench.config import DataConfig, EvalConfig, OptimizerConfig, RunConfig, ScheduleConfig
from trainbench.data import sft
from trainbench.data.steps import CycledSteps, batched, eval_share
from trainbench.errors import ConfigError, DataError
from trainbench.families.configs import LoraModelConfig
from trainbench.families.decoder.family import LoraFamily
from trainbench.mlperf import constants

if TYPE_CHECKING:
    import torch


ANSWER_SHARE = 0.1  # of a GovReport row's tokens, the summary's (where the loss is): about a tenth
GOVREPORT_EVAL = 173  # validation sequences MLPerf's runs log

LLAMA2_70B = LoraModelConfig(
    vocab_size=32000, hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8, intermediate_size=28672,
    max_seq_length=8192, rope_theta=10000.0, fused_qkv=True,
)  # fmt: skip
# 2 blocks of width 128 on `prepare llama2_70b_lora --synthetic --preset tiny` (48 topics): a random base with
# std 0.1 weights, so that rank-16 adapters move its outputs within a minute on 2 CPU cores.
TINY = LoraModelConfig(
    vocab_size=512, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=384,
    max_seq_length=256, rope_theta=10000.0, fused_qkv=True, init_std=0.1,
)  # fmt: skip


def _run(preset: str, model: LoraModelConfig, seq: int, lr: float, target: float = 0.925) -> RunConfig:
    return RunConfig(
        benchmark="llama2_70b_lora", preset=preset, model=dataclasses.replace(model),
        data=DataConfig(seq_length=seq, global_batch_size=8, micro_batch_size=1, eval_batch_size=1,
                        eval_samples=None),
        optimizer=OptimizerConfig(name="adamw", lr=lr, beta1=0.9, beta2=0.999, epsilon=1e-8, weight_decay=1e-4,
                                  max_grad_norm=0.3),
        schedule=ScheduleConfig(warmup_steps=0, total_steps=1024, end_lr=0.0),
        eval=EvalConfig(target=target),
    )  # fmt: skip


def _full() -> RunConfig:
    """MLPerf's shape, compiled, its layout planned for the GPUs it runs on (perf.plan=auto) from a probe of 8 blocks
    held 20 s at the power cap before it times them: with those the plan came within 2.7 % of the run on an H200,
    where the probe of 2 blocks as the GPU starts missed by 7.4-8.0 % (docs/lora.md, 'Layout chosen by the tool')."""
    cfg = _run("llama2-70b", LLAMA2_70B, seq=8192, lr=4e-4)
    cfg.perf.compile = True
    cfg.perf.plan = "auto"
    cfg.perf.probe_blocks, cfg.perf.probe_sustained_s = 8, 20.0
    return cfg


def tiny() -> RunConfig:
    cfg = _run("tiny", TINY, seq=256, lr=1e-2)
    cfg.data.micro_batch_size = 8
    cfg.data.eval_batch_size = 16
    cfg.schedule.max_samples = 8 * 400
    return cfg


class LoraBenchmark(LLMBenchmark):
    name = "llama2_70b_lora"
    mlperf_name = constants.LLAMA2_70B_LORA
    ruleset = "6.1.0"
    older_rulesets = ("6.0.0", "5.1.0")
    description = "Llama-2-70B LoRA fine-tuning on GovReport (AdamW, seq 8192), target eval loss 0.925"
    metric_name = "eval_loss"
    metric_explanation = ("eval_loss is the mean over the validation sequences of each sequence's mean cross entropy "
                          "on its answer tokens, in nats (as the reference evaluates); lower is better.")  # fmt: skip
    optimizer_name = "adamw"
    full_preset = "llama2-70b"
    presets = {
        "tiny": tiny,
        "llama2-70b": lambda: _full(),
    }
    # tiny: short examples packed into its rows, with a random base written beside; llama2-70b: MLPerf's GovReport
    # rows' shape and count (3,901 and 173 rows of 8,192 tokens), the base initialised from the run's seed (no
    # checkpoint of 138 GB is written): a throughput-and-cadence run, not a convergence result
    synthetic_sizes = {"tiny": {"train": 6000, "eval": 173}, "llama2-70b": {"train": 3901, "eval": 173}}
    # Expandable segments: at 70B on one GPU the caching allocator otherwise strands several recomputed blocks' worth
    # of memory between its blocks (docs/notes/lora-fp8-one-gpu.md, "3. Fragmentation: expandable segments").
    cuda_alloc_conf = "expandable_segments:True"
    unused_keys = LLMBenchmark.unused_keys | {
        "data.eval_samples": "it evaluates every validation sequence, as MLPerf's rules ask",
        "distributed.tp": "its adapters are sharded by FSDP2 only",
        "model.init_std": "its base is read from model.base_weights, and adapters start as peft's",
        "data.layout": "its rows are always packed (data.global_batch_size counts rows)",
        "model.precision": "its frozen base's precision is model.base_precision; the adapters train in fp32",
        "model.output_precision": "its output layer is part of the frozen base (model.base_precision)",
        "perf.optimizer_kernel": "its adapters are below tb_adamw's size (optim/adamw.py): torch's update takes all",
        "distributed.reduce_once_a_step": "its adapters' gradients are small; whole weights kept between micro-batches "
        "would undo the base's sharding",
        "distributed.keep_gathered": "its frozen base is what FSDP2 gathers (model.base_sharding=fsdp): kept "
        "gathered, it would undo the base's sharding",
        "distributed.keep_outer_gathered": "its embedding and output layer are frozen (no gradient to reduce) and "
        "placed with its base (model.base_sharding)",
        "distributed.output_layer_apart": "its output layer is frozen (no gradient to reduce) and placed with its "
        "base (model.base_sharding)",
        "distributed.grad_reduce_dtype": "its adapters' gradients, a fraction of a percent of the weights, are reduced "
        "in fp32",
    }

    def validate(self, cfg: RunConfig) -> None:
        super().validate(cfg)
        m = cfg.model
        if cfg.data.seq_length > 8192 and m.rope_theta == 10000.0 and m.num_layers == 80:
            raise ConfigError(f"data.seq_length={cfg.data.seq_length}: Llama-2-70B was trained on 4096 tokens and "
                              "MLPerf fine-tunes it on 8192")  # fmt: skip

    def eval_every_samples(self, cfg: RunConfig) -> int:
        gbs = cfg.data.global_batch_size
        return math.ceil(384 / gbs) * gbs

    def first_eval_samples(self, cfg: RunConfig, every: int) -> int:
        # MLPerf skips the first FLOOR(0.125 x GBS + 2) evals.
        return (math.floor(0.125 * cfg.data.global_batch_size + 2) + 1) * every

    # -- data -----------------------------------------------------------------------------------
    def _root(self, cfg: RunConfig) -> Path:
        if not cfg.data.dir:
            raise DataError(f"no dataset given: set data.dir=DIR to a folder made by `trainbench prepare {self.name} "
                            f"--synthetic --preset {cfg.preset} --out DIR` or `--source GOVREPORT_DIR`")  # fmt: skip
        return Path(cfg.data.dir)

    def base_weights(self, cfg: RunConfig) -> str | None:
        """The base model's folder: model.base_weights, else the one the data set was prepared with; None for a
        throughput run on no data set (`trainbench bench`: the base is initialised from the seed)."""
        if cfg.model.base_weights:
            return cfg.model.base_weights
        if not cfg.data.dir:
            return None
        root = self._root(cfg)
        manifest = sft.read_manifest(root, self.name)
        if manifest.get("base") == sft.RANDOM_BASE:
            return None
        base = manifest.get("base_weights")
        if not base:
            raise DataError(f"no base model: set model.base_weights=FOLDER (Llama-2-70B's safetensors, e.g. MLPerf's "
                            f"fused-qkv checkpoint); {root} names none")  # fmt: skip
        return str(root / base)

    def check_data(self, cfg: RunConfig) -> None:
        import torch

        from trainbench.families.decoder.hf_checkpoint import HFCheckpoint, check_shapes
        from trainbench.families.decoder.model import DecoderLM

        root = self._root(cfg)
        manifest = sft.read_manifest(root, self.name)
        if manifest["seq_length"] != cfg.data.seq_length:
            raise DataError(f"{root}: rows of {manifest['seq_length']} tokens, but data.seq_length="
                            f"{cfg.data.seq_length}; prepare the data for this length or set it")  # fmt: skip
        if manifest["vocab_size"] != cfg.model.vocab_size:
            raise DataError(f"{root}: tokenised for a vocabulary of {manifest['vocab_size']}, but model.vocab_size="
                            f"{cfg.model.vocab_size}; prepare it with this model's tokenizer")  # fmt: skip
        # Every shard there, every tensor of the model's shape: read from the files' headers, before any folder is made.
        base = self.base_weights(cfg)
        if base is not None:
            with torch.device("meta"), HFCheckpoint(base) as ckpt:
                check_shapes(DecoderLM(cfg.model), ckpt, cfg.model)
        splits = manifest.get("splits") if isinstance(manifest.get("splits"), dict) else {}
        for split in ("train", "eval"):
            sft.Split(root / split, cfg.data.seq_length).check(splits.get(split, {}), cfg.model.vocab_size)
        rows = splits["train"]["rows"]
        if cfg.data.global_batch_size > rows:
            raise DataError(f"{root}: {rows:,} training rows, fewer than one global batch (data.global_batch_size="
                            f"{cfg.data.global_batch_size}); prepare more data or set a smaller batch")  # fmt: skip

    def inputs_identity(self, cfg: RunConfig) -> dict[str, Any]:
        """The data set's and the base weights' identities (the base's from its index and tensor headers)."""
        from trainbench.families.decoder.hf_checkpoint import identity

        base = self.base_weights(cfg)
        return super().inputs_identity(cfg) | {"base weights": identity(base) if base else sft.RANDOM_BASE}

    def describe_input_change(self, name: str, old: Any, new: Any) -> str:
        if name == "base weights":
            from trainbench.families.decoder.hf_checkpoint import describe_change

            return describe_change(old or {}, new or {}) or "it differs"
        return super().describe_input_change(name, old, new)

    def build_data(self, cfg: RunConfig, rank: int, world_size: int, start_sample: int = 0) -> BenchmarkData:
        d, root = cfg.data, self._root(cfg)
        train, evals = sft.Split(root / "train", d.seq_length), sft.Split(root / "eval", d.seq_length)
        mine = batched(eval_share(evals.rows, rank, world_size), d.eval_batch_size)
        return BenchmarkData(
            train=sft.RowSteps(train, cfg.seed, d.global_batch_size, d.micro_batch_size, rank, world_size,
                               start_sample),
            eval=[evals.row_arrays(rows) for rows in mine],
            train_samples=train.rows,
            eval_samples=evals.sequences,
        )  # fmt: skip

    # -- throughput -----------------------------------------------------------------------------
    def bench_data(self, cfg: RunConfig, rank: int, world_size: int) -> BenchmarkData:
        """Rows of one sequence each, as MLPerf's pre-packed GovReport rows come, with the loss on the answer's
        share of the row (the last ANSWER_SHARE of its tokens)."""
        d = cfg.data
        rng = np.random.default_rng(cfg.seed)

        def rows(n: int) -> dict[str, np.ndarray]:
            tokens = rng.integers(0, cfg.model.vocab_size, (n, d.seq_length))
            targets = np.roll(tokens, -1, axis=1)
            targets[:, : int(d.seq_length * (1 - ANSWER_SHARE))] = sft.IGNORE
            targets[:, -1] = sft.IGNORE
            return {"tokens": tokens, "targets": targets, "seq_ids": np.repeat(np.arange(n)[:, None], d.seq_length, 1)}

        return BenchmarkData(train=CycledSteps([rows(d.global_batch_size)], d.global_batch_size, d.micro_batch_size,
                                               rank, world_size),
                             eval=[rows(d.eval_batch_size)], train_samples=0, eval_samples=GOVREPORT_EVAL)  # fmt: skip

    @functools.cached_property
    def family(self) -> LoraFamily:
        """LoRA on the frozen decoder, its base read from :meth:`base_weights`; NVIDIA's count for a row of the 70B
        model, 2,598 TFLOP at 80 blocks of its width and 8,192 tokens (forward and backward of the frozen base and the
        adapters, recompute excluded)."""
        return LoraFamily(self.base_weights, LLAMA2_70B, 8192, 2598e12)

    def end_lr(self, cfg: RunConfig) -> float:
        return cfg.schedule.end_lr if cfg.schedule.end_lr is not None else 0.0

    # -- step -----------------------------------------------------------------------------------
    def loss_weights(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return (batch["targets"] != sft.IGNORE).sum().float().reshape(1)

    def loss(self, model, batch, weights):
        total = model(batch["tokens"], targets=batch["targets"], positions=batch.get("positions"),
                      segments=batch.get("segments"))  # fmt: skip
        return total / weights[0]

    def eval_sums(self, model, batch) -> torch.Tensor:
        import torch

        logits = model(batch["tokens"], positions=batch.get("positions"), segments=batch.get("segments"))
        targets = batch["targets"]
        losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                                                   reduction="none", ignore_index=sft.IGNORE)  # fmt: skip
        counted = targets.flatten() != sft.IGNORE
        seqs, which = torch.unique(batch["seq_ids"].flatten()[counted], return_inverse=True)
        sums = torch.zeros(len(seqs), dtype=torch.float64, device=logits.device)
        counts = torch.zeros_like(sums)
        sums.index_add_(0, which, losses[counted].double())
        counts.index_add_(0, which, torch.ones_like(sums[which]))
        return torch.stack([(sums / counts).sum(), torch.tensor(float(len(seqs)), device=logits.device).double()])

    # -- MLPerf ---------------------------------------------------------------------------------
    def optimizer_keys(self, cfg: RunConfig) -> dict[str, Any]:
        return {}

    def hyperparameters(self, cfg: RunConfig) -> dict[str, Any]:
        o, s, m = cfg.optimizer, cfg.schedule, cfg.model
        return {
            constants.OPT_BASE_LR: o.lr,
            constants.OPT_LR_TRAINING_STEPS: s.total_steps,
            constants.OPT_LR_WARMUP_STEPS: s.warmup_steps,
            constants.OPT_GRADIENT_CLIP_NORM: o.max_grad_norm,
            constants.OPT_ADAMW_WEIGHT_DECAY: o.weight_decay,
            constants.LORA_ALPHA: m.lora_alpha,
            "lora_rank": m.lora_rank,
            "max_sequence_length": cfg.data.seq_length,
        }

    # -- the command line -----------------------------------------------------------------------
    add_prepare_arguments = staticmethod(lora_prepare.add_arguments)
    prepare_examples = lora_prepare.EXAMPLES

    def prepare(self, args) -> int:
        return lora_prepare.prepare(args, self)
