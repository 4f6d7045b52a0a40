"""AdamW after clipping the global gradient norm, for plain and sharded (DTensor) gradients."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainbench.optim.sqrt import sqrt


class AdamClipped(torch.optim.AdamW):
    """AdamW (Adam with decoupled weight decay; ``weight_decay=0`` groups for biases and norms) after clipping
    the global gradient norm. The norm is taken over sharded (DTensor) gradients too: squares are summed
    locally and all-reduced over the mesh dimensions each gradient is sharded on.

    With the fused update on CUDA (``fused=True``, plain tensors) the clip is no pass of its own over the
    gradients: its factor goes to the update's kernel as ``grad_scale`` (the kernel divides each gradient by it as
    it reads it, the hook torch's AMP grad scaler uses), which saves reading and writing every gradient once more
    (docs/notes/llm.md, "FP8 training"). ``fold_clip=False`` keeps the separate pass (measurements); on the CPU it
    is always separate, so CPU runs repeat bit for bit."""

    def __init__(self, params, max_grad_norm: float, fold_clip: bool = True, **kw):
        super().__init__(params, **kw)
        self.max_grad_norm = max_grad_norm
        self.fold_clip = fold_clip

    def _folds(self, grads: list[torch.Tensor]) -> bool:
        return (self.fold_clip and all(group.get("fused") for group in self.param_groups)
                and all(g.is_cuda and not isinstance(g, DTensor) for g in grads))  # fmt: skip

    @torch.no_grad()
    def clip_grads(self) -> None:
        """Scale the gradients so that their global norm is at most ``max_grad_norm``: in place, or (folded) by
        handing the update the factor to divide them by."""
        if self.max_grad_norm <= 0:
            return
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return
        norm = global_grad_norm(grads)
        scale = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
        if self._folds(grads):
            self.grad_scale = scale.reciprocal()  # read by torch.optim.AdamW.step (the fused kernel divides)
            return
        for g in grads:
            (g.to_local() if isinstance(g, DTensor) else g).mul_(scale)

    @torch.no_grad()
    def update(self, closure=None):
        """The AdamW update of the (clipped) gradients."""
        try:
            return super().step(closure)
        finally:
            self.__dict__.pop("grad_scale", None)

    @torch.no_grad()
    def step(self, closure=None):
        self.clip_grads()
        return self.update(closure)


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
