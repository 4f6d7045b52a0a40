"""FLUX.1's MMDiT (the `flux1` benchmark's model): architecture only.

A rectified-flow transformer over two token streams, the image's latent patches and the prompt's T5 encodings:
- double-stream blocks: each stream keeps its own weights (modulation, q/k/v, MLP) and the two attend jointly over
  the concatenated sequence (text first);
- single-stream blocks: one stream of text and image tokens, with attention and the MLP side by side (one
  projection into q, k, v and the MLP's input, one out of their concatenation);
- every block modulated (shift, scale, gate of each LayerNorm without its own weights) by the timestep's sinusoidal
  embedding plus the pooled CLIP vector, each through a small MLP;
- RMSNorm on each head's queries and keys, rotary positions over three axes (16, 56 and 56 of a head's 128
  channels: none for text, the latent's row and column for the image), on interleaved channel pairs.

Module names are those of Black Forest Labs' reference and torchtitan's flux model (``double_blocks.N.img_attn.qkv``,
``single_blocks.N.linear1``, ``final_layer.adaLN_modulation.1``), with q, k and v in one projection: one GEMM
instead of three. ``tests/test_flux.py`` checks the outputs and gradients against diffusers' ``FluxTransformer2DModel``
on the same weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainbench.families.configs import FluxConfig


def timestep_embedding(t: torch.Tensor, dim: int = 256, max_period: float = 10000.0) -> torch.Tensor:
    """The sinusoidal embedding [batch, dim] of timesteps ``t`` in [0, 1] scaled by 1000: cosines, then sines."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = (1000 * t.float())[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def rope(ids: torch.Tensor, axes_dim: tuple[int, ...], theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [seq, head_dim] for positions ``ids`` [seq, axes], each channel pair turning by one frequency of
    its axis (the pair's two channels repeat it)."""
    cos, sin = [], []
    for axis, dim in enumerate(axes_dim):
        freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=ids.device) / dim)
        angles = torch.outer(ids[:, axis].double(), freqs)
        cos.append(angles.cos().repeat_interleave(2, dim=1))
        sin.append(angles.sin().repeat_interleave(2, dim=1))
    return torch.cat(cos, dim=-1).float(), torch.cat(sin, dim=-1).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [batch, heads, seq, head_dim], its channel pairs (2i, 2i + 1) rotated."""
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(-2)
    wide = torch.promote_types(x.dtype, torch.float32)
    return (x.to(wide) * cos + rotated.to(wide) * sin).to(x.dtype)


class MLPEmbedder(nn.Module):
    def __init__(self, in_dim: int, hidden: int):
        super().__init__()
        self.in_layer = nn.Linear(in_dim, hidden)
        self.out_layer = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_layer(F.silu(self.in_layer(x)))


class QKNorm(nn.Module):
    """RMSNorm of each head's queries and of its keys."""

    def __init__(self, head_dim: int):
        super().__init__()
        self.query_norm = nn.RMSNorm(head_dim, eps=1e-6)
        self.key_norm = nn.RMSNorm(head_dim, eps=1e-6)


def heads_of(qkv: torch.Tensor, heads: int, norm: QKNorm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[batch, seq, 3 x width] as q, k, v [batch, heads, seq, head_dim], q and k normalised."""
    batch, seq, _ = qkv.shape
    q, k, v = qkv.view(batch, seq, 3, heads, -1).permute(2, 0, 3, 1, 4)
    return norm.query_norm(q), norm.key_norm(k), v


def attention(q, k, v, pe: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Full attention with rotary positions: [batch, seq, width]."""
    q, k = apply_rope(q, *pe), apply_rope(k, *pe)
    out = F.scaled_dot_product_attention(q, k, v)
    return out.transpose(1, 2).flatten(2)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """LayerNorm without weights, then the modulation's scale and shift (per sample)."""
    return F.layer_norm(x, (x.shape[-1],), eps=1e-6) * (1 + scale[:, None]) + shift[:, None]


class SelfAttention(nn.Module):
    def __init__(self, cfg: FluxConfig):
        super().__init__()
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.norm = QKNorm(cfg.head_dim)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)


class Modulation(nn.Module):
    def __init__(self, width: int, chunks: int):
        super().__init__()
        self.chunks = chunks
        self.lin = nn.Linear(width, chunks * width)

    def forward(self, vec: torch.Tensor) -> list[torch.Tensor]:
        return self.lin(F.silu(vec)).chunk(self.chunks, dim=-1)


def mlp(cfg: FluxConfig) -> nn.Sequential:
    return nn.Sequential(nn.Linear(cfg.hidden_size, cfg.mlp_width), nn.GELU(approximate="tanh"),
                         nn.Linear(cfg.mlp_width, cfg.hidden_size))  # fmt: skip


