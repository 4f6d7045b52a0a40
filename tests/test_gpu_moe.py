"""The mixture of experts on one GPU: the grouped product, the experts in FP8 (output, gradients, the rows' and the
weights' casts, the stand-ins' weight gradients), and the activation kernels.

Part of the single-GPU tier (``make test-gpu``, every tests/test_gpu_*.py but test_gpu_multi.py), skipped where no
CUDA device is visible."""

import math

import pytest
import torch
from conftest import single_gpu_tier

pytestmark = single_gpu_tier()


def test_the_experts_grouped_product_on_cuda_matches_the_padded_batched_one():
    """families/decoder/moe: torch's grouped GEMM (bf16, CUDA) against the padded batched product, groups of uneven
    sizes (one empty)."""
    from trainbench.families.decoder.moe import _grouped

    torch.manual_seed(0)
    counts = torch.tensor([5, 0, 17, 42], device="cuda")
    x = torch.randn(int(counts.sum()), 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4, 64, 96, device="cuda", dtype=torch.bfloat16)
    grouped = _grouped(x, w, counts)
    padded = _grouped(x.float(), w.float(), counts)  # fp32: the padded path
    assert grouped.shape == (64, 96)
    assert torch.allclose(grouped.float(), padded, rtol=2e-2, atol=2e-1)


@pytest.mark.parametrize("activation, bias", [("silu", False), ("gpt_oss", True)])
def test_the_experts_in_fp8_match_bf16_in_output_and_every_gradient_on_cuda(activation, bias):
    """families/decoder/moe with moe_fp8 (FP8 grouped products, each expert's rows padded to 16) against the same layer
    in bf16 and in fp64: FP8's error in the output and in the input's, experts' and router's gradients is of FP8's
    size (a few percent of each tensor's norm), and no more than a few times bf16's own."""
    from trainbench.families.decoder.moe import MoE, MoEShape
    from trainbench.families.decoder.moe_fp8 import experts_in_fp8

    pytest.importorskip("torchao", reason="torchao is the optional extra trainbench[fp8]")
    shape = MoEShape(hidden=256, ffn=256, experts=8, top_k=2, activation=activation, bias=bias)
    torch.manual_seed(0)
    base = MoE(shape)
    for p in base.parameters():
        torch.nn.init.normal_(p, std=0.06)
    x0 = torch.randn(2048, 256)
    direction = torch.randn(2048, 256)

    def run(dtype, fp8):
        layer = MoE(shape).cuda().to(torch.float64 if dtype == torch.float64 else torch.float32)
        layer.load_state_dict(base.state_dict())
        if fp8:
            assert experts_in_fp8(torch.nn.Sequential(layer), torch.device("cuda")) == 1
        x = x0.cuda().to(layer.gate_up_proj.dtype).requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            out, _ = layer(x)
        (out.double() * direction.cuda().double()).sum().backward()
        return {"output": out.double(), "input": x.grad.double()} | {
            n: p.grad.double() for n, p in layer.named_parameters()
        }

    exact, bf16, fp8 = run(torch.float64, False), run(torch.bfloat16, False), run(torch.bfloat16, True)
    for name, e in exact.items():
        scale = float(e.detach().norm())
        err_b, err_f = (float((r[name] - e).detach().norm()) / scale for r in (bf16, fp8))
        # e4m3 keeps 3 bits of mantissa: about 4 % a rounded operand, two products deep; bf16 (8 bits) far less, so
        # an error well above bf16's also shows that the FP8 product ran (the down projection's bias gradient, a
        # sum of the output's gradient per expert, takes no product)
        assert err_f < 0.1 and (name == "down_proj_bias" or 2 * err_b < err_f), (name, err_f, err_b)


