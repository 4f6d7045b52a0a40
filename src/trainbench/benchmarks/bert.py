"""MLPerf `bert`: BERT-large pretraining with LAMB to masked-LM accuracy 0.720.

Rules followed (MLPerf Training, `bert`): eval on the 10,000-sample eval set every
FLOOR(0.05 * (230.23 * GBS + 3,000,000), 25,000) samples, never at 0; the run succeeds at the first
eval with masked-LM accuracy >= 0.720; the LAMB hyperparameters and schedule are logged with the
`opt_lamb_*` keys; `eval_accuracy` carries the samples trained as `epoch_num`.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trainbench.benchmarks import bert_prepare
from trainbench.benchmarks.base import Benchmark, BenchmarkData
from trainbench.config import DataConfig, EvalConfig, OptimizerConfig, RunConfig, ScheduleConfig
from trainbench.data.bert_hdf5 import (
    Limits,
    ShardInfo,
    TrainBatches,
    changed_since,
    check_record,
    eval_batches,
    find_shards,
    scan_shard,
    shard_records,
)
from trainbench.data.steps import CycledSteps
from trainbench.errors import ConfigError, DataError
from trainbench.families.configs import BertConfig
from trainbench.families.encoder.family import EncoderFamily, checkpoint_file
from trainbench.mlperf import constants
from trainbench.optim.schedules import poly_warmup_lr

if TYPE_CHECKING:
    import torch


MLPERF_TARGET = 0.720


def large() -> RunConfig:
    """The MLPerf reference model and NVIDIA's 8xH200 hyperparameters at GBS 768 (48 per GPU, 8 GPUs, or
    accumulation on fewer)."""
    return RunConfig(
        benchmark="bert",
        preset="large",
        model=BertConfig(),
        data=DataConfig(
            seq_length=512,
            max_predictions=76,
            global_batch_size=768,
            micro_batch_size=48,
            eval_batch_size=128,
            eval_samples=10000,
        ),
        optimizer=OptimizerConfig(lr=9.6e-4, beta1=0.60466, beta2=0.85437, epsilon=1e-6, weight_decay=0.1),
        schedule=ScheduleConfig(warmup_steps=0, total_steps=3680),
        eval=EvalConfig(target=MLPERF_TARGET),
    )


def base() -> RunConfig:
    """BERT-base shape (12 x 768) on the MLPerf sequence shape: a single-GPU development preset."""
    cfg = large()
    cfg.preset = "base"
    cfg.model = dataclasses.replace(cfg.model, hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072)
    cfg.data = dataclasses.replace(cfg.data, global_batch_size=256, micro_batch_size=64)
    cfg.optimizer = dataclasses.replace(cfg.optimizer, lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01)
    cfg.schedule = dataclasses.replace(cfg.schedule, warmup_steps=200, total_steps=20000)
    return cfg


def tiny() -> RunConfig:
    """A 2-layer, 128-wide BERT on the synthetic data of `trainbench prepare bert --synthetic --preset tiny`;
    reaches the MLPerf target 0.720 in about a minute on 2 CPU cores."""
    return RunConfig(
        benchmark="bert",
        preset="tiny",
        model=BertConfig(
            vocab_size=1024,
            hidden_size=128,
            num_layers=2,
            num_heads=4,
            intermediate_size=512,
            max_position_embeddings=128,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        ),
        data=DataConfig(
            seq_length=128,
            max_predictions=20,
            global_batch_size=64,
            micro_batch_size=64,
            eval_batch_size=250,
            eval_samples=2000,
        ),
        optimizer=OptimizerConfig(lr=1e-2, beta1=0.9, beta2=0.999, epsilon=1e-6, weight_decay=0.01),
        schedule=ScheduleConfig(warmup_steps=50, total_steps=2000),
        eval=EvalConfig(target=MLPERF_TARGET, every_samples=6400),
    )


# Size of the synthetic data set `prepare bert --synthetic --preset P` writes, per preset.
SYNTHETIC_SIZES = {
    "tiny": dict(num_train_samples=64_000, num_eval_samples=2_000, num_shards=8),
    "base": dict(num_train_samples=256_000, num_eval_samples=10_000, num_shards=16),
    "large": dict(num_train_samples=256_000, num_eval_samples=10_000, num_shards=16),
}


LEGACY_ROWS = 1024  # rows of the first shard whose token ids are checked where manifest.json records no values


def value_limits(cfg: RunConfig, layout: str) -> Limits:
    """What the model takes of each dataset of a shard of ``layout``: the smallest and largest value, in words."""
    m, d = cfg.model, cfg.data
    ids = (0, m.vocab_size - 1, f"the vocabulary of {m.vocab_size:,} ids (model.vocab_size)")
    row = (0, d.seq_length - 1, f"a row of {d.seq_length:,} positions (data.seq_length)")
    limits = {
        "input_ids": ids,
        "masked_lm_ids": ids,
        "masked_lm_positions": row,
        "segment_ids": (0, m.type_vocab_size - 1, f"the {m.type_vocab_size} segments (model.type_vocab_size)"),
    }
    if layout == "packed":
        return limits | {
            "position_ids": (0, min(d.seq_length, m.max_position_embeddings) - 1, "a sequence's positions in the row "
                             "(data.seq_length, model.max_position_embeddings)"),
            "sequence_ids": (0, d.seq_length, "a row's sequences (0 for padding)"),
            "cls_positions": row,
            "next_sentence_labels": (-1, 1, "0 and 1 (and -1 for a slot of no sequence)"),
        }  # fmt: skip
    return limits | {"input_mask": (0, 1, "0 and 1"), "next_sentence_labels": (0, 1, "0 and 1")}


class BertBenchmark(Benchmark):
    name = "bert"
    mlperf_name = constants.BERT
    # The newest mlperf-logging ruleset whose closed division still lists `bert`.
    ruleset = "5.0.0"
    description = "BERT-large pretraining (LAMB, seq 512, 76 predictions), target masked-LM accuracy 0.720"
    metric_name = "masked_lm_accuracy"
    metric_explanation = ("masked_lm_accuracy is the share of the eval set's masked tokens whose most likely "
                          "prediction is the original token; higher is better.")  # fmt: skip
    higher_is_better = True
    optimizer_name = "lamb"
    full_preset = "large"
    family = EncoderFamily()
    presets = {"tiny": tiny, "base": base, "large": large}
    synthetic_sizes = SYNTHETIC_SIZES
    unused_keys = {
        "schedule.end_lr": "its schedule decays polynomially to 0 (schedule.poly_power shapes the decay)",
        "perf.activation_checkpointing": "BERT keeps its activations (the large preset fits on one GPU at 48 rows)",
        "perf.recompute_blocks": "BERT keeps its activations (no perf.activation_checkpointing)",
        "perf.offload_blocks": "BERT keeps its activations on the GPU",
        "perf.optimizer_kernel": "its LAMB update is its own (optim/lamb.py), not AdamW's",
        "distributed.reduce_once_a_step": "DDP reduces its gradients once a step already (no FSDP2)",
        "distributed.keep_gathered": "DDP keeps its whole weights on every rank already (no FSDP2)",
        "distributed.keep_outer_gathered": "DDP keeps its whole weights on every rank already (no FSDP2)",
        "distributed.output_layer_apart": "DDP shards no layer (no FSDP2)",
    }

    def validate(self, cfg: RunConfig) -> None:
        super().validate(cfg)
        d = cfg.data
        if d.length_bins and d.layout != "fixed":
            raise ConfigError(
                "data.length_bins applies to the fixed layout (packed rows have no padding to cut); "
                "set data.length_bins=0 or data.layout=fixed"
            )
        if d.length_bins < 0 or d.length_bins > d.seq_length:
            raise ConfigError(f"data.length_bins={d.length_bins} must be between 0 and data.seq_length={d.seq_length}")

    def eval_every_samples(self, cfg: RunConfig) -> int:
        gbs = cfg.data.global_batch_size
        return max(25_000, math.floor(0.05 * (230.23 * gbs + 3_000_000) / 25_000) * 25_000)

    # -- data -----------------------------------------------------------------------------------
    def _folders(self, cfg: RunConfig) -> tuple[Path, Path]:
        if not cfg.data.dir:
            raise DataError(
                "no dataset given: set data.dir=DIR to a folder made by "
                f"`trainbench prepare bert --synthetic --preset {cfg.preset} --out DIR`"
            )
        root = Path(cfg.data.dir)
        if not root.is_dir():
            raise DataError(
                f"data folder {root} does not exist; create it with "
                f"`trainbench prepare bert --synthetic --preset {cfg.preset} --out {root}`"
            )
        return root / "train", root / "eval"

    def _train_shards(self, cfg: RunConfig):
        train_dir, _ = self._folders(cfg)
        d = cfg.data
        if d.layout == "packed":
            train_dir = train_dir.with_name("train_packed")
            if not train_dir.is_dir():
                raise DataError(
                    f"data.layout=packed but {train_dir} does not exist; make it with "
                    "`trainbench prepare bert --input ... --formats fixed,packed`"
                )
        return train_dir, find_shards(train_dir, "training data", d.seq_length, d.max_predictions, d.layout)

    def check_data(self, cfg: RunConfig) -> None:
        if cfg.model.init_checkpoint:  # before any folder is made: a run that cannot start leaves nothing behind
            checkpoint_file(cfg.model.init_checkpoint)
        _, eval_dir = self._folders(cfg)
        d = cfg.data
        train_dir, shards = self._train_shards(cfg)
        eval_shards = find_shards(eval_dir, "eval data", d.seq_length, d.max_predictions)
        eval_total = sum(s.num_samples for s in eval_shards)
        if d.eval_samples is not None and d.eval_samples > eval_total:
            raise DataError(
                f"data.eval_samples={d.eval_samples} but the eval files in {eval_dir} hold only {eval_total} samples; "
                f"set data.eval_samples={eval_total} or lower"
            )
        if sum(s.num_samples for s in shards) < d.global_batch_size:
            raise DataError(f"{train_dir} holds fewer samples than one global batch ({d.global_batch_size})")
        self._check_values(cfg, train_dir, shards, d.layout, whole=False)
        self._check_values(cfg, eval_dir, eval_shards, "fixed", whole=True)

    def _check_values(self, cfg: RunConfig, folder: Path, shards: list[ShardInfo], layout: str, whole: bool) -> None:
        """Every shard of ``folder`` against its record in manifest.json (rows, bytes, the recorded values against
        what the model takes), and every value of a shard changed since the manifest was written (docs/data.md,
        "What every reader checks"). Without a record: every value where ``whole`` (the eval set, which a run reads
        whole anyway), else the token ids of the first rows of the first shard, said in a note."""
        from trainbench.benchmarks.prepare_common import progress_bar
        from trainbench.console import console

        limits = value_limits(cfg, layout)
        found = shard_records(Path(cfg.data.dir), shards)
        if found is None and not whole:
            console.print(f"note: manifest.json records no values of the shards in {folder} (data made elsewhere, or "
                          f"before `trainbench prepare bert` recorded them): only the token ids of the first "
                          f"{LEGACY_ROWS:,} rows of {shards[0].path.name} are checked against model.vocab_size before "
                          "the run; prepare the data again to check every shard", markup=False)  # fmt: skip
            self._check_first_rows(cfg, shards[0].path)
            return
        if found is None:  # the eval set without a record: every value of it
            for shard in shards:
                scan_shard(shard, None, limits)
            return
        records, stamp = found
        for shard in shards:
            check_record(shard, records[shard.path], limits)
        changed = changed_since(shards, stamp)
        if changed:
            console.print(f"{len(changed):,} of the {len(shards):,} shards in {folder} changed after manifest.json was "
                          "written (or were copied without their times): every value of theirs is read and checked",
                          markup=False)  # fmt: skip
            with progress_bar(f"checking {len(changed):,} shards", len(changed), not cfg.output.progress) as update:
                for done, shard in enumerate(changed, 1):
                    scan_shard(shard, records[shard.path], limits)
                    update(done)

    def _check_first_rows(self, cfg: RunConfig, shard: Path) -> None:
        import h5py

        with h5py.File(shard, "r") as f:
            top = int(np.max(f["input_ids"][: min(LEGACY_ROWS, f["input_ids"].shape[0])]))
        if top >= cfg.model.vocab_size:
            raise DataError(
                f"{shard}: token id {top} does not fit model.vocab_size={cfg.model.vocab_size}; "
                "was the data made for another preset?"
            )

    def build_data(self, cfg: RunConfig, rank: int, world_size: int, start_sample: int = 0) -> BenchmarkData:
        _, eval_dir = self._folders(cfg)
        d = cfg.data
        _, train_shards = self._train_shards(cfg)
        eval_shards = find_shards(eval_dir, "eval data", d.seq_length, d.max_predictions)
        train = TrainBatches(
            train_shards,
            cfg.seed,
            d.global_batch_size,
            d.micro_batch_size,
            rank,
            world_size,
            start_sample,
            d.layout,
            d.length_bins,
        )
        evals = eval_batches(eval_shards, d.eval_samples, d.eval_batch_size, rank, world_size)
        eval_total = d.eval_samples if d.eval_samples is not None else sum(s.num_samples for s in eval_shards)
        return BenchmarkData(train=train, eval=evals, train_samples=train.epoch_size, eval_samples=eval_total)

    # -- optimizer ------------------------------------------------------------------------------
    def build_optimizer(self, cfg: RunConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
        from trainbench.optim.lamb import Lamb, param_groups

        o = cfg.optimizer
        return Lamb(
            param_groups(model, o.weight_decay),
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.epsilon,
            weight_decay=o.weight_decay,
            # Bucket-wise clipping happens in the all-reduce hook, before the optimizer sees the gradient.
            max_grad_norm=0.0 if o.clip == "bucket" else o.max_grad_norm,
            bias_correction=o.bias_correction,
            fused=cfg.perf.compile,
        )

    def lr_at(self, cfg: RunConfig, step: int) -> float:
        s = cfg.schedule
        return poly_warmup_lr(step, cfg.optimizer.lr, s.warmup_steps, s.total_steps, s.poly_power, s.start_warmup_step)

    # -- step -----------------------------------------------------------------------------------
    @staticmethod
    def _valid(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        # Position 0 is [CLS], never masked: a 0 position is padding of masked_lm_positions.
        return batch["masked_lm_positions"] > 0

    def loss_weights(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[masked tokens, sequences] of a micro-batch: the loss's normalisers."""
        import torch

        masked = self._valid(batch).sum()
        sequences = (batch["next_sentence_labels"] >= 0).sum()
        return torch.stack([masked, sequences]).float()

    def _logits(self, model, batch):
        if "sequence_ids" in batch:  # packed rows
            return model(
                batch["input_ids"],
                batch["segment_ids"],
                masked_lm_positions=batch["masked_lm_positions"],
                position_ids=batch["position_ids"],
                sequence_ids=batch["sequence_ids"],
                cls_positions=batch["cls_positions"],
            )
        return model(batch["input_ids"], batch["segment_ids"], batch["input_mask"], batch["masked_lm_positions"])

    def loss(self, model, batch, weights):
        import torch.nn.functional as F

        # Padding predictions and empty sequence slots are ignored by label, not cut out with a boolean index:
        # an index's output size is known only on the host, so it would make the host wait for the forward
        # (and again in backward) every step, leaving the GPU idle while the host catches up.
        mlm_logits, nsp_logits = self._logits(model, batch)
        mlm_ids = batch["masked_lm_ids"].long().masked_fill(~self._valid(batch), -100)
        mlm = F.cross_entropy(mlm_logits.flatten(0, -2).float(), mlm_ids.flatten(), ignore_index=-100, reduction="sum")
        # packed rows mark their empty sequence slots with -1
        labels = batch["next_sentence_labels"].long().flatten()
        nsp = F.cross_entropy(nsp_logits.flatten(0, -2).float(), labels, ignore_index=-1, reduction="sum")
        return mlm / weights[0] + nsp / weights[1]

    def eval_sums(self, model, batch) -> torch.Tensor:
        import torch

        mlm_logits, _ = self._logits(model, batch)
        valid = self._valid(batch)
        correct = (mlm_logits.argmax(-1) == batch["masked_lm_ids"]) & valid
        return torch.stack([correct.sum(), valid.sum()]).double()

    def eval_metric(self, sums: torch.Tensor) -> float:
        return float(sums[0] / sums[1].clamp(min=1))

    # -- throughput -----------------------------------------------------------------------------
    # Sequences per packed row at most in bench's rows: `prepare bert`'s default (--max-per-pack).
    BENCH_PER_PACK = 3

    def bench_data(self, cfg: RunConfig, rank: int, world_size: int) -> BenchmarkData:
        """The synthetic language's samples (sentence pairs, MLPerf's masking) with MLPerf's length mix
        (synthetic_bert.mlperf_like_lengths): fixed rows padded to seq_length (which cost the same whatever their
        length, unless data.length_bins cuts them), or with data.layout=packed, rows packed as `prepare bert`
        packs them (at most 3 a row), each holding about 2 samples. Eval: fixed rows, as MLPerf's eval set."""
        from trainbench.data.packing import instances_from_fixed, pack, packed_predictions
        from trainbench.data.synthetic_bert import MASKED_LM_PROB, Language, make_samples, mlperf_like_lengths

        d = cfg.data
        lang, rng = Language(cfg.model.vocab_size, cfg.seed), np.random.default_rng(cfg.seed)

        def sample(n: int) -> dict[str, np.ndarray]:
            return make_samples(lang, rng, n, d.seq_length, d.max_predictions,
                                lengths=mlperf_like_lengths(rng, n, d.seq_length))  # fmt: skip

        gbs, samples = d.global_batch_size, d.global_batch_size
        rows = sample(gbs)
        if d.layout == "packed":
            per_pack = self.BENCH_PER_PACK
            columns = packed_predictions(d.seq_length, d.max_predictions, MASKED_LM_PROB, per_pack)
            rows = pack(instances_from_fixed(sample(per_pack * gbs)), d.seq_length, per_pack, columns, rng)
            # more rows than a batch: the pack's order is random; int64 as the reader gives them
            rows = {k: v[:gbs].astype(np.int64) for k, v in rows.items()}
            samples = int((rows["next_sentence_labels"] >= 0).sum())
        return BenchmarkData(train=CycledSteps([rows], gbs, d.micro_batch_size, rank, world_size,
                                               samples=samples),
                             eval=[sample(d.eval_batch_size)], train_samples=0,
                             eval_samples=d.eval_samples or 10_000)  # fmt: skip

    # -- MLPerf ---------------------------------------------------------------------------------
    def hyperparameters(self, cfg: RunConfig) -> dict[str, Any]:
        o, s = cfg.optimizer, cfg.schedule
        return {
            constants.OPT_BASE_LR: o.lr,
            constants.OPT_LAMB_EPSILON: o.epsilon,
            constants.OPT_LR_TRAINING_STEPS: s.total_steps,
            constants.OPT_LR_WARMUP_STEPS: s.warmup_steps,
            constants.NUM_WARMUP_STEPS: s.warmup_steps,
            constants.START_WARMUP_STEP: s.start_warmup_step,
            constants.OPT_LAMB_BETA_1: o.beta1,
            constants.OPT_LAMB_BETA_2: o.beta2,
            constants.OPT_LAMB_WEIGHT_DECAY: o.weight_decay,
            constants.OPT_LAMB_LR_DECAY_POLY_POWER: s.poly_power,
            "max_sequence_length": cfg.data.seq_length,
        }

    # -- the command line -----------------------------------------------------------------------
    add_prepare_arguments = staticmethod(bert_prepare.add_arguments)
    prepare_examples = bert_prepare.EXAMPLES

    def prepare(self, args) -> int:
        return bert_prepare.prepare(args, self)

    def convert(self, args) -> int:
        from trainbench.console import console
        from trainbench.convert import convert_bert

        state = convert_bert(args.tf_checkpoint, args.out)
        params = sum(t.numel() for t in state.values())
        console.print(
            f"wrote {args.out}: {len(state)} tensors, {params / 1e6:.2f}M parameters; "
            f"use it with model.init_checkpoint={args.out}"
        )
        return 0