class DoubleStreamBlock(nn.Module):
    def __init__(self, cfg: FluxConfig):
        super().__init__()
        self.heads = cfg.num_heads
        for stream in ("img", "txt"):
            self.add_module(f"{stream}_mod", Modulation(cfg.hidden_size, 6))
            self.add_module(f"{stream}_attn", SelfAttention(cfg))
            self.add_module(f"{stream}_mlp", mlp(cfg))

    def forward(self, img: torch.Tensor, txt: torch.Tensor, vec: torch.Tensor, pe) -> tuple[torch.Tensor, torch.Tensor]:
        img_mod, txt_mod = self.img_mod(vec), self.txt_mod(vec)
        iq, ik, iv = heads_of(self.img_attn.qkv(modulate(img, img_mod[0], img_mod[1])), self.heads, self.img_attn.norm)
        tq, tk, tv = heads_of(self.txt_attn.qkv(modulate(txt, txt_mod[0], txt_mod[1])), self.heads, self.txt_attn.norm)
        joint = attention(torch.cat([tq, iq], 2), torch.cat([tk, ik], 2), torch.cat([tv, iv], 2), pe)
        txt_out, img_out = joint[:, : txt.shape[1]], joint[:, txt.shape[1] :]
        img = img + img_mod[2][:, None] * self.img_attn.proj(img_out)
        img = img + img_mod[5][:, None] * self.img_mlp(modulate(img, img_mod[3], img_mod[4]))
        txt = txt + txt_mod[2][:, None] * self.txt_attn.proj(txt_out)
        txt = txt + txt_mod[5][:, None] * self.txt_mlp(modulate(txt, txt_mod[3], txt_mod[4]))
        return img, txt


class SingleStreamBlock(nn.Module):
    def __init__(self, cfg: FluxConfig):
        super().__init__()
        self.heads, self.width = cfg.num_heads, cfg.hidden_size
        self.modulation = Modulation(cfg.hidden_size, 3)
        self.linear1 = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size + cfg.mlp_width)
        self.norm = QKNorm(cfg.head_dim)
        self.linear2 = nn.Linear(cfg.hidden_size + cfg.mlp_width, cfg.hidden_size)

    def forward(self, x: torch.Tensor, vec: torch.Tensor, pe) -> torch.Tensor:
        shift, scale, gate = self.modulation(vec)
        qkv, hidden = self.linear1(modulate(x, shift, scale)).split([3 * self.width, self.linear2.in_features
                                                                    - self.width], dim=-1)  # fmt: skip
        out = attention(*heads_of(qkv, self.heads, self.norm), pe)
        return x + gate[:, None] * self.linear2(torch.cat([out, F.gelu(hidden, approximate="tanh")], dim=-1))


class LastLayer(nn.Module):
    def __init__(self, cfg: FluxConfig):
        super().__init__()
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(cfg.hidden_size, 2 * cfg.hidden_size))
        self.linear = nn.Linear(cfg.hidden_size, cfg.in_channels)

    def forward(self, x: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(vec).chunk(2, dim=-1)
        return self.linear(modulate(x, shift, scale))


class Flux(nn.Module):
    def __init__(self, cfg: FluxConfig):
        super().__init__()
        assert sum(cfg.axes_dim) == cfg.head_dim, "the rotary axes must cover a head's channels"
        self.cfg = cfg
        h = cfg.hidden_size
        self.img_in = nn.Linear(cfg.in_channels, h)
        self.time_in = MLPEmbedder(256, h)
        self.vector_in = MLPEmbedder(cfg.vector_dim, h)
        self.txt_in = nn.Linear(cfg.context_dim, h)
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(cfg) for _ in range(cfg.double_blocks))
        self.single_blocks = nn.ModuleList(SingleStreamBlock(cfg) for _ in range(cfg.single_blocks))
        self.final_layer = LastLayer(cfg)

    def forward(self, img: torch.Tensor, txt: torch.Tensor, vector: torch.Tensor, timesteps: torch.Tensor,
                img_ids: torch.Tensor, txt_ids: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """The predicted velocity [batch, image tokens, in_channels] for latent patches ``img`` [batch, image tokens,
        in_channels] at ``timesteps`` [batch] in [0, 1], prompt encodings ``txt`` [batch, text tokens, context_dim]
        and pooled ``vector`` [batch, vector_dim]; positions ``img_ids`` and ``txt_ids`` [tokens, 3]."""
        img, txt = self.img_in(img), self.txt_in(txt)
        vec = self.time_in(timestep_embedding(timesteps).to(img.dtype)) + self.vector_in(vector)
        pe = rope(torch.cat([txt_ids, img_ids]), self.cfg.axes_dim, self.cfg.rope_theta)
        for block in self.double_blocks:
            img, txt = block(img, txt, vec, pe)
        x = torch.cat([txt, img], dim=1)
        for block in self.single_blocks:
            x = block(x, vec, pe)
        return self.final_layer(x[:, txt.shape[1] :], vec)


def image_ids(height: int, width: int, device=None) -> torch.Tensor:
    """Positions [height x width, 3] of a latent's 2 x 2 patches in row-major order: (0, row, column)."""
    rows = torch.arange(height, device=device).repeat_interleave(width)
    cols = torch.arange(width, device=device).repeat(height)
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=-1)
