"""`trainbench bench`: the throughput of each benchmark's tiny preset through the run's own code (placement, step,
eval) on rows made in memory; bench.json's fields; --blocks extrapolation, labelled so; the report of a measurement's
folder; check and package refusing one; bad input in one sentence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import only_run_dir, run_cli

QUICK = ["--steps", "2", "--warmup", "1", "progress=false", "telemetry_hz=0"]
FIELDS = {"kind", "benchmark", "preset", "figures", "blocks", "blocks_measured", "ranks", "device", "global_batch_size",
          "step_seconds", "samples_per_s", "tokens_per_s", "samples_per_s_per_rank", "tokens_per_s_per_rank", "mfu",
          "peak_memory_gib", "eval_seconds_per_sample", "energy_joules_per_token", "steps", "warmup", "raw", "ruleset",
          "projection", "gpus", "compare", "samples_per_step", "profile", "nodes", "tokens_per_s_per_node",
          "router", "system", "lookups_per_s", "projection_none", "peak_reserved_gib", "allocator_retries",
          "forecast"}  # fmt: skip


def measured(benchmark: str, results: Path, *extra: str) -> tuple[Path, dict]:
    assert run_cli("bench", benchmark, "--preset", "tiny", *QUICK, f"output.results_dir={results}", *extra) == 0
    folder = only_run_dir(results)
    return folder, json.loads((folder / "bench.json").read_text())


ONE_RANK = ["bert", "llama31_8b", "gpt3", "llama2_70b_lora", "gpt_oss_20b", "flux1", "dlrmv4"]


@pytest.mark.parametrize("benchmark", ONE_RANK)
def test_each_tiny_preset_is_measured_on_one_rank(benchmark, tmp_path, capsys):
    folder, result = measured(benchmark, tmp_path / "r")
    printed = capsys.readouterr().out
    assert set(result) == FIELDS
    assert result["kind"].startswith("throughput measurement") and "not a time-to-train result" in result["kind"]
    assert result["figures"] == "measured" and result["ranks"] == 1 and result["device"] == "cpu"
    assert result["steps"] == 2 and result["warmup"] == 1
    assert result["allocator_retries"] is None and result["peak_reserved_gib"] is None  # CUDA's alone
    raw = next(iter(result["raw"].values()))
    assert result["samples_per_s"] == pytest.approx(result["global_batch_size"] * 2 / raw["seconds"])
    assert result["tokens_per_s"] > result["samples_per_s"] > 0 and result["eval_seconds_per_sample"] > 0
    assert result["projection"] is None  # a scaled-down preset's rate says nothing of the reference's samples
    assert result["projection_none"].startswith("a scaled-down preset"), result
    assert f"no projected time to train: {result['projection_none']}" in printed
    assert result["gpus"] is None and result["profile"] is None  # no GPU telemetry or kernel profile on a CPU
    assert result["samples_per_step"] == result["global_batch_size"]  # a row is a sample (no packed rows here)
    assert raw["mean_loss"] > 0 and not (folder / "result_0.txt").exists()  # trained; no MLPerf log written
    assert "not a time-to-train result" in printed and "tokens/s" in printed
    if benchmark == "dlrmv4":  # the user's row, 3 crosses, and 3 rows for each of 24 history events and the candidate
        assert result["lookups_per_s"] == pytest.approx(result["samples_per_s"] * (1 + 3 + 3 * 25))
        assert "table lookups/s" in printed
    else:
        assert result["lookups_per_s"] is None
    router = result["router"]  # a mixture of experts: how evenly its routers spread the eval pass's tokens
    if benchmark == "gpt_oss_20b":
        assert router["experts"] == 4 and len(router["busiest_over_mean"]) == 2 and "router: the busiest" in printed
        assert router["tokens_routed"] == 2 * 64 * 128  # top 2 of every token of the eval batch
        spread = zip(router["idlest_over_mean"], router["busiest_over_mean"], strict=True)
        assert all(lo <= 1 <= hi for lo, hi in spread)
    else:
        assert router is None


def test_a_measurement_is_reported_and_compared_but_never_checked_or_packaged(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the comparison's page is written
    a, _ = measured("llama31_8b", tmp_path / "a")
    b, _ = measured("llama31_8b", tmp_path / "b")
    capsys.readouterr()
    assert run_cli("report", a) == 0
    report = (a / "report.md").read_text()
    assert "throughput measurement (trainbench bench): not a time-to-train result" in report
    assert "tokens/s" in report and "No projection: a scaled-down preset" in report and (a / "report.html").exists()
    assert run_cli("report", a, b) == 0
    printed = capsys.readouterr().out
    assert "B/A" in printed and "different GPUs" not in printed  # (no GPU recorded on the CPU)
    assert "Hardware: 1 x cpu; 1 node x 1 rank;" in report and len(list(tmp_path.glob("compare_*_vs_*.html"))) == 1
    # Measured on two machines (their GPUs' UUIDs differ): the ratio holds the machines' difference, and says so.
    for folder, ids in ((a, "GPU-3afc4ea2, GPU-2dee2e30"), (b, "GPU-9c413394, GPU-0b1c2d3e")):
        result = json.loads((folder / "bench.json").read_text())
        (folder / "bench.json").write_text(json.dumps(result | {"system": result["system"] | {"gpu_ids": ids}}))
    assert run_cli("report", a, b, "--out", tmp_path / "two.html") == 0
    said = "A and B ran on different GPUs (GPU-3afc4ea2, GPU-2dee2e30 against GPU-9c413394, GPU-0b1c2d3e):"
    assert said in capsys.readouterr().out and said in (tmp_path / "two.html").read_text()
    # Their GPUs linked differently (system.gpu_links): the sentence names that too.
    for folder, links in ((a, "18 active NVLinks on each of 2 GPUs"), (b, "no active NVLink on its 2 GPUs (PCIe)")):
        result = json.loads((folder / "bench.json").read_text())
        (folder / "bench.json").write_text(json.dumps(result | {"system": result["system"] | {"gpu_links": links}}))
    assert run_cli("report", a, b, "--out", tmp_path / "two.html") == 0
    assert ("GPU-0b1c2d3e), linked differently (18 active NVLinks on each of 2 GPUs against no active NVLink on its 2 "
            "GPUs (PCIe)): B/A includes") in capsys.readouterr().out  # fmt: skip
    for command in (("check", a), ("package", a, "--org", "o", "--system", "s", "--out", tmp_path / "pkg")):
        assert run_cli(*command) == 2
        assert "is a throughput measurement (trainbench bench), not a run" in capsys.readouterr().out
    assert not (tmp_path / "pkg").exists()


def test_truncated_depths_are_extrapolated_and_labelled_so(tmp_path, capsys):
    folder, result = measured("llama31_8b", tmp_path / "r", "--blocks", "1,2", "model.num_layers=4")
    printed = capsys.readouterr().out
    assert result["figures"] == "extrapolated" and result["blocks_measured"] == [1, 2] and result["blocks"] == 4
    one, two = (result["raw"][d]["seconds"] / result["raw"][d]["steps"] for d in ("1", "2"))
    assert result["step_seconds"] == pytest.approx(one + (two - one) * 3)  # a straight line through both, at 4
    assert "(extrapolated from 1, 2 of 4 blocks" in printed
    assert run_cli("report", folder) == 0 and "figures extrapolated from 1, 2 of 4 blocks" in (
        folder / "report.md").read_text()  # fmt: skip


def test_flux_blocks_are_a_double_block_and_its_share_of_single_ones(tmp_path, monkeypatch):
    """flux1 is truncated by double-stream blocks, each with single_blocks / double_blocks single-stream ones (1 in
    the tiny preset, 2 at FLUX.1's 19 + 38), so its step time is extrapolated in a straight line to the model's
    depth, and the MFU counts the whole model's FLOPs at that rate (a peak stood in for on the CPU)."""
    from trainbench.benchmarks import get_benchmark
    from trainbench.resolve import load_run_config

    monkeypatch.setattr("trainbench.report.bench_report.peak_tflops", lambda device: 1.0)
    folder, result = measured("flux1", tmp_path / "r", "--blocks", "1,2", "--steps", "1", "--warmup", "0",
                              "--profile-steps", "0")  # fmt: skip
    assert result["figures"] == "extrapolated" and result["blocks_measured"] == [1, 2] and result["blocks"] == 2
    one = load_run_config(folder / "config_1_blocks.yaml")[1].model
    assert (one.double_blocks, one.single_blocks) == (1, 1) and not (folder / "config_2_blocks.yaml").exists()
    bench = get_benchmark("flux1")
    cfg = bench.config("tiny")
    assert result["mfu"] == pytest.approx(bench.family.flops_per_sample(cfg) * result["samples_per_s"] / 1e12)
    full = bench.config("flux1-schnell")
    assert bench.family.depth(full) == 19
    four = bench.family.truncated(full, 4).model
    assert (four.double_blocks, four.single_blocks) == (4, 8)
    assert bench.family.flops_per_sample(bench.family.truncated(full, 4)) * 19 / 4 == pytest.approx(
        bench.family.flops_per_sample(full)
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["nope"], "unknown benchmark 'nope'"),
        (["flux1", "--preset", "tiny", "--blocks", "1,2", "single_blocks=3"], "3 single-stream blocks are not a whole"),
        (["bert", "--preset", "huge"], "has no preset 'huge'"),
        (["bert", "--preset", "tiny", "--steps", "0"], "--steps must be at least 1"),
        (["llama31_8b", "--preset", "tiny", "--blocks", "1,9"], "the model has 2 blocks"),
        (["llama31_8b", "--preset", "tiny", "--blocks", "2"], "give at least two different depths"),
        (["llama31_8b", "--preset", "tiny", "--blocks", "a,b"], "give block counts as integers"),
        (["gpt_oss_20b", "--preset", "gpt-oss-20b", "--blocks", "2,3"], "repeat every 2 (a windowed block, then 1"),
        (["gpt_oss_20b", "--preset", "gpt-oss-20b", "--blocks", "1,3,4"], "2 apart, e.g. --blocks 1,3"),
        (["gpt_oss_20b", "--preset", "gpt-oss-20b", "model.window_every=3", "--blocks", "2,4"], "every 3"),
        (["bert", "--preset", "tiny", "--warmup", "-1"], "--warmup must be 0 or more"),
        (["bert", "--preset", "tiny", "--profile-steps", "-2"], "--profile-steps must be 0 or more"),
    ],
)
def test_bad_input_is_one_sentence_and_exit_2_before_any_folder(args, says, tmp_path, capsys):
    assert run_cli("bench", *args, f"output.results_dir={tmp_path / 'r'}") == 2
    out = capsys.readouterr().out
    assert says in out and "Traceback" not in out, out
    assert not (tmp_path / "r").exists()


