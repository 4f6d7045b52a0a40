"""gpt_oss_20b's decoder: the Llama-shaped decoder with a mixture of experts in every block and grouped-query
attention that slides a window over every other block. Architecture only.

Two blocks, chosen by ``block``:

- ``reference``, MLCommons' reference (Primus on Megatron): no linear biases, no attention sinks, RMSNorm over each
  head's queries and keys before the rotary positions (Megatron's ``qk_layernorm``), SiLU SwiGLU experts, plain
  rotary positions (base 150,000), RMSNorm eps 1e-6, init std 0.008, a window of 129 keys (Transformer Engine's
  ``window_size=(128, 0)``: 128 earlier tokens and the query's own);
- ``gpt_oss``, GPT-OSS's own block, as NVIDIA submitted it and as ``transformers``' ``GptOss`` defines it: biases on
  the q/k/v/o projections, the router and the experts, a learned sink per attention head, the clamped SwiGLU
  (``families/decoder/moe.py``), YaRN-scaled rotary positions.

Both route each token to its top-k experts with the softmax taken after top-k, drop no token, and sort the tokens by
expert for one grouped product (``families/decoder/moe.py``). The parameter names are ``transformers``' GPT-OSS names
(``model.layers.N.self_attn.sinks``, ``mlp.router``), with the experts' stacked tensors one level up
(``mlp.gate_up_proj`` where ``transformers`` has ``mlp.experts.gate_up_proj``).

An optional Switch-style load-balancing loss (``aux_loss_coeff``, 0 in the reference) is attached to each block's
output by an identity whose backward adds the loss's gradient, so the block's signature stays that of the dense
decoder's (checkpointing and compile see an ordinary block).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from trainbench.families.configs import GptOssConfig
from trainbench.families.decoder.model import Block, Body, DecoderLM, RMSNorm, apply_rope, norm
from trainbench.families.decoder.moe import MoE, MoEShape, load_balancing_loss
from trainbench.families.decoder.sink_attention import (
    flex_sink_attention,
    fused_sink_attention,
    sink_attention,
    window_mask,
)


def yarn_frequencies(cfg: GptOssConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2], the scale of cos and sin): YaRN (Peng et al. 2023) without truncating
    the ramp's ends, as GPT-OSS configures it; plain RoPE's and 1.0 where ``yarn_factor`` is 1."""
    dim, base, factor = cfg.head_dim, cfg.rope_theta, cfg.yarn_factor
    plain = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if factor == 1:
        return plain, 1.0

    def dim_of(rotations: float) -> float:  # the dimension whose frequency turns ``rotations`` times in the context
        return dim * math.log(cfg.yarn_original_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(dim_of(cfg.yarn_beta_fast), 0), min(dim_of(cfg.yarn_beta_slow), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the frequency kept as it is (fast ones), 0: divided by the factor (slow ones)
    return plain / factor * (1 - keep) + plain * keep, 0.1 * math.log(factor) + 1.0


def gpt_oss_rope(cfg: GptOssConfig, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [seq, head_dim] (rotate-half convention), YaRN-scaled where the config says so."""
    inv_freq, scale = yarn_frequencies(cfg)
    freqs = torch.outer(torch.arange(seq, device=device).float(), inv_freq.to(device))
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * scale, emb.sin() * scale


def window_block_mask(seq: int, window: int | None, device: torch.device) -> BlockMask:
    """FlexAttention's causal mask, within the last ``window`` keys where one is given."""

    def causal(b, h, q, kv):
        return q >= kv

    def sliding(b, h, q, kv):
        return (q >= kv) & (q - kv < window)

    return create_block_mask(causal if window is None else sliding, None, None, seq, seq, device=device)


def auto_kernel(device: torch.device, dtype: torch.dtype) -> str:
    """model.attention=auto on ``device`` for activations of ``dtype``: cuDNN's fused attention on a GPU of compute
    capability 9.0 or newer in 16 bits (the fastest measured on an H200: docs/gpt_oss.md), FlexAttention elsewhere."""
    half = dtype in (torch.bfloat16, torch.float16)
    return "cudnn" if device.type == "cuda" and half and torch.cuda.get_device_capability(device) >= (9, 0) else "flex"


class GptOssAttention(nn.Module):
    def __init__(self, cfg: GptOssConfig, index: int):
        super().__init__()
        h, d, bias = cfg.hidden_size, cfg.head_dim, cfg.gpt_oss_block
        self.head_dim = d
        self.window = cfg.sliding_window if cfg.windowed(index) else None
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, cfg.kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, cfg.kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=bias)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads)) if cfg.gpt_oss_block else None
        self.kernel = cfg.attention if self.window is None else cfg.window_attention
        if not cfg.gpt_oss_block:  # the reference's QK-norm: each head's queries and keys RMS-normalised
            self.q_norm, self.k_norm = RMSNorm(d, cfg.norm_eps), RMSNorm(d, cfg.norm_eps)

    @torch.no_grad()
    def init_parameters(self, std: float, out_std: float) -> None:
        if self.sinks is not None:  # every sink starts at logit 0 (its linear layers are initialised as Linears)
            nn.init.zeros_(self.sinks)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                mask: BlockMask | None = None) -> torch.Tensor:  # fmt: skip
        """``mask``: FlexAttention's block mask for this block's window (compiled on CUDA); None: SDPA, or the dense
        sink attention where the block has sinks."""
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        if self.sinks is None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        gqa = q.shape[1] != k.shape[1]
        if isinstance(mask, BlockMask):  # compiled on CUDA: a fused kernel (model.attention, model.window_attention)
            kernel = self.kernel if self.kernel != "auto" else auto_kernel(q.device, q.dtype)
            if kernel == "flex":
                out = flex_sink_attention(q, k, v, self.sinks, mask)
            else:
                out = fused_sink_attention(q, k, v, self.sinks, self.window, kernel)
        elif self.sinks is not None:
            out = sink_attention(q, k, v, self.sinks, self.window)
        elif self.window is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(seq, self.window, x.device),
                                                 enable_gqa=gqa)  # fmt: skip
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class _AddAuxGradient(torch.autograd.Function):
    """The identity on ``x`` whose backward also sends ``scale`` as the gradient of ``aux`` (a scalar loss computed
    in the block): the load-balancing loss trains without leaving the block."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scale)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (scale,) = ctx.saved_tensors
        return grad, scale.to(torch.float32), None


class GptOssBlock(Block):
    def __init__(self, cfg: GptOssConfig, index: int):
        nn.Module.__init__(self)
        self.input_layernorm = norm(cfg)
        self.self_attn = GptOssAttention(cfg, index)
        self.post_attention_layernorm = norm(cfg)
        shape = MoEShape(hidden=cfg.hidden_size, ffn=cfg.intermediate_size, experts=cfg.num_experts,
                         top_k=cfg.experts_per_token, activation="gpt_oss" if cfg.gpt_oss_block else "silu",
                         bias=cfg.gpt_oss_block)  # fmt: skip
        self.mlp = MoE(shape)
        self.aux_loss_coeff = cfg.aux_loss_coeff
        # The gradient of this micro-batch's load-balancing loss (GptOssLM.set_aux_loss_scale).
        self.register_buffer("aux_loss_scale", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor, rope=None, mask: BlockMask | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, mask)
        out, logits = self.mlp(self.post_attention_layernorm(x))
        if self.aux_loss_coeff and torch.is_grad_enabled():
            out = _AddAuxGradient.apply(out, load_balancing_loss(logits, self.mlp.shape.top_k), self.aux_loss_scale)
        return x + out


class GptOssBody(Body):
    def __init__(self, cfg: GptOssConfig):
        nn.Module.__init__(self)
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GptOssBlock(cfg, i) for i in range(cfg.num_layers))
        self.norm = norm(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                segments: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """One sequence per row (its benchmark trains on fixed windows of the token stream)."""
        assert positions is None and segments is None, "gpt_oss_20b trains on fixed windows, not packed rows"
        seq, device = input_ids.shape[1], input_ids.device
        x = self.embed_tokens(input_ids)
        rope = gpt_oss_rope(self.cfg, seq, device)
        masks: dict[int | None, BlockMask | None] = {}
        for layer in self.layers:
            window = layer.self_attn.window
            if window not in masks:  # under flex (compiled on CUDA), one block mask per window, built once a step
                masks[window] = window_block_mask(seq, window, device) if self.packed_kernel == "flex" else None
            x = layer(x, rope, masks[window])
        return self.norm(x)


class GptOssLM(DecoderLM):
    body = GptOssBody

    def set_aux_loss_scale(self, scale: float) -> None:
        """What the next forward's load-balancing losses weigh in the gradient: ``aux_loss_coeff`` x this micro-
        batch's share of the step's loss (the loop's normalisation of the cross entropy)."""
        for block in self.model.layers:
            block.aux_loss_scale.fill_(block.aux_loss_coeff * scale)
