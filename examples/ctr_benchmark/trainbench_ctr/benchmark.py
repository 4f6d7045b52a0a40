"""`ctr_tiny`: click-through-rate prediction to an eval AUC of 0.86, a benchmark of one's own (not MLPerf's).

What it takes from trainbench, all public: the :class:`Benchmark` interface, the :class:`ModelFamily` interface for
its model (trainbench_ctr/family.py), the config's ``option`` for its model section, the data-parallel placement
(DDP and ``torch.compile``), the step cutting (``Step``, ``rank_share``,
``eval_share``), AdamW with the global-norm clip, the cosine schedule and the preparation helpers. The loop,
the launchers, ``check``, ``report`` and ``package`` run it unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from trainbench.benchmarks.base import Benchmark, BenchmarkData
from trainbench.benchmarks.prepare_common import claim, progress_bar, synthetic_sizes, write_manifest
from trainbench.config import DataConfig, EvalConfig, OptimizerConfig, RunConfig, ScheduleConfig
from trainbench.errors import DataError, UserError
from trainbench.optim.adamw import AdamClipped
from trainbench.optim.groups import weight_decay_split
from trainbench.optim.schedules import cosine_warmup_lr
from trainbench_ctr import data
from trainbench_ctr.family import CtrFamily
from trainbench_ctr.model import CtrModelConfig

AUC_BINS = 4096
"""The eval's predicted probabilities are counted in this many bins, per label: AUC does not add up across batches,
but the bins' counts do (summed over batches and ranks), and the AUC is computed from them once."""


def tiny() -> RunConfig:
    return RunConfig(
        benchmark="ctr_tiny",
        preset="tiny",
        model=CtrModelConfig(),
        data=DataConfig(global_batch_size=256, micro_batch_size=256, eval_batch_size=4096, eval_samples=None),
        optimizer=OptimizerConfig(
            name="adamw", lr=3e-3, beta1=0.9, beta2=0.999, epsilon=1e-8, weight_decay=1e-5, max_grad_norm=1.0
        ),  # fmt: skip
        schedule=ScheduleConfig(warmup_steps=20, total_steps=2000, end_lr=0.0),
        eval=EvalConfig(target=0.86, every_samples=25_600),
    )


