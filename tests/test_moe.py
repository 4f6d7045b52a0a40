"""The mixture-of-experts layer (families/decoder/moe.py): GPT-OSS's block against `transformers`' GptOssMLP with the
same weights, the reference's SiLU experts against a dense computation of every expert, gradients included; the
load-balancing loss."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from conftest import spawned

from trainbench.families.decoder.glu_kernel import BiasGLU, glu, glu_backward
from trainbench.families.decoder.moe import MoE, MoEShape, load_balancing_loss, route
from trainbench.families.decoder.moe_fp8 import fp8_products


def _random(module: torch.nn.Module) -> None:
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.2)


def _layer_results(shape: MoEShape, seed: int, tokens: int, setup) -> list[torch.Tensor]:
    """The layer in float64 (random weights from ``seed``, then ``setup(layer)``) on ``tokens`` random rows: its
    output, the input's gradient and every parameter's, under a fixed linear loss."""
    torch.manual_seed(seed)
    layer = MoE(shape).double()
    _random(layer)
    setup(layer)
    x = torch.randn(tokens, shape.hidden, dtype=torch.float64, requires_grad=True)
    out, _ = layer(x)
    (out * torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)).sum().backward()
    return [out.detach(), x.grad] + [p.grad for p in layer.parameters()]


def test_gpt_oss_experts_match_transformers_gpt_oss_mlp_with_gradients():
    transformers = pytest.importorskip("transformers", reason="transformers is the optional extra trainbench[test]")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(hidden_size=64, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)
    hf = GptOssMLP(cfg).double()
    _random(hf)
    ours = MoE(MoEShape(hidden=64, ffn=48, experts=8, top_k=2, activation="gpt_oss", bias=True)).double()
    with torch.no_grad():  # the same names and layouts as transformers' (a GPT-OSS checkpoint loads as it is)
        for name in ("router.weight", "router.bias"):
            ours.get_parameter(name).copy_(hf.get_parameter(name))
        for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            ours.get_parameter(name).copy_(hf.get_parameter(f"experts.{name}"))
    x = torch.randn(3, 17, 64, dtype=torch.float64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    a, _ = hf(xa)
    b, logits = ours(xb)
    assert logits.shape == (51, 8)
    assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    a.square().sum().backward()
    b.square().sum().backward()
    assert torch.allclose(xa.grad, xb.grad, rtol=1e-10, atol=1e-10)
    assert torch.allclose(hf.experts.gate_up_proj.grad, ours.gate_up_proj.grad, rtol=1e-10, atol=1e-10)
    assert torch.allclose(hf.router.weight.grad, ours.router.weight.grad, rtol=1e-10, atol=1e-10)


def test_the_reference_silu_experts_match_every_expert_computed_densely():
    """No biases, SiLU SwiGLU, softmax after top-k: against all experts run on all tokens and the chosen ones'
    outputs mixed by the router's weights; an expert no token chose still gets a (zero) gradient."""
    torch.manual_seed(1)
    shape = MoEShape(hidden=32, ffn=24, experts=6, top_k=3)
    ours = MoE(shape).double()
    _random(ours)
    x = torch.randn(40, 32, dtype=torch.float64)
    out, logits = ours(x)
    weights, experts = route(logits, 3)
    gate_up = torch.einsum("th,ehf->tef", x, ours.gate_up_proj)
    every = torch.einsum("tef,efh->teh", torch.nn.functional.silu(gate_up[..., ::2]) * gate_up[..., 1::2],
                         ours.down_proj)  # fmt: skip
    dense = (every.gather(1, experts[..., None].expand(-1, -1, 32)) * weights[..., None]).sum(1)
    assert torch.allclose(out, dense, rtol=1e-12, atol=1e-12)
    assert ours.gate_up_proj_bias is None and ours.router.bias is None
    out.sum().backward()
    assert ours.down_proj.grad.shape == ours.down_proj.shape


