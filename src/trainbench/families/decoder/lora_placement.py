"""Placing a LoRA decoder: adapters attached on the meta device, then one of two layouts.

- bf16 (``base_precision=auto``): the frozen base in bf16 on a GPU, FSDP2 over the ranks, each rank's shards filled
  from the base checkpoint's slices (never the whole model on one rank).
- FP8 (``base_precision=fp8``): the whole base on every rank, built block by block (read or initialised in the
  run's precision, quantised, and only then the next block), so the high-precision model never exists whole;
  DDP all-reduces the adapters' gradients, the only ones there are.

Compilation is per block: the bf16 layout compiles each block with its checkpointing (as the pretraining decoder
does); the FP8 layout compiles inside the checkpointing, so a recomputed block keeps nothing of what its compiled
graph would save for the backward (compiled around it, every FP8 block's activations stayed alive: out of memory at
80 layers on one H200). On 2 GPUs the bf16 layout was slower compiled inside (docs/lora.md, "FP8 frozen base").
"""

from __future__ import annotations

import torch
from torch import nn

from trainbench.config import PerfConfig
from trainbench.distributed import DistInfo, Placed
from trainbench.errors import ConfigError
from trainbench.families import fp8
from trainbench.families.decoder import lora
from trainbench.families.decoder.hf_checkpoint import HFCheckpoint, check_shapes, fill, load_into
from trainbench.families.decoder.memory import recompute_all, recompute_and_offload
from trainbench.families.decoder.model import DecoderLM, init_part, lm_loss
from trainbench.families.decoder.offload import own_forward, run_from_outside
from trainbench.families.decoder.placement import parallelize, sharded_comm_precision, use_flex_for_packed_rows


def place_lora(model: DecoderLM, cfg: lora.LoraModelConfig, info: DistInfo, tp: int, bf16: bool, perf: PerfConfig,
               seed: int) -> Placed:  # fmt: skip
    """``model`` (built on the meta device) with adapters, placed and materialised: the base from
    ``cfg.base_weights`` (or the seed, where none is given), the adapters from the seed; compiled and checkpointed by
    ``perf.compile`` and ``perf.activation_checkpointing``, and what its blocks keep for the backward chosen by
    ``perf``'s other keys last (:func:`~trainbench.families.decoder.memory.recompute_and_offload`: checkpointing on
    fewer blocks, host offload)."""
    checkpointing, compile_blocks = perf.activation_checkpointing, perf.compile
    if tp != 1:
        raise ConfigError("distributed.tp must be 1 for LoRA: its adapters are sharded by FSDP2 only")
    lora.attach(model, cfg.targets, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout)
    bf16 = bf16 and info.device.type == "cuda"
    if bf16:  # the frozen base needs no fp32 master copy: half its memory; adapters stay fp32
        for p in model.parameters():
            if not p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
    if cfg.base_precision == "fp8":
        if cfg.base_sharding == "fsdp":
            placed = _place_fp8_sharded(model, cfg, info, checkpointing, compile_blocks, seed)
        else:
            placed = _place_fp8(model, cfg, info, checkpointing, seed)
        if compile_blocks:
            compile_inside_checkpointing(placed.module)
        use_flex_for_packed_rows(placed.module, info.device, compile_blocks)
    else:

        def fill_model(m: DecoderLM) -> None:
            if cfg.base_weights:
                load_into(m, cfg.base_weights, cfg, skip=lora.ADAPTER_KEYS)
            else:
                m.init_weights(seed)
            lora.load_adapters(m, lora.full_init(m, seed))

        module = parallelize(model, info.device, info.world_size, 1, bf16, checkpointing, compile_blocks, None, seed,
                             fill=fill_model)  # fmt: skip
        placed = Placed(module=module, model=module, comm_precision=sharded_comm_precision(info.world_size, bf16))
    trainable = sum(p.numel() for p in placed.module.parameters() if p.requires_grad)
    layout = ("base sharded by FSDP2" if cfg.base_precision != "fp8" else "FP8 base on every rank"
              if cfg.base_sharding == "replicate" else "FP8 base sharded by FSDP2, gathered in FP8")  # fmt: skip
    placed.notes.append(f"LoRA: {trainable:,} trainable parameters (rank {cfg.lora_rank}, on {cfg.lora_targets}); "
                        f"{layout}")  # fmt: skip
    return recompute_and_offload(placed, perf, info.device)


def compile_inside_checkpointing(model: DecoderLM) -> None:
    """Compile each block's computation, leaving its activation checkpointing eager around it (compiling the
    checkpoint as well kept every FP8 block's activations alive: out of memory at 80 layers), and the output
    layer with its loss."""
    for block in model.model.layers:
        run_from_outside(block, torch.compile(own_forward(block), dynamic=False))
    model.loss_fn = torch.compile(lm_loss, dynamic=False)


