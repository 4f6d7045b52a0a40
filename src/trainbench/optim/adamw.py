"""AdamW after clipping the global gradient norm, for plain and sharded (DTensor) gradients.

On CUDA the update of each large fp32 parameter (``OWN_KERNEL_MIN`` elements or more: the experts', the attention
projections', the embedding and the output layer) is one pass of a Triton kernel of our own (``tb_adamw``): it reads
the parameter, its gradient and the two moments and writes the three back, the arithmetic of torch's fused AdamW in
fp32. torch's fused kernel moved those 28 bytes a parameter well below the GPU's bandwidth in the model's profile
(docs/gpt_oss.md, "The optimizer's update in one pass of our own"; ``perf/adamw.py`` measures both, and torch's update
compiled); the smaller parameters keep torch's fused update, where a launch each would cost more than it saves. The CPU
keeps torch's update, so CPU runs repeat bit for bit.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from trainbench.families.triton_kernels import lazy_kernel
from trainbench.optim.sqrt import sqrt

OWN_KERNEL_MIN = 1 << 20  # elements: parameters this large are updated by tb_adamw on CUDA
OWN_KERNEL_BLOCK = 1024  # elements a program (perf/adamw.py: 1,024 the fastest of 1,024 to 8,192 on an H200)


def own_kernel_chosen(choice: str, world_size: int) -> bool:
    """Whether ``perf.optimizer_kernel``'s ``choice`` puts the large parameters on ``tb_adamw``. ``auto``: on one rank,
    where the update alone took less time than torch's fused one; not over several ranks, where whole steps of
    llama31_8b and gpt_oss_20b in FP8 were slower with it than with torch's update in the same calls (the figures:
    docs/performance.md, "The optimizer's update over several ranks")."""
    return choice == "own" or (choice == "auto" and world_size == 1)


def _define_adamw(triton, tl):
    """One AdamW step of one fp32 parameter, in torch's fused AdamW's order of operations."""

    @triton.jit
    def tb_adamw(p_ptr, g_ptr, m_ptr, v_ptr, step_ptr, divisor_ptr, n, lr, decay, beta1, beta2, log2_beta1,
                 log2_beta2, eps, HAS_DIVISOR: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        step = tl.load(step_ptr)  # already counted for this step
        correction1 = 1.0 - tl.exp2(step * log2_beta1)
        correction2_root = tl.sqrt_rn(1.0 - tl.exp2(step * log2_beta2))
        g = tl.load(g_ptr + offs, mask=mask, eviction_policy="evict_first")
        if HAS_DIVISOR:
            g = g / tl.load(divisor_ptr)
        p = tl.load(p_ptr + offs, mask=mask, eviction_policy="evict_first")
        m = tl.load(m_ptr + offs, mask=mask, eviction_policy="evict_first")
        v = tl.load(v_ptr + offs, mask=mask, eviction_policy="evict_first")
        p = p - lr * decay * p
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        p = p - (lr / correction1) * m / (tl.sqrt_rn(v) / correction2_root + eps)
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)

    return tb_adamw


_adamw_kernel = lazy_kernel(_define_adamw)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _memory(t: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor whose memory holds ``t``'s elements, for a kernel that reads and writes them through a
    pointer: a DTensor's local shard, and within a wrapper subclass (torchao's FP8-gathered weights under FSDP2) the
    one inner tensor of its shape, dtype and strides; None where there is no such tensor. A wrapper's own data pointer
    is 0: a kernel handed the wrapper itself writes at address 0 and the GPU faults (an illegal memory access, seen on
    every rank of FSDP2 over 4 GPUs with the weights gathered in FP8)."""
    t = _local(t)
    while is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = [getattr(t, name) for name in names]
        same = [
            x for x in inner if (x.shape, x.dtype, x.device, x.stride()) == (t.shape, t.dtype, t.device, t.stride())
        ]
        if len(same) != 1:
            return None
        t = _local(same[0])
    return t


