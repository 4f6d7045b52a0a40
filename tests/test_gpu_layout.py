"""The layout planner's probe on one GPU (a LoRA block, the 8B model's compiled blocks), the host link's rates, and
the allocator held to perf.gpu_memory_gib.

Part of the single-GPU tier (``make test-gpu``, every tests/test_gpu_*.py but test_gpu_multi.py), skipped where no
CUDA device is visible."""

import dataclasses
import gc
import json
import time

import pytest
import torch
from conftest import single_gpu_tier

pytestmark = single_gpu_tier()


@pytest.mark.alone  # (compares the host link's rates while a step runs and while none does)
def test_the_layout_probe_measures_a_block_of_the_lora_model_and_the_plan_fits_this_gpu(tmp_path, monkeypatch):
    """The probe (8 blocks of a 2048-wide LoRA model through the run's own build, held 20 s, as the LoRA's MLPerf
    preset probes) measures what the planner needs, and the plan made from it for a 48-block model of that width fits
    this GPU by its own account."""

    from trainbench.measure import probe
    from trainbench.measure.plan import block_probe, resources
    from trainbench.resolve import build_config

    bench, cfg = build_config("llama2_70b_lora", "llama2-70b", [], {
        "device": "cuda", "model.hidden_size": "2048", "model.num_heads": "16", "model.num_kv_heads": "4",
        "model.intermediate_size": "5632", "model.num_layers": "48", "data.seq_length": "4096"})  # fmt: skip
    data = probe.measure(bench.probe_config(cfg), bench)
    assert data["blocks"] == 8 and data["sustained_s"] == 20 and data["sustained_steps"] > 5, data
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
    """perf.plan=auto for llama31_8b probes its blocks compiled (Module.compile) as the run builds them: the marks
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
    assert data["blocks"] == 2 and "sustained_s" not in data, data  # the 8B's: perf.probe_blocks's default
    hidden = 2048 * 1024 * 2  # a row of bf16 activations (the residual stream is fp32 under autocast: twice that)
    assert 0 < data["forward_s"] < 1 and 0 < data["backward_s"] < 1, data
    assert data["input_bytes"] in (hidden, 2 * hidden) and 2 * hidden < data["kept_bytes"] < 40 * hidden, data
    assert data["optimizer_bytes_per_block"] > 0 and data["other_optimizer_bytes"] > 0, data
    # the clock its timed steps ran at, where NVML sampled one (steps this short may fall between two samples)
    assert "sm_clock_mhz" in data and (data["sm_clock_mhz"] is None or 100 < data["sm_clock_mhz"] < 5000), data


def test_the_probe_runs_steps_for_the_seconds_asked_before_it_times_its_blocks_on_cuda():
    """perf.probe_sustained_s: the probe of a small 8B-shaped model runs its steps for that long before it times three
    (to time its blocks at the clock the power cap holds through a run), of perf.probe_blocks blocks; its figures say
    so, and they are real."""
    from trainbench.measure import probe
    from trainbench.resolve import build_config

    bench, cfg = build_config("llama31_8b", "llama31-8b", [], {
        "device": "cuda", "perf.plan": "auto", "perf.probe_sustained_s": "5", "perf.probe_blocks": "3",
        "model.hidden_size": "1024",
        "model.num_heads": "8", "model.num_kv_heads": "2", "model.intermediate_size": "3584",
        "data.seq_length": "2048"})  # fmt: skip
    t = time.perf_counter()
    data = probe.measure(bench.probe_config(cfg), bench)
    assert time.perf_counter() - t > 5 and data["sustained_s"] == 5 and data["sustained_steps"] > 5, data
    assert data["blocks"] == 3 and data["streamed"], data
    assert 0 < data["forward_s"] < 1 and 0 < data["backward_s"] < 1, data
    assert data["sm_clock_mhz"] is None or 100 < data["sm_clock_mhz"] < 5000, data  # 5 s: sampled at 20 Hz


@pytest.mark.alone  # (the host link's rates)
def test_the_host_link_shared_by_every_gpu_here_is_no_faster_than_one_gpu_alone(tmp_path):
    """measure/probe.link_rates on every GPU of this machine at once (one GPU: the same as alone): each GPU's
    rate both ways is real and no more than its rate copying alone (timing spread aside); the ``--link`` entry writes
    the pair a plan caches."""
    from trainbench.measure import probe
    from trainbench.measure.plan import main

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


def test_allocator_retries_count_the_caching_allocators_cache_flushes_on_cuda():
    """bench's ``allocator_retries``: an allocation that no cached block fits and that new memory would take past the
    process's limit frees the cache and retries, once; an allocation the cache serves counts nothing."""
    from trainbench.measure.throughput import allocator_retries

    device = torch.device("cuda")
    gc.collect()
    torch.cuda.empty_cache()
    before = allocator_retries(device)
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved(device) + (3 << 30)) / total)
    try:
        cached = torch.empty(2 << 30, dtype=torch.uint8, device=device)
        del cached  # kept by the allocator for reuse
        again = torch.empty(2 << 30, dtype=torch.uint8, device=device)  # the cached block: no retry
        del again
        assert allocator_retries(device) == before
        larger = torch.empty(5 << 29, dtype=torch.uint8, device=device)  # 2.5 GiB: past the limit beside the cache
        del larger
        assert allocator_retries(device) == before + 1
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    assert allocator_retries(torch.device("cpu")) is None
