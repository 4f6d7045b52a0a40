"""The decoder's twins in HF's libraries, for `trainbench bench --compare hf` (measure/compare_hf.py): transformers'
`LlamaForCausalLM` (a llama-architecture decoder), `GptOssForCausalLM` (GPT-OSS's mixture of experts) and, for the
fine-tuning benchmark, that Llama with peft's LoRA, each built to the config's shapes. Every families/<family>/hf.py
answers the same calls: :func:`peer`, :func:`check`, :func:`packages`, :func:`build`, :func:`loss`, :func:`kernels`."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch

from trainbench.config import RunConfig
from trainbench.families.configs import GptOssConfig, LoraModelConfig

IGNORE = -100


def peer(cfg: RunConfig) -> str | None:
    """Which HF model stands beside ours: decoder (Llama), decoder_lora (Llama with peft's LoRA), moe (GPT-OSS);
    None for GPT-3's architecture, which transformers has no trainable twin of."""
    m = cfg.model
    if isinstance(m, GptOssConfig):
        return "moe"
    if m.arch != "llama":
        return None
    return "decoder_lora" if isinstance(m, LoraModelConfig) else "decoder"


def check(cfg: RunConfig) -> None:
    """transformers builds every shape of ours: nothing to refuse."""


def packages(cfg: RunConfig) -> list[str]:
    return ["transformers"] + (["peft"] if peer(cfg) == "decoder_lora" else [])


def build(cfg: RunConfig, device: torch.device) -> torch.nn.Module:
    import transformers

    m = cfg.model
    if peer(cfg) == "moe":
        return _gpt_oss(transformers, cfg, device)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads, num_key_value_heads=m.kv_heads, intermediate_size=m.intermediate_size,
        max_position_embeddings=cfg.data.seq_length, rope_theta=m.rope_theta, rms_norm_eps=m.norm_eps,
        tie_word_embeddings=m.tie_embeddings, attn_implementation="sdpa",
    )  # fmt: skip
    if peer(cfg) == "decoder":
        return transformers.LlamaForCausalLM(hf_cfg).to(device).train()
    import peft

    # The frozen base in bf16 on a GPU (as users load it for LoRA), adapters on q, k, v and o (peft keeps them
    # apart), gradient checkpointing on every block: how a 70B LoRA fits for HF users.
    model = transformers.LlamaForCausalLM(hf_cfg).to(device=device, dtype=torch.bfloat16 if device.type == "cuda"
                                                     else torch.float32)  # fmt: skip
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    targets = sorted({"q_proj", "k_proj", "v_proj"} if "qkv_proj" in m.targets else set()) + \
        [t for t in m.targets if t != "qkv_proj"]  # fmt: skip
    lora = peft.LoraConfig(r=m.lora_rank, lora_alpha=m.lora_alpha, lora_dropout=m.lora_dropout, bias="none",
                           target_modules=targets)  # fmt: skip
    model = peft.get_peft_model(model, lora)
    for p in model.parameters():  # adapters in fp32, as ours
        if p.requires_grad:
            p.data = p.data.float()
    return model.train()


def _gpt_oss(transformers, cfg: RunConfig, device: torch.device) -> torch.nn.Module:
    """transformers' GPT-OSS at our shape, always with its own block (sinks, biases, clamped SwiGLU; its rotary
    positions YaRN-scaled where ours are), the experts through its grouped GEMM and attention through FlexAttention
    on a GPU (its fastest trainable kernels for the window and the sinks) with bf16 weights and AdamW state, eager on
    the CPU; its load-balancing loss where ours has one."""
    m = cfg.model
    rope = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.yarn_factor != 1:
        rope = {"rope_type": "yarn", "rope_theta": m.rope_theta, "factor": m.yarn_factor, "beta_fast": m.yarn_beta_fast,
                "beta_slow": m.yarn_beta_slow, "truncate": False,
                "original_max_position_embeddings": m.yarn_original_positions}  # fmt: skip
    cuda = device.type == "cuda"
    hf_cfg = transformers.GptOssConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads, num_key_value_heads=m.kv_heads, head_dim=m.head_dim,
        intermediate_size=m.intermediate_size, num_local_experts=m.num_experts, num_experts_per_tok=m.experts_per_token,
        sliding_window=m.sliding_window or None, rms_norm_eps=m.norm_eps, rope_parameters=rope,
        max_position_embeddings=cfg.data.seq_length, router_aux_loss_coef=m.aux_loss_coeff,
        output_router_logits=m.aux_loss_coeff > 0, attn_implementation="flex_attention" if cuda else "eager",
        experts_implementation="grouped_mm" if cuda else "eager",
    )  # fmt: skip
    # bf16 weights on a GPU, as its users load it: its grouped GEMM takes bf16 only, and compiled with fp32 weights
    # it falls back to a product per expert.
    return transformers.GptOssForCausalLM(hf_cfg).to(device=device, dtype=torch.bfloat16 if cuda else None).train()


def inputs(cfg: RunConfig, batch: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """Our micro-batch as HF's keyword arguments (HF shifts the labels itself)."""
    t = {k: torch.as_tensor(v).to(device) for k, v in batch.items()}
    if peer(cfg) != "decoder_lora":  # (GPT-OSS: every token counted, ours leaves out those after a document's end)
        tokens = t["tokens"].long()[:, :-1]
        return {"input_ids": tokens, "labels": tokens}
    tokens, targets = t["tokens"].long(), t["targets"].long()
    labels = torch.full_like(tokens, IGNORE)
    labels[:, 1:] = torch.where(targets[:, :-1] != IGNORE, tokens[:, 1:], IGNORE)
    return {"input_ids": tokens, "labels": labels}


def loss(bench: Any, cfg: RunConfig, called, batch: dict[str, np.ndarray], device: torch.device) -> torch.Tensor:
    """The micro-batch's mean loss on the peer ``called``: HF's own, from its labels."""
    return called(**inputs(cfg, batch, device)).loss


def kernels() -> contextlib.AbstractContextManager:
    """Every attention kernel SDPA has."""
    return contextlib.nullcontext()
