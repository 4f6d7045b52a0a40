"""The FP8 layers and kernels on one GPU: the frozen FP8 base's linear and its transpose kernels, torchao's float8
training linear against float64 and its weights cast once a step, and the FP8 output layer's kernels.

Part of the single-GPU tier (``make test-gpu``, every tests/test_gpu_*.py but test_gpu_multi.py), skipped where no
CUDA device is visible."""

import pytest
import torch
from conftest import float8_layers, single_gpu_tier, torchao_weight_cast, train_float8_layers

pytestmark = single_gpu_tier()


def test_fp8_frozen_linear_matches_bf16_compiled_and_eager_on_cuda():
    from trainbench.families import fp8

    torch.manual_seed(0)
    ref = torch.nn.Linear(1024, 2048, bias=False, device="cuda").requires_grad_(False)
    q = torch.nn.Linear(1024, 2048, bias=False, device="cuda").requires_grad_(False)
    q.load_state_dict(ref.state_dict())
    fp8.quantize_linear(q)
    x = torch.randn(4, 512, 1024, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y_ref = ref(x)
        y = q(x)
        y_compiled = torch.compile(q)(x)
    err = lambda a, b: float((a.float() - b.float()).abs().max() / b.float().abs().max())
    assert y.dtype == torch.bfloat16 and err(y, y_ref) < 0.05 and err(y_compiled, y_ref) < 0.05
    (g,) = torch.autograd.grad(y.float().square().sum(), x)
    (g_ref,) = torch.autograd.grad(y_ref.float().square().sum(), x)
    assert err(g, g_ref) < 0.1


@pytest.mark.parametrize("shape", [(10240, 8192), (8192, 28672), (1000, 777), (1, 130), (129, 1)])
def test_the_fp8_transpose_kernel_equals_torchs_transpose_bit_for_bit_on_cuda(shape):
    from trainbench.families import fp8

    w, _ = fp8.quantize_rows(torch.randn(*shape, device="cuda"))
    for block in (32, 64, 128):
        got = fp8.transpose_fp8(w, block)
        assert got.shape == (shape[1], shape[0]) and got.dtype == fp8.E4M3 and got.is_contiguous()
        assert torch.equal(got.view(torch.uint8), w.t().contiguous().view(torch.uint8)), block


def test_the_fp8_input_gradient_through_the_kernel_equals_the_dequantised_product_on_cuda():
    """The backward's GEMM with the transposed weight against the same numbers in fp32: only the FP8 rounding of
    the gradient differs."""
    from trainbench.families import fp8

    torch.manual_seed(0)
    w, s = fp8.quantize_rows(torch.randn(768, 512, device="cuda"))
    grad = torch.randn(256, 768, device="cuda")
    gq, gs = fp8.quantize_rows(grad * s.t())
    got = fp8.fp8_grad_input(gq, gs, w, torch.float32)
    want = (gq.float() * gs) @ w.float()
    assert float((got - want).abs().max() / want.abs().max()) < 1e-2


def test_the_fp8_training_linear_matches_a_float64_reference_in_output_and_every_gradient_on_cuda():
    pytest.importorskip("torchao", reason="torchao is the optional extra trainbench[fp8]")
    from trainbench.families import fp8

    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.model = torch.nn.Module()
    holder.model.layers = torch.nn.ModuleList([torch.nn.Linear(1024, 2048, bias=False, device="cuda")])
    w64 = holder.model.layers[0].weight.detach().double().clone().requires_grad_(True)
    assert fp8.train_blocks_in_fp8(holder) == 1
    layer = holder.model.layers[0]
    x = torch.randn(4, 512, 1024, device="cuda", requires_grad=True)
    x64 = x.detach().double().clone().requires_grad_(True)
    dy = torch.randn(4, 512, 2048, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x)
    y.float().backward(dy)
    y64 = x64 @ w64.t()
    y64.backward(dy.double())
    rel = lambda a, b: float((a.double() - b).norm() / b.norm())  # noqa: E731
    assert rel(y, y64) < 0.05, rel(y, y64)  # e4m3 inputs and weight
    assert rel(x.grad, x64.grad) < 0.1, rel(x.grad, x64.grad)  # e5m2 output gradient
    assert rel(layer.weight.grad, w64.grad) < 0.1, rel(layer.weight.grad, w64.grad)
    assert layer.weight.grad.dtype == torch.float32  # the master weight and its gradient keep their precision


def test_fp8_weights_cast_once_a_step_follow_every_optimizer_step_compiled_on_cuda():
    """fp8.cast_weights_once_a_step (one unsharded rank): compiled layers of torchao's float8 training, over 3 steps
    of 2 micro-batches with the fused AdamW, give the outputs and gradients of the same layers casting their weights
    in every call, within FP8's rounding (the compiled per-call casts may round a scale's product otherwise), their
    gradients added into fp32 by the compiled one-pass add; a step left stale (no after_step) does not match."""
    pytest.importorskip("torchao", reason="torchao is the optional extra trainbench[fp8]")

    def train(once: bool, stale_step: int | None = None) -> list[torch.Tensor]:
        return train_float8_layers(once, stale_step, device="cuda", width=256, compiled=True)

    def worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
        return max(float((x - y).norm() / y.norm()) for x, y in zip(a, b, strict=True))

    per_call, once = train(False), train(True)
    assert worst(once, per_call) < 1e-2
    assert worst(train(True, stale_step=0), per_call) > 0.1


def test_the_weights_compiled_cast_once_a_step_is_torchaos_cast_bit_for_bit_on_cuda():
    """fp8._weight_cast compiled (one graph for every size): torchao's eager cast of the transposed weight, the same
    scale and bytes in the same strides, for weights of several sizes (one of them not a multiple of the compiled
    kernels' blocks), each with an outlier that sets its scale."""
    pytest.importorskip("torchao", reason="torchao is the optional extra trainbench[fp8]")
    from trainbench.families import fp8

    for width in (64, 256, 1040):
        for layer in float8_layers("cuda", width).model.layers:
            with torch.no_grad():
                layer.weight[0, 0] = 1e4
            mine, theirs = fp8._weight_cast(layer, compiled=True), torchao_weight_cast(layer)
            assert mine._data.stride() == theirs._data.stride() and torch.equal(mine._scale, theirs._scale)
            assert torch.equal(mine._data.view(torch.uint8), theirs._data.view(torch.uint8)), width


@pytest.mark.parametrize("g", [1.0 / 3, -2.0])
def test_the_fp8_output_kernels_compute_the_cpus_values_and_the_loss_follows_bf16_on_cuda(g, monkeypatch):
    """fp8_output's Triton kernels against the same functions on the CPU (torch's operations), at a vocabulary and a
    row count that are not multiples of the tiles: each row's log-sum-exp and term within fp32's rounding of exp;
    the logits' gradient in e5m2 the same bytes but where exp's last bit moved a value across a rounding boundary
    (one step of e5m2 then), its transposed copy the same bytes, also written into a column slice of a larger
    tensor; and the whole function, in chunks of 512 rows (the last one 16), its loss and gradients against bf16's
    products within FP8's rounding, for a negative loss gradient too."""
    from trainbench.families.decoder import fp8_output

    rows, width, vocab = 1040, 256, 1008
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, width, generator=gen).to(torch.bfloat16)
    weight = torch.randn(vocab, width, generator=gen) * 0.2
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[::7] = fp8_output.IGNORE
    logits = (hidden.float() @ weight.t()).to(torch.bfloat16)
    lse, terms = fp8_output.rows_lse(logits.cuda(), targets.cuda())
    lse_cpu, terms_cpu = fp8_output.rows_lse(logits, targets)
    assert torch.allclose(lse.cpu(), lse_cpu, atol=1e-5) and torch.allclose(terms.cpu(), terms_cpu, atol=1e-5)
    q, q_t = fp8_output.grad_casts(logits.cuda(), lse, targets.cuda())
    q_cpu, _ = fp8_output.grad_casts(logits, lse_cpu, targets)
    assert torch.equal(q_t.view(torch.uint8), q.t().contiguous().view(torch.uint8))
    wide = torch.zeros(vocab, rows + 64, dtype=torch.float8_e5m2, device="cuda")
    fp8_output.grad_casts(logits.cuda(), lse, targets.cuda(), wide[:, 32 : 32 + rows])
    assert torch.equal(wide[:, 32 : 32 + rows].view(torch.uint8), q_t.view(torch.uint8))
    assert wide[:, :32].float().abs().sum() == 0 and wide[:, 32 + rows :].float().abs().sum() == 0
    steps = (q.cpu().view(torch.uint8).int() - q_cpu.view(torch.uint8).int()).abs()
    assert steps.max() <= 1 and (steps > 0).float().mean() < 1e-3, (steps > 0).float().mean()
    monkeypatch.setattr(fp8_output, "CHUNK_ROWS", 512)
    head = torch.nn.Linear(width, vocab, bias=False, device="cuda")
    with torch.no_grad():
        head.weight.copy_(weight)
    h = hidden.cuda().requires_grad_()
    loss = fp8_output.lm_loss_fp8(h[None], head, targets.cuda()[None])
    loss.backward(torch.tensor(g, device="cuda"))
    h_ref, w_ref = hidden.cuda().requires_grad_(), weight.cuda().to(torch.bfloat16).requires_grad_()
    ref = torch.nn.functional.cross_entropy((h_ref @ w_ref.t()).float(), targets.cuda(), reduction="sum")
    (ref * g).backward()
    assert loss.item() == pytest.approx(ref.item(), rel=2e-3)
    for got, want in ((h.grad, h_ref.grad), (head.weight.grad, w_ref.grad)):
        rel = float((got.float() - want.float()).norm() / want.float().norm())
        assert 1e-4 < rel < 0.06, rel


def test_the_cast_transpose_kernel_equals_its_torch_form_bit_for_bit_on_cuda():
    """fp8.cast_transpose_e4m3: the Triton kernel's e4m3 bytes equal torch's divide, clamp, cast and transpose (the
    CPU's form), on shapes that are not multiples of its tiles and with values beyond e4m3's range (clamped)."""
    from trainbench.families.fp8 import cast_transpose_e4m3

    torch.manual_seed(0)
    for rows, cols in ((1000, 72), (130, 2880), (64, 64)):
        t = (torch.randn(rows, cols, device="cuda") * 200).bfloat16()
        divisors = torch.exp2(torch.randint(-3, 4, (rows,), device="cuda").float())
        got = cast_transpose_e4m3(t, divisors)
        want = cast_transpose_e4m3(t.cpu(), divisors.cpu())
        assert got.shape == (cols, rows) and got.is_contiguous()
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
