"""MLPerf `dlrmv4` (Training 6.1): the HSTU ranker of generative_recommenders' DLRMv3 on Yambda-5B's listening events,
to an eval AUC of 0.75 on the listen-plus label.

Rules followed (mlperf-logging 6.1.0's ``closed_dlrmv4.yaml``): sequences of at most 4,096 tokens; dense Adam (beta
0.95/0.999, eps 1e-8, no weight decay, the dense gradients' global norm clipped to 1.0) and RowWiseAdagrad on the
embedding tables at the same learning rate, both ramped linearly from 0 over 24,000 steps, then constant; the
learning rate within 0.5-1.5x of 1e-6 x GBS / 8192; an eval every 0.1 % of the 2,290,835,423 training samples (that
fraction divided once by the global batch, rounded up, times the batch), the first where the rules put it (the first
grid point at or after floor((4480 x GBS + 135,331,840) / 3) samples); 2,058,204 eval samples; AUC computed exactly.

What runs here: every rank holds every table by default; with ``perf.sharded_tables`` the family shards the tables
row-wise over the ranks (all-to-all lookups, RowWiseAdagrad on the touched rows); a host cache of cold rows is not
built (docs/dlrmv4.md).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trainbench.benchmarks.base import Benchmark, BenchmarkData
from trainbench.benchmarks.prepare_common import claim, progress_bar, synthetic_sizes, write_manifest
from trainbench.config import DataConfig, EvalConfig, OptimizerConfig, PerfConfig, RunConfig, ScheduleConfig
from trainbench.data import yambda
from trainbench.data.steps import CycledSteps
from trainbench.errors import ConfigError, DataError, UserError
from trainbench.families.configs import HstuConfig
from trainbench.families.hstu.family import HstuFamily

if TYPE_CHECKING:
    import torch

TRAIN_SAMPLES = 2_290_835_423  # the rules' training samples (the reference's anchors of Yambda-5B)
EVAL_SAMPLES = 2_058_204
MAX_SEQUENCE_LENGTH = 4096
WARMUP_STEPS = 24_000
EVAL_EVERY_DATA_PCT = 0.001
LR_PER_8192 = 1e-6  # the reference learning rate at a global batch of 8,192; the band is 0.5-1.5x its scaling
TARGET = 0.75
TABLE_EPS = 1e-8  # RowWiseAdagrad's epsilon (TorchRec's default)
MIN_HISTORY = 1  # an anchor needs this many events of its user before it
EVAL_FRACTION = 0.1  # users held out for eval by the hash of their id (the reference: 1 - train_split_percentage)
SPLIT_SALT = 0


def eval_interval(gbs: int) -> int:
    """The rules' eval cadence in samples for a global batch of ``gbs`` (the checker's own arithmetic)."""
    return max(1, int(math.ceil(EVAL_EVERY_DATA_PCT * TRAIN_SAMPLES / gbs))) * gbs


def first_eval(gbs: int) -> int:
    """The samples at the rules' first eval: the first point of the eval grid at or after the reference's earliest
    convergence for ``gbs``, less its margin (the checker's own arithmetic)."""
    every = eval_interval(gbs)
    return int(math.ceil(math.floor((4480 * gbs + 135331840) / 3) / every)) * every


def lr_band(gbs: int) -> tuple[float, float]:
    """The learning rates the rules allow at a global batch of ``gbs``."""
    return 0.5 * LR_PER_8192 * gbs / 8192, 1.5 * LR_PER_8192 * gbs / 8192


TINY_CROSSES = "item_id*hour_of_day:3000,artist_id*hour_of_day:600,uid*is_organic:1200"
TINY_SYNTHETIC = {"users": 1200, "items": 600, "artists": 60, "albums": 240, "favourites": 3, "loyalty": 0.6,
                  "signal": 3.0, "user_bias": 0.5, "artist_quality": 2.0, "item_quality": 1.0,
                  "min_events": 30, "max_events": 90, "session_events": 20}  # fmt: skip
TINY = HstuConfig(embedding_dim=16, model_dim=32, num_layers=2, num_heads=2, attention_dim=16, linear_dim=16,
                  input_dropout=0.0, linear_dropout=0.0, uid_rows=1200, item_rows=600, artist_rows=60, album_rows=240,
                  cross_features=TINY_CROSSES, history_length=24)  # fmt: skip


def tiny() -> RunConfig:
    return RunConfig(
        benchmark="dlrmv4", preset="tiny", model=HstuConfig(**vars(TINY)),
        data=DataConfig(seq_length=TINY.sequence_length, global_batch_size=128, micro_batch_size=128,
                        eval_batch_size=512, eval_samples=2048),
        optimizer=OptimizerConfig(name="adam", lr=4e-3, beta1=0.95, beta2=0.999, epsilon=1e-8, weight_decay=0.0,
                                  max_grad_norm=1.0),
        schedule=ScheduleConfig(warmup_steps=20, total_steps=1_000_000),
        eval=EvalConfig(target=0.77, every_samples=128 * 20),
    )  # fmt: skip


# The dense form of the HSTU layers' attention ([batch, heads, T, T] scores, T = 2,056 at the reference's history:
# 34 MB a sample in bf16, several such tensors a layer kept for the backward, the CPU's and perf.hstu_attention=dense's)
# fits 32 samples a micro-batch and 64 an eval batch on one H200 beside the tables. The jagged kernel (CUDA's default)
# keeps no scores and ran 128 a micro-batch faster (docs/dlrmv4.md); the preset keeps 32 until the whole tables'
# memory on a node is measured.
MICRO_BATCH = 32


def full() -> RunConfig:
    """The reference's shape and the first reference convergence point: GBS 8,192 at lr 1e-6. Its tables (559 GiB of
    fp32) fit no GPU whole: they are sharded row-wise over the ranks."""
    return RunConfig(
        benchmark="dlrmv4", preset="dlrmv4", model=HstuConfig(), perf=PerfConfig(sharded_tables=True),
        data=DataConfig(seq_length=MAX_SEQUENCE_LENGTH, global_batch_size=8192, micro_batch_size=MICRO_BATCH,
                        eval_batch_size=2 * MICRO_BATCH, eval_samples=EVAL_SAMPLES),
        optimizer=OptimizerConfig(name="adam", lr=LR_PER_8192, beta1=0.95, beta2=0.999, epsilon=1e-8,
                                  weight_decay=0.0, max_grad_norm=1.0),
        schedule=ScheduleConfig(warmup_steps=WARMUP_STEPS, total_steps=1_000_000),
        eval=EvalConfig(target=TARGET, every_samples=None),
    )  # fmt: skip


class Dlrmv4Benchmark(Benchmark):
    name = mlperf_name = "dlrmv4"
    ruleset = "6.1.0"
    description = "HSTU ranker (DLRMv3) on Yambda listening events, target eval AUC 0.75"
    metric_name = "auc"
    metric_explanation = ("auc is the area under the ROC curve of the listen-plus predictions over every eval sample, "
                          "computed exactly from the sorted scores (ties count half); 0.5 is a model that guesses; "
                          "higher is better.")  # fmt: skip
    higher_is_better = True
    optimizer_name = "adam"
    full_preset = "dlrmv4"
    presets = {"tiny": tiny, "dlrmv4": full}
    synthetic_sizes = {"tiny": {"users": TINY_SYNTHETIC["users"]}, "dlrmv4": {"users": 400}}
    unused_keys = {
        "data.max_predictions": "it predicts one label per sample",
        "distributed.reduce_once_a_step": "DDP reduces its dense gradients once a step already (no FSDP2)",
        "distributed.keep_gathered": "DDP keeps its dense weights whole on every rank already (no FSDP2)",
        "distributed.keep_outer_gathered": "DDP keeps its dense weights whole on every rank already (no FSDP2)",
        "distributed.output_layer_apart": "DDP shards no layer (no FSDP2)",
        "data.layout": "its samples are one anchor event each",
        "data.length_bins": "its samples are padded to one length",
        "optimizer.weight_decay": "the rules fix it at 0 (Adam without weight decay, RowWiseAdagrad without any)",
        "optimizer.bias_correction": "Adam always corrects its moments' bias",
        "optimizer.clip": "the optimizer clips the dense gradients' global norm",
        "schedule.poly_power": "its rate is constant after the warm-up",
        "schedule.start_warmup_step": "its warm-up starts at step 0 from 0",
        "schedule.end_lr": "its rate is constant after the warm-up",
        "schedule.total_steps": "its rate is constant after the warm-up",
        "perf.recompute_blocks": "it recomputes no blocks",
        "perf.offload_blocks": "it offloads no blocks",
        "perf.activation_checkpointing": "it recomputes no blocks",
    }
    prepare_examples = ("examples:\n  trainbench prepare dlrmv4 --synthetic --preset tiny --out data/dlrmv4-tiny\n"
                        "  trainbench prepare dlrmv4 --source yambda/processed --out data/dlrmv4\n")  # fmt: skip
    family = HstuFamily()

    # -- config ---------------------------------------------------------------------------------
    def validate(self, cfg: RunConfig) -> None:
        super().validate(cfg)
        m, d = cfg.model, cfg.data
        if d.seq_length > MAX_SEQUENCE_LENGTH:
            raise ConfigError(f"data.seq_length={d.seq_length}: dlrmv4's rules allow sequences of at most "
                              f"{MAX_SEQUENCE_LENGTH:,} tokens (max_sequence_length)")  # fmt: skip
        if m.sequence_length > d.seq_length:
            raise ConfigError(f"a sample's sequence is {m.sequence_length:,} tokens ({m.contextual} contextual, "
                              f"{m.history} of history, the candidate), longer than data.seq_length={d.seq_length}; "
                              "lower model.history_length or raise data.seq_length")  # fmt: skip
        if not self.scaled_down(cfg) and cfg.output.division == "closed":
            lo, hi = lr_band(d.global_batch_size)
            if not lo * (1 - 1e-9) <= cfg.optimizer.lr <= hi * (1 + 1e-9):
                raise ConfigError(f"optimizer.lr={cfg.optimizer.lr:g}: dlrmv4's closed rules allow {lo:g} to {hi:g} "
                                  f"at a global batch of {d.global_batch_size:,} (0.5-1.5x of 1e-6 x GBS / "
                                  "8192)")  # fmt: skip

    def target_range(self, cfg: RunConfig) -> tuple[float, float]:
        return 0.5, 1.0

    @property
    def target_range_why(self) -> str:
        return "an AUC; a model that guesses scores 0.5"

    def eval_every_samples(self, cfg: RunConfig) -> int:
        return eval_interval(cfg.data.global_batch_size)

    def first_eval_samples(self, cfg: RunConfig, every: int) -> int:
        """The rules' first eval where the run keeps the rules' cadence; else the first point of its own."""
        if every == eval_interval(cfg.data.global_batch_size):
            return first_eval(cfg.data.global_batch_size)
        return every

    # -- data -----------------------------------------------------------------------------------
    def _root(self, cfg: RunConfig) -> Path:
        if not cfg.data.dir:
            raise DataError("no dataset given: set data.dir=DIR to a folder made by `trainbench prepare dlrmv4 "
                            f"--synthetic --preset {cfg.preset} --out DIR` or `--source YAMBDA --out DIR`")  # fmt: skip
        return Path(cfg.data.dir)

    def _open(self, cfg: RunConfig) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        root = self._root(cfg)
        manifest = yambda.read_manifest(root, self.name)
        counts, m = manifest["counts"], cfg.model
        for table, key in (("uid", "max_uid"), ("item", "max_item"), ("artist", "max_artist"), ("album", "max_album")):
            rows = getattr(m, f"{table}_rows")
            if int(counts[key]) >= rows:
                raise DataError(f"{root}: {table} ids reach {int(counts[key]):,}, past the {table} table's {rows:,} "
                                f"rows (model.{table}_rows); set it to at least {int(counts[key]) + 1:,}")  # fmt: skip
        return manifest, yambda.open_store(root, counts)

    def check_data(self, cfg: RunConfig) -> None:
        manifest, _ = self._open(cfg)
        if manifest["counts"]["train"] < cfg.data.global_batch_size:
            raise DataError(f"{cfg.data.dir}: {manifest['counts']['train']:,} training samples, fewer than one global "
                            "batch")  # fmt: skip

    def build_data(self, cfg: RunConfig, rank: int, world_size: int, start_sample: int = 0) -> BenchmarkData:
        manifest, store = self._open(cfg)
        d = cfg.data
        builder = yambda.SampleBuilder(store, cfg.model, self._root(cfg))
        steps = yambda.YambdaSteps(builder, store["train_anchors"], cfg.seed, d.global_batch_size, d.micro_batch_size,
                                   rank, world_size, start_sample)  # fmt: skip
        total = min(d.eval_samples or len(store["eval_anchors"]), len(store["eval_anchors"]))
        evals = yambda.YambdaEval(builder, store["eval_anchors"], total, d.eval_batch_size, rank, world_size)
        return BenchmarkData(train=steps, eval=evals, train_samples=int(manifest["counts"]["train"]),
                             eval_samples=total)  # fmt: skip

    def bench_data(self, cfg: RunConfig, rank: int, world_size: int) -> BenchmarkData:
        """One global batch of random samples of the model's shapes (ids within each table, histories of every length,
        half the labels listen-plus) and one eval batch with its places in an eval set of its own size."""
        m, d = cfg.model, cfg.data
        rng = np.random.default_rng(cfg.seed)

        def rows(n: int) -> dict[str, np.ndarray]:
            h = m.history
            ids = lambda rows, *shape: rng.integers(0, rows, shape, dtype=np.int64)  # noqa: E731
            return {"uid": ids(m.uid_rows, n), "cross": np.stack([ids(c.rows, n) for c in m.crosses], 1) if m.crosses
                    else np.zeros((n, 0), np.int64),
                    "hist_item": ids(m.item_rows, n, h), "hist_artist": ids(m.artist_rows, n, h),
                    "hist_album": ids(m.album_rows, n, h), "hist_action": ids(8, n, h), "hist_len": ids(h + 1, n),
                    "cand_item": ids(m.item_rows, n), "cand_artist": ids(m.artist_rows, n),
                    "cand_album": ids(m.album_rows, n), "label": (rng.random(n) < 0.5).astype(np.float32)}  # fmt: skip

        n = d.eval_batch_size
        evals = rows(n) | {"index": np.arange(n, dtype=np.int64), "eval_size": np.array([n], dtype=np.int64)}
        return BenchmarkData(train=CycledSteps([rows(d.global_batch_size)], d.global_batch_size, d.micro_batch_size,
                                               rank, world_size),
                             eval=[evals], train_samples=0, eval_samples=d.eval_samples or EVAL_SAMPLES)  # fmt: skip

    # -- optimizer ------------------------------------------------------------------------------
    def build_optimizer(self, cfg: RunConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
        from trainbench.optim.rowwise_adagrad import AdamRowWiseAdagrad

        o = cfg.optimizer
        tables = {id(p) for p in model.table_parameters()}
        dense = [p for p in model.parameters() if id(p) not in tables]
        return AdamRowWiseAdagrad(dense, model.table_parameters(), o.max_grad_norm, lr=o.lr, betas=(o.beta1, o.beta2),
                                  eps=o.epsilon, table_eps=TABLE_EPS)  # fmt: skip

    def lr_at(self, cfg: RunConfig, step: int) -> float:
        """A linear ramp from 0 (step 0 trains at lr / warmup) to the base rate, then constant."""
        warmup = cfg.schedule.warmup_steps
        return cfg.optimizer.lr * min(1.0, (step + 1) / warmup) if warmup else cfg.optimizer.lr

    # -- the step -------------------------------------------------------------------------------
    def loss_weights(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        import torch

        return torch.tensor([batch["label"].shape[0]], dtype=torch.float32, device=batch["label"].device)

    def loss(self, model, batch, weights):
        import torch.nn.functional as F

        logits = model(batch)
        return F.binary_cross_entropy_with_logits(logits.float(), batch["label"], reduction="sum") / weights[0]

    def eval_sums(self, model, batch) -> torch.Tensor:
        """Each eval sample's logit and label at its place in the eval set ([2 x eval size], float64, zeros
        elsewhere): summed over batches and ranks they are the whole set's, exactly. ``eval_size`` is one number a
        batch, so an empty batch (a shorter share's last) gives zeros."""
        import torch

        size = int(batch["eval_size"][0])
        out = torch.zeros(2 * size, dtype=torch.float64, device=batch["label"].device)
        index = batch["index"]
        out[index] = model(batch).double()
        out[size + index] = batch["label"].double()
        return out

    def eval_metric(self, sums: torch.Tensor) -> float:
        size = sums.numel() // 2
        return exact_auc(sums[:size].cpu().numpy(), sums[size:].cpu().numpy())

    # -- MLPerf ---------------------------------------------------------------------------------
    def hyperparameters(self, cfg: RunConfig) -> dict[str, Any]:
        o, s = cfg.optimizer, cfg.schedule
        every = cfg.eval.every_samples or self.eval_every_samples(cfg)
        pct = EVAL_EVERY_DATA_PCT if every == self.eval_every_samples(cfg) else self._own_pct(cfg, every)
        return {
            "max_sequence_length": cfg.data.seq_length,
            "opt_name": "Adam",
            "opt_base_learning_rate": o.lr,
            "opt_adam_beta_1": o.beta1,
            "opt_adam_beta_2": o.beta2,
            "opt_adam_epsilon": o.epsilon,
            "opt_weight_decay": o.weight_decay,
            "opt_gradient_clip_norm": o.max_grad_norm,
            "opt_sparse_name": "RowWiseAdagrad",
            "opt_sparse_base_learning_rate": o.lr,
            "opt_learning_rate_warmup_steps": s.warmup_steps,
            "opt_learning_rate_warmup_start_lr": 0.0,
            "eval_every_data_pct": pct,
        }

    def _own_pct(self, cfg: RunConfig, every: int) -> float:
        """A scaled-down run's cadence as a fraction of its own training samples."""
        try:
            train = yambda.read_manifest(self._root(cfg), self.name)["counts"]["train"]
        except DataError:
            return every / TRAIN_SAMPLES
        return every / max(1, int(train))

    def waived_checks(self, cfg: RunConfig) -> frozenset[str]:
        """Only the checks that fix the full benchmark's shape, for a scaled-down run: its data's size, sequence
        length, warm-up, learning rate (the band scales the reference's 1e-6 at GBS 8,192) and eval cadence. The
        target (0.75) and every optimizer key are never waived."""
        waived = set()
        if self.scaled_down(cfg):
            waived.add("train_samples")
        if cfg.data.eval_samples != EVAL_SAMPLES:
            waived.add("eval_samples")
        if cfg.data.seq_length != MAX_SEQUENCE_LENGTH:
            waived.add("max_sequence_length")
        if cfg.schedule.warmup_steps != WARMUP_STEPS:
            waived.add("opt_learning_rate_warmup_steps")
        lo, hi = lr_band(cfg.data.global_batch_size)
        if not lo * (1 - 1e-9) <= cfg.optimizer.lr <= hi * (1 + 1e-9):
            waived.add("opt_base_learning_rate")
        if (cfg.eval.every_samples or self.eval_every_samples(cfg)) != self.eval_every_samples(cfg):
            waived |= {"eval_every_data_pct", "eval_accuracy"}
        return frozenset(waived)

    # -- the command line -----------------------------------------------------------------------
    @staticmethod
    def add_prepare_arguments(parser) -> None:
        own = parser.add_argument_group("Yambda")
        own.add_argument("--source", help="a folder of the reference's processed Yambda files (train_sessions.parquet, "
                         "artist_item_mapping.parquet, album_item_mapping.parquet): read in place")  # fmt: skip
        own.add_argument("--users", type=int, help="synthetic users (default: by preset)")

    def prepare(self, args) -> int:
        from trainbench.console import console

        if bool(args.synthetic) == bool(args.source):
            raise UserError("prepare dlrmv4 takes --synthetic (seeded data in the reference's layout) or --source DIR "
                            "(a downloaded copy of the reference's processed files), one of them")  # fmt: skip
        out = Path(args.out)
        if args.synthetic:
            sizes = synthetic_sizes(self, args, {"users": "users"})
            spec = {"kind": "synthetic", "seed": args.seed, **TINY_SYNTHETIC, **sizes}
            model = self.config(args.preset).model
            spec |= {"items": min(spec["items"], model.item_rows), "artists": min(spec["artists"], model.artist_rows),
                     "albums": min(spec["albums"], model.album_rows)}  # fmt: skip
            source = out / "yambda"
        else:
            source = Path(args.source)
            if not source.is_dir():
                raise UserError(f"--source {source}: no such folder")
            spec = {"kind": "source", "source": str(source.resolve())}
        spec |= {"min_history": MIN_HISTORY, "eval_fraction": EVAL_FRACTION, "split_salt": SPLIT_SALT}
        if claim(out, spec, args.force, replace=("yambda", "store") if args.synthetic else ("store",)):
            return 0
        if args.synthetic:
            yambda.write_synthetic(source, spec)
        with progress_bar("Yambda sessions to the flat store", 4, args.no_progress) as update:
            counts = yambda.build_store(source, out, MIN_HISTORY, EVAL_FRACTION, SPLIT_SALT, update)
        write_manifest(out, {"benchmark": self.name, "spec": spec, "counts": counts})
        console.print(f"wrote {counts['events']:,} events: {counts['train']:,} training and {counts['eval']:,} eval "
                      f"samples to {out}")  # fmt: skip
        return 0


def exact_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """The chance that a positive scores above a negative, ties counting half: the Mann-Whitney statistic from the
    scores' mid-ranks (float64, a stable sort: the same bits on every run)."""
    positive = labels > 0.5
    n_pos = int(positive.sum())
    n_neg = len(labels) - n_pos
    if n_pos == 0 or n_neg == 0:
        return 0.5
    order = np.argsort(scores, kind="stable")
    sorted_scores = scores[order]
    # Mid-rank of each run of equal scores (ranks from 1).
    starts = np.flatnonzero(np.concatenate([[True], sorted_scores[1:] != sorted_scores[:-1]]))
    ends = np.concatenate([starts[1:], [len(scores)]])
    mid = (starts + ends + 1) / 2.0
    ranks = np.empty(len(scores), dtype=np.float64)
    ranks[order] = np.repeat(mid, ends - starts)
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))
