"""The decoder LLMs on one GPU: packed rows through FlexAttention, the tiny llama to its target in FP8 (its output
layer too, sharded over one GPU or not), and the embedding's gradient rows.

Part of the single-GPU tier (``make test-gpu``, every tests/test_gpu_*.py but test_gpu_multi.py), skipped where no
CUDA device is visible."""

import pytest
import torch
from conftest import only_run_dir, run_cli, single_gpu_tier, tiny_run_to_target_on_cuda

pytestmark = single_gpu_tier()


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
