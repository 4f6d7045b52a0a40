"""The FP8 base's pieces on the CPU: the SwiGLU whose backward reads FP8 copies of its inputs against the plain one,
and the transpose's fallback."""

from __future__ import annotations

import torch

from trainbench.models import fp8
from trainbench.models.decoder import silu_mul


def test_swiglu_with_fp8_kept_inputs_gives_the_same_output_and_gradients_within_fp8_rounding():
    torch.manual_seed(0)
    gate = torch.randn(64, 384, requires_grad=True)
    up = torch.randn(64, 384, requires_grad=True)
    grad = torch.randn(64, 384)
    out = fp8.silu_mul_fp8_saved(gate, up)
    ref = silu_mul(gate, up)
    assert torch.equal(out, ref)  # the forward is the plain function's
    got = torch.autograd.grad(out, (gate, up), grad)
    want = torch.autograd.grad(ref, (gate, up), grad)
    for g, w in zip(got, want, strict=True):
        rel = float((g - w).norm() / w.norm())
        assert 1e-4 < rel < 0.06, rel  # FP8's rounding of the kept inputs, and no more
    with torch.no_grad():  # no autograd: the plain function
        assert torch.equal(fp8.silu_mul_fp8_saved(gate, up), ref)


def test_the_transpose_off_cuda_is_torchs():
    w, _ = fp8.quantize_rows(torch.randn(48, 80))
    assert torch.equal(fp8.transpose_fp8(w).view(torch.uint8), w.t().contiguous().view(torch.uint8))


def _two_float8_layers() -> torch.nn.Module:
    """Two of torchao's float8 training layers under a holder named as a decoder's blocks are (``model.layers``)."""
    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.model = torch.nn.Module()
    holder.model.layers = torch.nn.ModuleList([torch.nn.Linear(64, 128), torch.nn.Linear(128, 64, bias=False)])
    assert fp8.train_blocks_in_fp8(holder) == 2
    holder.forward = lambda x: holder.model.layers[1](torch.relu(holder.model.layers[0](x)))
    return holder


def _train_float8(once: bool, stale_step: int | None = None) -> list[torch.Tensor]:
    """3 steps of 2 micro-batches of bf16 rows through :func:`_two_float8_layers` with the fused AdamW; each
    micro-batch's output and each step's gradients. ``once``: the weights cast once a step; ``stale_step``: that
    step's casts left stale (no after_step)."""
    root = _two_float8_layers()
    after_step = fp8.cast_weights_once_a_step(root, compiled=False) if once else None
    opt = torch.optim.AdamW(root.parameters(), lr=1e-2, fused=True)  # (leaves the weights' version counters alone)
    xs = [torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(i)).bfloat16() for i in range(2)]
    seen = []
    for step in range(3):
        for x in xs:
            out = root(x)
            out.float().square().mean().backward()
            seen.append(out.detach().float())
        seen += [p.grad.detach().clone() for p in root.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after_step is not None and step != stale_step:
            after_step()
    return seen


def test_float8_weights_cast_once_a_step_give_the_per_call_casts_outputs_and_gradients_bit_for_bit(monkeypatch):
    """fp8.cast_weights_once_a_step: torchao's float8 layers handed their weights cast once a step give, over 3 steps
    of 2 micro-batches, the outputs and fp32 gradients of the same layers casting in every call, bit for bit; each
    weight's bf16 gradient reaches the one-pass add as it is (no cast of its own on the way), once a micro-batch
    after the first. A step whose casts are left stale does not match: what the comparison would catch."""
    added = []

    def add(total: torch.Tensor, grad: torch.Tensor) -> None:
        added.append((total.dtype, grad.dtype, tuple(grad.shape) == tuple(total.shape)))
        total.add_(grad)

    monkeypatch.setattr(fp8, "add_grad_into", add)
    per_call, once = _train_float8(False), _train_float8(True)
    assert len(once) == len(per_call) == 3 * (2 + 3)  # a step: 2 outputs, 3 gradients (a bias, two weights)
    for got, want in zip(once, per_call, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert added == [(torch.float32, torch.bfloat16, True)] * (3 * 2)  # 3 steps x 2 weights x (2 - 1) micro-batches
    stale = _train_float8(True, stale_step=0)
    assert not all(torch.equal(a, b) for a, b in zip(stale, per_call, strict=True))
