"""Placing a LoRA decoder: adapters attached on the meta device, the frozen base in bf16 (on a GPU), FSDP2 over the
ranks, and each rank's shards filled from the base checkpoint's slices (never the whole model on one rank)."""

from __future__ import annotations

import torch

from trainbench.distributed import DistInfo, Placed
from trainbench.errors import ConfigError
from trainbench.models import lora
from trainbench.models.decoder import DecoderLM
from trainbench.models.decoder_parallel import parallelize
from trainbench.models.hf_checkpoint import load_into


def place_lora(model: DecoderLM, cfg: lora.LoraModelConfig, info: DistInfo, tp: int, bf16: bool,
               checkpointing: bool, compile_blocks: bool, seed: int) -> Placed:  # fmt: skip
    """``model`` (built on the meta device) with adapters, sharded over the ranks and materialised: the base from
    ``cfg.base_weights`` (or the seed, where none is given), the adapters from the seed."""
    if tp != 1:
        raise ConfigError("distributed.tp must be 1 for LoRA: its adapters are sharded by FSDP2 only")
    lora.attach(model, cfg.targets, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout)
    bf16 = bf16 and info.device.type == "cuda"
    if bf16:  # the frozen base needs no fp32 master copy: half its memory; adapters stay fp32
        for p in model.parameters():
            if not p.requires_grad:
                p.data = p.data.to(torch.bfloat16)

    def fill(m: DecoderLM) -> None:
        if cfg.base_weights:
            load_into(m, cfg.base_weights, cfg, skip=lora.ADAPTER_KEYS)
        else:
            m.init_weights(seed)
        lora.load_adapters(m, lora.full_init(m, seed))

    placed = parallelize(model, info.device, info.world_size, 1, bf16, checkpointing, compile_blocks, None, seed,
                         fill=fill)  # fmt: skip
    trainable = sum(p.numel() for p in placed.parameters() if p.requires_grad)
    return Placed(module=placed, model=placed, notes=[f"LoRA: {trainable:,} trainable parameters "
                                                      f"(rank {cfg.lora_rank}, on {cfg.lora_targets})"])  # fmt: skip
