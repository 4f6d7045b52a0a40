"""Single-GPU tier (``make test-gpu``): runs only where CUDA is present (skipped on CI, which has no GPU). The tests of
2 GPUs or more are in test_gpu_multi.py."""

import dataclasses
import gc
import json
import math

import pytest
import torch
from conftest import only_run_dir, run_cli, tiny_run_to_target_on_cuda, train_float8_layers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.usefixtures("empty_compile_caches"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is visible"),
]


def test_bf16_forward_agrees_with_fp32_on_cuda():
    from trainbench.families.encoder.model import BertConfig, BertForPreTraining

    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig(hidden_dropout=0.0, attention_dropout=0.0, num_layers=4)).cuda().eval()
    ids = torch.randint(0, 30522, (4, 512), device="cuda")
    types = torch.zeros_like(ids)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ref, _ = model(ids, types, mask)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            low, _ = model(ids, types, mask)
    assert (low.float() - ref).abs().max() / ref.abs().max() < 5e-2
    assert (low.float().argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_tiny_preset_trains_on_cuda(small_data, tmp_path):
    run_cli(
        "run",
        "bert",
        f"data.dir={small_data}",
        f"output.results_dir={tmp_path}",
        "device=cuda",
        "eval_samples=256",
        "eval.every_samples=640",
        "schedule.max_samples=1280",
        "progress=false",
    )
    outcome = json.loads((only_run_dir(tmp_path) / "run_0.json").read_text())
    assert outcome["steps"] == 20 and outcome["peak_memory_gib"] > 0


def _packed_batch(rows: int = 4, seq: int = 128):
    """Packed rows as the packer lays them out: sequences 1, 2, 3 of random lengths, then padding."""
    import numpy as np

    rng = np.random.default_rng(0)
    ids_of_seq = np.zeros((rows, seq), np.int64)
    for row in ids_of_seq:
        cuts = np.sort(rng.choice(np.arange(8, seq - 8), 2, replace=False))
        row[: cuts[0]], row[cuts[0] : cuts[1]], row[cuts[1] : seq - 4] = 1, 2, 3
    ids = torch.from_numpy(rng.integers(5, 1000, (rows, seq))).cuda()
    sequence_ids = torch.from_numpy(ids_of_seq).cuda()
    positions = torch.zeros_like(sequence_ids)
    for b in range(rows):
        for s in (1, 2, 3):
            where = (sequence_ids[b] == s).nonzero().flatten()
            positions[b, where] = torch.arange(len(where), device="cuda")
    cls = torch.stack([(sequence_ids[b] == s).nonzero()[0, 0] for b in range(rows) for s in (1, 2, 3)]).view(rows, 3)
    return {
        "input_ids": ids * (sequence_ids > 0), "segment_ids": torch.zeros_like(ids), "position_ids": positions,
        "sequence_ids": sequence_ids, "cls_positions": cls, "next_sentence_labels": torch.ones(rows, 3).long().cuda(),
        "masked_lm_positions": cls + 2, "masked_lm_ids": ids[:, :3],
    }  # fmt: skip


def _packed_loss_and_grad(attention: str, bf16: bool, dropout: float = 0.0, seed: int = 0):
    import dataclasses

    from trainbench.benchmarks.bert import BertBenchmark
    from trainbench.families.encoder.model import BertConfig, BertForPreTraining

    cfg = BertConfig(vocab_size=1000, hidden_size=256, num_layers=2, num_heads=4, intermediate_size=512,
                     max_position_embeddings=128, hidden_dropout=0.0, attention_dropout=dropout)  # fmt: skip
    torch.manual_seed(0)
    model = BertForPreTraining(dataclasses.replace(cfg, packed_attention=attention)).cuda()
    batch, bench = _packed_batch(), BertBenchmark()
    torch.manual_seed(seed)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        kernel = model.packed_kernel(torch.device("cuda"))
        loss = bench.loss(model, batch, bench.loss_weights(batch))
    loss.backward()
    return kernel, loss.item(), model.layers[0].qkv.weight.grad.clone()


def _needs_cudnn_frontend():
    from trainbench.families.cudnn_attention import unavailable

    if (why := unavailable()) is not None:
        pytest.skip(why)


@pytest.mark.parametrize("attention, kernel", [("varlen", "varlen"), ("cudnn", "cudnn")])
def test_a_packed_training_step_never_makes_the_host_wait_on_cuda(attention, kernel):
    """Forward, loss and backward on packed rows with varlen flash attention in bf16 (the trainer's path), or
    cuDNN's attention, queue their kernels without a host sync: one would leave the GPU idle while the host
    catches up, every step."""
    from trainbench.benchmarks.bert import BertBenchmark
    from trainbench.families.encoder.model import BertConfig, BertForPreTraining

    if attention == "cudnn":
        _needs_cudnn_frontend()
    cfg = BertConfig(vocab_size=1000, hidden_size=256, num_layers=2, num_heads=4, intermediate_size=512,
                     max_position_embeddings=128, hidden_dropout=0.1, attention_dropout=0.1,
                     packed_attention=attention)  # fmt: skip
    model, batch, bench = BertForPreTraining(cfg).cuda(), _packed_batch(), BertBenchmark()

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            kernel = model.packed_kernel(torch.device("cuda"))
            loss = bench.loss(model, batch, bench.loss_weights(batch))
        loss.backward()
        return kernel, loss

    step()  # first calls: kernel choice, lazy initialisation
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got, loss = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got == kernel and torch.isfinite(loss)


def test_flex_attention_packed_rows_match_the_dense_mask_with_gradients_on_cuda():
    flex = _packed_loss_and_grad("auto", bf16=False)
    dense = _packed_loss_and_grad("sdpa", bf16=False)
    assert flex[0] == "flex" and dense[0] == "sdpa"
    assert flex[1] == pytest.approx(dense[1], rel=1e-4)
    assert (flex[2] - dense[2]).norm() <= 1e-3 * dense[2].norm()


def test_varlen_flash_attention_matches_the_dense_mask_and_has_seeded_dropout_on_cuda():
    reference = _packed_loss_and_grad("sdpa", bf16=False)  # fp32, dense mask
    varlen = _packed_loss_and_grad("varlen", bf16=True)
    dense_bf16 = _packed_loss_and_grad("sdpa", bf16=True)
    assert varlen[0] == "varlen" and dense_bf16[0] == "sdpa"
    # bf16 compute: as close to the fp32 reference as the dense bf16 path is
    for _, loss, grad in (varlen, dense_bf16):
        assert loss == pytest.approx(reference[1], rel=1e-2)
        assert (grad - reference[2]).norm() <= 3e-2 * reference[2].norm()
    _assert_seeded_dropout("varlen", varlen[1])


def _assert_seeded_dropout(attention: str, loss_without: float):
    """Dropout inside the kernel: it changes the loss, the same seed gives the same loss and gradient."""
    first = _packed_loss_and_grad(attention, bf16=True, dropout=0.3, seed=1)
    again = _packed_loss_and_grad(attention, bf16=True, dropout=0.3, seed=1)
    other = _packed_loss_and_grad(attention, bf16=True, dropout=0.3, seed=2)
    assert first[1] == again[1] and torch.equal(first[2], again[2])
    assert first[1] != other[1] and abs(first[1] - loss_without) > 1e-4
    assert torch.isfinite(first[2]).all()


def test_cudnn_attention_matches_the_dense_mask_and_has_seeded_dropout_on_cuda():
    _needs_cudnn_frontend()
    reference = _packed_loss_and_grad("sdpa", bf16=False)  # fp32, dense mask
    cudnn = _packed_loss_and_grad("cudnn", bf16=True)
    assert cudnn[0] == "cudnn"
    assert cudnn[1] == pytest.approx(reference[1], rel=1e-2)
    assert (cudnn[2] - reference[2]).norm() <= 3e-2 * reference[2].norm()
    _assert_seeded_dropout("cudnn", cudnn[1])


def test_cudnn_attention_handles_empty_slots_full_rows_and_padding_rows_on_cuda():
    """Rows with one sequence and no padding, three sequences and padding, and only padding: empty sequence
    slots. Output and the gradients of query, key and value (written into one tensor) match fp32 attention
    with a dense same-sequence mask at every real token."""
    _needs_cudnn_frontend()
    import torch.nn.functional as F

    from trainbench.families.cudnn_attention import cudnn_segments, cudnn_varlen_attention
    from trainbench.families.encoder.model import varlen_segments

    rows, seq, heads, dim = 4, 256, 4, 64
    ids = torch.zeros(rows, seq, dtype=torch.long)
    ids[0] = 1
    ids[1, :100], ids[1, 100:180], ids[1, 180:250] = 1, 2, 3
    ids[2, :17], ids[2, 17:240] = 1, 2
    ids = ids.cuda()  # row 3: padding only
    torch.manual_seed(0)
    qkv = torch.randn(rows * seq, 3, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(rows * seq, heads, dim, device="cuda", dtype=torch.bfloat16)
    segments = cudnn_segments(*varlen_segments(ids, 3), heads * dim)
    out = cudnn_varlen_attention(qkv, segments, 0.0)
    out.backward(grad)

    ref_in = qkv.detach().float().requires_grad_()
    q, k, v = (t.view(rows, seq, heads, dim).transpose(1, 2) for t in ref_in.unbind(1))
    mask = ids[:, None, :, None] == ids[:, None, None, :]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(rows * seq, heads, dim)
    ref.backward(grad.float())
    real = (ids > 0).flatten()
    assert ((out.float() - ref)[real]).norm() <= 1e-2 * ref[real].norm()
    for i in range(3):
        got, want = qkv.grad[:, i].float()[real], ref_in.grad[:, i][real]
        assert (got - want).norm() <= 2e-2 * want.norm(), f"gradient {'qkv'[i]}"
    assert torch.isfinite(out).all() and torch.isfinite(qkv.grad).all()


@pytest.mark.parametrize("kernel", ["varlen", "cudnn"])
def test_attention_dropout_keeps_the_expected_output_on_cuda(kernel):
    """Dropout on the attention probabilities, scaled by 1 / (1 - p), leaves the output's expectation unchanged:
    the mean of many draws approaches the output without dropout (a missing scale would sit 30 % below it),
    and one draw differs from it."""
    if kernel == "cudnn":
        _needs_cudnn_frontend()
    from trainbench.families.cudnn_attention import cudnn_segments, cudnn_varlen_attention
    from trainbench.families.encoder.model import varlen_attention, varlen_segments

    rows, seq, heads, dim, draws = 2, 256, 4, 64, 400
    ids = torch.zeros(rows, seq, dtype=torch.long, device="cuda")
    ids[0, :100], ids[0, 100:220], ids[1, :256] = 1, 2, 1
    segments = varlen_segments(ids, 3)
    torch.manual_seed(0)
    qkv = torch.randn(rows * seq, 3, heads, dim, device="cuda", dtype=torch.bfloat16)
    if kernel == "cudnn":
        cudnn_segs = cudnn_segments(*segments, heads * dim)

        def attend(p):
            return cudnn_varlen_attention(qkv, cudnn_segs, p).float()
    else:

        def attend(p):
            return varlen_attention(*qkv.unbind(1), segments, p).float()

    with torch.no_grad():
        exact = attend(0.0)
        mean = sum(attend(0.3) for _ in range(draws)) / draws
        one = attend(0.3)
    real = (ids > 0).flatten()
    assert (mean - exact)[real].norm() <= 0.1 * exact[real].norm()
    assert (one - exact)[real].norm() >= 0.2 * exact[real].norm()


def test_cudnn_attention_compiles_and_replays_in_cuda_graphs_on_cuda():
    """The trainer's fastest path: the model compiled with CUDA graphs (mode reduce-overhead) around the cuDNN
    custom ops gives the eager loss and gradient on every replay."""
    _needs_cudnn_frontend()
    from trainbench.benchmarks.bert import BertBenchmark
    from trainbench.families.encoder.model import BertConfig, BertForPreTraining

    cfg = BertConfig(vocab_size=1000, hidden_size=256, num_layers=2, num_heads=4, intermediate_size=512,
                     max_position_embeddings=128, hidden_dropout=0.0, attention_dropout=0.0,
                     packed_attention="cudnn")  # fmt: skip
    torch.manual_seed(0)
    model, batch, bench = BertForPreTraining(cfg).cuda(), _packed_batch(), BertBenchmark()

    def loss_and_grad(m):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = bench.loss(m, batch, bench.loss_weights(batch))
        loss.backward()
        return loss.item(), model.layers[0].qkv.weight.grad.clone()

    eager = loss_and_grad(model)
    compiled = torch.compile(model, mode="reduce-overhead", dynamic=False)
    for _ in range(3):  # warm-up, recording, replay
        torch.compiler.cudagraph_mark_step_begin()
        loss, grad = loss_and_grad(compiled)
        assert loss == pytest.approx(eager[0], rel=1e-2)
        assert (grad - eager[1]).norm() <= 3e-2 * eager[1].norm()


def test_compiled_step_with_cuda_graphs_and_length_bins_trains_like_eager_on_cuda(small_data, tmp_path):
    common = ["run", "bert", f"data.dir={small_data}", "device=cuda", "eval_samples=256", "eval.every_samples=640"]
    common += ["schedule.max_samples=1280", "progress=false", "log_every_steps=1", "micro_batch_size=64"]
    run_cli(*common, f"output.results_dir={tmp_path / 'eager'}")
    fast = ["perf.compile=true", "perf.cuda_graphs=true", "data.length_bins=4"]
    run_cli(*common, *fast, f"output.results_dir={tmp_path / 'fast'}")
    losses = {}
    for name in ("eager", "fast"):
        rows = [json.loads(line) for line in (only_run_dir(tmp_path / name) / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [r["loss"] for r in rows if "loss" in r]
    assert len(losses["eager"]) == len(losses["fast"]) == 20
    # bf16 autocast and other kernels: close, not equal
    for a, b in zip(losses["eager"], losses["fast"], strict=True):
        assert abs(a - b) <= 0.02 * abs(a), losses


def test_pinned_steps_keep_their_sample_count_and_copy_without_waiting_on_cuda():
    import numpy as np

    from trainbench.benchmarks.bert import BertBenchmark
    from trainbench.data.bert_hdf5 import Step
    from trainbench.data.prefetch import pinned

    step = Step({"input_ids": np.arange(6).reshape(2, 3) + 10 * i} for i in range(2))
    step.samples = 7
    (out,) = list(pinned([step], torch.device("cuda", 0)))
    assert out.samples == 7 and len(out) == 2 and all(mb["input_ids"].is_pinned() for mb in out)
    on_gpu = BertBenchmark().to_device(out[1], torch.device("cuda"))
    assert on_gpu["input_ids"].is_cuda and on_gpu["input_ids"].tolist() == [[10, 11, 12], [13, 14, 15]]


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


def test_decoder_packed_rows_through_flex_match_the_dense_mask_with_gradients_on_cuda():
    """The decoder's FlexAttention block mask (compiled blocks on CUDA) against SDPA with the dense document mask:
    the same outputs and gradients, with grouped-query attention, padding and sequences of odd lengths."""
    from trainbench.families.decoder.model import DecoderConfig, DecoderLM

    cfg = DecoderConfig(vocab_size=512, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                        intermediate_size=256, max_seq_length=512, rope_theta=10000.0)  # fmt: skip
    torch.manual_seed(0)
    model = DecoderLM(cfg).cuda()
    model.init_weights(0)
    lengths = [[100, 157, 199], [256, 200], [511]]
    tokens = torch.randint(0, 512, (3, 512), device="cuda")
    segments = torch.full((3, 512), -1, device="cuda")
    positions = torch.zeros(3, 512, dtype=torch.long, device="cuda")
    for b, row in enumerate(lengths):
        at = 0
        for i, n in enumerate(row):
            segments[b, at : at + n], positions[b, at : at + n] = i, torch.arange(n, device="cuda")
            at += n
    targets = torch.where(segments >= 0, tokens.roll(-1, 1), -100)
    results = []
    for kernel in ("dense", "flex"):
        model.model.packed_kernel = kernel
        model.zero_grad()
        loss = model(tokens, targets=targets, positions=positions, segments=segments)
        loss.backward()
        results.append((float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (dense, g_dense), (flex, g_flex) = results
    assert flex == pytest.approx(dense, rel=1e-4)
    for name, g in g_dense.items():
        assert float((g_flex[name] - g).abs().max()) <= 2e-3 * float(g.abs().max()) + 1e-7, name


@pytest.mark.parametrize("base", ["auto", "fp8"])
def test_tiny_lora_reaches_its_target_with_a_bf16_or_fp8_base_compiled_on_cuda(tmp_path, base):
    tiny_run_to_target_on_cuda(tmp_path, "llama2_70b_lora", "perf.compile=true", "perf.activation_checkpointing=true",
                               f"model.base_precision={base}")  # fmt: skip


def test_offloaded_blocks_train_like_kept_ones_with_less_gpu_memory_on_cuda(monkeypatch):
    """Four FP8 LoRA blocks, compiled inside their checkpointing as `trainbench run` places them: with two blocks'
    saved activations in host memory the loss is the same and the adapters' gradients too, and the GPU holds less
    between forward and backward."""
    import dataclasses

    from trainbench.benchmarks.lora import TINY
    from trainbench.distributed import DistInfo
    from trainbench.families.decoder import offload
    from trainbench.families.decoder.lora_placement import place_lora
    from trainbench.families.decoder.model import DecoderLM

    monkeypatch.setattr(offload, "MIN_BYTES", 1 << 20)
    cfg = dataclasses.replace(TINY, hidden_size=1024, num_heads=8, num_kv_heads=2, intermediate_size=2816,
                              num_layers=4, vocab_size=1000, max_seq_length=2048, base_precision="fp8")  # fmt: skip
    with torch.device("meta"):
        model = DecoderLM(cfg)
    one = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cuda", 0))
    model = place_lora(model, cfg, one, 1, True, False, True, 0).module
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 1000, (2, 2048), generator=gen).cuda()

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens, targets=tokens)
        held = torch.cuda.memory_allocated()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads, held

    step()  # compile
    loss, grads, held = step()
    _, again, _ = step()  # the attention backward's own run-to-run differences (its atomics)
    moved = offload.offload_blocks(model.model.layers, 2, one.device)
    assert moved.offloaded == [0, 2]
    step()
    loss_off, grads_off, held_off = step()
    assert moved.bytes_per_step > 2 * 2048 * 1024 * 2  # at least a block's input and its attention output
    assert torch.equal(loss_off, loss)
    for name, g in grads.items():
        noise = float((again[name] - g).abs().max())
        err = float((grads_off[name] - g).abs().max())
        scale = float(g.abs().max())
        assert err <= max(2 * noise, 1e-3 * scale), (name, err, noise, scale)
    assert all(float(g.abs().max()) > 0 for n, g in grads.items() if "lora_B" in n)  # (lora_B starts at 0: A's are 0)
    assert held - held_off > moved.bytes_per_step / 4  # block 0's copies are released during the forward
    moved.remove()
    assert all(b.saved_to_host is None for b in model.model.layers)


def test_recomputed_blocks_with_their_inputs_on_the_host_train_like_kept_ones_on_cuda(monkeypatch):
    """The last two of four FP8 LoRA blocks recomputed, their inputs in host memory (offload.recompute_from_host):
    the same loss and adapters' gradients as recomputing them with the inputs on the GPU, and the GPU holds less
    between forward and backward."""
    import dataclasses

    from trainbench.benchmarks.lora import TINY
    from trainbench.distributed import DistInfo
    from trainbench.families.decoder import offload
    from trainbench.families.decoder.lora_placement import place_lora
    from trainbench.families.decoder.model import DecoderLM, recompute_last

    monkeypatch.setattr(offload, "MIN_BYTES", 1 << 20)
    cfg = dataclasses.replace(TINY, hidden_size=1024, num_heads=8, num_kv_heads=2, intermediate_size=2816,
                              num_layers=4, vocab_size=1000, max_seq_length=2048, base_precision="fp8")  # fmt: skip
    with torch.device("meta"):
        model = DecoderLM(cfg)
    one = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cuda", 0))
    model = place_lora(model, cfg, one, 1, True, False, True, 0).module
    recompute_last(model, 4)  # all four (the first's input needs no gradient): 0 and 1 are released in the forward
    tokens = torch.randint(0, 1000, (2, 2048), generator=torch.Generator().manual_seed(0)).cuda()

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens, targets=tokens)
        held = torch.cuda.memory_allocated()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads, held

    step()
    loss, grads, held = step()
    _, again, _ = step()
    moved = offload.offload_blocks(model.model.layers, 0, one.device, recomputed_inputs=True)
    assert moved.offloaded == [0, 1, 2, 3]
    step()
    loss_off, grads_off, held_off = step()
    assert moved.bytes_per_step == 4 * 2 * 2048 * 1024 * 2  # four blocks' inputs, bf16 [2, 2048, 1024]
    assert torch.equal(loss_off, loss)
    for name, g in grads.items():
        noise = float((again[name] - g).abs().max())
        err = float((grads_off[name] - g).abs().max())
        assert err <= max(2 * noise, 1e-3 * float(g.abs().max())), (name, err, noise)
    assert all(float(g.abs().max()) > 0 for n, g in grads_off.items() if "lora_B" in n)
    # blocks 0 and 1's inputs (8 MiB each) left the GPU during the forward: more than one input's bytes are freed
    # (measured on an H200: 13.75 MiB fewer held; one input alone would be 8 MiB)
    assert held - held_off >= 1.5 * 2 * 2048 * 1024 * 2, held - held_off
    moved.remove()


@pytest.mark.alone  # (compares the host link's rates while a step runs and while none does)
def test_the_layout_probe_measures_a_block_of_the_lora_model_and_the_plan_fits_this_gpu(tmp_path, monkeypatch):
    """The probe (two blocks of a 2048-wide LoRA model through the run's own build) measures what the planner needs,
    and the plan made from it for a 48-block model of that width fits this GPU by its own account."""

    from trainbench.measure import probe
    from trainbench.measure.layout import block_probe, resources
    from trainbench.resolve import build_config

    bench, cfg = build_config("llama2_70b_lora", "llama2-70b", [], {
        "device": "cuda", "model.hidden_size": "2048", "model.num_heads": "16", "model.num_kv_heads": "4",
        "model.intermediate_size": "5632", "model.num_layers": "48", "data.seq_length": "4096"})  # fmt: skip
    data = probe.measure(bench.probe_config(cfg), bench)
    hidden = 4096 * 2048 * 2
    assert data["input_bytes"] == hidden and 2 * hidden < data["kept_bytes"] < 40 * hidden
    # (a frozen base has no weight gradients: a block's backward is about its forward again, with attention's more)
    assert 0 < data["forward_s"] < 1 and 0 < data["backward_s"] < 1 and data["to_host_bytes_s"] > 1e9
    # while a step runs the copies share the GPU's memory with it: no faster than idle (timing spread aside)
    for way in ("to_host", "to_gpu"):
        assert 1e9 < data[f"{way}_busy_bytes_s"] < 1.1 * data[f"{way}_bytes_s"], (way, data)
    assert data["block_weight_bytes"] > 2048 * 2048 * 4  # FP8 weights of a block: more than its q/k/v/o bytes
    planned, lines = bench.plan_layout(cfg, resources(cfg, data, here=True), block_probe(data))
    assert planned.model.base_precision == "fp8" and "predicted:" in lines[1]


@pytest.mark.parametrize("precision", ["auto", "fp8"])
def test_the_layout_probe_measures_a_compiled_block_of_the_8b_model(precision):
    """perf.layout=auto for llama31_8b probes its blocks compiled (Module.compile) as the run builds them: the marks
    around a block run outside its graph, so its forward, backward and kept bytes are measured (traced into the
    graph, the probe's CUDA events were never recorded and it failed)."""
    from trainbench.measure import probe
    from trainbench.resolve import build_config

    if precision == "fp8":
        pytest.importorskip("torchao", reason="torchao is the optional extra trainbench[fp8]")
    bench, cfg = build_config("llama31_8b", "llama31-8b", [], {
        "device": "cuda", "perf.compile": "true", "model.precision": precision, "model.hidden_size": "1024",
        "model.num_heads": "8", "model.num_kv_heads": "2", "model.intermediate_size": "3584",
        "data.seq_length": "2048"})  # fmt: skip
    data = probe.measure(bench.probe_config(cfg), bench)
    hidden = 2048 * 1024 * 2  # a row of bf16 activations (the residual stream is fp32 under autocast: twice that)
    assert 0 < data["forward_s"] < 1 and 0 < data["backward_s"] < 1, data
    assert data["input_bytes"] in (hidden, 2 * hidden) and 2 * hidden < data["kept_bytes"] < 40 * hidden, data
    assert data["optimizer_bytes_per_block"] > 0 and data["other_optimizer_bytes"] > 0, data
    # the clock its timed steps ran at, where NVML sampled one (steps this short may fall between two samples)
    assert "sm_clock_mhz" in data and (data["sm_clock_mhz"] is None or 100 < data["sm_clock_mhz"] < 5000), data


@pytest.mark.alone  # (the host link's rates)
def test_the_host_link_shared_by_every_gpu_here_is_no_faster_than_one_gpu_alone(tmp_path):
    """measure/probe.link_rates on every GPU of this machine at once (one GPU: the same as alone): each GPU's
    rate both ways is real and no more than its rate copying alone (timing spread aside); the ``--link`` entry writes
    the pair a plan caches."""
    from trainbench.measure import probe
    from trainbench.measure.layout import main

    alone = probe.link_rates()
    shared = probe.link_rates(gpus=torch.cuda.device_count())
    for rate, single in zip(shared, alone, strict=True):
        assert 1e9 < rate < 1.1 * single, (shared, alone)
    out = tmp_path / "link.json"
    assert main(["--link", str(torch.cuda.device_count()), str(out)]) == 0
    assert all(r > 1e9 for r in json.loads(out.read_text()))


def test_a_gpu_memory_limit_holds_the_allocator_to_it_on_cuda():
    """perf.gpu_memory_gib: the allocator refuses what a GPU of that size would not have had free, grants what it
    would, and a limit above the GPU's memory is one sentence."""
    from trainbench.errors import ConfigError
    from trainbench.resolve import build_config
    from trainbench.train.setup import limit_gpu_memory

    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()  # what is taken now, earlier tests' live tensors included, stays taken
    bench, cfg = build_config(
        "bert", "tiny", [], {"device": "cuda", "perf.gpu_memory_gib": f"{(total - free) / 2**30 + 2.5:.4f}"}
    )
    try:
        limit_gpu_memory(cfg, torch.device("cuda"))
        kept = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")  # 2 GiB of the 2.5 left
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        del kept
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    big = dataclasses.replace(cfg, perf=dataclasses.replace(cfg.perf, gpu_memory_gib=total / 2**30 + 1))
    with pytest.raises(ConfigError, match="is more than this GPU has"):
        limit_gpu_memory(big, torch.device("cuda"))


def test_tiny_lora_reaches_its_target_with_offloaded_blocks_on_cuda(tmp_path, monkeypatch):
    from trainbench.families.decoder import offload

    monkeypatch.setattr(offload, "MIN_BYTES", 0)  # the tiny model's tensors are small: move them all
    tiny_run_to_target_on_cuda(tmp_path, "llama2_70b_lora", "perf.compile=true", "perf.activation_checkpointing=true",
                               "perf.recompute_blocks=1", "perf.offload_blocks=1",
                               "model.base_precision=fp8")  # fmt: skip


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


def test_tiny_llama_reaches_its_target_training_in_fp8_on_cuda(tmp_path, capsys):
    pytest.importorskip("torchao", reason="torchao is the optional extra trainbench[fp8]")
    tiny_run_to_target_on_cuda(tmp_path, "llama31_8b", "--preset", "tiny", "perf.compile=true", "model.precision=fp8")
    assert (
        "14 linear layers of the blocks train in FP8 (torchao's float8 training, tensorwise" in capsys.readouterr().out
    )


@pytest.mark.parametrize("sharded", ["false", "true"])
def test_tiny_llama_reaches_its_target_with_its_output_layer_in_fp8_on_cuda(tmp_path, capsys, sharded):
    """model.output_precision=fp8, compiled blocks: the output layer and its loss through fp8_output's function,
    unsharded (its weight cast once a step) and sharded by FSDP2 over the one GPU (its weight gathered with the
    model's root, cast in each micro-batch)."""
    pytest.importorskip("torchao", reason="torchao is the optional extra trainbench[fp8]")
    tiny_run_to_target_on_cuda(tmp_path, "llama31_8b", "--preset", "tiny", "perf.compile=true", "model.precision=fp8",
                               "model.output_precision=fp8", f"distributed.shard_one_rank={sharded}")  # fmt: skip
    out = capsys.readouterr().out
    assert "14 linear layers of the blocks train in FP8" in out and ", the output layer and its loss too" in out
    assert "; the embedding as" in out


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


def test_fp8_sharded_over_one_gpu_trains_the_losses_of_the_unsharded_fp8_path_on_cuda(tmp_path):
    """distributed.shard_one_rank in FP8: FSDP2 over one GPU gathers the FP8 weights in FP8 with scales precomputed
    after each step; over 20 steps its losses stay within FP8's tolerance of the unsharded FP8 path's (FSDP2 keeps
    the norms' weights in bf16 where the unsharded path keeps them in fp32 under autocast)."""
    from conftest import losses_and_evals

    pytest.importorskip("torchao", reason="torchao is the optional extra trainbench[fp8]")
    data = tmp_path / "data"
    assert run_cli("prepare", "llama31_8b", "--synthetic", "--preset", "tiny", "--out", data) == 0
    common = ["run", "llama31_8b", "--preset", "tiny", f"data.dir={data}", "device=cuda", "perf.compile=true",
              "model.precision=fp8", "progress=false", "log_every_steps=1", "telemetry_hz=0",
              "schedule.max_samples=640", "eval.every_samples=640", "eval_samples=64"]  # fmt: skip
    runs = {"unsharded": [], "sharded": ["distributed.shard_one_rank=true"]}
    losses, evals = losses_and_evals(common, runs, tmp_path / "r", "log_perplexity")
    assert len(losses["unsharded"]) == 20 and losses["unsharded"][-1] < losses["unsharded"][0]
    assert max(abs(a - b) for a, b in zip(losses["unsharded"], losses["sharded"], strict=True)) <= 2e-2, losses
    assert max(abs(a - b) for a, b in zip(evals["unsharded"], evals["sharded"], strict=True)) <= 2e-2, evals
    console = (only_run_dir(tmp_path / "r" / "sharded") / "console.log").read_text()
    assert "FSDP2 gathers their weights in FP8" in console and "FSDP2 over this one rank" in console
    rows = "the embedding's gradient added into .grad by the rows each micro-batch touches"
    assert rows not in console  # (sharded: FSDP2 reduce-scatters the whole gradient)
    assert rows in (only_run_dir(tmp_path / "r" / "unsharded") / "console.log").read_text()


@pytest.mark.parametrize("max_norm", [1e-3, 1e3])  # clipped, and a norm under the limit (factor 1)
def test_the_clip_folded_into_the_fused_update_matches_the_separate_pass_on_cuda(max_norm):
    from trainbench.optim.adamw import AdamClipped

    def g(seed: int, shape) -> torch.Tensor:
        return torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))

    shapes = [(512, 256), (256,), (3, 1000)]

    def train(limit: float, fold: bool) -> list[torch.Tensor]:
        params = [torch.nn.Parameter(g(i, s)) for i, s in enumerate(shapes)]
        # eps of the gradients' clipped size: the update then depends on the clip (Adam alone is scale-free)
        opt = AdamClipped(params, limit, fold_clip=fold, lr=1e-2, eps=1e-4, weight_decay=0.1, fused=True)
        assert opt._folds([p.detach() for p in params]) is fold
        for step in range(3):
            for i, p in enumerate(params):
                p.grad = g(10 * (step + 1) + i, p.shape)
            opt.step()
            assert not hasattr(opt, "grad_scale")
        return [p.detach() for p in params]

    separate, folded, unclipped = train(max_norm, False), train(max_norm, True), train(0.0, True)
    for a, b, c in zip(separate, folded, unclipped, strict=True):
        # the same update but for rounding: the separate pass multiplies by the factor, the kernel divides by its
        # reciprocal
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
        if max_norm > 1:
            torch.testing.assert_close(b, c, rtol=1e-6, atol=1e-6)
    if max_norm < 1:  # the clip did act, so the comparison above saw it
        assert max((b - c).abs().max() for b, c in zip(folded, unclipped, strict=True)) > 1e-3


def test_own_adamw_kernel_matches_torchs_fused_update_and_keeps_its_state_on_cuda():
    """optim/adamw: tb_adamw (the large parameters) against torch's fused AdamW over 3 steps, the clip folded in,
    weight decay on one group and off the other; the state it keeps is torch's, so a checkpoint taken under one
    continues under the other."""
    from trainbench.optim.adamw import OWN_KERNEL_MIN, AdamClipped

    def g(seed: int, shape) -> torch.Tensor:
        return torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))

    shapes = [(1024, OWN_KERNEL_MIN // 1024 + 3), (OWN_KERNEL_MIN + 5,), (256,)]  # two large (one odd size), small

    def optimizer(own: bool, params):
        groups = [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}]
        opt = AdamClipped(groups, 1e-3, own_kernel=own, lr=1e-2, betas=(0.9, 0.95), eps=1e-6, fused=True)
        return opt, [own and p.numel() >= OWN_KERNEL_MIN for p in params]

    def train(own: bool, steps: range, state=None) -> tuple[list[torch.Tensor], dict]:
        params = [torch.nn.Parameter(g(i, s) if state is None else state[0][i].clone()) for i, s in enumerate(shapes)]
        opt, expect_own = optimizer(own, params)
        if state is not None:
            opt.load_state_dict(state[1])
        for step in steps:
            for i, p in enumerate(params):
                p.grad = g(10 * (step + 1) + i, p.shape)
            assert [opt._own(opt.param_groups[0 if i < 2 else 1], p) for i, p in enumerate(params)] == expect_own
            opt.step()
            assert all(p.grad is not None for p in params) and not hasattr(opt, "grad_scale")
        return [p.detach().clone() for p in params], opt.state_dict()

    start = [g(i, s) for i, s in enumerate(shapes)]
    torchs, torch_state = train(False, range(3))
    ours, our_state = train(True, range(3))
    for a, b, s in zip(ours, torchs, start, strict=True):
        assert (b - s).abs().max() > 1e-3  # the steps moved the weights
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6 * float((b - s).abs().max()))
    for name in ("step", "exp_avg", "exp_avg_sq"):
        for i in range(len(shapes)):
            a, b = our_state["state"][i][name], torch_state["state"][i][name]
            assert (a.dtype, a.device, a.shape) == (b.dtype, b.device, b.shape)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-12)
    # 3 steps under torch's update then 2 under ours equal 5 under torch's (and the reverse)
    five, _ = train(False, range(5))
    mixed, _ = train(True, range(3, 5), (torchs, torch_state))
    reverse, _ = train(False, range(3, 5), (ours, our_state))
    for a, b, c in zip(mixed, reverse, five, strict=True):
        torch.testing.assert_close(a, c, rtol=2e-6, atol=1e-6)
        torch.testing.assert_close(b, c, rtol=2e-6, atol=1e-6)


