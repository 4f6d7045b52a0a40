"""gpt_oss_20b on one GPU: its tiny presets to their target compiled, in FP8 and through the fused attention, the
window and the sinks through FlexAttention and the fused kernels, and the default attention.

Part of the single-GPU tier (``make test-gpu``, every tests/test_gpu_*.py but test_gpu_multi.py), skipped where no
CUDA device is visible."""

import json

import pytest
import torch
from conftest import single_gpu_tier, tiny_run_to_target_on_cuda

pytestmark = single_gpu_tier()


@pytest.mark.parametrize("preset", ["tiny", "tiny-hf"])
def test_tiny_gpt_oss_reaches_its_target_compiled_on_cuda(tmp_path, preset):
    """gpt_oss_20b's two blocks compiled on CUDA in bf16: FlexAttention for the window (and the sinks from its
    log-sum-exp), torch's grouped GEMM for the experts, the router in fp32."""
    tiny_run_to_target_on_cuda(tmp_path, "gpt_oss_20b", "--preset", preset, "perf.compile=true")


def test_tiny_gpt_oss_reaches_its_target_training_in_fp8_on_cuda(tmp_path, capsys):
    """model.precision=fp8 on gpt_oss_20b, compiled: the blocks' attention projections in torchao's float8 training,
    the experts' grouped products in FP8 (families/decoder/moe_fp8._FP8Grouped), the router in fp32; the log discloses
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


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_a_one_gpu_bench_in_fp8_keeps_the_casts_expert_parallelism_adds_on_cuda(tmp_path, monkeypatch, compiled):
    """`trainbench bench gpt_oss_20b` on one GPU in FP8 keeps, beside its step, the casts expert parallelism would add
    outside the compiled blocks a block and micro-batch (GptOssFamily.one_gpu_rates): compiled, by the kernel, and
    the FP8 wire's; each a time above zero, which a forecast on several GPUs charges (measure/forecast.py). Uncompiled,
    the wire's alone: the forecast charges no row casts there, so none is compiled to be timed."""
    from conftest import run_cli

    pytest.importorskip("torchao", reason="torchao is the optional extra trainbench[fp8]")
    monkeypatch.setenv("TRAINBENCH_CACHE_DIR", str(tmp_path / "cache"))
    assert run_cli("bench", "gpt_oss_20b", "--preset", "tiny", "--steps", "2", "--warmup", "1", "--profile-steps", "0",
                   "device=cuda", "progress=false", "output.telemetry_hz=0", f"perf.compile={str(compiled).lower()}",
                   "model.precision=fp8", f"output.results_dir={tmp_path / 'one'}") == 0  # fmt: skip
    kept = [json.loads(p.read_text()) for p in (tmp_path / "cache").rglob("*.json")]
    rates = [k["family_rates"] for k in kept if "step_s" in k]
    assert len(rates) == 1, kept
    want = (
        {"expert_casts_compiled_s", "expert_casts_kernel_s", "expert_casts_wire_s"}
        if compiled
        else {"expert_casts_wire_s"}
    )
    assert set(rates[0]) == want, rates
    assert all(s > 0 for s in rates[0].values()), rates
