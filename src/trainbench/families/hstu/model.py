"""The HSTU ranker of MLPerf's dlrmv4 (generative_recommenders' DLRMv3 on Yambda): embedding tables for the user, the
track, its artist and album and hashed crosses of them; a user's listening history and one candidate track as one
sequence through HSTU layers; a click (listen-plus) logit for the candidate. Architecture only: the tables' optimizer
lives in ``optim/rowwise_adagrad.py``, the placement in ``family.py`` (``families/data_parallel.py``, and
``sharded_tables.py`` where the tables are sharded), the recipe in
``benchmarks/dlrmv4.py``.

A sequence is ``contextual`` tokens (the user's table and one per cross feature), ``history`` tokens (right-aligned:
padding first, the newest event last) and the candidate, ``C + H + 1`` positions in all. An HSTU layer (the
reference's STU, without the relative attention bias it does not use in DLRMv3):

    n          = LayerNorm(x)
    U, V, Q, K = split(n W_uvqk + b_uvqk);  U = SiLU(U)
    A_h        = SiLU(alpha Q_h K_h^T) / T  masked to causal pairs of valid keys     (alpha = attention_dim^-1/2)
    y          = U * LayerNorm(concat_h A_h V_h)
    x'         = x + dropout(y) W_out

``T`` is the sequence's padded length, a constant of the config: a sample's output does not depend on which other
samples share its batch, so one rank and several train the same model.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trainbench.families.configs import ACTIONS, CANDIDATE_ACTION, HstuConfig


@dataclass(frozen=True)
class KeyPadding:
    """Which keys of a batch are padding: positions ``[start, stop[b])`` of sample b (the history is right-aligned,
    so its padding is one run after the contextual tokens). Every pair (query, key) of a sample attends where the key
    is at or before the query and not padding."""

    start: int
    stop: torch.Tensor  # [batch], integer

    def mask(self, t: int) -> torch.Tensor:
        """[batch, T, T] booleans: the pairs (query, key) that attend."""
        pos = torch.arange(t, device=self.stop.device)
        padding = (pos >= self.start) & (pos < self.stop.unsqueeze(-1))  # [batch, T]
        causal = pos.unsqueeze(-1) >= pos  # [T, T]
        return causal & ~padding.unsqueeze(-2)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, padding: KeyPadding,
                    alpha: float) -> torch.Tensor:  # fmt: skip
    """``SiLU(alpha Q K^T) / T``, masked to the pairs that attend, times V: q, k [batch, heads, T, A], v [batch, heads,
    T, D], out [batch, heads, T, D]. Every pair's score is computed and kept, then masked: the form a placement
    replaces (families/hstu/attention_kernel.py walks the valid pairs alone)."""
    t = q.shape[-2]
    scores = F.silu(alpha * (q @ k.transpose(-1, -2))) / t
    scores = scores * padding.mask(t).unsqueeze(-3).to(scores.dtype)
    return scores @ v


class HstuLayer(nn.Module):
    """One HSTU layer (the module docstring's equations) over [batch, T, model_dim], the keys' padding given.
    ``attend`` computes the attention (:func:`dense_attention`'s signature); a placement may set another."""

    def __init__(self, dim: int, heads: int, attention_dim: int, linear_dim: int, dropout: float = 0.0,
                 eps: float = 1e-6):  # fmt: skip
        super().__init__()
        self.heads, self.attention_dim, self.linear_dim, self.dropout = heads, attention_dim, linear_dim, dropout
        self.input_norm = nn.LayerNorm(dim, eps=eps)
        self.uvqk = nn.Linear(dim, heads * (2 * linear_dim + 2 * attention_dim))
        self.output_norm = nn.LayerNorm(heads * linear_dim, eps=eps)
        self.output = nn.Linear(heads * linear_dim, dim, bias=False)
        self.alpha = 1.0 / math.sqrt(attention_dim)
        self.attend = dense_attention

    def forward(self, x: torch.Tensor, padding: KeyPadding) -> torch.Tensor:
        b, t, _ = x.shape
        h, a, d = self.heads, self.attention_dim, self.linear_dim
        u, v, q, k = self.uvqk(self.input_norm(x)).split([h * d, h * d, h * a, h * a], dim=-1)
        u = F.silu(u)
        q, k = (z.view(b, t, h, a).transpose(1, 2) for z in (q, k))
        v = v.view(b, t, h, d).transpose(1, 2)
        attended = self.attend(q, k, v, padding, self.alpha).transpose(1, 2).reshape(b, t, h * d)
        y = F.dropout(u * self.output_norm(attended), self.dropout, self.training)
        return x + self.output(y)


INIT_CHUNK_ROWS = 1 << 16  # a table's rows are drawn in chunks of this many, each from a generator of its own


def init_table_rows(block: torch.Tensor, start: int, rows: int, seed: int, table: int) -> None:
    """Rows [start, start + len(block)) of the ``table``-th table (``rows`` rows in all) drawn into ``block`` as every
    block of that table draws them, however the table is cut over ranks: uniform in +-sqrt(1 / rows) (TorchRec's
    default), each chunk of :data:`INIT_CHUNK_ROWS` rows from a CPU generator seeded by (seed, table, chunk), copied
    to the block's device. A rank holding a block of a table draws only the chunks of that block."""
    bound = math.sqrt(1.0 / rows)
    stop = start + block.shape[0]
    for chunk in range(start // INIT_CHUNK_ROWS, -(-stop // INIT_CHUNK_ROWS)):
        lo, hi = chunk * INIT_CHUNK_ROWS, min(rows, (chunk + 1) * INIT_CHUNK_ROWS)
        key = hashlib.blake2b(f"{seed}/{table}/{chunk}".encode(), digest_size=8).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)
        drawn = torch.empty(hi - lo, block.shape[1]).uniform_(-bound, bound, generator=generator)
        a, b = max(lo, start), min(hi, stop)
        block[a - start : b - start].copy_(drawn[a - lo : b - lo])


class TableLookup:
    """The rows of the model's tables for a list of ``(table name, ids)`` requests, in order: the seam through which
    a placement keeps the tables elsewhere (families/hstu/sharded_tables.py shards them over the ranks and looks all
    requests up with one exchange). This default looks each request up in the model's own tables, one after another."""

    def __call__(self, tables: nn.ModuleDict, requests: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        return [tables[name](ids) for name, ids in requests]


class HstuRanker(nn.Module):
    """Listen-plus logits [batch] for a batch of samples (data/yambda.py's arrays). The tables are drawn from ``seed``
    (:func:`init_table_rows`, no global random state); with ``whole_tables=False`` they are left on the meta device,
    for a placement that builds each rank's blocks of rows alone (families/hstu/sharded_tables.py)."""

    CONTENT = ("item", "artist", "album")  # the tables of a track: its own rows, its artist's and its album's

    def __init__(self, cfg: HstuConfig, seed: int = 0, whole_tables: bool = True):
        super().__init__()
        self.cfg = cfg
        e, dim = cfg.embedding_dim, cfg.model_dim
        with torch.device("meta"):
            self.tables = nn.ModuleDict({name: nn.Embedding(rows, e) for name, rows in cfg.table_rows().items()})
        self.lookup = TableLookup()
        self.cross_names = [c.name for c in cfg.crosses]
        self.context_in = nn.Linear(e, dim)
        self.content_in = nn.Linear(3 * e, dim)  # a track: its own, its artist's and its album's rows
        self.actions = nn.Embedding(ACTIONS, dim)
        self.positions = nn.Embedding(cfg.sequence_length, dim)
        self.layers = nn.ModuleList(
            HstuLayer(dim, cfg.num_heads, cfg.attention_dim, cfg.linear_dim, cfg.linear_dropout)
            for _ in range(cfg.num_layers)
        )
        self.output_norm = nn.LayerNorm(dim, eps=1e-6)
        self.candidate_in = nn.Linear(3 * e, dim)
        self.head = nn.Sequential(nn.Linear(3 * dim, dim), nn.SiLU(), nn.Linear(dim, 1))
        if whole_tables:
            self.tables.to_empty(device="cpu")
            self.init_tables(seed)

    @torch.no_grad()
    def init_tables(self, seed: int) -> None:
        """Every table whole, drawn from ``seed`` (:func:`init_table_rows`)."""
        for index, table in enumerate(self.tables.values()):
            init_table_rows(table.weight, 0, table.num_embeddings, seed, index)

    def table_parameters(self) -> list[nn.Parameter]:
        """The embedding tables' weights: the sparse optimizer's (RowWiseAdagrad); every other parameter is dense."""
        return [t.weight for t in self.tables.values()]

    def key_padding(self, history_length: torch.Tensor) -> KeyPadding:
        """The batch's padding keys: a sample of n history events (right-aligned) has its padding at history positions
        below H - n."""
        c = self.cfg.contextual
        return KeyPadding(c, c + self.cfg.history - history_length)

    def requests(self, batch: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """Every table's rows the batch looks up, as one request list: the user's, each cross's, then a track's own,
        artist's and album's rows for the history and for the candidate."""
        content = self.CONTENT
        requests = [("uid", batch["uid"])] + [(n, batch["cross"][:, i]) for i, n in enumerate(self.cross_names)]
        return requests + [(n, batch[f"hist_{n}"]) for n in content] + [(n, batch[f"cand_{n}"]) for n in content]

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        requests = self.requests(batch)
        rows = self.lookup(self.tables, requests)
        c = len(requests) - 2 * len(self.CONTENT)
        context = self.context_in(torch.stack(rows[:c], dim=1))
        history = self.content_in(torch.cat(rows[c : c + 3], dim=-1)) + self.actions(batch["hist_action"])
        candidate_content = torch.cat(rows[c + 3 :], dim=-1)
        candidate = self.content_in(candidate_content) + self.actions.weight[CANDIDATE_ACTION]
        x = torch.cat([context, history, candidate.unsqueeze(1)], dim=1) + self.positions.weight
        x = F.dropout(x, self.cfg.input_dropout, self.training)
        padding = self.key_padding(batch["hist_len"])
        for layer in self.layers:
            x = layer(x, padding)
        user = self.output_norm(x[:, -1])
        item = self.candidate_in(candidate_content)
        return self.head(torch.cat([user, item, user * item], dim=-1)).squeeze(-1)