@pytest.mark.parametrize("spread", [1.0, 1e3])
def test_the_experts_fp8_weight_gradient_matches_each_experts_product_in_float64_on_cuda(spread):
    """moe_fp8.fp8_weight_grad: each expert's x^T grad over its rows (groups of multiples of 16 rows, one of none) as
    one FP8 grouped product, against float64: within FP8's error (e4m3 rounds each operand by up to 6 %; the sums
    over an expert's rows average much of it out), also where the rows' magnitudes spread over ``spread``, and far
    above bf16's own error (the product ran in FP8); an expert with no rows gets zeros."""
    from trainbench.families.decoder.moe_fp8 import _e4m3, fp8_weight_grad

    torch.manual_seed(0)
    counts = torch.tensor([256, 0, 64, 1024, 16, 512], device="cuda")
    groups, rows = counts.numel(), int(counts.sum())
    group = torch.repeat_interleave(torch.arange(groups, device="cuda"), counts)
    magnitude = torch.logspace(0, math.log10(spread), rows, device="cuda")[torch.randperm(rows, device="cuda")]
    x = (torch.randn(rows, 128, device="cuda") * magnitude[:, None]).bfloat16()
    grad = (torch.randn(rows, 96, device="cuda") / magnitude[:, None]).bfloat16()
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    got = fp8_weight_grad(x, _e4m3(x, -1)[1], grad, _e4m3(grad, -1)[1], group, groups, offsets).double()
    assert got.shape == (groups, 128, 96)
    assert got[1].abs().max() == 0
    for g in range(groups):
        if counts[g] == 0:
            continue
        rows_g = group == g
        exact = x[rows_g].double().t() @ grad[rows_g].double()
        bf16 = (x[rows_g].t() @ grad[rows_g]).double()
        err, err_bf16 = (float((r - exact).norm() / exact.norm()) for r in (got[g], bf16))
        assert err < 0.08 and err > 2 * err_bf16, (g, err, err_bf16)


def _two_fp8_expert_layers() -> list[torch.nn.Module]:
    """Two FP8 expert layers on CUDA (GPT-OSS's activation, with biases) holding the same random weights."""
    from trainbench.families.decoder.moe import MoE, MoEShape
    from trainbench.families.decoder.moe_fp8 import experts_in_fp8

    shape = MoEShape(hidden=256, ffn=256, experts=8, top_k=2, activation="gpt_oss", bias=True)
    torch.manual_seed(0)
    base = MoE(shape)
    for p in base.parameters():
        torch.nn.init.normal_(p, std=0.06)
    layers = []
    for _ in range(2):
        layer = MoE(shape).cuda()
        layer.load_state_dict(base.state_dict())
        experts_in_fp8(layer, torch.device("cuda"))
        layers.append(layer)
    return layers


def test_the_rows_fp8_casts_compiled_outside_a_block_equal_the_eager_ones_for_every_row_count_on_cuda():
    """moe_fp8._rows_e4m3 with ``compiled`` (the expert-parallel dispatch runs outside the compiled blocks): the e4m3
    rows and their scales' reciprocals equal the eager casts' bit for bit, at row counts that change every call (as
    the rows that arrive at a rank do) and at both of the experts' widths, without a compilation for each count."""
    from trainbench.families.decoder import moe_fp8 as moe

    torch._dynamo.utils.counters.clear()
    for i, rows in enumerate((4096, 4112, 65_536, 12_304, 16, 30_000, 4128)):
        t = torch.randn(rows, 2880 if i % 2 else 5760, device="cuda", dtype=torch.bfloat16) * (i + 1)
        (q, recip), (want_q, want_recip) = moe._rows_e4m3(t, compiled=True), moe._e4m3(t, -1)
        assert q.dtype == torch.float8_e4m3fn and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(recip, want_recip)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2  # one a width: the rows dynamic, the width not


def test_the_experts_fp8_weight_casts_made_once_a_step_follow_every_optimizer_step_on_cuda():
    """cache_fp8_weight_casts (one unsharded rank): over 3 steps of 2 micro-batches with the fused AdamW (which leaves
    the weights' version counters alone), the layer that casts its weights once a step gives the outputs and
    gradients of the same layer casting them in every call, also after a weight written in place outside a step.
    Left stale for one step (no after_step), it does not: what the comparison would catch."""
    from trainbench.families.decoder.moe_fp8 import cache_fp8_weight_casts

    pytest.importorskip("torchao", reason="torchao is the optional extra trainbench[fp8]")
    roots, optimizers = [], []
    for layer in _two_fp8_expert_layers():
        root = torch.nn.Sequential(layer)
        roots.append(root)
        optimizers.append(torch.optim.AdamW(root.parameters(), lr=1e-2, fused=True))
    after_step = cache_fp8_weight_casts(roots[1])
    xs = [torch.randn(512, 256, device="cuda") for _ in range(2)]

    def step(stale: bool = False):
        outs = []
        for root, opt in zip(roots, optimizers, strict=True):
            outs.append([])
            for x in xs:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out, _ = root(x)
                out.float().square().sum().backward()
                outs[-1].append(out.detach().float())
            outs[-1] += [p.grad.clone() for p in root.parameters()]
            opt.step()
            opt.zero_grad()
        if not stale:
            after_step()
        return [float((a - b).norm() / b.norm()) for a, b in zip(outs[1], outs[0], strict=True)]

    assert "_fp8_gate_up_proj_0" not in roots[1][0]._buffers
    for _ in range(3):
        assert max(step()) < 1e-4
    assert "_fp8_gate_up_proj_0" in roots[1][0]._buffers  # the cached casts were the ones used
    step(stale=True)
    assert max(step()[:2]) > 1e-2  # outputs from the weights of a step before
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        roots[1](xs[0])  # the casts made again after that step's after_step: fresh
    roots[1].load_state_dict(roots[0].state_dict())  # as a checkpoint's load: in place, the weights' versions move
    assert max(step()) < 1e-4