def test_own_adamw_kernel_updates_sharded_parameters_as_torchs_fused_update_on_cuda():
    """optim/adamw under FSDP2's DTensors (one rank, Shard(0)): tb_adamw updates each local shard, the clip (a
    separate pass for sharded gradients) before it, as torch's fused update does."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from trainbench.optim.adamw import OWN_KERNEL_MIN, AdamClipped

    def g(seed: int, shape) -> torch.Tensor:
        return torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))

    shapes = [(1024, OWN_KERNEL_MIN // 1024 + 3), (512,)]
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        mesh = init_device_mesh("cuda", (1,))
        weights = {}
        for own in (False, True):
            params = [torch.nn.Parameter(distribute_tensor(g(i, s), mesh, [Shard(0)])) for i, s in enumerate(shapes)]
            opt = AdamClipped(params, 1e-3, own_kernel=own, lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1,
                              fused=True)  # fmt: skip
            for step in range(3):
                for i, p in enumerate(params):
                    p.grad = distribute_tensor(g(10 * (step + 1) + i, p.shape), mesh, [Shard(0)])
                assert [opt._own(opt.param_groups[0], p) for p in params] == [own, False]
                opt.step()
            weights[own] = [p.detach().full_tensor() for p in params]
    finally:
        dist.destroy_process_group()
    for i, (a, b) in enumerate(zip(weights[True], weights[False], strict=True)):
        change = float((b - g(i, shapes[i])).abs().max())
        assert change > 1e-3
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6 * change)


def test_embedding_rows_into_grad_is_torchs_embedding_gradient_bit_for_bit_on_cuda():
    """families/decoder/embedding_rows on CUDA at gpt_oss_20b's vocabulary (a narrow table): over 3 micro-batches of
    32,768 tokens with repeats, the .grad equals torch's embedding backward and autograd's accumulation bit for bit (the
    adds into .grad never meet on a row, so their order does not matter)."""
    from trainbench.families.decoder.embedding_rows import rows_into_grad

    torch.manual_seed(0)
    plain = torch.nn.Embedding(201088, 64).cuda()
    ours = torch.nn.Embedding(201088, 64).cuda()
    ours.load_state_dict(plain.state_dict())
    rows_into_grad(ours)
    gen = torch.Generator("cuda").manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 5000, (4, 8192), device="cuda", generator=gen)  # many repeats
        upstream = torch.randn(4, 8192, 64, device="cuda", generator=gen)
        (plain(ids) * upstream).sum().backward()
        (ours(ids) * upstream).sum().backward()
        assert torch.equal(plain.weight.grad, ours.weight.grad)
    assert int((plain.weight.grad.abs().sum(1) > 0).sum()) > 4000


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


@pytest.mark.parametrize("preset", ["tiny", "tiny-hf"])
def test_tiny_gpt_oss_reaches_its_target_compiled_on_cuda(tmp_path, preset):
    """gpt_oss_20b's two blocks compiled on CUDA in bf16: FlexAttention for the window (and the sinks from its
    log-sum-exp), torch's grouped GEMM for the experts, the router in fp32."""
    tiny_run_to_target_on_cuda(tmp_path, "gpt_oss_20b", "--preset", preset, "perf.compile=true")