class CtrBenchmark(Benchmark):
    name = mlperf_name = "ctr_tiny"
    mlperf = False  # checked by mlperf-logging's common rules; no reference convergence points
    ruleset = "6.1.0"
    description = "Click-through rate (embedding tables, bottom and top MLPs, dot interactions), target AUC 0.86"
    metric_name = "auc"
    metric_explanation = (f"auc is the area under the ROC curve of the eval set's click predictions, from {AUC_BINS:,} "
                          "bins of the predicted probability per label, summed over every eval batch and rank; 0.5 is "
                          "a model that guesses; higher is better.")  # fmt: skip
    higher_is_better = True
    optimizer_name = "adamw"
    full_preset = "tiny"
    presets = {"tiny": tiny}
    synthetic_sizes = {"tiny": {"train": 100_000, "eval": 20_000}}
    unused_keys = {
        "data.seq_length": "its samples are feature rows, not sequences",
        "data.max_predictions": "it predicts one click per sample",
        "data.layout": "its samples are one row each",
        "data.length_bins": "its samples have no length",
        "data.eval_samples": "it evaluates every eval sample",
        "optimizer.bias_correction": "AdamW always corrects its moments' bias",
        "optimizer.clip": "the optimizer clips the global gradient norm",
        "schedule.poly_power": "its schedule is cosine",
        "schedule.start_warmup_step": "its warm-up starts at step 0",
        "perf.activation_checkpointing": "its activations are small",
        "perf.recompute_blocks": "it has no blocks to recompute",
        "perf.offload_blocks": "it has no blocks to offload",
    }
    prepare_examples = "examples:\n  trainbench prepare ctr_tiny --synthetic --out data/ctr\n"

    family = CtrFamily()  # the model, its checks and its placement (trainbench_ctr/family.py)

    # -- config ---------------------------------------------------------------------------------
    def target_range(self, cfg: RunConfig) -> tuple[float, float]:
        return 0.5, 1.0

    @property
    def target_range_why(self) -> str:
        return "an AUC; a model that guesses scores 0.5"

    def eval_every_samples(self, cfg: RunConfig) -> int:
        return 25_600

    # -- data -----------------------------------------------------------------------------------
    def _manifest(self, cfg: RunConfig) -> dict[str, Any]:
        if not cfg.data.dir:
            raise DataError("no dataset given: set data.dir=DIR to a folder made by "
                            "`trainbench prepare ctr_tiny --synthetic --out DIR`")  # fmt: skip
        path = Path(cfg.data.dir) / "manifest.json"
        if not path.is_file():
            raise DataError(f"{cfg.data.dir} holds no ctr_tiny data set (no manifest.json); write one with "
                            f"`trainbench prepare ctr_tiny --synthetic --out {cfg.data.dir}`")  # fmt: skip
        try:
            manifest = json.loads(path.read_text())
            spec = manifest["spec"]
        except (ValueError, KeyError, TypeError):
            raise DataError(f"{path} is not a ctr_tiny manifest") from None
        if manifest.get("benchmark") != self.name:
            raise DataError(f"{cfg.data.dir} holds data of {manifest.get('benchmark')!r}, not of {self.name}")
        return spec

    def check_data(self, cfg: RunConfig) -> None:
        spec, m = self._manifest(cfg), cfg.model
        for key in ("dense_features", "tables", "table_size"):
            if spec[key] != getattr(m, key):
                raise DataError(f"{cfg.data.dir} was written for {key}={spec[key]}, the model has model.{key}="
                                f"{getattr(m, key)}; prepare the data for this model or set it")  # fmt: skip
        if spec["train"] < cfg.data.global_batch_size:
            raise DataError(f"{cfg.data.dir}: {spec['train']:,} training samples, fewer than one global batch")

    def build_data(self, cfg: RunConfig, rank: int, world_size: int, start_sample: int = 0) -> BenchmarkData:
        root, d = Path(cfg.data.dir), cfg.data
        train, evals = data.read_split(root, "train"), data.read_split(root, "eval")
        steps = data.ClickSteps(train, cfg.seed, d.global_batch_size, d.micro_batch_size, rank, world_size,
                                start_sample)  # fmt: skip
        return BenchmarkData(train=steps, eval=data.eval_batches(evals, d.eval_batch_size, rank, world_size),
                             train_samples=len(train["label"]), eval_samples=len(evals["label"]))  # fmt: skip

    # -- optimizer ------------------------------------------------------------------------------
    def build_optimizer(self, cfg: RunConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
        o = cfg.optimizer
        decay, plain = weight_decay_split(model)
        groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": plain, "weight_decay": 0.0}]
        return AdamClipped(groups, o.max_grad_norm, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.epsilon, fused=True)

    def lr_at(self, cfg: RunConfig, step: int) -> float:
        s = cfg.schedule
        return cosine_warmup_lr(step, cfg.optimizer.lr, s.end_lr or 0.0, s.warmup_steps, s.total_steps)

    # -- the step -------------------------------------------------------------------------------
    def loss_weights(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The samples of a micro-batch: the loss is the mean over the global batch's samples."""
        return torch.tensor([batch["label"].shape[0]], dtype=torch.float32, device=batch["label"].device)

    def loss(self, model, batch, weights):
        logits = model(batch["dense"], batch["sparse"])
        return F.binary_cross_entropy_with_logits(logits.float(), batch["label"], reduction="sum") / weights[0]

    def eval_sums(self, model, batch) -> torch.Tensor:
        """Counts of the predicted probabilities in AUC_BINS bins, clicks' then non-clicks' (float64: exact)."""
        p = torch.sigmoid(model(batch["dense"], batch["sparse"]).double())
        bins = (p * AUC_BINS).long().clamp(max=AUC_BINS - 1)
        label = batch["label"].double()
        clicks = torch.bincount(bins, weights=label, minlength=AUC_BINS)
        return torch.cat([clicks, torch.bincount(bins, weights=1 - label, minlength=AUC_BINS)])

    def eval_metric(self, sums: torch.Tensor) -> float:
        """The chance that a click is scored above a non-click (a tie counts half), from the bins' counts."""
        clicks, others = sums[:AUC_BINS], sums[AUC_BINS:]
        below = torch.cumsum(others, 0) - others
        pairs = clicks.sum() * others.sum()
        return float((clicks * (below + 0.5 * others)).sum() / pairs) if pairs > 0 else 0.5

    # -- MLPerf ---------------------------------------------------------------------------------
    def hyperparameters(self, cfg: RunConfig) -> dict[str, Any]:
        o, s = cfg.optimizer, cfg.schedule
        return {
            "opt_name": o.name,
            "opt_base_learning_rate": o.lr,
            "opt_adamw_beta_1": o.beta1,
            "opt_adamw_beta_2": o.beta2,
            "opt_adamw_epsilon": o.epsilon,
            "opt_adamw_weight_decay": o.weight_decay,
            "opt_learning_rate_warmup_steps": s.warmup_steps,
            "opt_gradient_clip_norm": o.max_grad_norm,
        }

    # -- the command line -----------------------------------------------------------------------
    @staticmethod
    def add_prepare_arguments(parser) -> None:
        own = parser.add_argument_group("synthetic clicks")
        own.add_argument("--train-samples", type=int, help="training samples (default: by preset)")
        own.add_argument("--eval-samples", type=int, help="eval samples (default: by preset)")

    def prepare(self, args) -> int:
        from trainbench.console import console

        if not args.synthetic:
            raise UserError("ctr_tiny has synthetic data only: add --synthetic")
        model = self.config(args.preset).model
        sizes = synthetic_sizes(self, args, {"train": "train_samples", "eval": "eval_samples"})
        spec = {"seed": args.seed, "dense_features": model.dense_features, "tables": model.tables,
                "table_size": model.table_size, **sizes}  # fmt: skip
        out = Path(args.out)
        if claim(out, spec, args.force, replace=data.SPLITS):
            return 0
        with progress_bar("synthetic clicks", len(data.SPLITS), args.no_progress) as update:
            written = data.write_synthetic(out, spec, update)
        write_manifest(out, {"benchmark": self.name, "spec": spec})
        console.print(f"wrote {written['train']:,} training and {written['eval']:,} eval samples to {out}")
        return 0