def test_the_load_balancing_loss_is_one_when_balanced_and_grows_when_not():
    balanced = torch.eye(4) * 1e-3  # each token leans to another expert, the probabilities nearly uniform
    assert load_balancing_loss(balanced, 1).item() == pytest.approx(1.0, abs=1e-2)
    skewed = torch.zeros(4, 4)
    skewed[:, 0] = 5.0  # every token to expert 0, with most of the probability
    assert load_balancing_loss(skewed, 1).item() > 3.5


@pytest.mark.parametrize("activation, bias", [("silu", False), ("gpt_oss", True)])
@pytest.mark.parametrize("align", [1, 16])
def test_rows_dispatched_and_combined_by_gathers_equal_indexing_and_index_add(activation, bias, align):
    """The CUDA path's gathers (no atomic scatter either way) against the indexing and index_add_ the CPU takes:
    the same output and the same gradients of the input, the router and the experts. ``align`` 16: each expert's
    rows padded with zero rows to a multiple of 16, as FP8's grouped product needs (the padding reaches no token's
    output and no weight's gradient)."""
    shape = MoEShape(hidden=32, ffn=24, experts=6, top_k=3, activation=activation, bias=bias)

    def path(gather):
        def setup(layer):
            layer.gather_rows = gather
            layer.align_rows = align if gather else 1

        return setup

    results = [_layer_results(shape, 2, 50, path(gather)) for gather in (False, True)]
    for a, b in zip(*results, strict=True):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def _glu_reference_gradient(h, bias, group, grad, activation):
    """``h``'s gradient by autograd through the activation's tensor operations (what the CPU runs)."""
    h = h.detach().clone().requires_grad_()
    x = h if bias is None else h + bias[group]
    (glu(x, activation, 1.702, 7.0) * grad).sum().backward()
    return h.grad


@pytest.mark.parametrize("activation", ["silu", "gpt_oss"])
@pytest.mark.parametrize("bias", [False, True])
def test_the_activation_backward_as_one_op_equals_autograd_at_and_beyond_the_clamp(activation, bias):
    """``glu_backward`` (off CUDA: its torch form, the formula the CUDA kernel computes) against autograd of the
    activation in float64: values on both sides of GPT-OSS's clamps at +-7 and exactly on them, with each row's
    expert's bias added."""
    torch.manual_seed(0)
    rows, ffn, experts = 12, 8, 3
    h = torch.randn(rows, 2 * ffn, dtype=torch.float64) * 6
    h[0, :8] = torch.tensor([7.0, 7.0, -7.0, -7.0, 7.5, -7.5, 6.99, 7.01], dtype=torch.float64)
    grad = torch.randn(rows, ffn, dtype=torch.float64)
    b = torch.randn(experts, 2 * ffn, dtype=torch.float64) if bias else None
    group = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2]) if bias else None
    if bias:
        b[0, :8] = 0.0  # row 0's values stay exactly on the clamps
    ours = glu_backward(h, b, group, grad, activation, 1.702, 7.0)
    assert torch.allclose(ours, _glu_reference_gradient(h, b, group, grad, activation), rtol=1e-12, atol=1e-12)
    if activation == "gpt_oss":  # (gate, up) pairs: the clamps cut the gradient of a gate above 7 and of an up
        # outside [-7, 7], and pass it on the bounds themselves
        assert [ours[0, i].item() == 0 for i in range(8)] == [False, False, False, False, True, True, False, True]


@pytest.mark.parametrize("activation, bias", [("silu", False), ("gpt_oss", True)])
def test_the_experts_with_the_activation_backward_as_one_op_equal_autograd(activation, bias):
    """The layer with BiasGLU as its ``biased_activation`` (the CUDA placement's: one op for the activation's
    backward, the first bias's gradient by a product) against autograd of the tensor operations: outputs and every
    gradient, in float64, the weights large enough that GPT-OSS's clamps cut some rows."""
    shape = MoEShape(hidden=32, ffn=24, experts=6, top_k=3, activation=activation, bias=bias)

    def path(kernel):
        def setup(layer):
            with torch.no_grad():
                layer.gate_up_proj.mul_(10)
            layer.biased_activation = BiasGLU.apply if kernel else None

        return setup

    results = [_layer_results(shape, 4, 40, path(kernel)) for kernel in (False, True)]
    for a, b in zip(*results, strict=True):
        assert torch.allclose(a, b, rtol=1e-11, atol=1e-11)