def _place_fp8(model: DecoderLM, cfg: lora.LoraModelConfig, info: DistInfo, checkpointing: bool, seed: int) -> Placed:
    ckpt = HFCheckpoint(cfg.base_weights) if cfg.base_weights else None
    try:
        if ckpt is not None:
            check_shapes(model, ckpt, cfg, skip=lora.ADAPTER_KEYS)  # before any block is read
        torch.manual_seed(seed)
        parts: list[tuple[str, nn.Module]] = [(f"model.layers.{i}.", b) for i, b in enumerate(model.model.layers)]
        parts += [("model.embed_tokens.", model.model.embed_tokens), ("model.norm.", model.model.norm),
                  ("lm_head.", model.lm_head)]  # fmt: skip
        for prefix, part in parts:
            part.to_empty(device=info.device)
            if ckpt is not None:
                fill(part, ckpt, cfg, skip=lora.ADAPTER_KEYS, prefix=prefix)
            else:
                init_part(part, cfg)
            if prefix.startswith("model.layers."):
                fp8.quantize_frozen(part)
    finally:
        if ckpt is not None:
            ckpt.close()
    lora.load_adapters(model, lora.full_init(model, seed))
    recompute_all(model, checkpointing)
    for block in model.model.layers:
        if block.mlp.swiglu:  # the gate and up activations kept for the backward in FP8: half their memory
            block.mlp.gated = fp8.silu_mul_fp8_saved
    if info.world_size == 1:
        return Placed(module=model, model=model)
    from torch.nn.parallel import DistributedDataParallel

    ids = [info.device.index] if info.device.type == "cuda" else None
    # Every rank built the same base and adapters from the same files and seed: nothing to broadcast.
    ddp = DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False, init_sync=False)
    return Placed(module=model, model=ddp, no_sync=ddp.no_sync)


def _place_fp8_sharded(model: DecoderLM, cfg: lora.LoraModelConfig, info: DistInfo, checkpointing: bool,
                       compile_blocks: bool, seed: int) -> Placed:  # fmt: skip
    """The FP8 base sharded by FSDP2 over the ranks (one rank too): each block's FP8 weights and their scales are
    frozen parameters, sharded by rows and gathered in FP8 (FSDP2 gathers mixed dtypes as bytes, never upcast), a
    block at a time. Every rank makes each part whole from the checkpoint or the seed (in the order and from the
    RNG of the replicated placement, so the weights are the same), quantises it and keeps its rows: a row's scale
    is its own, so sharded quantisation equals whole."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from trainbench.distributed import single_rank_group
    from trainbench.families.decoder.placement import make_mesh

    single_rank_group(info.device)  # FSDP2 over one rank needs a process group too
    with torch.device("meta"):
        template = DecoderLM(cfg)  # full-precision parts to fill and quantise, one at a time
    lora.attach(template, cfg.targets, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout)
    recompute_all(model, checkpointing)
    for block in model.model.layers:
        fp8.quantize_frozen(block, as_parameters=True)
        if block.mlp.swiglu:
            block.mlp.gated = fp8.silu_mul_fp8_saved
    mesh = make_mesh(info.device.type, info.world_size, 1)["dp"]
    mp = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)  # FP8 stays FP8; adapters reduce in fp32
    for i, block in enumerate(model.model.layers):
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(model.model.layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device=info.device)
    _fill_shards(model, template, cfg, info.device, seed)
    lora.load_adapters(model, lora.full_init(model, seed))
    return Placed(module=model, model=model, comm_precision="fp8")  # the base's gathers move FP8 bytes


def _fill_shards(model: DecoderLM, template: DecoderLM, cfg: lora.LoraModelConfig, device: torch.device,
                 seed: int) -> None:  # fmt: skip
    from torch.distributed.tensor import DTensor, distribute_tensor

    ckpt = HFCheckpoint(cfg.base_weights) if cfg.base_weights else None
    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    try:
        if ckpt is not None:
            check_shapes(template, ckpt, cfg, skip=lora.ADAPTER_KEYS)
        torch.manual_seed(seed)
        parts = [(f"model.layers.{i}.", b) for i, b in enumerate(template.model.layers)]
        parts += [("model.embed_tokens.", template.model.embed_tokens), ("model.norm.", template.model.norm),
                  ("lm_head.", template.lm_head)]  # fmt: skip
        for prefix, part in parts:
            part.to_empty(device=device)
            if ckpt is not None:
                fill(part, ckpt, cfg, skip=lora.ADAPTER_KEYS, prefix=prefix)
            else:
                init_part(part, cfg)
            if prefix.startswith("model.layers."):
                fp8.quantize_frozen(part, as_parameters=True)
            for name, whole in [*part.named_parameters(), *part.named_buffers()]:
                if any(k in name for k in lora.ADAPTER_KEYS):
                    continue
                target = targets[prefix + name]
                with torch.no_grad():
                    if isinstance(target, DTensor):  # every rank has the whole: each keeps its rows, no scatter
                        target.copy_(distribute_tensor(whole.detach().to(target.dtype), target.device_mesh,
                                                       target.placements, src_data_rank=None))  # fmt: skip
                    else:
                        target.copy_(whole.detach())
            part.to_empty(device="meta")
    finally:
        if ckpt is not None:
            ckpt.close()