@pytest.mark.full
@pytest.mark.parametrize("benchmark", ["bert", "llama31_8b", "llama2_70b_lora", "dlrmv4"])
def test_each_tiny_preset_is_measured_on_two_ranks(benchmark, tmp_path):
    _, result = measured(benchmark, tmp_path / "r", "--nproc", "2")
    assert result["ranks"] == 2 and result["figures"] == "measured"
    assert result["samples_per_s_per_rank"] == pytest.approx(result["samples_per_s"] / 2)


def test_a_model_that_does_not_fit_is_one_sentence_naming_what_would(tmp_path, capsys, monkeypatch):
    """Out of GPU memory in the timed steps (stood in for here: the CPU has none to run out of)."""
    import types

    import torch

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 448.00 MiB.")

    monkeypatch.setattr("trainbench.measure.throughput._timed_steps", out_of_memory)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(total_memory=80 << 30)
    )
    assert run_cli("bench", "llama31_8b", "--preset", "tiny", *QUICK, f"output.results_dir={tmp_path}") == 2
    out = capsys.readouterr().out
    assert "llama31_8b/tiny does not fit in this GPU's 80 GiB at 2 blocks (an allocation of 448.00 MiB failed" in out
    assert "at its peak); a smaller micro-batch (data.micro_batch_size=16), recompute" in out, out
    assert "--blocks" not in out  # 2 blocks: none fewer to measure
    assert "Traceback" not in out


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["gpt3"], "transformers has no model of gpt3's architecture"),
        (["dlrmv4"], "dlrmv4's architecture to compare with (what users run instead is the reference's TorchRec"),
        (["llama31_8b", "--nproc", "2"], "--compare hf runs in one process"),
        (["flux1", "model.mlp_ratio=2"], "FluxTransformer2DModel fixes the MLP ratio at 4 and the RoPE base at 10000"),
    ],
)
def test_compare_hf_where_it_cannot_run_is_one_sentence(args, says, tmp_path, capsys):
    assert run_cli("bench", *args, "--preset", "tiny", "--compare", "hf", f"output.results_dir={tmp_path / 'r'}") == 2
    assert says in capsys.readouterr().out
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(("benchmark", "missing"), [("llama2_70b_lora", "peft"), ("flux1", "diffusers")])
def test_compare_hf_without_transformers_installed_says_what_to_install(benchmark, missing, tmp_path, capsys,
                                                                        monkeypatch):  # fmt: skip
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else real(name, *a))
    assert run_cli("bench", benchmark, "--preset", "tiny", "--compare", "hf",
                   f"output.results_dir={tmp_path / 'r'}") == 2  # fmt: skip
    assert f"--compare hf needs {missing}: pip install {missing}" in capsys.readouterr().out
    assert not (tmp_path / "r").exists()