@contextlib.contextmanager
def _gloo_rank(rank: int, world: int, port: int):
    """This process as one of ``world`` gloo ranks meeting at ``port``, one CPU thread; the process group shut down
    after, drained only if the body returned, and the process left."""
    import os

    import torch.distributed as dist

    from trainbench.distributed import leave, shutdown

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    finished = False
    try:
        yield
        finished = True
    finally:
        shutdown(drain=finished)
    leave(0)


def _on_gloo_ranks(rank: int, world: int, port: int, body, case=None) -> None:
    """``body(layer, x, direction)`` on one of ``world`` gloo ranks (:func:`_gloo_rank`), with the layer of ``case()``
    (default :func:`_expert_parallel_case`; a module holding several layers too) and the experts of every layer in it
    spread over the ranks."""
    from trainbench.families.decoder.placement import apply_expert_parallel

    with _gloo_rank(rank, world, port):
        layer, x, direction = (case or _expert_parallel_case)()
        apply_expert_parallel(torch.nn.Sequential(layer), "cpu", world, world)
        body(layer, x, direction)


def _expert_parallel_worker(rank, world, port, align, out):
    """One rank of two: the layer of ``test_rows_padded_per_expert_under_expert_parallelism_...``, its experts
    spread over the ranks, each rank's half of the tokens; rank 0 writes the outputs and gradients gathered."""
    import torch.distributed as dist

    def body(layer, x, direction):
        layer.gather_rows, layer.align_rows = True, align
        mine = x.chunk(world)[rank].clone().requires_grad_()
        result, _ = layer(mine)
        (result * direction.chunk(world)[rank]).sum().backward()

        def gathered(t):
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t.contiguous())
            return torch.cat(parts)

        router = layer.router.weight.grad.clone()
        dist.all_reduce(router)  # each rank's router saw its own tokens
        # each rank's experts' gradients were scaled by 1 / ranks (the loop scales each rank's loss by the ranks)
        experts = [gathered(layer.get_parameter(n).grad.to_local()) * world for n in _EXPERT_TENSORS]
        everything = [gathered(result.detach()), gathered(mine.grad), router, *experts]  # collectives: every rank
        if rank == 0:
            torch.save(everything, out)

    _on_gloo_ranks(rank, world, port, body)


_EXPERT_TENSORS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


def _expert_parallel_case():
    shape = MoEShape(hidden=32, ffn=24, experts=6, top_k=3, activation="gpt_oss", bias=True)
    torch.manual_seed(3)
    layer = MoE(shape).double()
    _random(layer)
    x = torch.randn(60, 32, dtype=torch.float64)
    return layer, x, torch.linspace(-1, 1, x.numel(), dtype=torch.float64).view_as(x)


def test_rows_padded_per_expert_under_expert_parallelism_give_the_one_rank_layer(tmp_path):
    """Expert parallelism over 2 gloo ranks (3 experts each, all-to-all) with each expert's arriving rows padded to
    a multiple of 16 (as the experts' FP8 grouped product needs) against the layer on one rank, unpadded, in
    float64: the same outputs, input gradients, router and expert gradients (biases included)."""
    layer, x, direction = _expert_parallel_case()
    x.requires_grad_()
    want, _ = layer(x)
    (want * direction).sum().backward()
    want = [want.detach(), x.grad, layer.router.weight.grad] + [layer.get_parameter(n).grad for n in _EXPERT_TENSORS]
    out = tmp_path / "ep.pt"
    spawned(_expert_parallel_worker, 2, 16, str(out))
    got = torch.load(out)
    for name, g, w in zip(["output", "input", "router", *_EXPERT_TENSORS], got, want, strict=True):
        assert torch.allclose(g, w, rtol=1e-12, atol=1e-12), name