def test_tiny_gpt_oss_reaches_its_target_training_in_fp8_on_cuda(tmp_path, capsys):
    """model.precision=fp8 on gpt_oss_20b, compiled: the blocks' attention projections in torchao's float8 training,
    the experts' grouped products in FP8 (families/decoder/moe._FP8Grouped), the router in fp32; the log discloses
    FP8."""
    pytest.importorskip("torchao", reason="torchao is the optional extra trainbench[fp8]")
    run_dir = tiny_run_to_target_on_cuda(tmp_path, "gpt_oss_20b", "--preset", "tiny", "perf.compile=true",
                                         "model.precision=fp8")  # fmt: skip
    out = capsys.readouterr().out
    # 2 blocks x (q, k, v, o); the routers are not swapped
    assert "8 linear layers of the blocks train in FP8" in out and "the routers as before" in out, out
    assert "the experts' grouped products of 2 blocks in FP8" in out
    events = [json.loads(line.split(":::MLLOG ")[1]) for line in (run_dir / "result_0.txt").read_text().splitlines()]
    assert {e["key"]: e["value"] for e in events}["lowest_numerical_precision_in_linear"] == "fp8"


@pytest.mark.parametrize("activation, bias", [("silu", False), ("gpt_oss", True)])
def test_the_experts_in_fp8_match_bf16_in_output_and_every_gradient_on_cuda(activation, bias):
    """families/decoder/moe with fp8 (FP8 grouped products, each expert's rows padded to 16) against the same layer
    in bf16 and in fp64: FP8's error in the output and in the input's, experts' and router's gradients is of FP8's
    size (a few percent of each tensor's norm), and no more than a few times bf16's own."""
    from trainbench.families.decoder.moe import MoE, MoEShape, experts_in_fp8

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