@pytest.mark.full
def test_compare_hf_times_transformers_and_peft_beside_ours(tmp_path, capsys):
    """HF's model of the same config with peft's adapters, eager and compiled, on the same rows: its rate and ours
    over it."""
    _, result = measured("llama2_70b_lora", tmp_path / "r", "--compare", "hf")
    assert set(result["compare"]) == {"hf_eager", "hf_compiled"}
    for peer in result["compare"].values():
        assert "error" not in peer, peer
        assert peer["tokens_per_s"] > 0 and peer["ours_over_it"] == pytest.approx(
            peer["step_seconds"] / result["step_seconds"]
        )  # the same rows: the ratio of the step times
    assert "hf_compiled: " in capsys.readouterr().out


def test_compare_hf_times_transformers_gpt_oss_beside_our_mixture_of_experts(tmp_path):
    """GPT-OSS's block and transformers' GptOss at the same shape and parameters, timed eager on the CPU (its
    compiled form and ours beside it: the device's figures, docs/gpt_oss.md)."""
    pytest.importorskip("transformers", reason="transformers is the optional extra trainbench[test]")
    import torch

    from trainbench.benchmarks import get_benchmark
    from trainbench.families.decoder.gpt_oss import GptOssLM
    from trainbench.measure import compare_hf

    bench = get_benchmark("gpt_oss_20b")
    cfg = bench.config("tiny-hf")
    assert compare_hf.require(bench, cfg) == "moe"
    model = compare_hf.twin(bench).build(cfg, torch.device("cpu"))
    assert type(model).__name__ == "GptOssForCausalLM"
    ours = {n.replace(".mlp.", ".mlp.experts.") if n.split(".")[-1].startswith(("gate_up", "down_proj")) else n
            for n, _ in GptOssLM(cfg.model).named_parameters()}  # fmt: skip
    assert ours == {n for n, _ in model.named_parameters()}  # the same parameters: the same work
    result = compare_hf.measure(bench, cfg, False, 1, 1, torch.device("cpu"))
    assert "error" not in result and result["seconds"] > 0 and result["samples_per_step"] == 32


@pytest.mark.parametrize("compare, peers", [("hf", {"hf_eager", "hf_compiled"}), ("hf-compiled", {"hf_compiled"})])
def test_compare_hf_times_diffusers_flux_transformer_beside_ours(tmp_path, capsys, monkeypatch, compare, peers):
    """diffusers' FluxTransformer2DModel at flux1's shape, eager and compiled (or compiled only), on the same rows.
    Compiling it on 2 CPU cores takes over a minute, so torch.compile hands back the model here: this checks what is
    built and timed, the compiled figures are the GPU's (perf/bench_figures.sh flux-hf)."""
    pytest.importorskip("diffusers", reason="diffusers is the optional extra trainbench[test]")
    import torch

    monkeypatch.setattr(torch, "compile", lambda model, *args, **kwargs: model)
    _, result = measured("flux1", tmp_path / "r", "--compare", compare, "--profile-steps", "0")
    assert set(result["compare"]) == peers
    for peer in result["compare"].values():
        assert "error" not in peer, peer
        assert peer["tokens_per_s"] > 0 and peer["ours_over_it"] == pytest.approx(
            peer["step_seconds"] / result["step_seconds"]
        )
    said = capsys.readouterr().out
    assert "measuring hf_compiled (flux)" in said and ("measuring hf_eager" in said) is ("hf_eager" in peers)