def _compiled_expert_parallel_worker(rank: int, world: int, port: int, out: str) -> None:
    """The padded expert-parallel layer compiled as a block is (``Module.compile``, fixed shapes), 6 calls on new
    tokens each (each rank's arriving rows, and each expert's, change every call); rank 0 writes what dynamo
    compiled."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import counters

    def body(layer, x, direction):
        layer.gather_rows, layer.align_rows = True, 16
        layer.compile(dynamic=False, backend="eager")
        g = torch.Generator().manual_seed(rank)
        for _ in range(6):
            x = torch.randn(30, 32, dtype=torch.float64, generator=g, requires_grad=True)
            result, _ = layer(x)
            result.sum().backward()
        if rank == 0:
            entries = len(_debug_get_cache_entry_list(MoE._experts_parallel.__code__))
            torch.save({"entries": entries, "graphs": counters["stats"]["unique_graphs"]}, out)

    _on_gloo_ranks(rank, world, port, body)


def test_the_expert_parallel_dispatch_is_not_compiled_for_each_call_s_row_counts(tmp_path):
    """Under expert parallelism the rows a rank receives, and each expert's, are known only on the host and change
    every call; compiled for fixed shapes, the dispatch was compiled anew for each call until dynamo's limit (the
    FP8 experts' padded layout each time, slow enough that a tiny run on 2 GPUs did not finish in 200 s). It runs
    uncompiled from the first call: the block's graphs before and after it are compiled once."""
    out = tmp_path / "compiled.pt"
    spawned(_compiled_expert_parallel_worker, 2, str(out))
    got = torch.load(out)
    assert got["entries"] == 0, got
    assert got["graphs"] <= 4, got  # before: 63 graphs, the dispatch compiled for each call


def _scaled_grouped_mm_on_cpu(a, b, scale_a, scale_b, offs=None, out_dtype=None, use_fast_accum=False):
    """torch's FP8 grouped product (CUDA only) in float32 on the CPU, to the same contract: ``a`` [rows, k] grouped
    by rows times ``b`` [groups, k, n] (scales per row of ``a``, per group's output column of ``b``), or ``a`` [m, K]
    times ``b`` [K, n] grouped along K into [groups, m, n] (scales per group's row and column)."""
    ends = offs.tolist()
    spans = list(zip([0, *ends[:-1]], ends, strict=True))
    a, b, scale_a, scale_b = a.float(), b.float(), scale_a.float(), scale_b.float()
    if b.dim() == 3:
        a, b = a * scale_a[:, None], b * scale_b.view(len(ends), 1, -1)
        out = torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(spans)])
    else:
        sa, sb = scale_a.view(len(ends), -1, 1), scale_b.view(len(ends), 1, -1)
        out = torch.stack([(a[:, s:e] @ b[s:e]) * sa[g] * sb[g] for g, (s, e) in enumerate(spans)])
    return out.to(out_dtype)


def _two_fp8_expert_layers():
    """Two copies of :func:`_expert_parallel_case`'s layer in float32, its experts in FP8 (each expert's rows padded
    to 16, the weights' gradient in FP8 too), and bf16 rows, as autocast hands them."""
    layer, x, direction = _expert_parallel_case()
    pair = torch.nn.ModuleList([layer.float(), copy.deepcopy(layer.float())])
    for m in pair:
        m.gather_rows = True
        fp8_products(m, weight_grad="fp8")
    return pair, x.to(torch.bfloat16), direction.float()


