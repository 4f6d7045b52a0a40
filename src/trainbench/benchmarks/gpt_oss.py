"""MLPerf `gpt_oss_20b` (Training 6.0 and 6.1): a 21 B-parameter mixture of experts (3.6 B active per token)
pretrained from scratch on C4 to a target eval log perplexity of 3.34.

A member of the decoder family (:class:`~trainbench.benchmarks.llm.LLMBenchmark`): the same data (Megatron indexed C4
cut into 8,193-token windows), loop, eval, checker and report as `llama31_8b`, with the model of
:mod:`trainbench.families.decoder.gpt_oss`. Rules followed (mlperf-logging's ``closed_gpt_oss_20b.yaml``, equal in
6.0.0 and 6.1.0): seq 8192, AdamW beta 0.9/0.95, eps 1e-5, weight decay 0.1, clip 1.0, cosine decay with linear warmup
over 1.2 M steps to 0.1 x the base rate, 1,024 eval sequences every 12,288 rounded up to the global batch. As the
reference (Megatron's ``eod_mask_loss``), a token that follows an end-of-document token is not predicted: neither
the training loss nor the eval counts it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import numpy as np

from trainbench.benchmarks.llm import TINY_DATA, Llama31Benchmark, read_manifest, run_config
from trainbench.config import DataConfig, OptimizerConfig, RunConfig, ScheduleConfig
from trainbench.data import prepare_llm
from trainbench.errors import DataError
from trainbench.families.configs import GptOssConfig
from trainbench.families.decoder.family import GptOssFamily

if TYPE_CHECKING:
    import torch


# The reference's shape (Primus' gpt_oss_20B): 24 blocks of width 2880, 64 query and 8 key/value heads of 64,
# 32 experts of width 2880, 4 a token, a window of 128 earlier keys (and the query's own) on every other block.
GPT_OSS_20B = GptOssConfig()
# GPT-OSS's own block at the same shape, as transformers defines it (its vocabulary, sinks, biases, clamped SwiGLU,
# YaRN from 4,096 positions by 32, RMSNorm eps 1e-5): the shape measured against transformers' GptOss.
GPT_OSS_20B_HF = GptOssConfig(block="gpt_oss", vocab_size=201088, norm_eps=1e-5, init_std=0.02, yarn_factor=32.0,
                              sliding_window=128)  # fmt: skip
TINY_GPT_OSS = GptOssConfig(
    vocab_size=512, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, attention_head_dim=32,
    intermediate_size=128, num_experts=4, experts_per_token=2, sliding_window=32, rope_theta=10000.0, init_std=0.02,
)  # fmt: skip


def tiny(block: str) -> RunConfig:
    model = dataclasses.replace(TINY_GPT_OSS, block=block)
    opt = OptimizerConfig(name="adamw", lr=3e-3, beta1=0.9, beta2=0.95, epsilon=1e-5, weight_decay=0.1,
                          max_grad_norm=1.0)  # fmt: skip
    sched = ScheduleConfig(warmup_steps=20, total_steps=1000)
    return run_config("gpt_oss_20b", "tiny", model, dataclasses.replace(TINY_DATA), opt, sched, target=1.6, every=1600)


def full(preset: str, model: GptOssConfig) -> RunConfig:
    """The reference's first RCP: GBS 16, micro-batch 2, lr 4e-4, warmup 2,048 samples (128 steps)."""
    return run_config(
        "gpt_oss_20b", preset, model,
        DataConfig(seq_length=8192, global_batch_size=16, micro_batch_size=2, eval_batch_size=1, eval_samples=1024),
        OptimizerConfig(name="adamw", lr=4e-4, beta1=0.9, beta2=0.95, epsilon=1e-5, weight_decay=0.1,
                        max_grad_norm=1.0),
        ScheduleConfig(warmup_steps=128, total_steps=1_200_000), target=3.34,
    )  # fmt: skip


def eod_id(manifest: dict) -> int:
    """The end-of-document token: the manifest's (C4), the synthetic language's."""
    if manifest.get("source") == "synthetic":
        return prepare_llm.EOD
    if not isinstance(manifest.get("eod_id"), int):
        raise DataError(f"{manifest['path']} names no end-of-document token (eod_id); prepare the data again")
    return manifest["eod_id"]