def test_diffusers_flux_peer_trains_on_the_same_loss_as_ours():
    """On the same weights (mapped as tests/test_flux.py maps them) and the same micro-batch, the peer's loss and a
    gradient are ours: both sides do the same work, from the latent's draw and the noising to the velocity's MSE."""
    pytest.importorskip("diffusers", reason="diffusers is the optional extra trainbench[test]")
    import torch
    from test_flux import ours_from_diffusers

    from trainbench.benchmarks import get_benchmark
    from trainbench.measure import compare_hf

    bench = get_benchmark("flux1")
    cfg = bench.config("tiny")
    cpu = torch.device("cpu")
    assert compare_hf.require(bench, cfg) == "flux"
    torch.manual_seed(0)
    theirs = compare_hf.twin(bench).build(cfg, cpu)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(std=0.1)
    ours = bench.family.build_model(cfg)
    ours.load_state_dict(ours_from_diffusers(theirs, cfg.model))
    batch = next(iter(next(iter(bench.bench_data(cfg, 0, 1).train))))
    t = bench.to_device(batch, cpu)
    mine = bench.loss(ours, t, bench.loss_weights(t))
    peer = compare_hf.twin(bench).loss(bench, cfg, theirs, batch, cpu)
    nothing = bench.loss(lambda img, *rest: torch.zeros_like(img), t, bench.loss_weights(t))
    assert peer.item() == pytest.approx(mine.item(), rel=1e-5)
    assert abs(mine.item() - nothing.item()) > 0.1  # the model's prediction counts in the loss
    mine.backward()
    peer.backward()
    a = ours.get_parameter("double_blocks.0.img_attn.proj.weight").grad
    b = theirs.get_parameter("transformer_blocks.0.attn.to_out.0.weight").grad
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_our_rows_become_the_inputs_hf_trains_on_with_the_same_loss_positions():
    """HF shifts its labels itself: the tokens HF is asked to predict are those our loss counts."""
    import torch

    from trainbench.benchmarks import get_benchmark
    from trainbench.families.decoder import hf as decoder_hf
    from trainbench.families.encoder import hf as encoder_hf
    from trainbench.measure import compare_hf

    IGNORE = decoder_hf.IGNORE
    cpu = torch.device("cpu")
    for name, family in (("llama2_70b_lora", "decoder_lora"), ("llama31_8b", "decoder"), ("bert", "encoder")):
        bench = get_benchmark(name)
        cfg = bench.config("tiny")
        assert compare_hf.twin(bench).peer(cfg) == family
        batch = next(iter(bench.bench_data(cfg, 0, 1).train))[0]
        hf = encoder_hf.inputs(batch, cpu) if family == "encoder" else decoder_hf.inputs(cfg, batch, cpu)
        if family == "encoder":
            valid = batch["masked_lm_positions"] > 0
            rows, cols = valid.nonzero()
            picked = hf["labels"][rows, batch["masked_lm_positions"][rows, cols]]
            assert picked.tolist() == batch["masked_lm_ids"][rows, cols].tolist()
            assert int((hf["labels"] != IGNORE).sum()) == int(valid.sum())
        elif family == "decoder":
            assert hf["input_ids"].shape == (len(batch["tokens"]), cfg.data.seq_length)
        else:  # our targets[t] is token t+1 where the loss counts; HF's label at t+1 is that token
            ours = batch["targets"][:, :-1] != IGNORE
            assert (hf["labels"][:, 1:] != IGNORE).numpy().tolist() == ours.tolist()
            assert int(ours.sum()) > 0 and (hf["labels"][:, 1:][torch.as_tensor(ours)] ==
                                            torch.as_tensor(batch["tokens"][:, 1:][ours])).all()  # fmt: skip


def test_each_benchmark_names_its_hf_twin_in_its_model_family():
    """``--compare hf`` asks the benchmark for its twin (ModelFamily.hf_twin): a module of families/ answering the same
    calls for every family, or None where HF has no model of the architecture (the comparer then says so)."""
    import importlib

    from trainbench.benchmarks import BENCHMARKS
    from trainbench.families.encoder import hf as encoder_hf

    calls = ("peer", "check", "packages", "build", "loss", "kernels")
    named = {}
    for bench in BENCHMARKS.values():
        if bench.family.hf_twin is None:
            continue
        assert bench.family.hf_twin.startswith("trainbench.families.") and bench.family.hf_twin.endswith(".hf"), (
            bench.family.hf_twin
        )
        twin = importlib.import_module(bench.family.hf_twin)
        assert all(callable(getattr(twin, call, None)) for call in calls), bench.family.hf_twin
        named[bench.name] = twin.peer(bench.config("tiny"))
    assert named["bert"] == "encoder" and named["flux1"] == "flux" and named["gpt_oss_20b"] == "moe"
    assert named["gpt3"] is None  # a decoder, but not one transformers has
    assert BENCHMARKS["dlrmv4"].family.hf_twin is None
    assert encoder_hf.packages(BENCHMARKS["bert"].config("tiny")) == ["transformers"]


def _trace(kernels: list[tuple[str, float, float]]) -> dict:
    """A Chrome trace of GPU kernels: (name, start us, duration us)."""
    return {"traceEvents": [{"ph": "X", "cat": "kernel", "name": n, "ts": t, "dur": d} for n, t, d in kernels]}


def test_a_profiled_step_is_split_and_its_kernels_grouped_by_kind():
    from trainbench.report.bench_report import profile_at_depth
    from trainbench.train.profiling import kernels_by_kind, timeline

    def profiled(blocks: int) -> dict:
        # 2 steps of: `blocks` FP8 GEMMs of 1 ms and attention of 0.5 ms, an AdamW kernel of 2 ms, an all-reduce of
        # 1 ms that half overlaps the last GEMM, then 1 ms with nothing running
        events, t = [], 0.0
        for _ in range(2):
            for _ in range(blocks):
                events += [("sm90_xmma_gemm_e4m3", t, 1000), ("cudnn_flash_fprop", t + 1000, 500)]
                t += 1500
            events += [("ncclDevKernel_AllReduce", t - 500, 1000), ("multi_tensor_apply_adam", t + 500, 2000)]
            t += 3500
        trace = _trace(events)
        return {"trace": f"profile_{blocks}_trace.json", "split": timeline(trace, 2)} | kernels_by_kind(trace, 2)

    p2 = profiled(2)
    assert p2["by_kind_ms"] == pytest.approx({"fp8 gemm": 2.0, "attention": 1.0, "optimizer": 2.0, "nccl": 1.0})
    assert p2["kernels"][0]["kind"] in ("fp8 gemm", "optimizer") and p2["kernels"][0]["calls"] in (2, 1)
    split = p2["split"]
    assert split["comm_exposed_ms"] == pytest.approx(0.5)  # half the all-reduce ran beside the GEMM
    assert split["compute_ms"] == pytest.approx(5.0) and split["idle_ms"] == pytest.approx(0.5)
    raws = {2: {"profile": p2}, 6: {"profile": profiled(6)}}
    at = profile_at_depth(raws, 32, [2, 6])
    assert at["figures"] == "extrapolated" and at["traces"] == ["profile_2_trace.json", "profile_6_trace.json"]
    assert at["block_by_kind_ms"] == pytest.approx({"fp8 gemm": 1.0, "attention": 0.5, "optimizer": 0, "nccl": 0})
    assert at["by_kind_ms"]["fp8 gemm"] == pytest.approx(32.0) and at["split_ms"]["compute_ms"] == pytest.approx(50)
    assert list(at["by_kind_ms"])[0] == "fp8 gemm"  # largest first
    assert profile_at_depth({2: {"profile": None}}, 32, None) is None