def _cached_casts_worker(rank: int, world: int, port: int, out: str) -> None:
    """One rank of two: the same FP8 expert-parallel layer with and without cache_fp8_weight_casts, 2 steps of 2
    micro-batches of this rank's tokens each, a sign-descent step between; rank 0 writes what it saw."""
    from trainbench.families.decoder import moe_fp8 as moe

    def body(pair, x, direction):
        torch._scaled_grouped_mm = _scaled_grouped_mm_on_cpu
        casts = {"forward": 0, "input_grad": 0}

        def counted(cast, key):
            def call(w):
                casts[key] += 1
                return cast(w)

            return call

        moe._weight_for_forward = counted(moe._weight_for_forward, "forward")
        moe._weight_for_input_grad = counted(moe._weight_for_input_grad, "input_grad")
        uncached, cached = pair[0], torch.nn.Sequential(pair[1])
        after_step = moe.cache_fp8_weight_casts(cached, compiled=False)
        mine = [t.chunk(world)[rank].chunk(2) for t in (x, direction)]
        seen = {"equal": [], "casts": []}
        for _ in range(2):
            results = []
            for model in (uncached, cached):
                casts.update(forward=0, input_grad=0)
                outs = []
                for micro, d in zip(*mine, strict=True):
                    result, _ = model(micro)
                    (result.float() * d).sum().backward()
                    outs.append(result.detach())
                params = list(model.parameters())
                results.append(outs + [getattr(p.grad, "_local_tensor", p.grad).clone() for p in params])
                seen["casts"].append(dict(casts))
                with torch.no_grad():  # a step: every weight moves
                    for p in params:
                        p.sub_(1e-2 * p.grad.sign())
                model.zero_grad()
            after_step()
            seen["equal"].append([torch.equal(a, b) for a, b in zip(*results, strict=True)])
        seen["buffers"] = sorted(k for k in pair[1]._buffers if k.startswith("_fp8_"))
        seen["cast_shape"] = tuple(pair[1]._buffers["_fp8_gate_up_proj_0"].shape)
        if rank == 0:
            torch.save(seen, out)

    _on_gloo_ranks(rank, world, port, body, case=_two_fp8_expert_layers)


def test_under_expert_parallelism_each_rank_casts_its_share_of_the_fp8_experts_once_a_step(tmp_path):
    """cache_fp8_weight_casts with the experts spread over 2 gloo ranks (each rank's share a DTensor that FSDP2
    leaves alone): each rank casts its own share once a step, for the forward and for the input's gradient, instead
    of in each micro-batch's forward and backward (2 micro-batches: 4 casts of each kind become 2), and the outputs and
    every gradient equal the uncached layer's bit for bit, also after a step has moved the weights (torch's FP8
    grouped product stood in for on the CPU)."""
    out = tmp_path / "cached.pt"
    spawned(_cached_casts_worker, 2, str(out))
    seen = torch.load(out)
    assert seen["casts"] == [{"forward": 4, "input_grad": 4}, {"forward": 2, "input_grad": 2}] * 2, seen["casts"]
    for equal in seen["equal"]:
        assert equal and all(equal), seen["equal"]
    assert seen["buffers"] == [f"_fp8_{n}_{i}" for n in ("down_proj", "gate_up_proj") for i in range(4)]
    assert seen["cast_shape"] == (3, 32, 48)  # this rank's 3 of the 6 experts


def test_rows_sent_in_e4m3_arrive_as_the_grouped_product_casts_them():
    """moe_fp8's wire format: a row's e4m3 values and its scale's exponent (one byte) are _e4m3's of the row, and the
    row rebuilt from them, cast again as the grouped product casts its rows, gives the same values with the same
    scale or each doubled with the scale halved (a row whose largest magnitude rounded down to 224): the same
    products. Rows from 2**-40 to 2**40 in magnitude, a zero row, one whose largest value rounds to 224."""
    from trainbench.families.decoder.moe_fp8 import _e4m3, _e4m3_with_exponent, _from_e4m3

    torch.manual_seed(0)
    rows = torch.randn(83, 64) * torch.exp2(torch.arange(-40, 43, dtype=torch.float32))[:, None]
    rows[3] = 0
    rows[5] = torch.linspace(-1, 1, 64) * 225 / 256  # the largest scaled by 256 to 225, which rounds to 224
    for dtype in (torch.bfloat16, torch.float32):
        t = rows.to(dtype)
        q, exponent = _e4m3_with_exponent(t)
        want_q, want_recip = _e4m3(t, -1)
        assert exponent.dtype == torch.int8 and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(torch.exp2(exponent.float()), want_recip)
        back = _from_e4m3(q, exponent, dtype)
        assert back.dtype == dtype and torch.equal(back, (want_q.float() * want_recip[:, None]).to(dtype))
        again, recip = _e4m3(back, -1)
        ratio = recip / want_recip  # 1, or 1/2 where the values doubled
        assert set(ratio.tolist()) <= {1.0, 0.5} and ratio[5] == 0.5, ratio
        assert torch.equal(again.float() * recip[:, None], want_q.float() * want_recip[:, None])