def data_vocab(manifest: dict) -> int | None:
    """The vocabulary the folder's tokens were made with, where its manifest says."""
    spec = manifest.get("spec")
    vocab = manifest.get("vocab_size", spec.get("vocab_size") if isinstance(spec, dict) else None)
    return vocab if isinstance(vocab, int) else None


class GptOssBenchmark(Llama31Benchmark):
    name = "gpt_oss_20b"
    mlperf_name = "gpt_oss_20b"
    ruleset = "6.1.0"
    older_rulesets = ("6.0.0",)
    description = "GPT-OSS 20B mixture-of-experts pretraining on C4 (AdamW, seq 8192), target log perplexity 3.34"
    full_preset = "gpt-oss-20b"
    family = GptOssFamily()
    presets = {
        "tiny": lambda: tiny("reference"),
        "tiny-hf": lambda: tiny("gpt_oss"),
        "gpt-oss-20b": lambda: full("gpt-oss-20b", GPT_OSS_20B),
        "gpt-oss-20b-hf": lambda: full("gpt-oss-20b-hf", GPT_OSS_20B_HF),
    }
    unused_keys = Llama31Benchmark.unused_keys | {
        "model.fused_qkv": "its attention has q, k and v projections of their own (transformers' GPT-OSS names)",
        "model.max_seq_length": "its positions are rotary",
    }

    def eval_every_samples(self, cfg: RunConfig) -> int:
        """12,288 sequences rounded up to a multiple of the global batch."""
        gbs = cfg.data.global_batch_size
        return math.ceil(self.eval_every / gbs) * gbs

    def check_data(self, cfg: RunConfig) -> None:
        if not cfg.data.dir:
            super().check_data(cfg)  # its one sentence: which folder to give
        manifest = read_manifest(cfg.data.dir)
        eod_id(manifest)
        vocab = data_vocab(manifest)
        # The model's vocabulary may be the data's rounded up to a multiple of 128, as Megatron pads it: rows no
        # token reaches, for products that take multiples of 16 (model.output_precision=fp8)
        if vocab is not None and not vocab <= cfg.model.vocab_size <= -(-vocab // 128) * 128:
            raise DataError(f"{cfg.data.dir} was tokenised with a vocabulary of {vocab:,} but model.vocab_size="
                            f"{cfg.model.vocab_size:,} (that vocabulary, or it rounded up to a multiple of 128): data "
                            "prepared for another tokenizer (the reference's is Llama 3.1's, 128,256)")  # fmt: skip
        super().check_data(cfg, manifest)

    # -- data: the end-of-document token rides with each row --------------------------------------
    def batch_rows(self, cfg: RunConfig):
        eod = eod_id(read_manifest(cfg.data.dir)) if cfg.data.dir else prepare_llm.EOD
        return lambda tokens: {"tokens": tokens, "eod": np.full(len(tokens), eod, dtype=np.int64)}

    def _targets(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Next tokens, -100 (not counted) where the input is an end-of-document token."""
        tokens = batch["tokens"]
        follows_eod = tokens[:, :-1] == batch["eod"][:, None]
        return tokens[:, 1:].masked_fill(follows_eod, -100)

    def loss_weights(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return (self._targets(batch) != -100).sum().float().reshape(1)

    def _token_losses(self, model, batch) -> torch.Tensor:
        return model(batch["tokens"][:, :-1], targets=self._targets(batch))

    def loss(self, model, batch, weights):
        import torch

        if model.cfg.aux_loss_coeff:
            # The load-balancing loss weighs this micro-batch's share of the step, as its cross entropy does (the
            # loop scales every rank's loss by the ranks, which FSDP's mean of the gradients undoes).
            world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
            model.set_aux_loss_scale(float(self.loss_weights(batch)[0] / weights[0]) * world)
        return self._token_losses(model, batch) / weights[0]

    def eval_sums(self, model, batch) -> torch.Tensor:
        import torch

        count = self.loss_weights(batch).double()[0]
        return torch.stack([self._token_losses(model, batch).double(), count])
