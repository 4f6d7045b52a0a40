"""MLPerf `flux1` (Training 6.0 and 6.1): FLUX.1-schnell's MMDiT trained from scratch with the rectified-flow loss on
precomputed CC12M encodings, to an eval loss of 0.586 averaged over 8 fixed timesteps on COCO-2014.

Rules followed (mlperf-logging's ``closed_flux1.yaml``; the reference, torchtitan's flux in mlcommons/training
``text_to_image``): AdamW beta 0.9/0.95, eps 1e-8, weight decay 0.1 on every parameter, clip 1.0; a linear warmup
then a constant rate; an eval every 262,144 samples (rounded up to the global batch). A training sample draws its
latent from the VAE's mean and log-variance, scales it as the reference does ((z - 0.1159) x 0.3611), takes a
timestep t uniform in [0, 1), noise, x_t = (1 - t) x + t noise, and the model predicts noise - x (MSE); 10 % of
samples train on the empty prompt's encodings. An eval sample is taken at its fixed timestep (its ``timestep`` / 8)
with noise fixed by its index, and the loss is averaged per timestep, then over the 8.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trainbench.benchmarks.base import Benchmark, BenchmarkData
from trainbench.benchmarks.prepare_common import claim, progress_bar, synthetic_sizes, write_manifest
from trainbench.config import DataConfig, EvalConfig, OptimizerConfig, RunConfig, ScheduleConfig
from trainbench.data.steps import CycledSteps
from trainbench.errors import DataError, UserError
from trainbench.families.configs import FluxConfig
from trainbench.families.mmdit.family import MMDiTFamily

if TYPE_CHECKING:
    import torch


SHIFT, SCALE = 0.1159, 0.3611  # the reference's latent normalisation: (z - shift) x scale
EVAL_EVERY = 262_144
TIMESTEPS = 8

TINY = FluxConfig(in_channels=16, hidden_size=64, num_heads=2, double_blocks=2, single_blocks=2, context_dim=32,
                  vector_dim=16, rope_axes="8,12,12", text_tokens=8, latent_size=8)  # fmt: skip


def preset(name: str, model: FluxConfig, gbs: int, micro: int, lr: float, warmup: int, every: int | None,
           eval_samples: int, target: float = 0.586) -> RunConfig:  # fmt: skip
    return RunConfig(
        benchmark="flux1", preset=name, model=dataclasses.replace(model),
        data=DataConfig(global_batch_size=gbs, micro_batch_size=micro, eval_batch_size=64, eval_samples=eval_samples),
        optimizer=OptimizerConfig(name="adamw", lr=lr, beta1=0.9, beta2=0.95, epsilon=1e-8, weight_decay=0.1,
                                  max_grad_norm=1.0),
        schedule=ScheduleConfig(warmup_steps=warmup, total_steps=1_000_000),
        eval=EvalConfig(target=target, every_samples=every),
    )  # fmt: skip


def pack(latent: torch.Tensor) -> torch.Tensor:
    """[batch, channels, height, width] as tokens of 2 x 2 patches [batch, height x width / 4, channels x 4]."""
    b, c, h, w = latent.shape
    return latent.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, c * 4)


class Flux1Benchmark(Benchmark):
    name = mlperf_name = "flux1"
    ruleset = "6.1.0"
    older_rulesets = ("6.0.0",)
    description = "FLUX.1-schnell text-to-image, rectified flow on CC12M encodings, target eval loss 0.586"
    metric_name = "eval_loss"
    metric_explanation = ("eval_loss is the mean squared error of the predicted velocity (noise - latent) on the eval "
                          "set, each sample at its fixed timestep, averaged per timestep and then over the 8; lower "
                          "is better.")  # fmt: skip
    higher_is_better = False
    optimizer_name = "adamw"
    full_preset = "flux1-schnell"
    presets = {
        "tiny": lambda: preset("tiny", TINY, gbs=32, micro=32, lr=1e-3, warmup=10, every=1024, eval_samples=256),
        # The first reference convergence point: GBS 512, lr 2e-4, 1,600 warmup steps.
        "flux1-schnell": lambda: preset(
            "flux1-schnell", FluxConfig(), gbs=512, micro=4, lr=2e-4, warmup=1600, every=None, eval_samples=29_696
        ),  # fmt: skip
    }
    synthetic_sizes = {"tiny": {"train": 4096, "eval": 256}, "flux1-schnell": {"train": 64, "eval": 64}}
    family = MMDiTFamily()
    unused_keys = {
        "data.seq_length": "its sequences are fixed by the latent (model.latent_size) and the prompt "
                           "(model.text_tokens)",
        "data.max_predictions": "it predicts a velocity for every latent patch",
        "data.layout": "its samples are one latent and one prompt each",
        "data.length_bins": "its samples all have one length",
        "optimizer.bias_correction": "AdamW always corrects its moments' bias",
        "optimizer.clip": "the optimizer clips the global gradient norm",
        "schedule.poly_power": "its rate is constant after the warmup",
        "distributed.keep_outer_gathered": "its layers outside the blocks (the embedders, the final layer) are a "
        "small share of its weights: FSDP2 gathers them with the model each micro-batch",
        "distributed.output_layer_apart": "its final layer is a small share of its weights: FSDP2 shards it with the "
        "model",
        "schedule.start_warmup_step": "its warmup starts at step 0",
        "schedule.end_lr": "its rate is constant after the warmup",
        "perf.recompute_blocks": "perf.activation_checkpointing recomputes every block",
        "perf.offload_blocks": "it offloads no blocks",
        "distributed.bucket_cap_mb": "several ranks shard it with FSDP2, which reduce-scatters per block",
        "distributed.overlap_compiled": "several ranks compile it block by block, and FSDP2 overlaps its collectives",
    }  # fmt: skip

    def target_range(self, cfg: RunConfig) -> tuple[float, float]:
        return 0.0, 4.0

    @property
    def target_range_why(self) -> str:
        return "a mean squared error of the velocity; an untrained model scores about 2"

    def eval_every_samples(self, cfg: RunConfig) -> int:
        gbs = cfg.data.global_batch_size
        return math.ceil(EVAL_EVERY / gbs) * gbs

    def evaluation_frequency(self, cfg: RunConfig) -> int:
        """The eval cadence the run keeps (and logs): the config's, else the rules'."""
        return cfg.eval.every_samples or self.eval_every_samples(cfg)

    # -- data -----------------------------------------------------------------------------------
    def _root(self, cfg: RunConfig) -> Path:
        if not cfg.data.dir:
            raise DataError("no dataset given: set data.dir=DIR to a folder made by `trainbench prepare flux1 "
                            f"--synthetic --preset {cfg.preset} --out DIR`, or one holding the reference's "
                            "train/, eval/ and empty_encodings/")  # fmt: skip
        return Path(cfg.data.dir)

    def check_data(self, cfg: RunConfig) -> None:
        from trainbench.data import flux_data

        root, m = self._root(cfg), cfg.model
        expected = {"t5_encodings": (m.text_tokens, m.context_dim), "clip_encodings": (m.vector_dim,),
                    "mean": (m.in_channels // 4, m.latent_size, m.latent_size)}  # fmt: skip
        expected["logvar"] = expected["mean"]
        for split in ("train", "eval"):
            data = flux_data.EncodedSplit(root / split)
            for name, shape in data.check().items():  # every row's shape and type, the timesteps
                if shape != expected[name]:
                    raise DataError(f"{root / split}: {name} of shape {list(shape)}, the model expects "
                                    f"{list(expected[name])} (model.* must match the data)")  # fmt: skip
            if split == "eval":
                data.timesteps()
        empty = flux_data.read_empty(root / "empty_encodings")
        for name in ("t5_encodings", "clip_encodings"):
            if empty[name].shape != expected[name]:
                raise DataError(f"{root / 'empty_encodings'}: the empty prompt's {name} has shape "
                                f"{list(empty[name].shape)}, not {list(expected[name])}")  # fmt: skip

    def build_data(self, cfg: RunConfig, rank: int, world_size: int, start_sample: int = 0) -> BenchmarkData:
        from trainbench.data import flux_data

        root, d = self._root(cfg), cfg.data
        train, evals = flux_data.EncodedSplit(root / "train"), flux_data.EncodedSplit(root / "eval")
        empty = flux_data.read_empty(root / "empty_encodings")
        steps = flux_data.FluxSteps(train, cfg.seed, d.global_batch_size, d.micro_batch_size, rank, world_size,
                                    start_sample, empty)  # fmt: skip
        n_eval = min(d.eval_samples or len(evals), len(evals))
        return BenchmarkData(train=steps, eval=flux_data.FluxEval(evals, d.eval_batch_size, rank, world_size, n_eval),
                             train_samples=len(train), eval_samples=n_eval)  # fmt: skip

    # -- optimizer ------------------------------------------------------------------------------
    def build_optimizer(self, cfg: RunConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
        from trainbench.optim.adamw import AdamClipped, own_kernel_chosen

        o = cfg.optimizer  # weight decay on every parameter, as the reference
        own = own_kernel_chosen(cfg.perf.optimizer_kernel, cfg.distributed.world_size)
        return AdamClipped(model.parameters(), o.max_grad_norm, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.epsilon,
                           weight_decay=o.weight_decay, fused=True, own_kernel=own)  # fmt: skip

    def lr_at(self, cfg: RunConfig, step: int) -> float:
        warmup = cfg.schedule.warmup_steps
        return cfg.optimizer.lr * min(1.0, (step + 1) / warmup) if warmup else cfg.optimizer.lr

    # -- the step -------------------------------------------------------------------------------
    def _errors(self, model, batch) -> torch.Tensor:
        """Each sample's mean squared error of the predicted velocity."""
        import torch

        from trainbench.families.mmdit.model import image_ids

        z = batch["mean"] + torch.exp(0.5 * batch["logvar"]) * batch["eps"]
        x = (z - SHIFT) * SCALE
        t = batch["t"].to(x.dtype)
        noisy = (1 - t[:, None, None, None]) * x + t[:, None, None, None] * batch["noise"]
        target = pack(batch["noise"] - x)
        h = x.shape[-1] // 2
        txt = batch["t5_encodings"]
        img_ids = image_ids(h, h, device=x.device)
        txt_ids = torch.zeros(txt.shape[1], 3, device=x.device, dtype=img_ids.dtype)
        pred = model(pack(noisy), txt, batch["clip_encodings"], t, img_ids, txt_ids)
        return (pred.float() - target.float()).square().mean(dim=(1, 2))

    def loss_weights(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        import torch

        return torch.tensor([batch["t"].shape[0]], dtype=torch.float32, device=batch["t"].device)

    def loss(self, model, batch, weights):
        return self._errors(model, batch).sum() / weights[0]

    def eval_sums(self, model, batch) -> torch.Tensor:
        """Per timestep, the summed errors and the samples (float64)."""
        import torch

        errors, step = self._errors(model, batch).double(), batch["step_index"]
        sums = torch.zeros(TIMESTEPS, dtype=torch.float64, device=errors.device).index_add_(0, step, errors)
        counts = torch.bincount(step, minlength=TIMESTEPS).double()
        return torch.cat([sums, counts])

    def eval_metric(self, sums: torch.Tensor) -> float:
        errors, counts = sums[:TIMESTEPS], sums[TIMESTEPS:]
        seen = counts > 0
        return float((errors[seen] / counts[seen]).mean()) if seen.any() else float("nan")

    # -- throughput -----------------------------------------------------------------------------
    def bench_data(self, cfg: RunConfig, rank: int, world_size: int) -> BenchmarkData:
        """One global batch of random encodings and latent distributions of the model's shapes, each sample with its
        randomness as in training, and one eval batch at the 8 timesteps in turn."""
        m, d = cfg.model, cfg.data
        rng = np.random.default_rng(cfg.seed)
        latent = (m.in_channels // 4, m.latent_size, m.latent_size)

        def rows(n: int) -> dict[str, np.ndarray]:
            normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)  # noqa: E731
            return {"t5_encodings": normal(n, m.text_tokens, m.context_dim), "clip_encodings": normal(n, m.vector_dim),
                    "mean": normal(n, *latent), "logvar": np.full((n, *latent), -6.0, np.float32),
                    "noise": normal(n, *latent), "eps": normal(n, *latent)}  # fmt: skip

        train = rows(d.global_batch_size) | {"t": rng.random(d.global_batch_size, dtype=np.float32)}
        steps = np.arange(d.eval_batch_size) % TIMESTEPS
        evals = rows(d.eval_batch_size) | {"t": (steps / TIMESTEPS).astype(np.float32), "step_index": steps}
        return BenchmarkData(train=CycledSteps([train], d.global_batch_size, d.micro_batch_size, rank, world_size),
                             eval=[evals], train_samples=0, eval_samples=d.eval_samples or 29_696)  # fmt: skip

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
            "evaluation_frequency": self.evaluation_frequency(cfg),
        }

    def waived_checks(self, cfg: RunConfig) -> frozenset[str]:
        return frozenset({"evaluation_frequency"} if self.evaluation_frequency(cfg) != EVAL_EVERY else ())

    # -- the command line -----------------------------------------------------------------------
    @staticmethod
    def add_prepare_arguments(parser) -> None:
        own = parser.add_argument_group("synthetic encodings")
        own.add_argument("--train-samples", type=int, help="training samples (default: by preset)")
        own.add_argument("--eval-samples", type=int, help="eval samples (default: by preset)")

    prepare_examples = "examples:\n  trainbench prepare flux1 --synthetic --preset tiny --out data/flux-tiny\n"

    def prepare(self, args) -> int:
        from trainbench.console import console
        from trainbench.data import flux_data

        if not args.synthetic:
            raise UserError(
                "flux1 reads the reference's preprocessed encodings as they are (data.dir holding train/, "
                "eval/ and empty_encodings/); `prepare flux1` writes synthetic ones: add --synthetic"
            )
        m = self.config(args.preset).model
        sizes = synthetic_sizes(self, args, {"train": "train_samples", "eval": "eval_samples"})
        spec = {"seed": args.seed, "latent": [m.in_channels // 4, m.latent_size, m.latent_size],
                "text_tokens": m.text_tokens, "text_width": m.context_dim, "pooled_width": m.vector_dim,
                "classes": 8, **sizes}  # fmt: skip
        out = Path(args.out)
        if claim(out, spec, args.force, replace=("train", "eval", "empty_encodings")):
            return 0
        with progress_bar("synthetic encodings", 3, args.no_progress) as update:
            written = flux_data.write_synthetic(out, spec, update)
        write_manifest(out, {"benchmark": self.name, "spec": spec})
        console.print(f"wrote {written['train']:,} training and {written['eval']:,} eval samples to {out}")
        return 0
