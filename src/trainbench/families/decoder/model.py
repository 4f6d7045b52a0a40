"""One decoder-only transformer for GPT-3 and Llama, chosen by config: architecture only.

GPT-3 (Brown et al. 2020): learned positions, LayerNorm with biases, GELU MLP, multi-head attention.
Llama 3 / 3.1: rotary positions, RMSNorm, SwiGLU MLP, grouped-query attention, no biases.

Module names are those of ``transformers.LlamaForCausalLM`` (``model.embed_tokens``,
``model.layers.N.self_attn.q_proj``, ``model.layers.N.mlp.gate_proj``, ``model.norm``, ``lm_head``), so an
HF Llama state dict or safetensors file loads as it is (:func:`load_hf_weights`); the GPT-3 variant adds
``model.embed_positions`` and norm and projection biases under the same scheme.

The model is meant to be built on the meta device (no memory), parallelised from outside
(``trainbench.families.decoder.placement``) and only then materialised with :meth:`DecoderLM.init_weights`. What a
block keeps for its backward (activation checkpointing, host offload) is applied from outside too
(``trainbench.families.decoder.memory``).
Attention is causal SDPA (flash attention on CUDA).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from trainbench.families.configs import DecoderConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def norm(cfg: DecoderConfig) -> nn.Module:
    return (
        RMSNorm(cfg.hidden_size, cfg.norm_eps) if cfg.arch == "llama" else nn.LayerNorm(cfg.hidden_size, cfg.norm_eps)
    )


def rope_tables(cfg: DecoderConfig, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [seq, head_dim] for rotate-half RoPE (HF Llama's convention)."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device).float() / cfg.head_dim))
    freqs = torch.outer(torch.arange(seq, device=device).float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rope_at(cfg: DecoderConfig, positions: torch.Tensor | None, seq: int, device: torch.device):
    """cos and sin for ``positions`` [batch, seq] (each packed sequence counting from 0) as [batch, 1, seq,
    head_dim]; for positions 0..seq-1 of every row (``positions`` None), the [seq, head_dim] tables."""
    if positions is None:
        return rope_tables(cfg, seq, device)
    cos, sin = rope_tables(cfg, seq, device)
    return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)


def document_mask(segments: torch.Tensor) -> torch.Tensor:
    """Attention mask [batch, 1, seq, seq] for packed rows: a token sees the tokens before it of its own sequence
    (``segments`` [batch, seq] numbers the sequences of a row)."""
    seq = segments.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=segments.device).tril()
    return (segments[:, :, None] == segments[:, None, :]).logical_and(causal).unsqueeze(1)


def document_block_mask(segments: torch.Tensor) -> BlockMask:
    """The same mask as :func:`document_mask` for FlexAttention: only the blocks that hold a causal pair of one
    sequence are computed, and no [seq, seq] mask reaches the attention kernel."""

    def same_sequence_causal(b, h, q, kv):
        return (segments[b, q] == segments[b, kv]) & (q >= kv)

    batch, seq = segments.shape
    return create_block_mask(same_sequence_causal, batch, None, seq, seq, device=segments.device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [batch, heads, seq, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        h, d, bias = cfg.hidden_size, cfg.head_dim, cfg.arch == "gpt3"
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.kv_heads, d
        self.fused = cfg.fused_qkv
        if self.fused:
            self.qkv_proj = nn.Linear(h, (cfg.num_heads + 2 * cfg.kv_heads) * d, bias=bias)
        else:
            self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=bias)
            self.k_proj = nn.Linear(h, cfg.kv_heads * d, bias=bias)
            self.v_proj = nn.Linear(h, cfg.kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=bias)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                mask: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        batch, seq, _ = x.shape
        if self.fused:
            d = self.head_dim
            q, k, v = self.qkv_proj(x).split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # -1 heads: under tensor parallelism each rank holds a share of the heads.
        q = q.view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, -1, self.head_dim).transpose(1, 2)
        if rope is not None:
            cos, sin = rope
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        gqa = q.shape[1] != k.shape[1]
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        elif isinstance(mask, BlockMask):  # packed rows, compiled on CUDA: only the blocks of each sequence
            out = flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gating: ``silu(gate) * up``."""
    return F.silu(gate) * up


