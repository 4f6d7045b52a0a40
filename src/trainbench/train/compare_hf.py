"""What users would run instead, timed the way `trainbench bench` times ours (``--compare hf``): HF `transformers`
(`LlamaForCausalLM`, `GptOssForCausalLM`, `BertForPreTraining`), with `peft`'s LoRA for the fine-tuning benchmark,
and `diffusers`' `FluxTransformer2DModel` for FLUX.1's MMDiT, built from the same config at the same depth, fed the
same rows cut into the same micro-batches, trained with AdamW under bf16 autocast and the same gradient clip, eager
and compiled. One process only; transformers, peft and diffusers are optional."""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from typing import Any

import numpy as np
import torch

from trainbench.benchmarks.base import Benchmark
from trainbench.config import RunConfig
from trainbench.errors import UserError

IGNORE = -100


def hf_family(bench: Benchmark, cfg: RunConfig) -> str | None:
    """Which HF model stands beside ours: decoder (a llama-architecture decoder), decoder_lora, moe (GPT-OSS),
    encoder (BERT), flux (FLUX.1's MMDiT, in diffusers); None for none."""
    model = cfg.model
    if hasattr(model, "double_blocks"):
        return "flux"
    if hasattr(model, "num_experts"):
        return "moe"
    if hasattr(model, "lora_rank"):
        return "decoder_lora" if model.arch == "llama" else None
    if hasattr(model, "arch"):
        return "decoder" if model.arch == "llama" else None
    if hasattr(model, "type_vocab_size"):
        return "encoder"
    return None


def require(bench: Benchmark, cfg: RunConfig) -> str:
    """The HF family to compare with, or one sentence why none can run here."""
    family = hf_family(bench, cfg)
    if family is None:
        raise UserError(f"--compare hf: transformers has no model of {bench.name}'s architecture to compare with")
    m = cfg.model
    if family == "flux" and (m.mlp_ratio != 4 or m.rope_theta != 10000):
        raise UserError(f"--compare hf: diffusers' FluxTransformer2DModel fixes the MLP ratio at 4 and the RoPE base "
                        f"at 10000, not model.mlp_ratio={m.mlp_ratio:g} and "
                        f"model.rope_theta={m.rope_theta:g}")  # fmt: skip
    needed = ["diffusers"] if family == "flux" else ["transformers"] + (["peft"] if family == "decoder_lora" else [])
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(f"--compare hf needs {' and '.join(missing)}: pip install {' '.join(missing)} "
                        "(or pip install -e '.[test]' in trainbench's clone)")  # fmt: skip
    if cfg.distributed.world_size > 1:
        raise UserError("--compare hf runs in one process: drop --nproc")
    return family


def build(family: str, cfg: RunConfig, device: torch.device) -> torch.nn.Module:
    m = cfg.model
    if family == "flux":
        import diffusers

        # Weights in fp32 under bf16 autocast, as ours and as diffusers' training scripts with mixed precision bf16.
        return diffusers.FluxTransformer2DModel(
            patch_size=1, in_channels=m.in_channels, num_layers=m.double_blocks, num_single_layers=m.single_blocks,
            attention_head_dim=m.head_dim, num_attention_heads=m.num_heads, joint_attention_dim=m.context_dim,
            pooled_projection_dim=m.vector_dim, guidance_embeds=False, axes_dims_rope=m.axes_dim,
        ).to(device).train()  # fmt: skip
    import transformers

    if family == "encoder":
        hf_cfg = transformers.BertConfig(
            vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
            num_attention_heads=m.num_heads, intermediate_size=m.intermediate_size,
            max_position_embeddings=m.max_position_embeddings, type_vocab_size=m.type_vocab_size,
            hidden_dropout_prob=m.hidden_dropout, attention_probs_dropout_prob=m.attention_dropout,
            layer_norm_eps=m.layer_norm_eps, attn_implementation="sdpa",
        )  # fmt: skip
        return transformers.BertForPreTraining(hf_cfg).to(device).train()
    if family == "moe":
        return _gpt_oss(transformers, cfg, device)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads, num_key_value_heads=m.kv_heads, intermediate_size=m.intermediate_size,
        max_position_embeddings=cfg.data.seq_length, rope_theta=m.rope_theta, rms_norm_eps=m.norm_eps,
        tie_word_embeddings=m.tie_embeddings, attn_implementation="sdpa",
    )  # fmt: skip
    if family == "decoder":
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