def test_an_extrapolated_split_never_has_the_gpu_idle_less_than_never():
    """The host's waits shrink as the GPU's work grows with the blocks: a straight line through two shallow depths
    (flux1 at 1 and 2 blocks: 36.2 and 18.4 ms idle) ends below zero at the model's depth (-284 ms at 19), a window
    shorter than the busy time. The extrapolated split holds idle at 0 and the window at the busy time; the rest is
    the straight line's."""
    from trainbench.report.bench_report import profile_at_depth

    def profile(window, busy):
        split = {"window_ms": window, "busy_ms": busy, "compute_ms": busy, "comm_exposed_ms": 0.0,
                 "idle_ms": window - busy}  # fmt: skip
        return {"profile": {"split": split, "by_kind_ms": {"gemm": busy}, "kernels": [], "trace": "t.json"}}

    at = profile_at_depth({1: profile(155.6, 119.4), 2: profile(247.2, 228.8)}, 19, [1, 2])
    split = at["split_ms"]
    assert split["busy_ms"] == pytest.approx(119.4 + 18 * 109.4) and split["compute_ms"] == split["busy_ms"]
    assert split["idle_ms"] == 0.0 and split["window_ms"] == split["busy_ms"]
    shallow = profile_at_depth({1: profile(155.6, 119.4), 2: profile(247.2, 228.8)}, 3, [1, 2])["split_ms"]
    assert shallow["idle_ms"] == pytest.approx(0.6) and shallow["window_ms"] == pytest.approx(338.8)  # kept


def test_a_split_whose_line_through_the_depths_goes_negative_is_shown_as_measured_at_the_deepest():
    """flux1 over 2 GPUs at 1 and 2 blocks: at 1 block the all-gathers waited on the other rank (151 ms of NCCL
    kernels, 47 at 2 blocks), and the line through them gave -2,143 ms of communication at 19 blocks. Such a split is
    not extrapolated: the deepest depth's profile is shown, measured, and the console line says why."""
    from trainbench.report.bench_report import profile_at_depth, rows, split_line

    def profile(comm, compute, parts=True):
        split = {"window_ms": comm + compute, "busy_ms": comm + compute, "compute_ms": compute,
                 "comm_exposed_ms": comm, "idle_ms": 0.0}  # fmt: skip
        kinds = {"nccl": comm, "fp8 gemm": compute}
        extra = {"by_part_ms": {"communication": comm, "model": compute}} if parts else {}
        return {"profile": {"split": split, "by_kind_ms": kinds, "kernels": [], "trace": "t.json", **extra}}

    at = profile_at_depth({1: profile(187.0, 141.2), 2: profile(57.6, 255.9)}, 19, [1, 2])
    assert at["figures"] == "measured at 2 blocks" and "block_by_kind_ms" not in at
    assert at["split_ms"]["comm_exposed_ms"] == 57.6 and at["by_kind_ms"] == {"fp8 gemm": 255.9, "nccl": 57.6}
    assert at["by_part_ms"] == {"model": 255.9, "communication": 57.6}
    line = split_line(at)
    assert line.startswith("step (measured at 2 blocks, ms): window 313.5") and "gave a negative comm_exposed" in line
    assert ["step's split: measured at 2 blocks", at["note"]] in rows({"profile": at})  # the report says it too
    # a line that stays above zero is extrapolated as before
    fine = profile_at_depth({1: profile(40.0, 141.2), 2: profile(57.6, 255.9)}, 19, [1, 2])
    assert fine["figures"] == "extrapolated" and fine["split_ms"]["comm_exposed_ms"] == pytest.approx(40 + 18 * 17.6)
    assert "note" not in fine and "nccl" in fine["block_by_kind_ms"]


def test_a_profiled_steps_gpu_time_is_split_by_the_host_ranges_that_launched_each_kernel():
    """kernels_by_part: a kernel counts to the first part whose expression matches a CPU range open on its launching
    thread (by the launch's correlation id), the optimizer's range after the family's parts, collectives to
    communication, everything else (and a kernel whose launch is not in the trace) to the model."""
    from trainbench.report.bench_report import profile_at_depth, split_line
    from trainbench.train.profiling import kernels_by_kind, kernels_by_part, timeline

    def cpu(name, ts, dur, tid=1, cat="cpu_op"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid}

    def launch(corr, ts, tid=1):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "pid": 7, "tid": tid,
                "args": {"correlation": corr}}  # fmt: skip

    def kernel(corr, name, dur, ts=0):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 0,
                "args": {"correlation": corr}}  # fmt: skip

    events = [
        cpu("tb.embedding_lookup", 0, 100, cat="user_annotation"), launch(1, 10), launch(2, 90),
        cpu("aten::mm", 100, 50), launch(3, 120),  # the model
        cpu("_ExchangeBackward", 200, 40, tid=2), launch(4, 210, tid=2),  # the backward's thread
        launch(5, 215, tid=1),  # same time, another thread: the model
        cpu("Optimizer.step#AdamRowWiseAdagrad.step", 300, 100), launch(6, 310),
        cpu("tb.rowwise_adagrad", 350, 40, cat="user_annotation"), launch(7, 360),  # inside the optimizer's range
        kernel(1, "gather", 1000), kernel(2, "index_copy", 1000), kernel(3, "nvjet_gemm", 3000),
        kernel(4, "index_add", 2000), kernel(5, "triton_poi", 500), kernel(6, "multi_tensor_apply_adam", 400),
        kernel(7, "pow", 600), kernel(8, "lost_launch", 100), kernel(9, "ncclDevKernel_AllToAll", 800),
    ]  # fmt: skip
    parts = (("embedding lookup", r"^(tb\.embedding_lookup|_ExchangeBackward)$"),
             ("tables' optimizer", r"^tb\.rowwise_adagrad$"))  # fmt: skip
    by_part = kernels_by_part({"traceEvents": events}, 2, parts)
    assert by_part == pytest.approx({"embedding lookup": 2.0, "model": 1.8, "communication": 0.4,
                                     "tables' optimizer": 0.3, "optimizer": 0.2})  # fmt: skip
    assert list(by_part)[0] == "embedding lookup"  # largest first
    assert kernels_by_part({"traceEvents": events}, 2) == pytest.approx(
        {"model": 3.8, "communication": 0.4, "optimizer": 0.5}
    )
    trace = {"traceEvents": events}
    raw = {"trace": "t.json", "split": timeline(trace, 2), "by_part_ms": by_part} | kernels_by_kind(trace, 2)
    at = profile_at_depth({5: {"profile": raw}}, 5, None)
    assert at["by_part_ms"] == pytest.approx(by_part)
    assert "by part: embedding lookup 2.0, model 1.8" in split_line(at)
    del raw["by_part_ms"]  # a profile of an older trainbench: no split by part, and no error
    assert "by_part_ms" not in profile_at_depth({5: {"profile": raw}}, 5, None)