class AdamClipped(torch.optim.AdamW):
    """AdamW (Adam with decoupled weight decay; ``weight_decay=0`` groups for biases and norms) after clipping
    the global gradient norm. The norm is taken over sharded (DTensor) gradients too: squares are summed
    locally and all-reduced over the mesh dimensions each gradient is sharded on.

    With the fused update on CUDA (``fused=True``, plain tensors) the clip is no pass of its own over the
    gradients: its factor goes to the update's kernel as ``grad_scale`` (the kernel divides each gradient by it as
    it reads it, the hook torch's AMP grad scaler uses), which saves reading and writing every gradient once more
    (docs/notes/llm.md, "FP8 training"). ``fold_clip=False`` keeps the separate pass (measurements); on the CPU it
    is always separate, so CPU runs repeat bit for bit."""

    def __init__(self, params, max_grad_norm: float, fold_clip: bool = True, own_kernel: bool = True,
                 own_kernel_block: int = OWN_KERNEL_BLOCK, **kw):  # fmt: skip
        super().__init__(params, **kw)
        self.max_grad_norm = max_grad_norm
        self.fold_clip = fold_clip
        self.own_kernel = own_kernel  # False: torch's fused update for every parameter (measurements)
        self.own_kernel_block = own_kernel_block

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

    def _own(self, group: dict, p: torch.Tensor) -> bool:
        """Whether ``p``'s update is ``tb_adamw``'s: a large fp32 CUDA parameter of a fused group."""
        if not (self.own_kernel and group.get("fused") and p.grad is not None and p.is_cuda):
            return False
        if group.get("amsgrad") or group.get("maximize") or torch.is_tensor(group["lr"]):
            return False
        if not all(isinstance(b, float) and 0 < b < 1 for b in group["betas"]):
            return False
        local, grad = _memory(p), _memory(p.grad)
        if local is None or grad is None:
            return False
        return (local.dtype == grad.dtype == torch.float32 and local.numel() >= OWN_KERNEL_MIN
                and local.is_contiguous() and grad.is_contiguous() and _adamw_kernel() is not None)  # fmt: skip

    @torch.no_grad()
    def update(self, closure=None):
        """The AdamW update of the (clipped) gradients: the large CUDA parameters' through ``tb_adamw``, the rest
        through torch's update (their gradients hidden from it while it runs)."""
        loss = None
        if closure is not None:  # first, so that the gradients it makes are all there to be split
            with torch.enable_grad():
                loss = closure()
        own = [(group, p) for group in self.param_groups for p in group["params"] if self._own(group, p)]
        grads = [p.grad for _, p in own]
        try:
            for _, p in own:
                p.grad = None
            super().step()
        finally:
            for (_, p), grad in zip(own, grads, strict=True):
                p.grad = grad
        try:
            self._own_update(own)
        finally:
            self.__dict__.pop("grad_scale", None)
        return loss

    def _own_update(self, own: list[tuple[dict, torch.Tensor]]) -> None:
        """``tb_adamw`` over each of ``own``'s parameters, their state kept as torch's fused AdamW keeps it."""
        if not own:
            return
        kernel, cdiv = _adamw_kernel()
        for _, p in own:
            state = self.state[p]
            if not state:  # as torch's fused update makes it, so checkpoints are the same either way
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        torch._foreach_add_([self.state[p]["step"] for _, p in own], 1.0)
        divisor = getattr(self, "grad_scale", None)
        for group, p in own:
            state, (beta1, beta2) = self.state[p], group["betas"]
            memory = [_memory(t) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
            n, block = memory[0].numel(), self.own_kernel_block
            assert all(m is not None and m.is_contiguous() and m.numel() == n for m in memory), (
                "tb_adamw: 4 equal tensors"
            )
            kernel[(cdiv(n, block),)](*memory, state["step"], divisor if divisor is not None else state["step"], n,
                                      float(group["lr"]), float(group["weight_decay"]), beta1, beta2, math.log2(beta1),
                                      math.log2(beta2), group["eps"], HAS_DIVISOR=divisor is not None, BLOCK=block,
                                      num_warps=8)  # fmt: skip

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
