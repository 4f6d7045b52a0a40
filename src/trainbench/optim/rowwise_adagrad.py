"""Row-wise Adagrad for embedding tables, beside Adam for the dense parameters: dlrmv4's two optimizers at one
learning rate, as the reference runs them (TorchRec's fused ``EXACT_ROWWISE_ADAGRAD`` on the tables, Adam on the rest).

Row-wise Adagrad keeps one accumulator per table row. For each row r a step touches, with g_r the row's gradient
summed over the step's lookups of it (dimension D):

    s_r <- s_r + sum(g_r^2) / D
    w_r <- w_r - lr * g_r / (sqrt(s_r) + eps)

A row no lookup touched keeps its weights and its accumulator. Here the tables' gradients are dense (zero in the
untouched rows), so the update over every row is that update exactly: an untouched row adds 0 to its accumulator
and moves by 0. No weight decay. The dense parameters' global gradient norm is clipped before Adam; the tables'
gradients are not clipped (the reference's fused update applies them in the backward, outside any clip).
"""

from __future__ import annotations

import torch

from trainbench.optim.adamw import AdamClipped
from trainbench.optim.sqrt import sqrt

SPARSE = "rowwise_adagrad"  # the key marking the tables' parameter group


@torch.no_grad()
def rowwise_adagrad_(weight: torch.Tensor, grad: torch.Tensor, accumulator: torch.Tensor, lr: float,
                     eps: float) -> None:  # fmt: skip
    """One row-wise Adagrad step of a [rows, D] table in place (``accumulator``: [rows])."""
    accumulator.add_(grad.square().mean(dim=1))
    weight.sub_(grad * (lr / (sqrt(accumulator) + eps)).unsqueeze(1))


class AdamRowWiseAdagrad(AdamClipped):
    """Adam (decoupled weight decay 0, the dense gradients' global norm clipped to ``max_grad_norm``) for
    ``dense`` and row-wise Adagrad for ``tables``, one optimizer whose parameter groups both take the learning rate
    the loop sets. The tables' state is ``accumulator`` ([rows]) per table, checkpointed like Adam's moments."""

    def __init__(self, dense, tables, max_grad_norm: float, lr: float, betas: tuple[float, float], eps: float,
                 table_eps: float) -> None:  # fmt: skip
        groups = [{"params": list(dense)}, {"params": list(tables), SPARSE: True, "eps": table_eps}]
        super().__init__(groups, max_grad_norm, lr=lr, betas=betas, eps=eps, weight_decay=0.0, fused=True)

    def _groups(self, sparse: bool) -> list[dict]:
        return [g for g in self.param_groups if bool(g.get(SPARSE)) == sparse]

    @torch.no_grad()
    def clip_grads(self) -> None:
        """Clip the dense gradients' global norm only."""
        if self.max_grad_norm <= 0:
            return
        from trainbench.optim.adamw import global_grad_norm

        grads = [p.grad for g in self._groups(sparse=False) for p in g["params"] if p.grad is not None]
        if not grads:
            return
        scale = torch.clamp(self.max_grad_norm / (global_grad_norm(grads) + 1e-6), max=1.0)
        if self._folds(grads):
            self.grad_scale = scale.reciprocal()
            return
        torch._foreach_mul_(grads, scale)

    @torch.no_grad()
    def step(self, closure=None):
        self.clip_grads()
        tables = [p for g in self._groups(sparse=True) for p in g["params"]]
        grads = [p.grad for p in tables]
        try:
            for p in tables:  # Adam skips a parameter without a gradient
                p.grad = None
            loss = self.update(closure)
        finally:
            for p, grad in zip(tables, grads, strict=True):
                p.grad = grad
        for group in self._groups(sparse=True):
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "accumulator" not in state:
                    state["accumulator"] = torch.zeros(p.shape[0], dtype=p.dtype, device=p.device)
                rowwise_adagrad_(p, p.grad, state["accumulator"], float(group["lr"]), group["eps"])
        return loss
