"""LAMB as MLPerf BERT uses it (You et al. 2019; the MLPerf reference and NVIDIA's fused LAMB).

Per step, for each parameter p with gradient g (after global-norm clipping of all gradients):

    m = beta1 m + (1 - beta1) g                 v = beta2 v + (1 - beta2) g^2
    m_hat = m / (1 - beta1^t)                   v_hat = v / (1 - beta2^t)      (bias_correction)
    u = m_hat / (sqrt(v_hat) + eps) + wd * p
    ratio = ||p|| / ||u||   (1 where either norm is 0, and for groups without layer adaptation)
    p = p - lr * ratio * u

Biases and LayerNorm parameters get no weight decay and no layer adaptation (ratio 1), as in the
reference's ``exclude_from_weight_decay`` / ``exclude_from_layer_adaptation``. The update runs on
whole parameter lists with ``torch._foreach_*`` ops: a handful of kernels per step, not ~400.
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer

from trainbench.optim.groups import weight_decay_split
from trainbench.optim.sqrt import foreach_sqrt, sqrt


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """LAMB's two groups under the one rule of :func:`~trainbench.optim.groups.weight_decay_split`: decayed and
    layer-adapted weights, and biases and norms with neither (frozen parameters in neither group)."""
    decay, plain = weight_decay_split(model)
    return [
        {"params": decay, "weight_decay": weight_decay, "layer_adaptation": True},
        {"params": plain, "weight_decay": 0.0, "layer_adaptation": False},
    ]


class Lamb(Optimizer):
    """Multi-tensor LAMB. ``fused=True`` compiles the whole update (clipping, moments, trust ratios,
    parameter update, every group) into a few Inductor kernels: trainbench's fused LAMB.

    The learning rate and step count live on the device as tensors, so the compiled update is traced
    once and never recompiled as the schedule moves (a Python float would be a new constant each step),
    and the step never waits for the host.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        max_grad_norm: float = 1.0,
        bias_correction: bool = True,
        fused: bool = False,
    ):
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            layer_adaptation=True,
        )
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm
        self.fused = fused
        self._update = torch.compile(_lamb_update, fullgraph=True) if fused else _lamb_update
        self._lrs: torch.Tensor | None = None

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if not torch.is_tensor(state.get("step")):  # new, or an int from an older checkpoint
            state["step"] = torch.tensor(float(state.get("step", 0)), device=p.device)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "Lamb does not take a closure"
        groups = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            states = [self._init_state(p) for p in params]
            groups.append((params, [p.grad for p in params], states))
        if not any(g[0] for g in groups):
            return None
        device = next(g[0][0].device for g in groups if g[0])
        if self._lrs is None or self._lrs.device != device:
            self._lrs = torch.zeros(len(self.param_groups), device=device)
        for i, group in enumerate(self.param_groups):
            self._lrs[i].fill_(group["lr"])  # a kernel argument: no host-to-device copy, no sync
        self._update(
            [g[0] for g in groups],
            [g[1] for g in groups],
            [[s["exp_avg"] for s in g[2]] for g in groups],
            [[s["exp_avg_sq"] for s in g[2]] for g in groups],
            [[s["step"] for s in g[2]] for g in groups],
            self._lrs,
            [
                (
                    *group["betas"],
                    group["eps"],
                    group["weight_decay"],
                    group["bias_correction"],
                    group["layer_adaptation"],
                )
                for group in self.param_groups
            ],  # fmt: skip
            self.max_grad_norm,
        )
        return None


def _lamb_update(params, grads, exp_avgs, exp_avg_sqs, steps, lrs, settings, max_grad_norm: float) -> None:
    """One LAMB step over all groups (lists of lists, one per group); pure tensor code, compilable."""
    grads_all = [g for gs in grads for g in gs]
    # Global-norm clipping over every gradient, kept on device (no host sync).
    global_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads_all)))
    clip = torch.ones_like(global_norm)
    if max_grad_norm > 0:
        clip = torch.clamp(max_grad_norm / (global_norm + 1e-6), max=1.0)
    for i, (p, g, m, v, t) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, steps, strict=True)):
        if not p:
            continue
        beta1, beta2, eps, weight_decay, bias_correction, layer_adaptation = settings[i]
        torch._foreach_add_(t, 1.0)
        g = torch._foreach_mul(g, clip)
        torch._foreach_lerp_(m, g, 1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, g, g, value=1 - beta2)
        denom = foreach_sqrt(v)
        update = m
        if bias_correction:
            step = t[0]
            torch._foreach_div_(denom, sqrt(1 - torch.pow(beta2, step)))
            torch._foreach_add_(denom, eps)
            update = torch._foreach_div(m, denom)
            torch._foreach_div_(update, 1 - torch.pow(beta1, step))
        else:
            torch._foreach_add_(denom, eps)
            update = torch._foreach_div(m, denom)
        if weight_decay != 0:
            torch._foreach_add_(update, p, alpha=weight_decay)
        if layer_adaptation:
            w_norm = torch._foreach_norm(p)
            u_norm = torch._foreach_norm(update)
            ratios = [
                torch.where((w > 0) & (u > 0), w / u, torch.ones_like(w)) for w, u in zip(w_norm, u_norm, strict=True)
            ]
            torch._foreach_mul_(update, ratios)
        torch._foreach_mul_(update, -lrs[i])
        torch._foreach_add_(p, update)
