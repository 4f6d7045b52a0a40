"""The model and its config section: architecture only (placement comes from trainbench's shared helper)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from trainbench.config import option


@dataclass(kw_only=True)
class CtrModelConfig:
    """The run config's ``model`` section (``model.embedding_dim=32`` on the command line, ``--help-config``)."""

    dense_features: int = option(8, "Dense (numerical) features per sample; must match the data.", at_least=1)
    tables: int = option(4, "Categorical features, one embedding table each; must match the data.", at_least=1)
    table_size: int = option(500, "Rows of each embedding table: categories per feature, as in the data.", at_least=1)
    embedding_dim: int = option(16, "Width of each embedding and of the bottom MLP's output.", at_least=1)
    bottom_width: int = option(64, "Hidden width of the bottom MLP (dense features to embedding_dim).", at_least=1)
    top_width: int = option(64, "Hidden width of the top MLP's two layers.", at_least=1)


class CtrModel(nn.Module):
    """Click logits from dense features [batch, dense_features] (float) and categories [batch, tables] (int)."""

    def __init__(self, cfg: CtrModelConfig):
        super().__init__()
        d = cfg.embedding_dim
        self.embeddings = nn.ModuleList(nn.Embedding(cfg.table_size, d) for _ in range(cfg.tables))
        self.bottom = nn.Sequential(nn.Linear(cfg.dense_features, cfg.bottom_width), nn.ReLU(),
                                    nn.Linear(cfg.bottom_width, d), nn.ReLU())  # fmt: skip
        features = cfg.tables + 1
        self.register_buffer("pairs", torch.triu_indices(features, features, offset=1), persistent=False)
        width = cfg.top_width
        self.top = nn.Sequential(nn.Linear(d + self.pairs.shape[1], width), nn.ReLU(), nn.Linear(width, width),
                                 nn.ReLU(), nn.Linear(width, 1))  # fmt: skip
        for table in self.embeddings:
            nn.init.normal_(table.weight, std=d**-0.5)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        features = torch.stack([x, *(table(sparse[:, i]) for i, table in enumerate(self.embeddings))], dim=1)
        dots = features @ features.transpose(1, 2)  # every pair of features, once each
        return self.top(torch.cat([x, dots[:, self.pairs[0], self.pairs[1]]], dim=1)).squeeze(-1)