def inputs(family: str, batch: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """Our micro-batch as HF's keyword arguments (HF shifts the labels itself)."""
    t = {k: torch.as_tensor(v).to(device) for k, v in batch.items()}
    if family == "encoder":
        labels = torch.full_like(t["input_ids"], IGNORE).long()
        valid = t["masked_lm_positions"] > 0
        labels.scatter_(1, t["masked_lm_positions"].long() * valid, torch.where(valid, t["masked_lm_ids"].long(),
                                                                                 IGNORE))  # fmt: skip
        labels[:, 0] = IGNORE
        return {"input_ids": t["input_ids"].long(), "token_type_ids": t["segment_ids"].long(),
                "attention_mask": t["input_mask"].long(), "labels": labels,
                "next_sentence_label": t["next_sentence_labels"].long()}  # fmt: skip
    if family in ("decoder", "moe"):  # (GPT-OSS: every token counted, ours leaves out those after a document's end)
        tokens = t["tokens"].long()[:, :-1]
        return {"input_ids": tokens, "labels": tokens}
    tokens, targets = t["tokens"].long(), t["targets"].long()
    labels = torch.full_like(tokens, IGNORE)
    labels[:, 1:] = torch.where(targets[:, :-1] != IGNORE, tokens[:, 1:], IGNORE)
    return {"input_ids": tokens, "labels": labels}


def loss_of(family: str, bench: Benchmark, called, batch: dict[str, np.ndarray], device: torch.device) -> torch.Tensor:
    """The micro-batch's mean loss on the peer ``called``: HF's own loss from its labels, or for diffusers' MMDiT
    (which has none) the benchmark's own loss, its rectified flow drawn from the same batch, with diffusers called in
    place of ours (it scales the timestep by 1000 itself, as ours does)."""
    if family != "flux":
        return called(**inputs(family, batch, device)).loss

    def as_ours(img, txt, vec, t, img_ids, txt_ids):  # our model's call, made on diffusers'
        return called(hidden_states=img, encoder_hidden_states=txt, pooled_projections=vec, timestep=t,
                      img_ids=img_ids, txt_ids=txt_ids, return_dict=False)[0]  # fmt: skip

    t = bench.to_device(batch, device)
    return bench.loss(as_ours, t, bench.loss_weights(t))


def _adamw(model: torch.nn.Module, cfg: RunConfig, device: torch.device):
    """The trainable parameters and the AdamW HF users train them with, at our optimizer's settings."""
    params = [p for p in model.parameters() if p.requires_grad]
    o = cfg.optimizer
    opt = torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.epsilon, weight_decay=o.weight_decay,
                            fused=device.type == "cuda")  # fmt: skip
    return params, opt


def _kernels(family: str):
    """The attention kernels the peer may use: for diffusers' FLUX all of SDPA's but cuDNN's, whose backward fails on
    its layout at FLUX.1's shape with torch 2.11 on an H200 (an illegal memory access); flash attention then serves
    it. Every kernel for the others."""
    import contextlib

    if family != "flux":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def measure(bench: Benchmark, cfg: RunConfig, family: str, compiled: bool, steps: int, warmup: int,
            device: torch.device) -> dict[str, Any]:  # fmt: skip
    """HF's seconds for ``steps`` optimizer steps of the global batch after ``warmup``; an out-of-memory is recorded
    as such (HF's peer does not fit where ours does), not raised. HF's BERT has no packed rows: where ours trains on
    packed rows, HF trains on fixed rows of the same length mix (padded, as its users train), and the two are
    compared by samples per second."""
    if cfg.data.layout == "packed":
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, layout="fixed"))
    torch.manual_seed(cfg.seed)
    model = None
    try:
        model = build(family, cfg, device)
        called = torch.compile(model) if compiled else model
        params, opt = _adamw(model, cfg, device)
        o = cfg.optimizer
        data = bench.bench_data(cfg, 0, 1)
        source = iter(data.train)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for i in range(warmup + steps):
            if i == warmup:
                torch.cuda.synchronize(device) if device.type == "cuda" else None
                start = time.perf_counter()
            micro = next(source)
            samples = micro.samples
            for batch in micro:
                with _kernels(family):
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                        loss = loss_of(family, bench, called, batch, device) / len(micro)
                    loss.backward()
            torch.nn.utils.clip_grad_norm_(params, o.max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        return {
            "steps": steps,
            "warmup": warmup,
            "seconds": seconds,
            "samples_per_step": samples,
            "peak_memory_gib": peak,
        }
    except torch.OutOfMemoryError as exc:
        return {"error": f"out of memory: {str(exc).splitlines()[0]}"}
    finally:
        del model
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
