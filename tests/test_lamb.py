"""The multi-tensor LAMB against a straightforward per-parameter reference, and the LR schedule."""

import math

import pytest
import torch

from trainbench.optim.groups import no_decay
from trainbench.optim.lamb import Lamb, param_groups
from trainbench.optim.schedules import poly_warmup_lr


def reference_lamb_step(params, grads, state, lr, beta1, beta2, eps, wd, adapt, max_norm, step, bias_correction=True):
    """LAMB written out one parameter at a time, in plain float64 arithmetic, as MLPerf's reference states it."""
    total = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    clip = min(1.0, max_norm / (total + 1e-6)) if max_norm > 0 else 1.0
    new = []
    for i, (p, g) in enumerate(zip(params, grads, strict=False)):
        p, g = p.double(), g.double() * clip
        m, v = state.setdefault(i, (torch.zeros_like(p), torch.zeros_like(p)))
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        state[i] = (m, v)
        m_hat = m / (1 - beta1**step) if bias_correction else m
        v_hat = v / (1 - beta2**step) if bias_correction else v
        update = m_hat / (v_hat.sqrt() + eps) + wd[i] * p
        ratio = 1.0
        if adapt[i]:
            w_norm, u_norm = p.norm().item(), update.norm().item()
            ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
        new.append(p - lr * ratio * update)
    return new


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = torch.nn.Linear(16, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.out = torch.nn.Linear(8, 3)


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("max_norm", [1.0, 0.0, 1e-3])
def test_foreach_lamb_matches_reference(max_norm, bias_correction):
    check_against_reference(max_norm, bias_correction, fused=False)


def test_fused_lamb_matches_reference():
    """The compiled (fused) update follows the same reference, clipping triggered."""
    check_against_reference(1e-3, True, fused=True)


def check_against_reference(max_norm, bias_correction, fused):
    torch.manual_seed(0)
    net = Net()
    groups = param_groups(net, weight_decay=0.1)
    opt = Lamb(
        groups,
        lr=0.05,
        betas=(0.8, 0.95),
        eps=1e-6,
        weight_decay=0.1,
        max_grad_norm=max_norm,
        bias_correction=bias_correction,
        fused=fused,
    )
    params = [p for g in opt.param_groups for p in g["params"]]
    wd = [g["weight_decay"] for g in opt.param_groups for _ in g["params"]]
    adapt = [g["layer_adaptation"] for g in opt.param_groups for _ in g["params"]]
    ref_params = [p.detach().clone().double() for p in params]
    state = {}
    for step in range(1, 6):
        x = torch.randn(32, 16)
        loss = net.out(net.norm(net.dense(x))).pow(2).mean() * 10
        loss.backward()
        grads = [p.grad.detach().clone() for p in params]
        opt.step()
        opt.zero_grad()
        ref_params = reference_lamb_step(
            ref_params, grads, state, 0.05, 0.8, 0.95, 1e-6, wd, adapt, max_norm, step, bias_correction
        )
        for p, r in zip(params, ref_params, strict=False):
            torch.testing.assert_close(p.detach().double(), r, rtol=1e-5, atol=1e-6)
        # keep the reference on the optimizer's trajectory so float32 rounding cannot accumulate
        ref_params = [p.detach().clone().double() for p in params]


def test_bias_and_layernorm_get_no_decay_nor_adaptation():
    net = Net()
    decay, plain = param_groups(net, 0.01)
    names = {id(p): n for n, p in net.named_parameters()}
    assert sorted(names[id(p)] for p in decay["params"]) == ["dense.weight", "out.weight"]
    assert plain["weight_decay"] == 0.0 and plain["layer_adaptation"] is False
    assert no_decay("layers.0.attn_norm.weight", torch.zeros(4)) and not no_decay("qkv.weight", torch.zeros(4, 4))


def test_poly_warmup_schedule():
    lr = lambda s: poly_warmup_lr(s, 1.0, warmup_steps=4, total_steps=12, power=1.0)
    assert [lr(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr(4) == 1.0 and lr(8) == 0.5 and lr(12) == 0.0 and lr(20) == 0.0
    quad = poly_warmup_lr(8, 2.0, warmup_steps=0, total_steps=16, power=2.0)
    assert quad == pytest.approx(2.0 * 0.25)
    # warmup started 2 steps before step 0 (MLPerf's negative start_warmup_step)
    assert poly_warmup_lr(0, 1.0, 4, 12, 1.0, start_warmup_step=-2) == 0.75


def test_fused_lamb_compiles_once_as_the_schedule_moves():
    """lr and step are device tensors: a new learning rate every step must not recompile the update."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    torch._dynamo.reset()
    nets = [Net(), Net()]
    nets[1].load_state_dict(nets[0].state_dict())
    opts = [Lamb(param_groups(n, 0.01), lr=0.0, fused=f) for n, f in zip(nets, (False, True), strict=True)]
    for step in range(6):
        x = torch.randn(8, 16)
        for net, opt in zip(nets, opts, strict=True):
            for group in opt.param_groups:
                group["lr"] = 0.01 * (step + 1)
            net.out(net.norm(net.dense(x))).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        if step == 0:
            compiled_frames = counters["stats"]["unique_graphs"]
    assert compiled_frames >= 1
    assert counters["stats"]["unique_graphs"] == compiled_frames, "the update was recompiled"
    for a, b in zip(nets[0].parameters(), nets[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_one_weight_decay_rule_for_every_optimizer_and_frozen_parameters_get_no_state():
    """LAMB (BERT) and clipped AdamW (the decoders) group parameters by the same rule, and a frozen parameter is in
    neither group: no moments are kept for it and it does not move."""
    from trainbench.benchmarks import BENCHMARKS
    from trainbench.optim.groups import weight_decay_split

    for name in ("bert", "llama31_8b"):
        bench = BENCHMARKS[name]
        cfg = bench.config("tiny")
        model = bench.family.build_model(cfg)
        if name == "llama31_8b":
            model = model.to_empty(device="cpu")
            model.init_weights(0)
        frozen = [p for n, p in model.named_parameters() if "embed" in n]
        for p in frozen:
            p.requires_grad_(False)
        decay, plain = weight_decay_split(model)
        opt = bench.build_optimizer(cfg, model)
        grouped = [p for g in opt.param_groups for p in g["params"]]
        assert [id(p) for p in grouped] == [id(p) for p in decay + plain]
        assert not {id(p) for p in frozen} & {id(p) for p in grouped}
        assert all(p.ndim >= 2 for p in decay) and all(p.ndim == 1 for p in plain), name
        assert [g["weight_decay"] for g in opt.param_groups] == [cfg.optimizer.weight_decay, 0.0]


def test_the_optimizers_square_root_is_the_correctly_rounded_one_on_this_cpu():
    """MKL's float32 sqrt is off by one ulp for some inputs, and for other inputs on Intel than on AMD; the optimizers'
    root is the correctly rounded one (NumPy's) on any CPU, so a CPU run gives the same bits on either."""
    import numpy as np

    from trainbench.optim.sqrt import foreach_sqrt, sqrt

    x = torch.rand(100_003, generator=torch.Generator().manual_seed(0)) + 1e-8
    exact = torch.from_numpy(np.sqrt(x.numpy()))
    assert torch.equal(sqrt(x), exact)
    assert all(torch.equal(a, b) for a, b in zip(foreach_sqrt([x, x[:7]]), [exact, exact[:7]], strict=True))
    assert torch.equal(sqrt(x.double()), x.double().sqrt())
