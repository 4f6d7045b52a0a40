"""Which parameters an optimizer updates, and which of them decay: one rule for every benchmark."""

from __future__ import annotations

import torch


def no_decay(name: str, param: torch.Tensor) -> bool:
    """Biases, norms and other 1-d parameters are excluded from weight decay (and from LAMB's layer adaptation)."""
    return param.ndim <= 1 or name.endswith(".bias") or "norm" in name.lower()


def weight_decay_split(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(parameters that decay, parameters that do not), in the model's order. Frozen parameters
    (``requires_grad=False``, e.g. a LoRA run's base weights) are in neither: no optimizer state is kept for them."""
    decay, plain = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (plain if no_decay(name, p) else decay).append(p)
    return decay, plain
