"""The output layer and its cross entropy in FP8 (families/decoder/fp8_output.py), on the CPU: the same values the CUDA
kernels compute (tests/test_gpu_fp8.py compares the two), against torch's cross entropy in fp32."""

import pytest
import torch
import torch.nn.functional as F

from trainbench.families.decoder import fp8_output


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


def test_the_logits_gradient_is_cast_at_its_fixed_scale_in_both_layouts():
    """The gradient at a loss gradient of 1, softmax - onehot, in e5m2 at the scale 1 / 57344, known before it is
    computed: every value within e5m2's rounding (2 mantissa bits: 12.5 % at most, where not below its smallest
    normal), the largest magnitudes using the format's top (no amax needed to get there), ignored rows zero, the
    transposed layout the same bytes, also written into a column slice of a larger tensor."""
    hidden, weight, targets = inputs()
    logits = (hidden @ weight.t() * 4).to(torch.bfloat16)
    lse, _ = fp8_output.rows_lse(logits, targets)
    q, q_t = fp8_output.grad_casts(logits, lse, targets)
    assert q.dtype == q_t.dtype == torch.float8_e5m2 and fp8_output.GRAD_SCALE == 1 / 57344
    assert torch.equal(q_t.view(torch.uint8), q.t().contiguous().view(torch.uint8))
    wide = torch.zeros(160, 100, dtype=torch.float8_e5m2)
    fp8_output.grad_casts(logits, lse, targets, wide[:, 20:68])
    assert torch.equal(wide[:, 20:68].view(torch.uint8), q_t.view(torch.uint8))
    assert wide[:, :20].float().abs().sum() == 0 and wide[:, 68:].float().abs().sum() == 0
    logits.requires_grad_()
    want = torch.autograd.grad(F.cross_entropy(logits.float(), targets, reduction="sum"), logits)[0].float()
    got = q.float() * fp8_output.GRAD_SCALE
    normal = want.abs() >= 2**-14  # e5m2's smallest normal, 2^-14, at this scale
    assert torch.all((got - want).abs()[normal] <= 0.125 * want.abs()[normal])
    assert torch.all((got - want).abs()[~normal] <= 2**-16)  # its subnormal step
    assert got[[3, 7]].abs().sum() == 0
    assert q.float().abs().max() > 2**14  # the mispredicted targets' -1 lands near the format's top


@pytest.mark.parametrize("g", [1.0, -0.5])
@pytest.mark.parametrize("rows", [48, 34])  # 34: padded with ignored rows to 48, which the FP8 product sums over
def test_the_fp8_loss_and_its_gradients_follow_torchs_cross_entropy_within_fp8_rounding(rows, g, monkeypatch):
    """In chunks of 16 rows (3 chunks), the loss and both gradients (those of the hidden states for the chunks' rows,
    the weight's over all rows), a negative loss gradient too."""
    monkeypatch.setattr(fp8_output, "CHUNK_ROWS", 16)
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


def test_chunks_of_rows_change_no_gradient_and_keep_no_logits(monkeypatch):
    """The rows taken 16 at a time give the same gradients, bit for bit, as all at once (each row's gradient is its
    own; the weight's is one product over all rows either way), and the loss within fp32's rounding of a sum; what
    the forward keeps for the backward is the two gradients, not the [rows, vocab] logits."""
    hidden, weight, targets = inputs()
    head = torch.nn.Linear(64, 160, bias=False)
    head.weight = torch.nn.Parameter(weight.clone())
    results = []
    for chunk in (48, 16):
        monkeypatch.setattr(fp8_output, "CHUNK_ROWS", chunk)
        h = hidden.clone().requires_grad_()
        head.weight.grad = None
        loss = fp8_output.lm_loss_fp8(h[None], head, targets[None])
        kept = [t.shape for t in loss.grad_fn.saved_tensors]
        loss.backward()
        results.append((loss.item(), h.grad, head.weight.grad.clone(), kept))
    (loss_all, h_all, w_all, kept), (loss_16, h_16, w_16, _) = results
    assert torch.equal(h_all, h_16) and torch.equal(w_all, w_16)
    assert loss_16 == pytest.approx(loss_all, rel=1e-6)
    assert kept == [torch.Size([48, 64]), torch.Size([160, 64])]


def test_on_one_rank_the_weights_gradient_goes_into_its_grad_as_autograd_would_add_it():
    """With the casts made once a step (one unsharded rank: fp8_output.cache_output_casts), the backward adds g times
    the weight's gradient into the fp32 .grad itself, in one pass, and hands autograd none: over 3 micro-batches of
    different loss gradients, the same .grad bit for bit as autograd's cast, scale and accumulation (the same two
    roundings), the hidden states' gradients the same too."""
    hidden, weight, targets = inputs()
    grads = []
    for direct in (False, True):
        model = torch.nn.Module()
        model.lm_head = torch.nn.Linear(64, 160, bias=False)
        model.lm_head.weight = torch.nn.Parameter(weight.clone())
        if direct:
            fp8_output.cache_output_casts(model, compiled=False)
            model.lm_head._fp8_casts = fp8_output.weight_casts(model.lm_head.weight.detach())  # (its pre-hook's)
        hs = []
        for i, g in enumerate((1.0, -0.25, 3.0)):
            h = (hidden * (i + 1)).requires_grad_()
            loss = fp8_output.lm_loss_fp8(h[None], model.lm_head, targets[None])
            assert (loss.grad_fn.into is not None) is direct
            loss.backward(torch.tensor(g))
            hs.append(h.grad)
        grads.append((model.lm_head.weight.grad, hs))
    (w_autograd, h_autograd), (w_direct, h_direct) = grads
    assert w_direct.dtype == torch.float32 and torch.equal(w_direct, w_autograd)
    assert all(torch.equal(a, b) for a, b in zip(h_autograd, h_direct, strict=True))
    assert w_direct.abs().sum() > 0
