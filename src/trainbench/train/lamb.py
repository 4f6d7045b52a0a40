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


def no_decay(name: str, param: torch.Tensor) -> bool:
    """Biases, norms and other 1-d parameters are excluded from weight decay and layer adaptation."""
    return param.ndim <= 1 or name.endswith(".bias") or "norm" in name.lower()


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, plain = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (plain if no_decay(name, p) else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay, "layer_adaptation": True},
        {"params": plain, "weight_decay": 0.0, "layer_adaptation": False},
    ]


class Lamb(Optimizer):
    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        max_grad_norm: float = 1.0,
        bias_correction: bool = True,
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

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "Lamb does not take a closure"
        grads_all = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not grads_all:
            return None
        # Global-norm clipping over every gradient, kept on device (no host sync).
        global_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads_all)))
        clip = torch.ones_like(global_norm)
        if self.max_grad_norm > 0:
            clip = torch.clamp(self.max_grad_norm / (global_norm + 1e-6), max=1.0)

        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            beta1, beta2 = group["betas"]
            for p in params:
                if not self.state[p]:
                    self.state[p]["step"] = 0
                    self.state[p]["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    self.state[p]["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                self.state[p]["step"] += 1
            step = self.state[params[0]]["step"]
            grads = torch._foreach_mul([p.grad for p in params], clip)
            exp_avg = [self.state[p]["exp_avg"] for p in params]
            exp_avg_sq = [self.state[p]["exp_avg_sq"] for p in params]

            torch._foreach_lerp_(exp_avg, grads, 1 - beta1)
            torch._foreach_mul_(exp_avg_sq, beta2)
            torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1 - beta2)

            c1 = 1 - beta1**step if group["bias_correction"] else 1.0
            c2 = 1 - beta2**step if group["bias_correction"] else 1.0
            denom = torch._foreach_sqrt(exp_avg_sq)
            torch._foreach_div_(denom, c2**0.5)
            torch._foreach_add_(denom, group["eps"])
            update = torch._foreach_div(exp_avg, denom)
            torch._foreach_div_(update, c1)
            if group["weight_decay"] != 0:
                torch._foreach_add_(update, params, alpha=group["weight_decay"])
            if group["layer_adaptation"]:
                w_norm = torch._foreach_norm(params)
                u_norm = torch._foreach_norm(update)
                ratios = [
                    torch.where((w > 0) & (u > 0), w / u, torch.ones_like(w))
                    for w, u in zip(w_norm, u_norm, strict=False)
                ]
                torch._foreach_mul_(update, ratios)
            torch._foreach_add_(params, update, alpha=-group["lr"])
        return None


def poly_warmup_lr(
    step: int, base_lr: float, warmup_steps: int, total_steps: int, power: float, start_warmup_step: int = 0
) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then polynomial decay to 0.

    Warmup counts from ``start_warmup_step`` (MLPerf's knob; negative values start warmup before step 0).
    During warmup the rate is ``base_lr * (s + 1) / warmup_steps`` with ``s = step - start_warmup_step``;
    afterwards ``base_lr * (1 - progress) ** power`` with progress running from 0 at the end of warmup to
    1 at ``total_steps``, then held at 0.
    """
    s = step - start_warmup_step
    if s < warmup_steps:
        return base_lr * max(0, s + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps - start_warmup_step)
    progress = min(1.0, max(0.0, (s - warmup_steps) / decay_steps))
    return base_lr * (1.0 - progress) ** power
