"""Row-wise Adagrad for embedding tables, beside Adam for the dense parameters: dlrmv4's two optimizers at one
learning rate, as the reference runs them (TorchRec's fused ``EXACT_ROWWISE_ADAGRAD`` on the tables, Adam on the rest).

Row-wise Adagrad keeps one accumulator per table row. For each row r a step touches, with g_r the row's gradient
summed over the step's lookups of it (dimension D):

    s_r <- s_r + sum(g_r^2) / D
    w_r <- w_r - lr * g_r / (sqrt(s_r) + eps)

A row no lookup touched keeps its weights and its accumulator. Where every rank holds every table, the tables'
gradients are dense (zero in the untouched rows), so the update over every row is that update exactly: an untouched
row adds 0 to its accumulator and moves by 0. Where the tables are sharded over the ranks
(families/hstu/sharded_tables.py), a table's parameter has no gradient: its lookups' backward appends (rows, row
gradients) of this rank's shard to the parameter's ``ROW_GRADS`` list, over every micro-batch of the step, and
:func:`rowwise_adagrad_rows_` updates the touched rows alone (no [rows, D] gradient is made). No weight decay.
The dense parameters' global gradient norm is clipped before Adam; the tables' gradients are not clipped (the
reference's fused update applies them in the backward, outside any clip).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from trainbench.optim.adamw import AdamClipped
from trainbench.optim.sqrt import sqrt

SPARSE = "rowwise_adagrad"  # the key marking the tables' parameter group
ROW_GRADS = "row_grads"
"""The attribute of a sharded table's parameter holding the step's [(local rows [n], gradients [n, D]), ...]."""


@torch.no_grad()
def rowwise_adagrad_(weight: torch.Tensor, grad: torch.Tensor, accumulator: torch.Tensor, lr: float,
                     eps: float) -> None:  # fmt: skip
    """One row-wise Adagrad step of a [rows, D] table in place (``accumulator``: [rows])."""
    accumulator.add_(grad.square().mean(dim=1))
    weight.sub_(grad * (lr / (sqrt(accumulator) + eps)).unsqueeze(1))


@torch.no_grad()
def rowwise_adagrad_rows_(weight: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor, accumulator: torch.Tensor,
                          lr: float, eps: float) -> None:  # fmt: skip
    """The row-wise Adagrad step of :func:`rowwise_adagrad_` for the rows a step touched only: ``rows`` [n] (repeats
    allowed) with their gradients ``grads`` [n, D], summed per unique row first, then :func:`rowwise_adagrad_` on
    those rows gathered (``index_select``) and written back (``index_copy_``)."""
    unique, inverse = torch.unique(rows, return_inverse=True)
    summed = torch.zeros(unique.numel(), grads.shape[1], dtype=grads.dtype, device=grads.device)
    summed.index_add_(0, inverse, grads)
    touched, grown = weight.index_select(0, unique), accumulator.index_select(0, unique)
    rowwise_adagrad_(touched, summed, grown, lr, eps)
    accumulator.index_copy_(0, unique, grown)
    weight.index_copy_(0, unique, touched)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _accumulator(p: torch.Tensor) -> torch.Tensor:
    """Zeros, one a row of ``p``: sharded like ``p`` where it is a DTensor sharded by rows (each rank's accumulator
    covers its shard's rows, and a checkpoint saves each shard once)."""
    if not isinstance(p, DTensor):
        return torch.zeros(p.shape[0], dtype=p.dtype, device=p.device)
    local = torch.zeros(p.to_local().shape[0], dtype=p.dtype, device=p.to_local().device)
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=(p.shape[0],), stride=(1,))


class AdamRowWiseAdagrad(AdamClipped):
    """Adam (decoupled weight decay 0, the dense gradients' global norm clipped to ``max_grad_norm``) for
    ``dense`` and row-wise Adagrad for ``tables``, one optimizer whose parameter groups both take the learning rate
    the loop sets. The tables' state is ``accumulator`` ([rows]) per table, checkpointed like Adam's moments."""

    def __init__(self, dense, tables, max_grad_norm: float, lr: float, betas: tuple[float, float], eps: float,
                 table_eps: float) -> None:  # fmt: skip
        groups = [{"params": list(dense)}, {"params": list(tables), SPARSE: True, "eps": table_eps}]
        super().__init__(groups, max_grad_norm, lr=lr, betas=betas, eps=eps, weight_decay=0.0, fused=True)

    def __setstate__(self, state: dict) -> None:
        """Adam's reads a ``step`` in every parameter's state (loading a checkpoint comes here); a table's state is its
        accumulator alone, kept aside meanwhile."""
        tables = {id(p) for g in state["param_groups"] if g.get(SPARSE) for p in g["params"]}
        held = {p: s for p, s in state["state"].items() if id(p) in tables}
        for p in held:
            del state["state"][p]
        super().__setstate__(state)
        self.state.update(held)

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
        with torch.profiler.record_function("tb.rowwise_adagrad"):  # bench's profile counts the tables' update apart
            self._update_tables()
        return loss

    def _update_tables(self) -> None:
        for group in self._groups(sparse=True):
            for p in group["params"]:
                pending = getattr(p, ROW_GRADS, None)
                if p.grad is None and pending is None:  # (a sharded table's state is made on every rank at once)
                    continue
                state = self.state[p]
                if "accumulator" not in state:
                    state["accumulator"] = _accumulator(p)
                lr, eps, accumulator = float(group["lr"]), group["eps"], _local(state["accumulator"])
                if p.grad is not None:  # dense: every rank's whole table (or checkpoint loading's zeros)
                    rowwise_adagrad_(_local(p), _local(p.grad), accumulator, lr, eps)
                if pending:
                    rows, grads = zip(*pending, strict=True)
                    rowwise_adagrad_rows_(_local(p), torch.cat(rows), torch.cat(grads), accumulator, lr, eps)
                    pending.clear()
