"""BERT's twin in transformers, for `trainbench bench --compare hf` (measure/compare_hf.py): `BertForPreTraining`
built to the config's shapes; the calls every families/<family>/hf.py answers (families/decoder/hf.py names them)."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch

from trainbench.config import RunConfig

IGNORE = -100


def peer(cfg: RunConfig) -> str | None:
    return "encoder"


def check(cfg: RunConfig) -> None:
    """transformers builds every shape of ours: nothing to refuse."""


def packages(cfg: RunConfig) -> list[str]:
    return ["transformers"]


def build(cfg: RunConfig, device: torch.device) -> torch.nn.Module:
    import transformers

    m = cfg.model
    hf_cfg = transformers.BertConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads, intermediate_size=m.intermediate_size,
        max_position_embeddings=m.max_position_embeddings, type_vocab_size=m.type_vocab_size,
        hidden_dropout_prob=m.hidden_dropout, attention_probs_dropout_prob=m.attention_dropout,
        layer_norm_eps=m.layer_norm_eps, attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.BertForPreTraining(hf_cfg).to(device).train()


def inputs(batch: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """Our micro-batch as HF's keyword arguments: the masked positions' tokens as labels at those positions."""
    t = {k: torch.as_tensor(v).to(device) for k, v in batch.items()}
    labels = torch.full_like(t["input_ids"], IGNORE).long()
    valid = t["masked_lm_positions"] > 0
    labels.scatter_(1, t["masked_lm_positions"].long() * valid, torch.where(valid, t["masked_lm_ids"].long(),
                                                                             IGNORE))  # fmt: skip
    labels[:, 0] = IGNORE
    return {"input_ids": t["input_ids"].long(), "token_type_ids": t["segment_ids"].long(),
            "attention_mask": t["input_mask"].long(), "labels": labels,
            "next_sentence_label": t["next_sentence_labels"].long()}  # fmt: skip


def loss(bench: Any, cfg: RunConfig, called, batch: dict[str, np.ndarray], device: torch.device) -> torch.Tensor:
    """The micro-batch's mean loss on the peer ``called``: HF's own, from its labels."""
    return called(**inputs(batch, device)).loss


def kernels() -> contextlib.AbstractContextManager:
    """Every attention kernel SDPA has."""
    return contextlib.nullcontext()
