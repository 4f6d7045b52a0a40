"""The FP8 base's pieces on the CPU: the SwiGLU whose backward reads FP8 copies of its inputs against the plain one,
and the transpose's fallback."""

from __future__ import annotations

import pytest
import torch
from conftest import float8_layers, torchao_weight_cast, train_float8_layers

from trainbench.families import fp8
from trainbench.families.decoder.model import silu_mul


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


def test_the_output_layer_in_fp8_follows_the_unswapped_loss_within_fp8_rounding():
    """model.output_precision=fp8: the tiny decoder (blocks in torchao's FP8) computes its loss through the output
    layer's own FP8 function (fp8_output.lm_loss_fp8); the loss is the unswapped model's within FP8's rounding, and
    not that of the model with only its blocks in FP8; its fp32 weight gradient too; the weight is cast once a step
    (the same casts for a step's two micro-batches, new ones after the step); the console's line says which side the
    output layer is on."""
    from trainbench.distributed import Placed
    from trainbench.families.decoder import fp8_output
    from trainbench.families.decoder.model import DecoderLM
    from trainbench.resolve import build_config

    _, cfg = build_config("llama31_8b", "tiny")
    torch.manual_seed(0)
    ref = DecoderLM(cfg.model)
    model, blocks_only = DecoderLM(cfg.model), DecoderLM(cfg.model)
    for m in (model, blocks_only):
        m.load_state_dict(ref.state_dict())
        swapped = fp8.train_blocks_in_fp8(m)
    model.loss_fn = fp8_output.lm_loss_fp8
    after_step = fp8_output.cache_output_casts(model)
    assert type(model.lm_head) is torch.nn.Linear and type(model.model.embed_tokens) is torch.nn.Embedding
    ids = torch.randint(0, cfg.model.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    losses, casts = [], []
    for m in (ref, model, blocks_only):
        loss = m(ids[:, :-1], targets=ids[:, 1:])
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[1] - losses[0]) / losses[0] < 1e-3, losses
    assert losses[1] != losses[2]  # the output layer's FP8 products did run
    got, want = model.lm_head.weight.grad, ref.lm_head.weight.grad
    assert got.dtype == torch.float32
    rel = float((got - want).norm() / want.norm())
    assert 1e-4 < rel < 0.08, rel
    casts.append(model.lm_head._fp8_casts)
    model(ids[:, :-1], targets=ids[:, 1:])  # the step's second micro-batch: the same casts
    casts.append(model.lm_head._fp8_casts)
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)
    after_step()
    model(ids[:, :-1], targets=ids[:, 1:])
    assert casts[1] is casts[0] and model.lm_head._fp8_casts is not casts[0]
    assert torch.equal(model.lm_head._fp8_casts[2], 2 * casts[0][2])  # cast anew from the stepped weight
    for m, also in ((model, ", the output layer and its loss too"), (blocks_only, "")):
        placed = Placed(module=m, model=m, comm_precision="bf16")
        fp8.finish_placement(placed, False, "the embedding")  # the console's line names the output layer's side
        after = "the embedding as before" if m is model else "the output layer and the embedding as before"
        line = f"{swapped} linear layers of the blocks train in FP8 (torchao's float8 training, tensorwise scales)"
        assert placed.notes[0].startswith(line + also) and placed.notes[0].endswith(f"; {after}"), placed.notes


def test_the_optimizers_own_kernel_is_handed_an_fp8_gathered_weights_memory_never_its_wrapper():
    """Under FSDP2 with the weights gathered in FP8, a weight's shard is torchao's wrapper subclass, whose own data
    pointer is 0; optim/adamw hands ``tb_adamw`` the tensor inside it (the same memory), and refuses a wrapper of
    several same-shaped tensors rather than guess."""
    import pytest

    pytest.importorskip("torchao", reason="torchao is the optional extra trainbench[fp8]")
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from trainbench.optim.adamw import _memory

    inner = torch.randn(8, 16)
    wrapped = WeightWithDynamicFloat8CastTensor(inner, LinearMMConfig(), torch.float8_e4m3fn, torch.ones(()))
    assert wrapped.data_ptr() == 0  # what a kernel handed the wrapper would write through
    assert _memory(wrapped) is inner and _memory(inner) is inner
    twice = torch.nn.Parameter(wrapped)  # (a parameter of it, as FSDP2 holds it)
    assert _memory(twice).data_ptr() == inner.data_ptr()

    class Pair(WeightWithDynamicFloat8CastTensor):  # two inner tensors of the wrapper's shape: which one is not known
        def __tensor_flatten__(self):
            return ["_tensor", "_other"], {}

    pair = Pair(inner, LinearMMConfig(), torch.float8_e4m3fn)
    pair._other = inner.clone()
    assert _memory(pair) is None


def test_the_weights_cast_once_a_step_are_torchaos_cast_bit_for_bit_in_its_layout():
    """fp8._weight_cast reads the weight in its own order and transposes the result as a view: the same scale and
    bytes as torchao's cast of the transposed weight, in the same strides, reporting bf16; a weight changed after
    the cast would not match (what the comparison would catch)."""
    pytest.importorskip("torchao", reason="torchao is the optional extra trainbench[fp8]")
    for layer in float8_layers("cpu", 48).model.layers:
        mine, theirs = fp8._weight_cast(layer), torchao_weight_cast(layer)
        assert mine.dtype == torch.bfloat16 and mine.shape == theirs.shape == layer.weight.t().shape
        assert mine._data.stride() == theirs._data.stride() and torch.equal(mine._scale, theirs._scale)
        assert torch.equal(mine._data.view(torch.uint8), theirs._data.view(torch.uint8))
        with torch.no_grad():
            layer.weight.add_(0.01)
        assert not torch.equal(fp8._weight_cast(layer)._data.view(torch.uint8), theirs._data.view(torch.uint8))


def test_what_runs_after_each_step_runs_in_the_order_it_was_added():
    """Placed.also_after_step, which the placements use to add the FP8 casts' bookkeeping after each optimizer step:
    every function added runs once a step, in the order added; None adds nothing."""
    from trainbench.distributed import Placed

    ran = []
    placed = Placed(module=torch.nn.Linear(1, 1), model=None)
    placed.also_after_step(None)
    assert placed.after_step is None
    for name in ("scales", "casts", "output"):
        placed.also_after_step(lambda name=name: ran.append(name))
        placed.also_after_step(None)
    placed.after_step()
    placed.after_step()
    assert ran == ["scales", "casts", "output"] * 2
