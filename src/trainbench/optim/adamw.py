"""AdamW after clipping the global gradient norm, for plain and sharded (DTensor) gradients."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainbench.optim.sqrt import sqrt


class AdamClipped(torch.optim.AdamW):
    """AdamW (Adam with decoupled weight decay; ``weight_decay=0`` groups for biases and norms) after clipping
    the global gradient norm. The norm is taken over sharded (DTensor) gradients too: squares are summed
    locally and all-reduced over the mesh dimensions each gradient is sharded on."""

    def __init__(self, params, max_grad_norm: float, **kw):
        super().__init__(params, **kw)
        self.max_grad_norm = max_grad_norm

    @torch.no_grad()
    def step(self, closure=None):
        if self.max_grad_norm > 0:
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            norm = global_grad_norm(grads)
            scale = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
            for g in grads:
                (g.to_local() if isinstance(g, DTensor) else g).mul_(scale)
        return super().step(closure)


def global_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all ``grads`` together; a sharded gradient's squares are summed over its shards."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        if isinstance(g, DTensor):
            mesh = g.device_mesh
            key = tuple(mesh.get_group(i) for i, pl in enumerate(g.placements) if pl.is_shard())
            groups.setdefault(key, []).append(g.to_local())
        else:
            groups.setdefault((), []).append(g)
    total = None
    for key, tensors in groups.items():
        sq = torch.stack(torch._foreach_norm([t.float() for t in tensors])).pow(2).sum()
        for group in key:
            dist.all_reduce(sq, group=group)
        total = sq if total is None else total + sq.to(total.device)
    return sqrt(total)