@pytest.mark.parametrize("spread", [1.0, 1e3])
def test_the_experts_fp8_weight_gradient_matches_each_experts_product_in_float64_on_cuda(spread):
    """moe.fp8_weight_grad: each expert's x^T grad over its rows (groups of multiples of 16 rows, one of none) as
    one FP8 grouped product, against float64: within FP8's error (e4m3 rounds each operand by up to 6 %; the sums
    over an expert's rows average much of it out), also where the rows' magnitudes spread over ``spread``, and far
    above bf16's own error (the product ran in FP8); an expert with no rows gets zeros."""
    from trainbench.families.decoder.moe import _e4m3, fp8_weight_grad

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
    from trainbench.families.decoder.moe import MoE, MoEShape, experts_in_fp8

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
    """moe._rows_e4m3 with ``compiled`` (the expert-parallel dispatch runs outside the compiled blocks): the e4m3 rows
    and their scales' reciprocals equal the eager casts' bit for bit, at row counts that change every call (as the
    rows that arrive at a rank do) and at both of the experts' widths, without a compilation for each count."""
    from trainbench.families.decoder import moe

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
    from trainbench.families.decoder.moe import cache_fp8_weight_casts

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
    the fp32 ``.grad`` through stand-ins (moe._fp32_grad_stand_in, its cast and addition compiled): over 3 steps of 2
    micro-batches every gradient and output equals, bit for bit, the same layer's with the stand-ins taken away
    (autograd's cast and add), and the steps after the first compile nothing new."""
    from trainbench.families.decoder.moe import cache_fp8_weight_casts

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


def test_gpt_oss_attention_through_flex_matches_the_dense_path_with_gradients_on_cuda():
    """The window and the sinks through compiled FlexAttention against the dense sink attention, gradients included."""
    import dataclasses

    from trainbench.families.decoder.gpt_oss import GptOssConfig, GptOssLM

    cfg = GptOssConfig(block="gpt_oss", vocab_size=128, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                       attention_head_dim=32, intermediate_size=64, num_experts=4, experts_per_token=2,
                       sliding_window=64, yarn_factor=32.0)  # fmt: skip
    grads = []
    for kernel in ("dense", "flex"):
        torch.manual_seed(0)
        model = GptOssLM(dataclasses.replace(cfg)).cuda()
        model.init_weights(1)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_()
        model.model.packed_kernel = kernel
        for layer in model.model.layers:
            layer.compile(dynamic=False)
        ids = torch.randint(0, 128, (2, 256), device="cuda")
        model(ids[:, :-1], targets=ids[:, 1:]).backward()
        grads.append({n: p.grad.float().clone() for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        assert torch.allclose(g, grads[1][name], rtol=1e-3, atol=1e-4), name


@pytest.mark.parametrize("kernel, window", [("flash", None), ("flash", 96), ("cudnn", None)])
@pytest.mark.parametrize("sinks", [True, False])
def test_fused_sink_attention_matches_the_dense_form_in_every_gradient_on_cuda(kernel, window, sinks):
    """families/decoder/sink_attention.fused_sink_attention (a fused kernel's own forward and backward, the sinks
    applied outside them) against the dense form in float64: output, query, key, value and sink gradients within bf16's
    own error (the dense form on the same bf16 inputs)."""
    from trainbench.families.decoder.sink_attention import fused_sink_attention, sink_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(2, 8, 512, 64), (2, 2, 512, 64), (2, 2, 512, 64)]
    exact = [torch.randn(*s, generator=g, device="cuda", dtype=torch.float64).requires_grad_() for s in shapes]
    exact_sinks = torch.randn(8, generator=g, device="cuda", dtype=torch.float64)
    if sinks:
        exact.append(exact_sinks.requires_grad_())
    direction = torch.randn(2, 8, 512, 64, generator=g, device="cuda", dtype=torch.float64)

    def run(fn, tensors):
        out = fn(*tensors[:3], tensors[3] if sinks else None)
        (out.double() * direction).sum().backward()
        return [out.double()] + [t.grad.double() for t in tensors]

    none = torch.full((8,), -torch.inf, device="cuda")
    want = run(lambda q, k, v, s: sink_attention(q, k, v, s if sinks else none.double(), window), exact)

    def halves():
        return [t.detach().to(torch.bfloat16 if i < 3 else torch.float32).requires_grad_() for i, t in enumerate(exact)]

    dense = run(lambda q, k, v, s: sink_attention(q, k, v, s if sinks else none, window), halves())
    fused = run(lambda q, k, v, s: fused_sink_attention(q, k, v, s, window, kernel), halves())
    for name, w, d, f in zip(("out", "dq", "dk", "dv", "dsinks"), want, dense, fused, strict=False):
        err_dense, err_fused = (float((x - w).norm() / w.norm()) for x in (d, f))
        assert err_fused < max(3 * err_dense, 2e-3), (name, err_fused, err_dense)


@pytest.mark.parametrize(
    "preset, causal, windowed",
    [("tiny-hf", "flash", "flash"), ("tiny-hf", "cudnn", "flex"), ("tiny", "cudnn", "flash")],
)
def test_tiny_gpt_oss_reaches_its_target_through_the_fused_attention_on_cuda(tmp_path, capsys, preset, causal,
                                                                             windowed):  # fmt: skip
    """model.attention (the causal blocks) and model.window_attention (the windowed ones): flash attention, with its
    own window, or cuDNN, GPT-OSS's sinks applied outside the kernels; the tiny presets still reach their target, and
    the run says which kernels it took."""
    tiny_run_to_target_on_cuda(tmp_path, "gpt_oss_20b", "--preset", preset, "perf.compile=true",
                               f"model.attention={causal}", f"model.window_attention={windowed}")  # fmt: skip
    assert f"attention through {causal} (whole prefix) and {windowed} (window)" in capsys.readouterr().out


def test_the_default_attention_is_cudnn_on_hopper_and_newer_in_bf16(tmp_path, capsys):
    """model.attention=auto: cuDNN for the causal blocks on compute capability 9.0 or newer, FlexAttention before."""
    tiny_run_to_target_on_cuda(tmp_path, "gpt_oss_20b", "--preset", "tiny-hf", "perf.compile=true")
    want = "cudnn" if torch.cuda.get_device_capability() >= (9, 0) else "flex"
    assert f"attention through {want} (whole prefix) and flex (window)" in capsys.readouterr().out


@pytest.mark.parametrize("placement", [[], ["perf.compile=true", "perf.activation_checkpointing=true"]])
def test_tiny_flux_reaches_its_target_on_cuda(tmp_path, placement):
    """flux1's tiny preset in bf16 on CUDA: the rectified-flow loss to 0.586, the log compliant but for the scaled-down
    eval cadence; eager as one module, and compiled block by block with every block recomputed."""
    tiny_run_to_target_on_cuda(tmp_path, "flux1", "--preset", "tiny", *placement)


def test_tiny_flux_reaches_its_target_training_in_fp8_on_cuda(tmp_path, capsys):
    """flux1's tiny preset with model.precision=fp8, compiled: its blocks' attention and MLP layers in torchao's float8
    training, their modulation not; the same target, a compliant log that discloses fp8."""
    pytest.importorskip("torchao", reason="torchao is the optional extra trainbench[fp8]")
    run_dir = tiny_run_to_target_on_cuda(
        tmp_path, "flux1", "--preset", "tiny", "perf.compile=true", "model.precision=fp8"
    )
    # 2 double blocks x 2 streams x (qkv, proj, 2 MLP layers) + 2 single blocks x (linear1, linear2)
    assert "20 linear layers of the blocks train in FP8" in capsys.readouterr().out
    events = [json.loads(line.split(":::MLLOG ")[1]) for line in (run_dir / "result_0.txt").read_text().splitlines()]
    assert {e["key"]: e["value"] for e in events}["lowest_numerical_precision_in_linear"] == "fp8"
