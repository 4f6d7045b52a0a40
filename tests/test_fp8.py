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
