"""FLUX.1's MMDiT twin in diffusers, for `trainbench bench --compare hf` (measure/compare_hf.py):
`FluxTransformer2DModel` built to the config's shapes; the calls every families/<family>/hf.py answers
(families/decoder/hf.py names them)."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch

from trainbench.config import RunConfig
from trainbench.errors import UserError


def peer(cfg: RunConfig) -> str | None:
    return "flux"


def check(cfg: RunConfig) -> None:
    """What diffusers' model cannot be built to: one sentence."""
    m = cfg.model
    if m.mlp_ratio != 4 or m.rope_theta != 10000:
        raise UserError(f"--compare hf: diffusers' FluxTransformer2DModel fixes the MLP ratio at 4 and the RoPE base "
                        f"at 10000, not model.mlp_ratio={m.mlp_ratio:g} and "
                        f"model.rope_theta={m.rope_theta:g}")  # fmt: skip


def packages(cfg: RunConfig) -> list[str]:
    return ["diffusers"]


def build(cfg: RunConfig, device: torch.device) -> torch.nn.Module:
    import diffusers

    m = cfg.model
    # Weights in fp32 under bf16 autocast, as ours and as diffusers' training scripts with mixed precision bf16.
    return diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=m.in_channels, num_layers=m.double_blocks, num_single_layers=m.single_blocks,
        attention_head_dim=m.head_dim, num_attention_heads=m.num_heads, joint_attention_dim=m.context_dim,
        pooled_projection_dim=m.vector_dim, guidance_embeds=False, axes_dims_rope=m.axes_dim,
    ).to(device).train()  # fmt: skip


def loss(bench: Any, cfg: RunConfig, called, batch: dict[str, np.ndarray], device: torch.device) -> torch.Tensor:
    """The micro-batch's mean loss on the peer ``called``: diffusers' MMDiT has none of its own, so the benchmark's
    (``bench``), its rectified flow drawn from the same batch, with diffusers called in place of ours (it scales the
    timestep by 1000 itself, as ours does)."""

    def as_ours(img, txt, vec, t, img_ids, txt_ids):  # our model's call, made on diffusers'
        return called(hidden_states=img, encoder_hidden_states=txt, pooled_projections=vec, timestep=t,
                      img_ids=img_ids, txt_ids=txt_ids, return_dict=False)[0]  # fmt: skip

    t = bench.to_device(batch, device)
    return bench.loss(as_ours, t, bench.loss_weights(t))


def kernels() -> contextlib.AbstractContextManager:
    """All of SDPA's kernels but cuDNN's, whose backward fails on diffusers' layout at FLUX.1's shape with torch 2.11
    on an H200 (an illegal memory access); flash attention then serves it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