def test_bert_is_measured_on_packed_rows_with_mlperfs_length_mix(tmp_path, capsys):
    import numpy as np

    from trainbench.data.synthetic_bert import mlperf_like_lengths

    lengths = mlperf_like_lengths(np.random.default_rng(0), 50_000, 512)
    assert 0.48 < lengths.mean() / 512 < 0.56 and lengths.min() >= 5 and lengths.max() == 512  # about half padding
    assert 0.22 < (lengths >= 0.92 * 512).mean() < 0.28
    _, fixed = measured("bert", tmp_path / "f")
    _, packed = measured("bert", tmp_path / "p", "data.layout=packed")
    gbs = packed["global_batch_size"]
    # at most 3 samples a row, about 2 on this mix; each counted as a sample
    assert 1.5 * gbs < packed["samples_per_step"] <= 3 * gbs and fixed["samples_per_step"] == gbs
    raw = next(iter(packed["raw"].values()))
    assert packed["samples_per_s"] == pytest.approx(packed["samples_per_step"] * 2 / raw["seconds"])
    # a packed sample counts its real tokens (about half a row), a fixed one the whole row it occupies
    assert packed["tokens_per_s"] / packed["samples_per_s"] < 0.6 * fixed["tokens_per_s"] / fixed["samples_per_s"]
    assert f"in {gbs} packed rows" in capsys.readouterr().out


def test_a_peer_on_fixed_rows_is_compared_with_ours_on_packed_rows_by_samples_a_second():
    from trainbench.report.bench_report import compared

    # ours: 2 s a step of 96 packed rows holding 200 samples; HF: 1 s a step of 96 fixed rows (96 samples)
    peers = {"hf_eager": {None: {"steps": 4, "seconds": 4.0, "samples_per_step": 96, "peak_memory_gib": 3.0}}}
    hf = compared(peers, None, 200, 270, 2.0)["hf_eager"]
    assert hf["samples_per_s"] == 96 and hf["tokens_per_s"] == 96 * 270
    assert hf["ours_over_it"] == pytest.approx(100 / 96)  # 100 samples/s against 96, though our step is twice as long


