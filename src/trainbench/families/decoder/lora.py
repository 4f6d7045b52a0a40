"""LoRA (Hu et al. 2021) attached to a model from outside: the model's file keeps its architecture only.

``attach`` gives each chosen ``nn.Linear`` two child layers, ``lora_A`` (in -> rank) and ``lora_B`` (rank -> out),
and a forward hook that adds ``lora_B(lora_A(dropout(x))) * alpha / rank`` to the layer's output; the base weight
keeps its name (``...qkv_proj.weight``), so base checkpoints load unchanged, and the adapters are named as peft
names them (``...qkv_proj.lora_A.weight``). The base is frozen; only adapters train. Initialisation is peft's:
A Kaiming-uniform, B zero, so the adapted model starts equal to the base.

Why not peft itself: peft replaces each layer with a wrapper (``qkv_proj.base_layer.weight``), which renames the
base weights the sharded loader and FSDP2's per-block groups see, and it needs a ``PretrainedConfig``-shaped model.
A hook keeps every name and composes with FSDP2 (the adapters shard with their block), activation checkpointing
(dropout masks are replayed) and per-block compilation (the hook is traced into the block's graph). peft stays the
reference the tests compare with: same adapter weights, same outputs and adapter gradients, and ``export_peft``
writes an adapter peft loads.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from trainbench.families.configs import LoraModelConfig

ADAPTER_KEYS = (".lora_A.", ".lora_B.")


def _add_adapter(module: nn.Module, output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return output + module.lora_B(module.lora_A(module.lora_dropout(x))) * module.lora_scale


def _hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return _add_adapter(module, output, args[0])


def adapted(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and hasattr(m, "lora_A")]


def attach(model: nn.Module, targets: tuple[str, ...], rank: int, alpha: float, dropout: float) -> int:
    """Give every ``nn.Linear`` of ``model`` whose name ends with one of ``targets`` an adapter (on whichever
    device the model is, the meta device included) and freeze everything else; returns how many were adapted."""
    for p in model.parameters():
        p.requires_grad_(False)
    count = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or name.rsplit(".", 1)[-1] not in targets:
            continue
        device = module.weight.device
        module.lora_A = nn.Linear(module.in_features, rank, bias=False, device=device)
        module.lora_B = nn.Linear(rank, module.out_features, bias=False, device=device)
        module.lora_dropout = nn.Dropout(dropout)
        module.lora_scale = alpha / rank
        module.register_forward_hook(_hook)
        count += 1
    if not count:
        raise ValueError(f"no linear layer of the model is named {', '.join(targets)}")
    return count


def full_init(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """The adapters' initial weights, whole, on the CPU, from ``seed`` alone (so every world size starts from the
    same ones): A as ``nn.Linear`` initialises (peft's default), B zero."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, module in adapted(model):
        a = torch.empty(module.lora_A.weight.shape)
        bound = 1 / math.sqrt(a.shape[1])  # kaiming_uniform_(a=sqrt(5)) of a [rank, in] matrix
        out[f"{name}.lora_A.weight"] = a.uniform_(-bound, bound, generator=gen)
        out[f"{name}.lora_B.weight"] = torch.zeros(module.lora_B.weight.shape)
    return out


@torch.no_grad()
def load_adapters(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy whole adapter tensors into the model's adapters, whole or sharded (each rank copies its part)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = dict(model.named_parameters())
    missing = [n for n in params if any(k in n for k in ADAPTER_KEYS) and n not in state]
    if missing:
        raise ValueError(f"adapter weights missing: {missing[:3]}")
    for name, tensor in state.items():
        p = params[name]
        if isinstance(p, DTensor):
            p.copy_(distribute_tensor(tensor.to(p.dtype), p.device_mesh, p.placements))
        else:
            p.copy_(tensor)


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' weights, whole (gathered from the shards where sharded), on the CPU."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        if any(k in name for k in ADAPTER_KEYS):
            t = p.full_tensor() if isinstance(p, DTensor) else p
            out[name] = t.detach().float().cpu()
    return out


@torch.no_grad()
def merge(model: nn.Module) -> None:
    """Fold every adapter into its base weight (W += scale * B @ A) and remove it: a plain model for export."""
    for _, module in adapted(model):
        delta = module.lora_B.weight.float() @ module.lora_A.weight.float() * module.lora_scale
        module.weight += delta.to(module.weight.dtype)
        module._forward_hooks.clear()
        for child in ("lora_A", "lora_B", "lora_dropout"):
            delattr(module, child)
        del module.lora_scale


def export_peft(state: dict[str, torch.Tensor], cfg: LoraModelConfig, folder: str | Path) -> Path:
    """Write adapters as peft saves them (``adapter_model.safetensors`` and ``adapter_config.json``), loadable by
    ``peft.PeftModel.from_pretrained`` on ``transformers``' Llama (separate q/k/v only: transformers has no fused
    projection)."""
    from safetensors.torch import save_file

    if cfg.fused_qkv:
        raise ValueError("peft's Llama has q/k/v_proj, not qkv_proj: export adapters of an unfused model")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({f"base_model.model.{k}": v.contiguous() for k, v in state.items()},
              str(folder / "adapter_model.safetensors"))  # fmt: skip
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha,
        "lora_dropout": cfg.lora_dropout, "target_modules": list(cfg.targets), "bias": "none",
        "fan_in_fan_out": False, "base_model_name_or_path": cfg.base_weights,
    }  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return folder
