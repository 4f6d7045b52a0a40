"""The optimizer's own update on one GPU: the clip folded into the fused update, tb_adamw against torch's fused
AdamW, plain and over FSDP2's shards.

Part of the single-GPU tier (``make test-gpu``, every tests/test_gpu_*.py but test_gpu_multi.py), skipped where no
CUDA device is visible."""

import pytest
import torch
from conftest import single_gpu_tier

pytestmark = single_gpu_tier()


@pytest.mark.parametrize("max_norm", [1e-3, 1e3])  # clipped, and a norm under the limit (factor 1)
def test_the_clip_folded_into_the_fused_update_matches_the_separate_pass_on_cuda(max_norm):
    from trainbench.optim.adamw import AdamClipped

    def g(seed: int, shape) -> torch.Tensor:
        return torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))

    shapes = [(512, 256), (256,), (3, 1000)]

    def train(limit: float, fold: bool) -> list[torch.Tensor]:
        params = [torch.nn.Parameter(g(i, s)) for i, s in enumerate(shapes)]
        # eps of the gradients' clipped size: the update then depends on the clip (Adam alone is scale-free)
        opt = AdamClipped(params, limit, fold_clip=fold, lr=1e-2, eps=1e-4, weight_decay=0.1, fused=True)
        assert opt._folds([p.detach() for p in params]) is fold
        for step in range(3):
            for i, p in enumerate(params):
                p.grad = g(10 * (step + 1) + i, p.shape)
            opt.step()
            assert not hasattr(opt, "grad_scale")
        return [p.detach() for p in params]

    separate, folded, unclipped = train(max_norm, False), train(max_norm, True), train(0.0, True)
    for a, b, c in zip(separate, folded, unclipped, strict=True):
        # the same update but for rounding: the separate pass multiplies by the factor, the kernel divides by its
        # reciprocal
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
        if max_norm > 1:
            torch.testing.assert_close(b, c, rtol=1e-6, atol=1e-6)
    if max_norm < 1:  # the clip did act, so the comparison above saw it
        assert max((b - c).abs().max() for b, c in zip(folded, unclipped, strict=True)) > 1e-3


def test_own_adamw_kernel_matches_torchs_fused_update_and_keeps_its_state_on_cuda():
    """optim/adamw: tb_adamw (the large parameters) against torch's fused AdamW over 3 steps, the clip folded in,
    weight decay on one group and off the other; the state it keeps is torch's, so a checkpoint taken under one
    continues under the other."""
    from trainbench.optim.adamw import OWN_KERNEL_MIN, AdamClipped

    def g(seed: int, shape) -> torch.Tensor:
        return torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))

    shapes = [(1024, OWN_KERNEL_MIN // 1024 + 3), (OWN_KERNEL_MIN + 5,), (256,)]  # two large (one odd size), small

    def optimizer(own: bool, params):
        groups = [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}]
        opt = AdamClipped(groups, 1e-3, own_kernel=own, lr=1e-2, betas=(0.9, 0.95), eps=1e-6, fused=True)
        return opt, [own and p.numel() >= OWN_KERNEL_MIN for p in params]

    def train(own: bool, steps: range, state=None) -> tuple[list[torch.Tensor], dict]:
        params = [torch.nn.Parameter(g(i, s) if state is None else state[0][i].clone()) for i, s in enumerate(shapes)]
        opt, expect_own = optimizer(own, params)
        if state is not None:
            opt.load_state_dict(state[1])
        for step in steps:
            for i, p in enumerate(params):
                p.grad = g(10 * (step + 1) + i, p.shape)
            assert [opt._own(opt.param_groups[0 if i < 2 else 1], p) for i, p in enumerate(params)] == expect_own
            opt.step()
            assert all(p.grad is not None for p in params) and not hasattr(opt, "grad_scale")
        return [p.detach().clone() for p in params], opt.state_dict()

    start = [g(i, s) for i, s in enumerate(shapes)]
    torchs, torch_state = train(False, range(3))
    ours, our_state = train(True, range(3))
    for a, b, s in zip(ours, torchs, start, strict=True):
        assert (b - s).abs().max() > 1e-3  # the steps moved the weights
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6 * float((b - s).abs().max()))
    for name in ("step", "exp_avg", "exp_avg_sq"):
        for i in range(len(shapes)):
            a, b = our_state["state"][i][name], torch_state["state"][i][name]
            assert (a.dtype, a.device, a.shape) == (b.dtype, b.device, b.shape)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-12)
    # 3 steps under torch's update then 2 under ours equal 5 under torch's (and the reverse)
    five, _ = train(False, range(5))
    mixed, _ = train(True, range(3, 5), (torchs, torch_state))
    reverse, _ = train(False, range(3, 5), (ours, our_state))
    for a, b, c in zip(mixed, reverse, five, strict=True):
        torch.testing.assert_close(a, c, rtol=2e-6, atol=1e-6)
        torch.testing.assert_close(b, c, rtol=2e-6, atol=1e-6)


def test_own_adamw_kernel_updates_sharded_parameters_as_torchs_fused_update_on_cuda():
    """optim/adamw under FSDP2's DTensors (one rank, Shard(0)): tb_adamw updates each local shard, the clip (a
    separate pass for sharded gradients) before it, as torch's fused update does."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from trainbench.optim.adamw import OWN_KERNEL_MIN, AdamClipped

    def g(seed: int, shape) -> torch.Tensor:
        return torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))

    shapes = [(1024, OWN_KERNEL_MIN // 1024 + 3), (512,)]
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        mesh = init_device_mesh("cuda", (1,))
        weights = {}
        for own in (False, True):
            params = [torch.nn.Parameter(distribute_tensor(g(i, s), mesh, [Shard(0)])) for i, s in enumerate(shapes)]
            opt = AdamClipped(params, 1e-3, own_kernel=own, lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1,
                              fused=True)  # fmt: skip
            for step in range(3):
                for i, p in enumerate(params):
                    p.grad = distribute_tensor(g(10 * (step + 1) + i, p.shape), mesh, [Shard(0)])
                assert [opt._own(opt.param_groups[0], p) for p in params] == [own, False]
                opt.step()
            weights[own] = [p.detach().full_tensor() for p in params]
    finally:
        dist.destroy_process_group()
    for i, (a, b) in enumerate(zip(weights[True], weights[False], strict=True)):
        change = float((b - g(i, shapes[i])).abs().max())
        assert change > 1e-3
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6 * change)