class _GradRoundedToE4M3(torch.autograd.Function):
    """The identity whose backward rounds the gradient's rows to e4m3 with a power-of-two scale a row, as moe_fp8's
    wire carries them."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        from trainbench.families.decoder.moe_fp8 import _e4m3_with_exponent, _from_e4m3

        return _from_e4m3(*_e4m3_with_exponent(grad), grad.dtype)


def _three_fp8_expert_layers():
    """:func:`_two_fp8_expert_layers` and a third copy."""
    pair, x, direction = _two_fp8_expert_layers()
    return torch.nn.ModuleList([*pair, copy.deepcopy(pair[0])]), x, direction


def _wire_worker(rank: int, world: int, port: int, out: str) -> None:
    """One rank of two: the FP8 expert-parallel layer with bf16 on the wire, with ``exchange_in_fp8``, and with bf16
    on the wire but the outputs' gradients rounded to e4m3 as they arrive at the experts, each rank's half of the
    tokens (torch's FP8 grouped product stood in for on the CPU); each rank writes what the three gave and the
    dtypes moe_fp8's all-to-alls carried."""
    from trainbench.families.decoder import moe_fp8 as moe

    def body(layers, x, direction):
        torch._scaled_grouped_mm = _scaled_grouped_mm_on_cpu
        carried = []
        exchange = moe.exchange_rows
        moe.exchange_rows = lambda t, *args: carried.append(t.dtype) or exchange(t, *args)
        moe.exchange_in_fp8(layers[1])
        layers[2].from_experts = lambda rows, *args: MoE.from_experts(_GradRoundedToE4M3.apply(rows), *args)
        mine, d = x.chunk(world)[rank].clone(), direction.chunk(world)[rank]
        results = []
        for layer in layers:
            carried.append(None)
            rows = mine.clone().requires_grad_()
            result, _ = layer(rows)
            (result.float() * d).sum().backward()
            grads = {n: getattr(p.grad, "_local_tensor", p.grad).clone() for n, p in layer.named_parameters()}
            results.append({"output": result.detach(), "input": rows.grad, **grads})
        torch.save({"results": results, "carried": carried}, f"{out}.{rank}")

    _on_gloo_ranks(rank, world, port, body, case=_three_fp8_expert_layers)


def test_fp8_on_the_wire_keeps_the_forward_and_the_inputs_gradient_to_the_bit(tmp_path):
    """distributed.expert_exchange=fp8 on 2 gloo ranks, the FP8 experts' layer against itself with bf16 on the wire: the
    rows to the experts and the gradients of their outputs on the way back to them travel as bytes (e4m3 and an
    exponent a row), the outputs and the rows' gradients as they are. The outputs and every gradient are the same to
    the bit, but the output bias's, which sums the outputs' gradients as they arrive: rounded to e4m3 there, it is the
    bias gradient of bf16 on the wire with those gradients rounded to e4m3 on arrival, to the bit."""
    out = tmp_path / "wire.pt"
    spawned(_wire_worker, 2, str(out))
    for rank in range(2):
        seen = torch.load(f"{out}.{rank}")
        plain, fp8, rounded = seen["results"]
        # bf16 on the wire goes by torch's all-to-all with autograd (moe._all_to_all), FP8 by moe_fp8's: the rows
        # forward as e4m3 bytes and their exponents, the outputs back in bf16, then in the backward the outputs'
        # gradients as bytes and exponents, and the rows' gradients back in bf16
        assert seen["carried"] == [None, None, torch.uint8, torch.int8, torch.bfloat16, torch.uint8, torch.int8,
                                   torch.bfloat16, None], seen["carried"]  # fmt: skip
        assert not torch.equal(fp8["down_proj_bias"], plain["down_proj_bias"]), "no e4m3 rounding on the way back"
        for name in plain:
            assert torch.equal(fp8[name], rounded[name]), (rank, name)
            assert name == "down_proj_bias" or torch.equal(fp8[name], plain[name]), (rank, name)


def test_the_weight_gradient_operands_take_one_power_of_two_scale_an_expert_and_are_transposed():
    """moe_fp8._group_scaled_transpose (the FP8 weight gradient's operands): [rows, n] becomes row-major [n, rows] in
    e4m3 whose scale is constant over each expert's rows (the grouped product sums along them), a power of two that
    brings the expert's largest magnitude within e4m3's range; dequantised it gives the rows back to e4m3's
    rounding; an expert with no rows gets 1."""
    from trainbench.families.decoder.moe_fp8 import _e4m3, _group_scaled_transpose
    from trainbench.families.fp8 import E4M3_MAX

    torch.manual_seed(0)
    counts = torch.tensor([32, 0, 16, 48])
    group = torch.repeat_interleave(torch.arange(4), counts)
    t = torch.randn(int(counts.sum()), 24) * torch.tensor([1e-3, 0.0, 5.0, 300.0]).repeat_interleave(counts)[:, None]
    _, row_recips = _e4m3(t, -1)
    q, recips = _group_scaled_transpose(t, row_recips, group, 4)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (24, t.shape[0]) and q.is_contiguous()
    assert recips[1] == 1
    for g in (0, 2, 3):
        rows = group == g
        amax = t[rows].abs().max()
        # a power of two, as large as it can be with the expert's largest magnitude inside e4m3's range
        assert torch.log2(recips[g]) == torch.round(torch.log2(recips[g]))
        assert amax / recips[g] <= E4M3_MAX < 2 * amax / recips[g]
        back = q[:, rows].float().t() * recips[g]
        assert torch.allclose(back, t[rows], rtol=2**-3, atol=float(recips[g]) * 2**-9)


class _ProductThroughACast(torch.autograd.Function):
    """``x @ w16`` per group, as the FP8 experts multiply through casts made beforehand: ``w`` (the fp32 weight, or
    its stand-in) is read for nothing but its gradient, which comes back in bf16."""

    @staticmethod
    def forward(ctx, x, w, w16):
        ctx.save_for_backward(x, w16)
        return torch.bmm(x, w16)

    @staticmethod
    def backward(ctx, grad):
        x, w16 = ctx.saved_tensors
        return grad.bmm(w16.transpose(1, 2)), torch.bmm(x.transpose(1, 2), grad), None


@pytest.mark.parametrize("compiled", [False, True])
def test_a_weights_gradient_added_through_its_bf16_stand_in_equals_autograds_cast_and_add(compiled):
    """The experts' weights cast once a step hand their products a stand-in (moe_fp8._fp32_grad_stand_in), a leaf
    whose hook adds each micro-batch's bf16 gradient into the fp32 ``.grad`` itself: over 3 micro-batches the
    gradient equals, bit for bit, autograd's (each bf16 gradient cast to fp32, then accumulated). Compiled
    (AOTAutograd, as the blocks compile), a new stand-in in each micro-batch compiles once."""
    from trainbench.families.decoder.moe_fp8 import _fp32_grad_stand_in

    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(3, 16, 24))
    plain = torch.nn.Parameter(weight.detach().clone())
    w16 = weight.detach().bfloat16()
    xs = [torch.randn(3, 8, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]

    def loss(x, w):
        return _ProductThroughACast.apply(x, w, w16).float().square().sum()

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    standin_loss = torch.compile(loss, backend="aot_eager", dynamic=False) if compiled else loss
    for x in xs:
        standin = _fp32_grad_stand_in(weight)
        assert standin.dtype == torch.bfloat16 and standin.shape == weight.shape and standin.stride() == (0, 0, 0)
        standin_loss(x, standin).backward()
        loss(x.detach().requires_grad_(), plain).backward()
        assert torch.equal(weight.grad, plain.grad)
    assert weight.grad.dtype == torch.float32 and weight.grad.abs().sum() > 0
    if compiled:
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def placed_gpt_oss_experts(device: torch.device) -> list[MoE]:
    """The expert layers of a two-block GPT-OSS model built on the meta device and placed on ``device`` by the
    decoder's placement, after one forward and backward (their loss finite)."""
    from trainbench.families.decoder.gpt_oss import GptOssConfig, GptOssLM
    from trainbench.families.decoder.placement import parallelize

    cfg = GptOssConfig(block="gpt_oss", vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       attention_head_dim=16, intermediate_size=32, num_experts=4, experts_per_token=2,
                       sliding_window=16)  # fmt: skip
    with torch.device("meta"):
        model = GptOssLM(cfg)
    model = parallelize(model, device, 1, 1, device.type == "cuda", False, False, None, 0)
    ids = torch.randint(0, 128, (2, 33), device=device, generator=torch.Generator(device).manual_seed(0))
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss = model(ids[:, :-1], targets=ids[:, 1:])
    loss.backward()
    assert torch.isfinite(loss)
    return [m for m in model.modules() if isinstance(m, MoE)]


def test_the_cpu_placement_leaves_the_experts_activation_to_autograd():
    """On the CPU the experts' activation stays the tensor operations under autograd (the golden runs' sums); the
    fused op is the CUDA placement's (tests/test_gpu_moe.py)."""
    layers = placed_gpt_oss_experts(torch.device("cpu"))
    assert len(layers) == 2 and all(m.biased_activation is None for m in layers)


def _placed_keys_worker(rank: int, world: int, port: int, out: str) -> None:
    """One rank of two: the tiny ``gpt_oss_20b`` placed by its family with ``distributed.ep=2`` and the FP8 wire asked
    (set past the check that wants FP8, which a CPU cannot run): rank 0 writes what each mixture layer exchanges
    through and the placement's notes."""
    import dataclasses
    import json

    from trainbench.distributed import DistInfo
    from trainbench.resolve import build_config

    with _gloo_rank(rank, world, port):
        bench, cfg = build_config("gpt_oss_20b", "tiny", None, {"distributed.nproc": str(world),
                                                                "distributed.ep": str(world)})  # fmt: skip
        cfg = dataclasses.replace(cfg, distributed=dataclasses.replace(cfg.distributed, expert_exchange="fp8",
                                                                       expert_row_casts="kernel"))  # fmt: skip
        placed = bench.family.place(bench.family.build_model(cfg), cfg, DistInfo(rank, 0, world, torch.device("cpu")),
                                    False)  # fmt: skip
        layers = [m for m in placed.module.modules() if isinstance(m, MoE)]
        if rank == 0:

            def name(f) -> str:  # (a functools.partial's function)
                return getattr(f, "func", f).__name__

            json.dump({"layers": len(layers), "to": [name(m.to_experts) for m in layers],
                       "from": [name(m.from_experts) for m in layers],
                       "products": [m.expert_product is MoE.expert_product for m in layers],
                       "notes": placed.notes}, open(out, "w"))  # fmt: skip


def test_the_placement_sets_the_fp8_wire_on_every_mixture_layer_and_the_kernel_casts_only_on_fp8_experts(tmp_path):
    """``GptOssFamily.place`` under expert parallelism over 2 gloo ranks with ``distributed.expert_exchange=fp8`` and
    ``distributed.expert_row_casts=kernel``: every mixture layer exchanges its rows through the FP8 wire both ways;
    the kernel's casts go only to layers whose experts multiply in FP8 (none here, in bf16: their products stay);
    the run's notes say both keys are not yet run over NCCL."""
    import json

    out = tmp_path / "placed.json"
    spawned(_placed_keys_worker, 2, str(out))
    got = json.loads(out.read_text())
    assert got["layers"] == 2 and all("fp8" in n for n in got["to"] + got["from"]), got
    assert all(got["products"]), got
    notes = " ".join(got["notes"])
    assert "distributed.expert_exchange=fp8): not yet run over NCCL" in notes, notes
    assert "distributed.expert_row_casts=kernel): not yet run over NCCL" in notes, notes