def test_kernel_kinds_tell_fp8_gemms_attention_and_compiled_casts_apart():
    from trainbench.train.profiling import kernel_kind as kind

    assert kind("nvjet_sm90_qrtst_128x160_128x5_2x1_v_bz_coopA_algo2_TNT") == "fp8 gemm"  # e4m3 x e5m2
    assert kind("nvjet_sm90_qqtst_256x128_128x4_1x2_h_bz_coopA_TNT") == "fp8 gemm"
    assert kind("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "gemm"
    assert kind("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26") == "attention"
    assert kind("triton_per_fused__fused_rms_norm__scaled_mm__to_copy_add_clamp_t_view_20") == "compiled elementwise"
    assert kind("void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>>") == "optimizer"
    assert kind("Memcpy HtoD (Pageable -> Device)") == "copy"
    assert kind("void at::native::vectorized_elementwise_kernel<4, FillFunctor<float>>") == "other"
    assert kind("void lamb_stage_1<float>") == "optimizer"
    # torch's elementwise kernels name their functor's lambda, its layer norm a norm_kernel: neither is the optimizer
    silu = ("void at::native::vectorized_elementwise_kernel<8, at::native::(anonymous namespace)::silu_kernel("
            "at::TensorIteratorBase&)::{lambda()#1}::operator()() const::{la")  # fmt: skip
    layer_norm = ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float, false>(int, "
                  "float, float const*, float const*, float const*, float*, float*, ")  # fmt: skip
    assert kind(silu) == kind(layer_norm) == "other"
    assert (
        kind(
            "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::"
            "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::opera"
        )
        == "copy"
    )
    assert kind("tb_output_grad") == kind("tb_glu_backward") == "own kernels"  # the families' Triton kernels
    assert kind("tb_adamw") == "optimizer"  # optim/adamw's update counts with the optimizer


def test_depths_a_whole_repeat_of_the_blocks_apart_are_taken():
    """gpt_oss_20b's windowed and whole-prefix blocks alternate: 1 and 3 blocks (one of each kind between them) or 2
    and 4 are measured; with no window every block is alike and any two depths do."""
    from trainbench.benchmarks import get_benchmark
    from trainbench.measure.bench import parse_blocks
    from trainbench.resolve import build_config

    bench, cfg = build_config("gpt_oss_20b", "gpt-oss-20b", [], {})
    assert parse_blocks("1,3", 24, bench.family.block_period(cfg)) == [1, 3]
    assert parse_blocks("4,2,6", 24, bench.family.block_period(cfg)) == [2, 4, 6]
    _, plain = build_config("gpt_oss_20b", "gpt-oss-20b", [], {"model.sliding_window": "0"})
    assert bench.family.block_period(plain) == (1, "")
    assert parse_blocks("2,3", 24, bench.family.block_period(plain)) == [2, 3]
    llm = get_benchmark("llama31_8b")
    assert llm.family.block_period(cfg) == (1, "")


def test_truncated_depths_under_a_planned_layout_share_the_deepest_depth_s_rows(tmp_path, monkeypatch, capsys):
    """bench --blocks with perf.plan=auto: the whole model is not planned (it need not fit this GPU: the 8B on one
    H100 was refused before any depth was measured); each depth is planned for its own blocks, all at the deepest
    depth's rows a micro-batch, so that the rate between them is extrapolated at one micro-batch. A stand-in
    planner, as a GPU's probe would plan: the whole model does not fit, 1 block takes 32 rows, 2 blocks 16."""
    from trainbench.errors import ConfigError
    from trainbench.measure import plan
    from trainbench.resolve import load_run_config

    asked = []

    def planned(bench, cfg, say, here=True):
        if cfg.perf.plan != "auto":
            return cfg, []
        asked.append(cfg.model.num_layers)
        if cfg.model.num_layers > 2:
            raise ConfigError("the whole model does not fit this GPU")
        rows = 16 if cfg.model.num_layers == 2 else 32
        return bench.with_layout(cfg, {"data.micro_batch_size": rows}), [f"layout for {rows} rows"]

    monkeypatch.setattr(plan, "planned", planned)
    folder, result = measured("llama31_8b", tmp_path / "r", "--blocks", "1,2", "model.num_layers=4",
                              "perf.plan=auto")  # fmt: skip
    printed = capsys.readouterr().out
    assert 4 not in asked and result["figures"] == "extrapolated"
    for depth in (1, 2):
        assert load_run_config(folder / f"config_{depth}_blocks.yaml")[1].data.micro_batch_size == 16
    assert "all at 16 rows a micro-batch (the deepest's)" in printed
    assert "at 1 blocks: layout for 32 rows (measured at 16 a micro-batch, as the deepest)" in printed


def test_the_energy_a_token_is_rank_0s_nodes_energy_over_the_tokens_its_ranks_trained():
    """bench.json's energy a token: the energy of rank 0's node's GPUs (the GPUs it samples) over the tokens its
    ranks trained in the timed steps, not over every node's tokens (which would make 2 nodes look twice as frugal)."""
    from trainbench.benchmarks.bert import BertBenchmark
    from trainbench.report.bench_report import summarise

    bench = BertBenchmark()
    cfg = bench.config("tiny")
    raw = {"seconds": 2.0, "steps": 4, "warmup": 1, "samples_per_step": cfg.data.global_batch_size,
           "eval_seconds_per_sample": 0.001, "eval_samples": 10, "peak_memory_gib": None, "device": "cpu",
           "energy_joules": 1000.0, "profile": None}  # fmt: skip
    tokens = cfg.data.global_batch_size * 4 * bench.family.tokens_per_sample(cfg)
    layers = bench.family.depth(cfg)
    one = summarise(bench, cfg, {layers: raw}, layers, None)
    assert one["energy_joules_per_token"] == pytest.approx(1000.0 / tokens)
    cfg.distributed.nproc, cfg.distributed.nodes = 2, 2  # rank 0's node trained half the tokens
    two = summarise(bench, cfg, {layers: raw}, layers, None)
    assert two["energy_joules_per_token"] == pytest.approx(1000.0 / (tokens / 2))


def test_bench_samples_the_telemetry_at_10_hz_unless_a_file_or_the_command_line_says_otherwise(tmp_path):
    """A bench's timed steps last seconds, so it samples at 10 Hz where a run samples at 1 (the medians of power and
    clock would rest on one sample); a value in a YAML file or on the command line is kept, 0 (off) too."""
    import yaml

    from trainbench.cli.bench import BENCH_DEFAULTS
    from trainbench.resolve import build_config

    assert build_config("bert", "tiny", defaults=BENCH_DEFAULTS)[1].output.telemetry_hz == 10.0
    assert build_config("bert", "tiny")[1].output.telemetry_hz == 1.0  # a run's own default
    assert build_config("bert", "tiny", overrides={"telemetry_hz": "0"}, defaults=BENCH_DEFAULTS)[1] \
        .output.telemetry_hz == 0.0  # fmt: skip
    config = tmp_path / "c.yaml"
    config.write_text("output:\n  telemetry_hz: 2\n")
    assert build_config("bert", "tiny", [str(config)], defaults=BENCH_DEFAULTS)[1].output.telemetry_hz == 2.0
    args = ["--steps", "1", "--warmup", "0", "progress=false", f"output.results_dir={tmp_path / 'r'}"]
    assert run_cli("bench", "bert", "--preset", "tiny", *args) == 0
    saved = yaml.safe_load((only_run_dir(tmp_path / "r") / "config.yaml").read_text())
    assert saved["output"]["telemetry_hz"] == 10.0


def test_a_recommenders_lookups_a_second_are_in_its_report_and_no_other_models(tmp_path):
    """dlrmv4's bench.json has its table lookups a second, and the report of its folder shows them; a model without
    tables has none, and its report no such row."""
    dlrm, _ = measured("dlrmv4", tmp_path / "d")
    bert, _ = measured("bert", tmp_path / "b")
    assert run_cli("report", dlrm) == 0 and run_cli("report", bert) == 0
    assert "table lookups/s" in (dlrm / "report.md").read_text()
    assert "table lookups/s" not in (bert / "report.md").read_text()


def test_the_eval_time_is_the_median_of_three_timed_passes_after_an_untimed_one(monkeypatch):
    """One slow timed pass (a recompilation, another process's burst) no longer sets the eval's share of a projection:
    the untimed pass is not counted, and of three timed ones the middle counts."""
    import types

    import torch

    from trainbench.distributed import DistInfo
    from trainbench.measure import throughput

    clock = [0.0]  # the time each pass takes, on a clock of the test's own
    passes = iter([30.0, 2.0, 20.0, 4.0])  # untimed (compiling), then three timed: 2, 20, 4 s

    def evaluate(*args) -> None:
        clock[0] += next(passes)

    monkeypatch.setattr(throughput, "evaluate", evaluate)
    monkeypatch.setattr(throughput, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    run = types.SimpleNamespace(data=types.SimpleNamespace(eval=[{"input_ids": torch.zeros(4, 8)}]),
                                placed=types.SimpleNamespace(model=None, module=torch.nn.Linear(2, 2)))  # fmt: skip
    seconds, router = throughput._eval_seconds_per_row(None, run, DistInfo(0, 0, 1, torch.device("cpu")), None)
    assert seconds == 4.0 / 4 and router is None  # the median pass over 4 rows
    assert next(passes, None) is None  # every pass ran: one untimed, three timed


def test_the_peak_memory_is_put_on_the_line_through_the_depths_and_says_when_the_whole_model_would_not_fit():
    """flux1 at 1 and 2 of 19 blocks on 2 H200, its gradients kept whole and its weights gathered (9.9 and 17.6 GiB
    measured): about 148.5 GiB at 19 blocks on that line, more than the GPU's 139.3, said beside the peak measured; a
    line within a tenth of the GPU's memory may not fit (the whole model reduced once a step failed an allocation at
    130.8 GiB on an H200 of 139.8); a layout whose line stays below that is said to fit, and a run on the CPU (no
    peak) says neither; the report's rows say the same."""
    from trainbench.benchmarks.flux1 import Flux1Benchmark
    from trainbench.cli.bench import bench_summary
    from trainbench.report.bench_report import rows, summarise

    bench = Flux1Benchmark()
    cfg = bench.config("flux1-schnell")

    def raw(peak, gpu=139.3):
        return {"seconds": 1.0, "steps": 1, "warmup": 1, "samples_per_step": 512, "eval_seconds_per_sample": 0.001,
                "eval_samples": 10, "peak_memory_gib": peak, "gpu_memory_gib": gpu, "device": "NVIDIA H200",
                "profile": None}  # fmt: skip

    kept = summarise(bench, cfg, {1: raw(9.9), 2: raw(17.6)}, 19, [1, 2])
    assert kept["peak_memory_gib_at_depth"] == pytest.approx(9.9 + 18 * 7.7) and kept["gpu_memory_gib"] == 139.3
    assert ("peak memory 17.6 GiB (about 148.5 at 19 blocks on the line through the depths measured, more than the "
            "GPU's 139.3: the whole model would not fit this layout)") in bench_summary(kept)  # fmt: skip
    assert ["peak memory at the model's depth, on the line (GiB)", "148.5"] in rows(kept), rows(kept)
    fits = summarise(bench, cfg, {1: raw(5.0), 2: raw(9.0)}, 19, [1, 2])
    assert "(about 77.0 at 19 blocks on the line through the depths measured of the GPU's 139.3)" in bench_summary(fits)
    # reduced once a step alone (2 H200, 2026-11-30): 135.5 on the line; the whole model failed at 130.8 allocated
    close = summarise(bench, cfg, {1: raw(9.5, 139.80072), 2: raw(16.5, 139.80072)}, 19, [1, 2])
    assert close["peak_memory_gib_at_depth"] == pytest.approx(135.5)
    assert (
        "(about 135.5 at 19 blocks on the line through the depths measured of the GPU's 139.8, more than the 90 % "
        "of it a run can count on allocating: the whole model may not fit this layout)"
    ) in bench_summary(close)
    fit_row = "the whole model in this layout on the GPU, by the line"
    assert [fit_row, "may not: more than 90 % of it"] in rows(close), rows(close)
    assert [fit_row, "no: more than the GPU's memory"] in rows(kept) and [fit_row, "yes"] in rows(fits)
    cpu = summarise(bench, cfg, {1: raw(None, None), 2: raw(None, None)}, 19, [1, 2])
    assert "peak_memory_gib_at_depth" not in cpu and "gpu_memory_gib" not in cpu
    assert not any(row[0] == fit_row for row in rows(cpu))


def test_allocator_retries_in_the_timed_steps_are_said_and_kept_and_none_is_a_zero_without_a_sentence():
    """Where the CUDA caching allocator ran out of room in the timed steps (it frees its cache, waiting on the GPU,
    and retries), the console says so with what may help and the report keeps the count and the peak held; a run
    without retries shows 0 and no sentence; a CPU run (None) and an older bench.json (no key) show neither."""
    from trainbench.benchmarks import get_benchmark
    from trainbench.cli.bench import bench_summary
    from trainbench.report.bench_report import rows, summarise

    bench = get_benchmark("llama31_8b")
    cfg = bench.config("tiny")

    def raw(**memory):
        figures = {"seconds": 1.0, "steps": 2, "warmup": 1, "samples_per_step": 8, "eval_seconds_per_sample": 0.001,
                   "eval_samples": 10, "peak_memory_gib": 120.0, "device": "NVIDIA H200", "profile": None}  # fmt: skip
        return figures | memory

    said = "the CUDA caching allocator ran out of room 1,234 times in the timed steps"
    pressed = summarise(bench, cfg, {None: raw(allocator_retries=1234, peak_reserved_gib=137.5)}, None, None)
    assert pressed["allocator_retries"] == 1234 and pressed["peak_reserved_gib"] == 137.5
    assert said in bench_summary(pressed) and "expandable_segments:True" in bench_summary(pressed)
    assert ["allocator retries in the timed steps (memory pressure)", "1,234"] in rows(pressed), rows(pressed)
    assert ["peak memory held by the allocator (GiB)", "137.5"] in rows(pressed)
    calm = summarise(bench, cfg, {None: raw(allocator_retries=0, peak_reserved_gib=121.0)}, None, None)
    assert "caching allocator" not in bench_summary(calm)
    assert ["allocator retries in the timed steps (memory pressure)", "0"] in rows(calm)
    for old in (raw(), raw(allocator_retries=None, peak_reserved_gib=None)):
        result = summarise(bench, cfg, {None: old}, None, None)
        assert "caching allocator" not in bench_summary(result)
        assert not any("allocator" in row[0] for row in rows(result))