class MLP(nn.Module):
    # How the gate meets the up projection; a placement may swap in an equal function that keeps less for the
    # backward (families/fp8.py keeps both inputs in FP8).
    gated = staticmethod(silu_mul)

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.swiglu = cfg.arch == "llama"
        if self.swiglu:
            self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=not self.swiglu)
        self.down_proj = nn.Linear(i, h, bias=not self.swiglu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.down_proj(self.gated(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.input_layernorm = norm(cfg)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rope=None, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    # Attention over packed rows: "dense" (SDPA with a [seq, seq] mask, any device) or "flex" (FlexAttention's
    # block mask: compiled Triton, CUDA); a placement that compiles the blocks on CUDA picks flex.
    packed_kernel = "dense"

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        if cfg.arch == "gpt3":
            self.embed_positions = nn.Embedding(cfg.max_seq_length, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = norm(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                segments: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """``positions`` and ``segments`` [batch, seq] for packed rows: each sequence's positions from 0, and which
        sequence of its row a token belongs to (attention stays inside it). None: one sequence per row."""
        seq = input_ids.shape[1]
        x = self.embed_tokens(input_ids)
        rope = None
        if self.cfg.arch == "gpt3":
            x = x + self.embed_positions(torch.arange(seq, device=input_ids.device) if positions is None else positions)
        else:
            rope = rope_at(self.cfg, positions, seq, input_ids.device)
        if segments is None:
            mask = None
        elif self.packed_kernel == "flex":
            mask = document_block_mask(segments)
        else:
            mask = document_mask(segments)
        for layer in self.layers:
            x = layer(x, rope) if mask is None else layer(x, rope, mask)
        return self.norm(x)


def lm_loss(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross entropy of the output layer ``head`` (an ``nn.Linear`` without bias, or torchao's
    float8 form of one) on ``hidden`` [batch, seq, width], taken in fp32. One function, so that compiled the cast,
    the log-sum-exp and its backward fuse into a few passes over the logits instead of several eager passes over an
    fp32 copy of them."""
    logits = head(hidden)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


class DecoderLM(nn.Module):
    body = Body  # the embedding, blocks and final norm; a member of the family with other blocks brings its own

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.model = self.body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.loss_fn = lm_loss  # replaced by its compiled form where blocks are compiled

    def forward(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        segments: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [batch, seq, vocab]; with ``targets`` [batch, seq], the summed cross entropy instead (the logits
        then never leave the loss function; a target of -100 counts nothing). ``positions`` and ``segments``: see
        :meth:`Body.forward`."""
        hidden = self.model(input_ids, positions, segments)
        if targets is None:
            return self.lm_head(hidden)
        return self.loss_fn(hidden, self.lm_head, targets)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialise every parameter in place (after ``to_empty`` from the meta device): normal(0, std) for
        matrices and embeddings, std / sqrt(2 x layers) for the projections into the residual stream (GPT-2/3),
        zeros for biases, ones for norm weights. Works on sharded (DTensor) parameters too."""
        if seed is not None:
            torch.manual_seed(seed)
        init_part(self, self.cfg)


@torch.no_grad()
def init_part(part: nn.Module, cfg: DecoderConfig) -> None:
    """:meth:`DecoderLM.init_weights` for any part of the model (a block, the embedding), from the current RNG."""
    std = cfg.init_std
    out_std = std / math.sqrt(2 * cfg.num_layers)
    for name, module in part.named_modules():
        if isinstance(module, nn.Linear):
            is_out = name.endswith(("o_proj", "down_proj"))
            nn.init.normal_(module.weight, std=out_std if is_out else std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, (nn.LayerNorm, RMSNorm)):
            module.reset_parameters()
        elif hasattr(module, "init_parameters"):  # parameters of its own (a mixture of experts' stacked experts)
            module.init_parameters(std, out_std)


def load_hf_weights(model: DecoderLM, path: str | Path) -> None:
    """Load HF ``LlamaForCausalLM`` weights (same names) into a materialised model: a safetensors checkpoint folder
    or its ``model.safetensors`` through :func:`trainbench.families.decoder.hf_checkpoint.load_into` (names and shapes
    checked before anything is copied), or a whole ``.pt``/``.bin`` state dict."""
    path = Path(path)
    if path.is_dir() or path.suffix == ".safetensors":
        from trainbench.families.decoder.hf_checkpoint import SINGLE, load_into

        if not path.is_dir() and path.name != SINGLE:
            raise ValueError(f"{path}: a single safetensors file must be named {SINGLE}; or give its folder")
        load_into(model, path if path.is_dir() else path.parent, model.cfg)
        return
    state = torch.load(path, map_location="cpu", weights_only=True)
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    if model.cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (model.cfg.tie_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
