"""BERT for pretraining (masked LM + next-sentence prediction): architecture only.

Post-LayerNorm encoder as in the BERT paper and MLPerf's reference. Query, key and value are one fused
projection (one GEMM instead of three); :func:`from_hf_state_dict` and :func:`to_hf_state_dict`
translate to and from the parameter names of ``transformers.BertForPreTraining``, so HF checkpoints
and converted MLPerf checkpoints load, and our weights load into HF.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from trainbench.families.configs import BertConfig
from trainbench.families.cudnn_attention import CudnnSegments, cudnn_segments, cudnn_varlen_attention
from trainbench.families.cudnn_attention import unavailable as cudnn_unavailable


def document_mask(sequence_ids: torch.Tensor) -> BlockMask:
    """FlexAttention block mask for packed rows: a query attends to the keys of its own sequence, and no key is
    padding (id 0; a padding query's output is 0). Blocks with no such pair are skipped, so attention spends
    nothing on padding or across sequences."""

    def same_sequence(b, h, q, kv):
        return (sequence_ids[b, q] == sequence_ids[b, kv]) & (sequence_ids[b, kv] > 0)

    batch, seq = sequence_ids.shape
    return create_block_mask(same_sequence, batch, None, seq, seq, device=sequence_ids.device)


class Varlen(NamedTuple):
    """Packed rows as one stream of variable-length sequences for flash attention: ``cu_seqlens`` [N + 1] (int32)
    are the offsets of the sequences in the flattened [rows x seq] tokens, ``max_len`` bounds their length."""

    cu_seqlens: torch.Tensor
    max_len: int


def varlen_segments(sequence_ids: torch.Tensor, per_row: int) -> Varlen:
    """Offsets of every sequence of packed rows laid out as the packer writes them (sequence 1, 2, ... then the
    row's padding), with static shapes: each row contributes ``per_row`` sequence slots and one padding slot,
    any of which may be empty. Padding attends only to padding, so it never mixes with a sequence."""
    ids = sequence_ids.long()
    counts = (ids[:, :, None] == torch.arange(per_row + 1, device=ids.device)).sum(1)  # [rows, slots]; 0: pad
    lengths = torch.cat([counts[:, 1:], counts[:, :1]], dim=1).flatten()
    return Varlen(F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32), sequence_ids.shape[1])


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Varlen, dropout_p: float):
    """Flash attention over variable-length sequences (q, k, v: [tokens, heads, head_dim], 16-bit, CUDA):
    no compute on padding or across sequences, and attention dropout inside the kernel."""
    cu, n = segments
    return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, n, n, dropout_p, False, False)[0]


def packed_kernel_unavailable(kernel: str, cuda: bool, half: bool, grad: bool, dropout: bool) -> str | None:
    """Why the packed-row attention ``kernel`` cannot run (on CUDA or not, in a 16-bit compute type or not, with
    gradients or not, with attention dropout or not), or None where it can. Varlen flash attention and cuDNN's
    attention need CUDA and 16-bit inputs (cuDNN's also its frontend package); FlexAttention's backward does not
    run on CPU (without gradients it runs anywhere), and it has no dropout; SDPA with a dense mask runs
    anywhere."""
    if kernel in ("varlen", "cudnn") and not (cuda and half):
        return f"model.packed_attention={kernel} runs on CUDA in bf16 (precision=auto or bf16)"
    if kernel == "cudnn" and (problem := cudnn_unavailable()) is not None:
        return problem
    if kernel == "flex" and not (cuda or not grad):
        return "model.packed_attention=flex runs on CUDA (its backward does not run on CPU)"
    if kernel == "flex" and dropout:
        return "model.packed_attention=flex has no attention dropout: set model.attention_dropout=0"
    return None


PACKED_KERNELS = ("cudnn", "varlen", "flex", "sdpa")  # auto's order of preference


def choose_packed_kernel(choice: str, cuda: bool, half: bool, grad: bool, dropout: bool) -> str:
    """The attention kernel for packed rows (``model.packed_attention``). ``auto`` takes the first that can run
    here: cuDNN's attention on CUDA in a 16-bit compute type where its frontend is installed (the fastest,
    with dropout); else varlen flash attention there (also with dropout); else FlexAttention where it can run;
    else SDPA with a dense mask. A kernel named outright must be able to run here
    (:func:`packed_kernel_unavailable`), or this raises ValueError saying why not."""
    here = dict(cuda=cuda, half=half, grad=grad, dropout=dropout)
    if choice == "auto":
        return next(k for k in PACKED_KERNELS if packed_kernel_unavailable(k, **here) is None)
    if (problem := packed_kernel_unavailable(choice, **here)) is not None:
        raise ValueError(problem)
    return choice


class EncoderLayer(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.attention_dropout = cfg.attention_dropout
        self.qkv = nn.Linear(h, 3 * h)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.ffn_in = nn.Linear(h, cfg.intermediate_size)
        self.ffn_out = nn.Linear(cfg.intermediate_size, h)
        self.ffn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x: torch.Tensor, attn_mask) -> torch.Tensor:
        # LayerNorm returns fp32 under autocast; the residual stream keeps the dtype it came in with.
        x = self.attn_norm(x + self.dropout(self.attn_out(self.attention(x, attn_mask)))).to(x.dtype)
        return self.ffn_norm(x + self.dropout(self.ffn_out(F.gelu(self.ffn_in(x))))).to(x.dtype)

    def attention(self, x: torch.Tensor, attn_mask) -> torch.Tensor:
        batch, seq, hidden = x.shape
        heads, dropout_p = self.num_heads, self.attention_dropout if self.training else 0.0
        if isinstance(attn_mask, CudnnSegments):  # the same, read in place from the fused projection
            qkv = self.qkv(x).view(batch * seq, 3, heads, hidden // heads)
            return cudnn_varlen_attention(qkv, attn_mask, dropout_p).view(batch, seq, hidden)
        if isinstance(attn_mask, Varlen):  # packed rows as one stream of sequences
            q, k, v = self.qkv(x).view(batch * seq, 3, heads, hidden // heads).unbind(1)
            return varlen_attention(q, k, v, attn_mask, dropout_p).view(batch, seq, hidden)
        q, k, v = self.qkv(x).view(batch, seq, 3, heads, hidden // heads).transpose(1, 3).unbind(2)
        if isinstance(attn_mask, BlockMask):  # packed rows: only blocks that hold one sequence are computed
            attn = flex_attention(q, k, v, block_mask=attn_mask)
        else:
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)
        return attn.transpose(1, 2).reshape(batch, seq, hidden)


class BertForPreTraining(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        assert cfg.hidden_size % cfg.num_heads == 0, "hidden_size must be a multiple of num_heads"
        self.cfg = cfg
        h = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, h)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, h)
        self.embedding_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))
        self.pooler = nn.Linear(h, h)
        self.mlm_transform = nn.Linear(h, h)
        self.mlm_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        # The MLM decoder's weight is the word-embedding table (tied); only its bias is its own.
        self.mlm_bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        self.nsp = nn.Linear(h, 2)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=self.cfg.init_std)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        nn.init.zeros_(self.mlm_bias)

    def encode(
        self, input_ids, token_type_ids, attention_mask, position_ids=None, sequence_ids=None, per_row: int = 3
    ) -> torch.Tensor:
        """Hidden states [batch, seq, hidden].

        Unpacked rows pass ``attention_mask`` (1 for tokens, 0 for padding). Packed rows (several sequences per
        row) pass ``position_ids`` (restarting at 0 per sequence) and ``sequence_ids`` (1, 2, ... per sequence,
        0 for padding; at most ``per_row`` sequences, in that order, then padding) instead: a token then attends
        only to tokens of its own sequence.
        """
        seq = input_ids.shape[1]
        positions = torch.arange(seq, device=input_ids.device) if position_ids is None else position_ids.long()
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions)
            + self.token_type_embeddings(token_type_ids)
        )
        x = self.dropout(self.embedding_norm(x))
        if self.cfg.low_precision_residual and torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        kernel = self.packed_kernel(input_ids.device) if sequence_ids is not None else None
        if kernel == "varlen":
            attn_mask = varlen_segments(sequence_ids, per_row)
        elif kernel == "cudnn":
            attn_mask = cudnn_segments(*varlen_segments(sequence_ids, per_row), self.cfg.hidden_size)
        elif kernel == "flex":
            attn_mask = document_mask(sequence_ids)
        elif kernel == "sdpa":
            # [batch, 1, seq, seq]: same sequence. Padding attends to padding, so no row is all False.
            attn_mask = (sequence_ids[:, None, :, None] == sequence_ids[:, None, None, :]).contiguous()
        else:
            # Boolean [batch, 1, 1, seq] mask: True where a key may be attended to.
            attn_mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        for layer in self.layers:
            x = layer(x, attn_mask)
        return x

    def packed_kernel(self, device: torch.device) -> str:
        """The attention kernel for packed rows here (:func:`choose_packed_kernel`)."""
        return choose_packed_kernel(
            self.cfg.packed_attention,
            cuda=device.type == "cuda",
            half=torch.is_autocast_enabled("cuda") or self.word_embeddings.weight.dtype in (torch.bfloat16, torch.half),
            grad=torch.is_grad_enabled(),
            dropout=self.training and self.cfg.attention_dropout > 0,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        masked_lm_positions: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        sequence_ids: torch.Tensor | None = None,
        cls_positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MLM logits and NSP logits.

        With ``masked_lm_positions`` [batch, P] the MLM head runs only at those positions and the
        logits are [batch, P, vocab]; without it, at every position ([batch, seq, vocab]).
        NSP logits are [batch, 2] from each row's first token, or [batch, K, 2] from the tokens at
        ``cls_positions`` [batch, K] (packed rows: one [CLS] per sequence).
        """
        per_row = 3 if cls_positions is None else cls_positions.shape[1]
        x = self.encode(input_ids, token_type_ids, attention_mask, position_ids, sequence_ids, per_row)
        if cls_positions is None:
            cls = x[:, 0]
        else:
            cls = torch.gather(x, 1, cls_positions.long().unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        nsp_logits = self.nsp(torch.tanh(self.pooler(cls)))
        if masked_lm_positions is not None:
            index = masked_lm_positions.long().unsqueeze(-1).expand(-1, -1, x.shape[-1])
            x = torch.gather(x, 1, index)
        x = self.mlm_norm(F.gelu(self.mlm_transform(x)))
        mlm_logits = F.linear(x, self.word_embeddings.weight, self.mlm_bias)
        return mlm_logits, nsp_logits


# ---------------------------------------------------------------------------------------------
# State-dict adapter: HF `BertForPreTraining` names <-> ours.

# One table, used in both directions. {i} is a layer index, {p} is "weight" or "bias".
_NAMES = [
    ("bert.embeddings.word_embeddings.weight", "word_embeddings.weight"),
    ("bert.embeddings.position_embeddings.weight", "position_embeddings.weight"),
    ("bert.embeddings.token_type_embeddings.weight", "token_type_embeddings.weight"),
    ("bert.embeddings.LayerNorm.{p}", "embedding_norm.{p}"),
    ("bert.encoder.layer.{i}.attention.output.dense.{p}", "layers.{i}.attn_out.{p}"),
    ("bert.encoder.layer.{i}.attention.output.LayerNorm.{p}", "layers.{i}.attn_norm.{p}"),
    ("bert.encoder.layer.{i}.intermediate.dense.{p}", "layers.{i}.ffn_in.{p}"),
    ("bert.encoder.layer.{i}.output.dense.{p}", "layers.{i}.ffn_out.{p}"),
    ("bert.encoder.layer.{i}.output.LayerNorm.{p}", "layers.{i}.ffn_norm.{p}"),
    ("bert.pooler.dense.{p}", "pooler.{p}"),
    ("cls.predictions.transform.dense.{p}", "mlm_transform.{p}"),
    ("cls.predictions.transform.LayerNorm.{p}", "mlm_norm.{p}"),
    ("cls.predictions.bias", "mlm_bias"),
    ("cls.seq_relationship.{p}", "nsp.{p}"),
]
# HF keeps query, key and value apart; we fuse them into one projection.
_HF_QKV = "bert.encoder.layer.{i}.attention.self.{part}.{p}"
_OURS_QKV = "layers.{i}.qkv.{p}"
# Tied to other entries, or buffers that HF may store: nothing of ours to load from them.
_IGNORED = re.compile(r"cls\.predictions\.decoder\.(weight|bias)|bert\.embeddings\.(position_ids|token_type_ids)")


def _pattern(template: str) -> re.Pattern:
    groups = {"i": r"(?P<i>\d+)", "p": r"(?P<p>weight|bias)", "part": r"(?P<part>query|key|value)"}
    return re.compile(re.sub(r"\\\{(\w+)\\\}", lambda m: groups[m.group(1)], re.escape(template)))


_FORWARD = [(_pattern(hf), ours) for hf, ours in _NAMES]
_BACKWARD = [(_pattern(ours), hf) for hf, ours in _NAMES]


def _rename(name: str, table: list[tuple[re.Pattern, str]]) -> str | None:
    for pattern, target in table:
        if m := pattern.fullmatch(name):
            return target.format(**m.groupdict())
    return None


def _normalise_name(name: str) -> str:
    """Accept the spellings of converted checkpoints: DDP's `module.`, TF's gamma/beta, NVIDIA's dense_act."""
    name = name.removeprefix("module.")
    if not name.startswith(("bert.", "cls.")):
        name = "bert." + name
    name = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", name)
    name = re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", name)
    return name.replace(".dense_act.", ".dense.")


def from_hf_state_dict(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-named (or MLPerf-converted) BERT pretraining weights -> our names. Unknown names raise KeyError."""
    ours: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    qkv_pattern = _pattern(_HF_QKV)
    unknown = []
    for raw_name, tensor in hf.items():
        name = _normalise_name(raw_name)
        if _IGNORED.fullmatch(name):
            continue
        if m := qkv_pattern.fullmatch(name):
            qkv.setdefault((m["i"], m["p"]), {})[m["part"]] = tensor
        elif (target := _rename(name, _FORWARD)) is not None:
            ours[target] = tensor
        else:
            unknown.append(raw_name)
    if unknown:
        raise KeyError(f"not BERT pretraining weights: {', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}")
    for (layer, kind), parts in qkv.items():
        if set(parts) != {"query", "key", "value"}:
            raise KeyError(f"layer {layer} {kind}: query, key and value are not all present")
        ours[_OURS_QKV.format(i=layer, p=kind)] = torch.cat([parts["query"], parts["key"], parts["value"]], dim=0)
    return ours


def to_hf_state_dict(ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our names -> `transformers.BertForPreTraining` names (the decoder weight is the tied embedding)."""
    hf: dict[str, torch.Tensor] = {}
    qkv_pattern = _pattern(_OURS_QKV)
    for name, tensor in ours.items():
        if m := qkv_pattern.fullmatch(name):
            for part, chunk in zip(("query", "key", "value"), tensor.chunk(3, dim=0), strict=True):
                hf[_HF_QKV.format(i=m["i"], part=part, p=m["p"])] = chunk
        elif (target := _rename(name, _BACKWARD)) is not None:
            hf[target] = tensor
        else:
            raise KeyError(f"unexpected parameter {name}")
    hf["cls.predictions.decoder.weight"] = hf["bert.embeddings.word_embeddings.weight"]
    hf["cls.predictions.decoder.bias"] = hf["cls.predictions.bias"]
    return hf