def test_the_experts_weight_gradients_added_through_their_stand_ins_equal_autograds_compiled_on_cuda():
    """With the weights' casts made once a step, the compiled layer's experts add their bf16 weight gradients into
    the fp32 ``.grad`` through stand-ins (moe_fp8._fp32_grad_stand_in, its cast and addition compiled): over 3 steps
    of 2 micro-batches every gradient and output equals, bit for bit, the same layer's with the stand-ins taken away
    (autograd's cast and add), and the steps after the first compile nothing new."""
    from trainbench.families.decoder.moe_fp8 import cache_fp8_weight_casts

    roots, after_steps = [], []
    for with_standins, layer in zip((False, True), _two_fp8_expert_layers(), strict=True):
        root = torch.nn.ModuleDict({"moe": layer})
        root.forward = lambda x, layer=layer: layer(x)
        layer.compile(dynamic=False)
        after_steps.append(cache_fp8_weight_casts(root))  # the casts and the gradients' additions compiled
        if not with_standins:  # runs after the hook that hands them out
            root.register_forward_pre_hook(lambda m, args, layer=layer: setattr(layer, "_grad_standins", {}))
        roots.append(root)
    xs = [torch.randn(512, 256, device="cuda") for _ in range(2)]
    torch._dynamo.utils.counters.clear()
    for step in range(3):
        if step == 1:
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        results = []
        for root, after_step in zip(roots, after_steps, strict=True):
            outs = []
            for i, x in enumerate(xs):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out, _ = root(x)
                (out.float().square() * (i + 1)).sum().backward()
                outs.append(out.detach())
            results.append(outs + [p.grad.clone() for p in root.parameters()])
            with torch.no_grad():
                for p in root.parameters():
                    p.sub_(1e-2 * p.grad.sign())
            root.zero_grad()
            after_step()
        assert roots[1]["moe"]._grad_standins and not roots[0]["moe"]._grad_standins
        for a, b in zip(*results, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("activation", ["silu", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_activation_kernels_match_their_torch_form_on_cuda(activation, dtype):
    """glu_kernel's Triton kernels, forward and backward, against the same formulas in torch (the backward's is the
    one the CPU tests check against autograd), on values across GPT-OSS's clamps and exactly on them, each row's
    expert's bias added; a width that is not a multiple of the kernels' block."""
    from trainbench.families.decoder.glu_kernel import _glu_backward_torch, glu, glu_backward, glu_forward

    torch.manual_seed(0)
    rows, ffn, experts = 300, 1500, 5
    h = (torch.randn(rows, 2 * ffn, device="cuda") * 6).to(dtype)
    h[0, :8] = torch.tensor([7.0, 7.0, -7.0, -7.0, 7.5, -7.5, 6.5, 7.5])
    grad = torch.randn(rows, ffn, device="cuda").to(dtype)
    bias = torch.randn(experts, 2 * ffn, device="cuda")
    bias[:, :8] = 0.0
    group = torch.randint(0, experts, (rows,), device="cuda").sort().values
    for b, g in ((None, None), (bias, group)):
        act = glu_forward(h, b, g, activation, 1.702, 7.0)
        x = h if b is None else h + b[g].to(dtype)
        expected = glu(x.float(), activation, 1.702, 7.0)  # the forward in fp32, rounded once, as the kernel does
        assert act.dtype == dtype and act.shape == grad.shape
        assert torch.allclose(act.float(), expected, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)
        ours = glu_backward(h, b, g, grad, activation, 1.702, 7.0)
        ref = _glu_backward_torch(h, b, g, grad, activation, 1.702, 7.0)
        assert ours.dtype == dtype and ours.shape == h.shape
        tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the same fp32 value may round one step apart
        assert torch.allclose(ours.float(), ref.float(), rtol=tol, atol=tol * float(ref.float().abs().max()))
        assert float((ours.float() - ref.float()).norm() / ref.float().norm()) < tol / 10
        if activation == "gpt_oss":
            assert [ours[0, i].item() == 0 for i in range(8)] == [False, False, False, False, True, True, False, True]


def test_the_cuda_placement_gives_every_expert_layer_the_fused_activation_on_cuda():
    """The decoder's placement on CUDA sets BiasGLU (glu_kernel's forward and backward kernels) as every expert layer's
    ``biased_activation``, and the placed model trains a step with it."""
    from test_moe import placed_gpt_oss_experts

    from trainbench.families.decoder.glu_kernel import BiasGLU

    layers = placed_gpt_oss_experts(torch.device("cuda"))
    assert len(layers) == 2 and all(m.biased_activation == BiasGLU.apply for m in layers)  # == : a new bound method


def _two_ranks_on_one_gpu(rank: int, world: int, port: int, mode: str, out: str) -> None:
    """One of 2 gloo ranks sharing the one GPU: the FP8 experts' layer as the CUDA placement makes it (the rows' casts
    compiled, the fused activation, the weights' casts once a step), its 8 experts over the 2 ranks, each rank its own
    1,024 tokens. ``wire``: one forward and backward with bf16 on the wire, then with FP8
    (``distributed.expert_exchange=fp8``). ``casts``: the same with the rows' casts compiled, then by the Triton
    kernel (``distributed.expert_row_casts=kernel``). ``deal``: 3 AdamW steps with the experts in their contiguous
    halves, then with them dealt out again by their load after each step (``distributed.expert_rebalance_every=1``),
    then a forward of each. Each rank writes what it saw."""
    import os

    import torch.distributed as dist

    from trainbench.families.decoder.expert_placement import ExpertPlacer
    from trainbench.families.decoder.glu_kernel import fuse_activations
    from trainbench.families.decoder.moe import MoE, MoEShape
    from trainbench.families.decoder.moe_fp8 import (
        cache_fp8_weight_casts,
        exchange_in_fp8,
        experts_in_fp8,
        fp8_products,
    )
    from trainbench.families.decoder.placement import apply_expert_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        shape = MoEShape(hidden=256, ffn=256, experts=8, top_k=2, activation="gpt_oss", bias=True)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(1024, 256, generator=g).cuda()
        direction = torch.randn(1024, 256, generator=g).cuda()
        seen = []
        for variant in (0, 1):
            torch.manual_seed(0)
            layer = MoE(shape)
            for p in layer.parameters():
                torch.nn.init.normal_(p, std=0.06)
            layer.router.weight.data[:, :8] += 0.3 * torch.arange(8.0)  # a router that favours some experts
            holder = torch.nn.Sequential(layer.cuda())
            experts_in_fp8(holder, torch.device("cuda"), compiled_casts=True)
            fuse_activations(holder)
            apply_expert_parallel(holder, "cuda", world, world)
            if mode in ("wire", "casts"):
                if variant and mode == "wire":
                    exchange_in_fp8(layer)
                if variant and mode == "casts":
                    fp8_products(layer, "fp8", "kernel")
                rows = x.clone().requires_grad_()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    result, _ = layer(rows)
                (result.float() * direction).sum().backward()
                grads = {n: getattr(p.grad, "_local_tensor", p.grad).cpu() for n, p in layer.named_parameters()}
                seen.append({"output": result.detach().cpu(), "input": rows.grad.cpu(), **grads})
                continue
            after_step = cache_fp8_weight_casts(holder, compiled=True)
            placer = ExpertPlacer(holder, every=1, gain=-1.0) if variant else None
            optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2, foreach=False)  # (DTensors beside tensors)
            for _ in range(3):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    result, _ = layer(x)
                ((result.float() * direction).sum() * world).backward()
                for p in layer.router.parameters():  # replicated: FSDP would average them
                    dist.all_reduce(p.grad)
                    p.grad /= world
                optimizer.step()
                after_step()
                if placer:
                    placer.rearrange(optimizer)
                optimizer.zero_grad()
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                result, _ = layer(x)
            if placer:
                placer.rearrange(optimizer, canonical=True)
            weights = {n: p.to_local().cpu() for n, p in layer.named_parameters() if hasattr(p, "to_local")}
            seen.append({"output": result.float().cpu(), "moves": placer.moves if placer else 0, **weights})
        torch.save(seen, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_fp8_on_the_wire_keeps_the_experts_forward_and_the_inputs_gradient_to_the_bit_on_cuda(tmp_path):
    """distributed.expert_exchange=fp8 with torch's FP8 grouped product and the compiled casts, 2 gloo ranks on the one
    GPU: the outputs, the input's and the router's gradients and the first product's bias gradient are those of bf16
    on the wire to the bit; the weights' gradients, whose FP8 products cast their operands again with a scale an
    expert, the same but where a value falls among e4m3's subnormals; the output bias's gradient, summed from the
    outputs' gradients rounded to e4m3 on the wire, within e4m3's rounding of them."""
    from conftest import spawned

    out = tmp_path / "wire.pt"
    spawned(_two_ranks_on_one_gpu, 2, "wire", str(out))
    for rank in range(2):
        plain, fp8 = torch.load(f"{out}.{rank}")
        for name in ("output", "input", "router.weight", "router.bias", "gate_up_proj_bias"):
            assert torch.equal(fp8[name], plain[name]), (rank, name)
        for name, rtol in (("gate_up_proj", 2**-6), ("down_proj", 2**-6), ("down_proj_bias", 2**-3)):
            scale = plain[name].float().abs().max()
            error = (fp8[name].float() - plain[name].float()).abs().max()
            assert error <= rtol * scale, (rank, name, float(error), float(scale))


def test_experts_dealt_out_by_their_load_train_as_in_their_halves_on_cuda(tmp_path):
    """distributed.expert_rebalance_every with the FP8 experts (their weights' casts made once a step, which a move
    must renew), 2 gloo ranks on the one GPU: 3 AdamW steps with the experts dealt out after each give the outputs and,
    back in the contiguous order, the weights of the same steps with the experts in their halves, to FP8's rounding;
    experts moved."""
    from conftest import spawned

    out = tmp_path / "deal.pt"
    spawned(_two_ranks_on_one_gpu, 2, "deal", str(out))
    for rank in range(2):
        halves, dealt = torch.load(f"{out}.{rank}")
        assert dealt["moves"] > 0 and halves["moves"] == 0
        for name in halves:
            if name != "moves":
                scale = halves[name].abs().max()
                assert (dealt[name] - halves[name]).abs().max() <= 2e-2 * scale, (rank, name)


@pytest.mark.parametrize("width", [2880, 5760, 100])
def test_the_wires_kernels_cast_and_rebuild_rows_as_torchs_operations_do_on_cuda(width):
    """moe_fp8._wire_cast and _wire_uncast (the Triton kernels of distributed.expert_exchange=fp8 and
    distributed.expert_row_casts=kernel) against the torch operations they stand for, and the products' cast by the
    kernel against the compiled one, to the bit: bf16 rows from 2**-40 to 2**40 in magnitude, a zero row, rows whose
    largest value is 1.75 x a power of two and just above it, one that rounds down to 224; and no rows."""
    from trainbench.families.decoder.moe_fp8 import (
        _e4m3_with_exponent,
        _from_e4m3,
        _rows_e4m3,
        _wire_cast,
        _wire_uncast,
    )

    torch.manual_seed(0)
    rows = torch.randn(83, width) * torch.exp2(torch.arange(-40, 43, dtype=torch.float32))[:, None]
    rows[3] = 0
    rows[5] = torch.linspace(-1, 1, width) * 225 / 256  # scaled by 256 to 225, which rounds to 224
    rows[6, 0], rows[7, 0] = 1.75 * 2**-3, 1.7578125 * 2**5  # the largest: 1.75 x 2**-3; just above 1.75 x 2**5
    for t in (rows.to(torch.bfloat16).cuda(), torch.empty(0, width, dtype=torch.bfloat16, device="cuda")):
        q, exponent = _wire_cast(t)
        want_q, want_exponent = _e4m3_with_exponent(t)
        assert q.dtype == want_q.dtype and exponent.dtype == torch.int8
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(exponent, want_exponent)
        assert torch.equal(_wire_uncast(q, exponent, torch.bfloat16), _from_e4m3(q, exponent, torch.bfloat16))
        # the products' cast outside a compiled block by the same kernel (distributed.expert_row_casts=kernel)
        (kq, krecip), (cq, crecip) = _rows_e4m3(t, "kernel"), _rows_e4m3(t, True)
        assert torch.equal(kq.view(torch.uint8), cq.view(torch.uint8)) and torch.equal(krecip, crecip)


def test_the_experts_rows_cast_by_the_kernel_give_every_gradient_of_the_compiled_casts_on_cuda(tmp_path):
    """distributed.expert_row_casts=kernel, 2 gloo ranks on the one GPU, the FP8 experts over them: the outputs and
    every gradient equal those of the compiled casts, to the bit."""
    from conftest import spawned

    out = tmp_path / "casts.pt"
    spawned(_two_ranks_on_one_gpu, 2, "casts", str(out))
    for rank in range(2):
        compiled, kernel = torch.load(f"{out}.{rank}")
        for name in compiled:
            assert torch.equal(kernel[name], compiled[name]), (rank, name)
