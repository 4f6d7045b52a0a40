"""BERT on one GPU: its bf16 forward and tiny run, the packed rows' attention kernels (FlexAttention, varlen flash,
cuDNN) and their dropout, the compiled step in CUDA graphs, and the pinned steps' copy to the GPU.

Part of the single-GPU tier (``make test-gpu``, every tests/test_gpu_*.py but test_gpu_multi.py), skipped where no
CUDA device is visible."""

import json

import pytest
import torch
from conftest import only_run_dir, run_cli, single_gpu_tier

pytestmark = single_gpu_tier()


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
