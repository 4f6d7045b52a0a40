"""The output layer and its cross entropy in FP8 (models/fp8_output.py), on the CPU: the same values the CUDA kernels
compute (tests/test_gpu.py compares the two), against torch's cross entropy in fp32."""

import pytest
import torch
import torch.nn.functional as F

from trainbench.models import fp8_output


def inputs(rows: int = 48, width: int = 64, vocab: int = 160, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, width, generator=g)
    weight = torch.randn(vocab, width, generator=g) * 0.1
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[3] = targets[7] = fp8_output.IGNORE
    return hidden, weight, targets


def test_each_rows_log_sum_exp_and_term_are_torchs_cross_entropy():
    hidden, weight, targets = inputs()
    logits = (hidden @ weight.t()).to(torch.bfloat16)
    lse, terms = fp8_output.rows_lse(logits, targets)
    assert torch.allclose(lse, torch.logsumexp(logits.float(), -1))
    want = F.cross_entropy(logits.float(), targets, reduction="none")  # 0 for an ignored target
    assert torch.allclose(terms, want, atol=1e-6) and terms[3] == 0 and terms[7] == 0


@pytest.mark.parametrize("g", [0.37, -2.0])
def test_the_logits_gradient_is_cast_at_its_fixed_scale_in_both_layouts(g):
    """The gradient g * (softmax - onehot) in e5m2 at the scale |g| / 57344, known before it is computed: every value
    within e5m2's rounding (2 mantissa bits: 12.5 % at most, where not below its smallest normal), the largest
    magnitudes using the format's top (no amax needed to get there), ignored rows zero, the transposed layout the
    same bytes."""
    hidden, weight, targets = inputs()
    logits = (hidden @ weight.t() * 4).to(torch.bfloat16)
    lse, _ = fp8_output.rows_lse(logits, targets)
    q, q_t, scale = fp8_output.grad_casts(logits, lse, targets, torch.tensor(g))
    assert q.dtype == q_t.dtype == torch.float8_e5m2 and scale.item() == pytest.approx(abs(g) / 57344.0)
    assert torch.equal(q_t.view(torch.uint8), q.t().contiguous().view(torch.uint8))
    logits.requires_grad_()
    want = torch.autograd.grad(F.cross_entropy(logits.float(), targets, reduction="sum") * g, logits)[0].float()
    got = q.float() * scale
    normal = want.abs() >= 2**-14 * abs(g)  # e5m2's smallest normal, 2^-14, at this scale
    assert torch.all((got - want).abs()[normal] <= 0.125 * want.abs()[normal])
    assert torch.all((got - want).abs()[~normal] <= 2**-16 * abs(g))  # its subnormal step
    assert got[[3, 7]].abs().sum() == 0
    assert q.float().abs().max() > 2**14  # the mispredicted targets' -1 lands near the format's top


@pytest.mark.parametrize("g", [1.0, -0.5])
@pytest.mark.parametrize("rows", [48, 34])  # 34: padded with ignored rows to 48, which the FP8 product sums over
def test_the_fp8_loss_and_its_gradients_follow_torchs_cross_entropy_within_fp8_rounding(rows, g):
    hidden, weight, targets = inputs(rows)
    head = torch.nn.Linear(64, 160, bias=False)
    head.weight = torch.nn.Parameter(weight.clone())
    h = hidden.clone().requires_grad_()
    loss = fp8_output.lm_loss_fp8(h.reshape(2, rows // 2, 64), head, targets.reshape(2, rows // 2))
    loss.backward(torch.tensor(g))
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = F.cross_entropy(h_ref @ w_ref.t(), targets, reduction="sum")
    ref.backward(torch.tensor(g))
    assert loss.item() == pytest.approx(ref.item(), rel=2e-3)
    assert h.grad.shape == hidden.shape and head.weight.grad.dtype == torch.float32
    for got, want in ((h.grad, h_ref.grad), (head.weight.grad, w_ref.grad)):
        rel = float((got - want).norm() / want.norm())
        assert 1e-4 < rel < 0.06, rel  # FP8's rounding (e4m3 inputs, e5m2 gradient), and no more
    assert h.grad[3].abs().sum() == 0  # an ignored target's row gets no gradient
    with torch.no_grad():
        assert fp8_output.lm_loss_fp8(hidden[None], head, targets[None]).item() == pytest.approx(loss.item())
