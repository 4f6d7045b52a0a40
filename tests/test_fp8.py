"""The FP8 base's pieces on the CPU: the SwiGLU whose backward reads FP8 copies of its inputs against the plain one,
and the transpose's fallback."""

from __future__ import annotations

import torch
from conftest import float8_layers, train_float8_layers

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
    per_call, once = train_float8_layers(False), train_float8_layers(True)
    assert len(once) == len(per_call) == 3 * (2 + 3)  # a step: 2 outputs, 3 gradients (a bias, two weights)
    for got, want in zip(once, per_call, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert added == [(torch.float32, torch.bfloat16, True)] * (3 * 2)  # 3 steps x 2 weights x (2 - 1) micro-batches
    stale = train_float8_layers(True, stale_step=0)
    assert not all(torch.equal(a, b) for a, b in zip(stale, per_call, strict=True))


def test_float8_weights_cast_once_a_step_add_each_layers_gradient_as_the_backward_leaves_the_layer():
    """fp8.cast_weights_once_a_step hands each layer its cast as a leaf of its own (fp8.grad_leaf): the later layer's
    weight gradient is in its fp32 ``.grad`` before the backward reaches the earlier layer, in each micro-batch, so no
    layer's bf16 gradient is held to the end of the whole backward (a node made before the first layer, as by the
    model's pre-hook, runs only then: what this would catch)."""
    root = float8_layers()
    assert fp8.cast_weights_once_a_step(root, compiled=False) is not None
    first, second = root.model.layers
    seen = []

    def watch(module, args, out: torch.Tensor) -> None:  # when the gradient reaches the first layer's output
        out.register_hook(lambda grad: seen.append((second.weight.grad is not None, first.weight.grad is not None)))

    first.register_forward_hook(watch)
    for _ in range(2):
        root(torch.randn(4, 128, 64, dtype=torch.bfloat16)).float().square().mean().backward()
    assert seen == [(True, False), (True, True)]
    assert all(p.grad.dtype == torch.float32 for p in root.parameters())


def test_the_output_layer_in_fp8_swaps_lm_head_and_its_loss_follows_the_unswapped_within_fp8_rounding():
    """model.output_precision=fp8: the tiny decoder's output layer becomes torchao's float8 layer beside the blocks'
    (the embedding stays); the loss through it is the unswapped model's within FP8's rounding, and not that of the
    model with only its blocks in FP8; its weight gradient too; the weight is cast once a step as the blocks' are
    (its gradient added into fp32, as theirs); the console's line says which side the output layer is on."""
    from trainbench.distributed import Placed
    from trainbench.launch.local import build_config
    from trainbench.models.decoder import DecoderLM

    _, cfg = build_config("llama31_8b", "tiny")
    torch.manual_seed(0)
    ref = DecoderLM(cfg.model)
    model = DecoderLM(cfg.model)
    model.load_state_dict(ref.state_dict())
    blocks_only = DecoderLM(cfg.model)
    blocks_only.load_state_dict(ref.state_dict())
    swapped = fp8.train_blocks_in_fp8(blocks_only)
    assert fp8.train_blocks_in_fp8(model, in_blocks=fp8.in_decoder_blocks_or_output) == swapped + 1
    assert type(model.lm_head).__name__ == "Float8Linear" and type(model.model.embed_tokens) is torch.nn.Embedding
    assert fp8.cast_weights_once_a_step(model, compiled=False) is not None
    ids = torch.randint(0, cfg.model.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    losses = []
    for m in (ref, model, blocks_only):
        loss = m(ids[:, :-1], targets=ids[:, 1:])
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[1] - losses[0]) / losses[0] < 1e-3, losses
    assert losses[1] != losses[2]  # the output layer's FP8 products did run
    assert getattr(model.lm_head, "_trainbench_weight_t", None) is not None  # cast once a step, as the blocks'
    got, want = model.lm_head.weight.grad, ref.lm_head.weight.grad
    assert got.dtype == torch.float32
    rel = float((got - want).norm() / want.norm())
    assert 1e-4 < rel < 0.08, rel
    for m, line in ((model, f"{swapped} linear layers of the blocks and the output layer train in FP8"),
                    (blocks_only, f"{swapped} linear layers of the blocks train in FP8")):  # fmt: skip
        placed = Placed(module=m, model=m, comm_precision="bf16")
        fp8.finish_placement(placed, False, "the embedding")  # the console's line names the output layer's side
        after = "the embedding as before" if m is model else "the output layer and the embedding as before"
        assert placed.notes[0].startswith(line) and placed.notes[0].endswith(f"; {after}"), placed.notes
