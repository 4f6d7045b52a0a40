"""perf.plan=auto: the memory and time model of a step (families/planner.py), the 70B LoRA's plan for faked GPUs and
hosts, its refusals, keys given by hand kept as given, and the launcher's use of a cached probe before any folder."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch
from conftest import run_cli

from trainbench.errors import ConfigError, UserError
from trainbench.families.planner import GIB, BlockProbe, Resources, best, evaluate, with_rows

# A block of the 70B LoRA with its FP8 base, as measured on one H100 and H200 (docs/notes/lora-fp8-one-gpu.md): it
# keeps 1.36 GiB for its backward, its input is 128 MiB, 12 ms forward and 28 ms backward, 52/50 GB/s to and from
# the host.
P70 = BlockProbe(kept_bytes=int(1.36 * GIB), input_bytes=8192 * 8192 * 2, block_weight_bytes=int(0.815 * GIB),
                 other_weight_bytes=int(1.0 * GIB), optimizer_bytes_per_block=9 << 20, working_bytes=4 * GIB,
                 forward_s=0.012, backward_s=0.028, head_s=0.1, to_host_bytes_s=52e9, to_gpu_bytes_s=50e9)  # fmt: skip
H100 = Resources(gpu_bytes=int(79.1 * GIB), host_bytes=120 * GIB, gpus=1, gpu_name="H100")
H200 = Resources(gpu_bytes=int(139.5 * GIB), host_bytes=240 * GIB, gpus=1, gpu_name="H200")


def probe_data(probe: BlockProbe, gpu_name: str, free: int, total: int, host: int, **more) -> dict:
    """``probe``'s figures as measure/probe.measure writes them, on a GPU of that name and memory (free, total bytes)
    with ``host`` bytes of host memory free, and ``more`` beside."""
    data = {f.name: getattr(probe, f.name) for f in dataclasses.fields(probe)}
    return data | {"gpu_name": gpu_name, "capability": [9, 0], "gpu_free_bytes": free, "gpu_total_bytes": total,
                   "host_available_bytes": host, **more}  # fmt: skip


def test_the_model_counts_every_gib_and_charges_copies_only_beyond_the_forward_they_overlap():
    plan = evaluate(80, P70, recompute=40, offload=0, inputs=False)
    assert plan.gpu_bytes == sum(plan.account.values()) and plan.host_bytes == 0 and plan.stall_s == 0
    assert plan.account["40 blocks' saved activations"] == 40 * P70.kept_bytes
    assert plan.seconds == pytest.approx(0.1 + 80 * 0.040 + 40 * 0.012)
    # 34 blocks out during a 0.96 s forward at 52 GB/s: just within it; 60 are not, and the excess is waited for
    assert evaluate(80, P70, 0, 34, False).stall_s == pytest.approx(0, abs=0.005)
    late = evaluate(80, P70, 0, 60, False)
    assert late.stall_s == pytest.approx(60 * P70.kept_bytes / 52e9 - 0.96)
    inputs = evaluate(80, P70, 40, 0, True)  # recomputed blocks' inputs leave the GPU, two at a time in flight
    assert inputs.account["40 recomputed blocks' inputs"] == 0 and inputs.host_bytes == 40 * P70.input_bytes


def test_the_copies_are_charged_at_the_rate_measured_while_the_gpu_computes():
    """Where the probe measured the link while a step ran, the plan counts on that rate: 34 blocks out during a
    0.96 s forward fit at the idle 52 GB/s, not at 30 GB/s; one H100 then offloads fewer blocks and recomputes more."""
    from trainbench.measure.plan import block_probe

    busy = dataclasses.replace(P70, to_host_busy_bytes_s=30e9, to_gpu_busy_bytes_s=30e9)
    assert busy.rates() == (30e9, 30e9) and P70.rates() == (52e9, 50e9)
    assert evaluate(80, busy, 0, 34, False).stall_s == pytest.approx(34 * P70.kept_bytes / 30e9 - 0.96)
    idle_plan, _ = best(80, P70, H100, {})
    busy_plan, _ = best(80, busy, H100, {})
    assert busy_plan.offload < idle_plan.offload and busy_plan.recompute > idle_plan.recompute
    assert busy_plan.seconds > idle_plan.seconds
    # a probe saved before the busy rates were measured reads with the idle ones standing
    older = {k: v for k, v in dataclasses.asdict(P70).items() if "busy" not in k}
    assert block_probe(older) == P70


def test_the_node_s_gpus_copying_at_once_scale_the_rates_by_the_share_each_keeps():
    """Where every GPU of a node offloads at once, each keeps a share of its link (measured with all copying: 26 of
    52 GB/s out, 40 of 50 back): the plan's busy rates are scaled by that share, so the node's H100s offload fewer
    blocks than one H100 alone would, and recompute more."""
    busy = dataclasses.replace(P70, to_host_busy_bytes_s=48e9, to_gpu_busy_bytes_s=45e9)
    shared = dataclasses.replace(busy, to_host_shared_bytes_s=26e9, to_gpu_shared_bytes_s=40e9)
    assert shared.rates() == pytest.approx((48e9 * 26 / 52, 45e9 * 40 / 50))
    # a share measured above the GPU's own rate (noise) never raises the rate
    assert dataclasses.replace(busy, to_host_shared_bytes_s=60e9).rates() == busy.rates()
    alone, _ = best(80, busy, H100, {})
    node, _ = best(80, shared, dataclasses.replace(H100, gpus=4), {})
    assert node.offload < alone.offload and node.recompute > alone.recompute and node.seconds > alone.seconds


def test_a_plan_for_several_ranks_a_node_measures_the_shared_link_once_and_says_so(tmp_path, monkeypatch):
    """--nproc 4 on a machine with the GPUs: the shared link is measured once (in a process of its own, faked here)
    and cached with the probe; a plan for 4 ranks counts it and prints it, one for 1 rank does not, and a failed
    measurement leaves one GPU's rates with a line that says so."""
    from trainbench.measure import plan, probe

    monkeypatch.setenv("TRAINBENCH_CACHE_DIR", str(tmp_path / "cache"))
    bench, cfg = _lora_cfg()
    data = probe_data(P70, "NVIDIA H100 80GB HBM3", H100.gpu_bytes, 80 * GIB, 480 * GIB)
    probe.save(bench.probe_config(cfg), data)
    four = dataclasses.replace(cfg, distributed=dataclasses.replace(cfg.distributed, nproc=4))
    calls, said = [], []
    monkeypatch.setattr(plan, "_measured", lambda *args: calls.append(args) or (0, [20e9, 30e9]))
    measured = plan.shared_link(bench, four, probe.cached(bench.probe_config(cfg)), True, said.append)
    assert calls == [("--link", "4")] and measured["shared_link"] == {"4": [20e9, 30e9]}
    assert "4 GPUs copying at once" in said[0]
    assert plan.shared_link(bench, four, measured, True, said.append) is measured and len(calls) == 1  # cached
    assert probe.cached(bench.probe_config(cfg))["shared_link"] == {"4": [20e9, 30e9]}
    node, lines = plan.planned(bench, four, print, here=False)
    assert lines[-1].endswith("with 4 GPUs copying at once 20 and 30 GB/s each, idle (the plan's rates scaled by "
                              "that share)"), lines[-1]  # fmt: skip
    one, lines = plan.planned(bench, cfg, print, here=False)
    assert "copying at once" not in lines[-1] and node.perf.offload_blocks < one.perf.offload_blocks
    monkeypatch.setattr(plan, "_measured", lambda *args: (1, None))
    unmeasured = plan.shared_link(bench, four, data, True, said.append)
    assert unmeasured is data and "the plan counts the link's rates of one GPU copying alone" in said[-1]


def test_one_h100_offloads_what_the_link_carries_and_recomputes_the_rest_with_inputs_on_the_host():
    plan, _ = best(80, P70, H100, {})
    assert plan is not None and plan.gpu_bytes <= 0.97 * H100.gpu_bytes
    assert plan.offload_inputs and 28 <= plan.offload <= 36  # about what 0.96 s of forward carries at 52 GB/s
    assert 80 - plan.recompute - plan.offload <= 3  # hardly any room to keep a block on the GPU
    assert 2 * 65536 / 8 / plan.seconds > 2000  # tokens/s: the floor for one H100


def test_one_h200_keeps_40_blocks_and_offloads_more_than_an_h100():
    plan, _ = best(80, P70, H200, {})
    h100, _ = best(80, P70, H100, {})
    kept = 80 - plan.recompute - plan.offload
    assert kept >= 40 and plan.recompute <= 2 < h100.recompute and plan.seconds < h100.seconds


def test_keys_given_by_hand_are_kept_and_the_rest_planned_around_them():
    plan, _ = best(80, P70, H200, {"perf.offload_blocks": 10})
    assert plan.offload == 10 and plan.recompute > 0
    plan, _ = best(80, P70, H200, {"perf.activation_checkpointing": False, "perf.recompute_blocks": 0,
                                   "perf.offload_recomputed_inputs": False})  # fmt: skip
    assert plan.recompute == 0  # nothing recomputed: offload what does not fit
    assert plan.offload >= 80 - 54


def test_too_little_host_memory_offloads_less_or_is_refused_naming_what_would_fit():
    tight = dataclasses.replace(H100, host_bytes=20 * GIB)
    plan, _ = best(80, P70, tight, {})
    assert plan is not None and plan.host_bytes <= 0.8 * 20 * GIB and plan.offload < 15
    from trainbench.families.planner import refusal

    none = dataclasses.replace(H100, host_bytes=GIB // 4)
    plan, smallest = best(80, P70, none, {})
    assert plan is None
    said = refusal("llama2_70b_lora/llama2-70b", smallest, 80, none, P70)
    assert "pinned host memory" in said and "0.2 GiB available a rank" in said


def _lora_cfg(**perf):
    from trainbench.resolve import build_config

    return build_config("llama2_70b_lora", "llama2-70b", [], {"device": "cuda", **perf})


@pytest.mark.parametrize(
    ("resources", "says"),
    [
        (Resources(gpu_bytes=48 * GIB, host_bytes=400 * GIB, gpus=1, gpu_name="L40S"),
         "does not fit one L40S of 48.0 GiB: even with every block recomputed"),
        (Resources(gpu_bytes=40 * GIB, host_bytes=400 * GIB, gpus=1, gpu_name="A100-40GB", fp8=False),
         "with a bf16 base needs about"),
    ],
)  # fmt: skip
def test_a_gpu_too_small_is_one_sentence_naming_what_would_fit(resources, says):
    bench, cfg = _lora_cfg()
    with pytest.raises(ConfigError, match=says):
        bench.plan_layout(cfg, resources, P70)


def test_the_plan_sets_the_layout_keys_and_says_why():
    bench, cfg = _lora_cfg()
    assert cfg.perf.plan == "auto" and cfg.perf.compile  # the full-size preset plans its own layout
    planned, lines = bench.plan_layout(cfg, H100, P70)
    assert planned.model.base_precision == "fp8" and planned.perf.activation_checkpointing
    assert planned.perf.offload_recomputed_inputs and planned.perf.offload_blocks > 20
    assert "recomputed (their inputs in host memory)" in lines[0] and "1 x H100 of 79.1 GiB" in lines[0]
    assert "predicted:" in lines[1] and "tokens/s a GPU" in lines[1] and "GPU memory: weights" in lines[2]
    # eight H200: a replica on each, planned per GPU
    planned8, lines8 = bench.plan_layout(cfg, dataclasses.replace(H200, gpus=8), P70)
    assert "8 x H200" in lines8[0] and planned8.model.base_precision == "fp8"
    assert "the collectives not modelled" in lines8[1] and "exposed communication" not in lines8[1], lines8
    # eight 40 GB GPUs without FP8: the bf16 base sharded over them, every block recomputed
    a100 = Resources(gpu_bytes=79 * GIB, host_bytes=200 * GIB, gpus=8, gpu_name="A100-80GB", fp8=False)
    sharded, lines = bench.plan_layout(cfg, a100, P70)
    assert sharded.model.base_precision == "auto" and sharded.perf.activation_checkpointing
    assert "bf16 base sharded by FSDP2 over 8 x A100-80GB" in lines[0]


def test_contradicting_or_impossible_layout_keys_are_one_sentence(tmp_path, capsys):
    with pytest.raises(ConfigError, match="perf.offload_blocks=20 but only 10 blocks keep their activations"):
        _lora_cfg(**{"perf.activation_checkpointing": "true", "perf.recompute_blocks": "70",
                     "perf.offload_blocks": "20"})  # fmt: skip
    bench, cfg = _lora_cfg(**{"model.base_precision": "fp8"})
    with pytest.raises(ConfigError, match="needs FP8 tensor cores"):
        bench.plan_layout(cfg, dataclasses.replace(H200, fp8=False), P70)
    assert run_cli("run", "llama2_70b_lora", "--preset", "tiny", "perf.offload_recomputed_inputs=true",
                   "device=cpu", f"output.results_dir={tmp_path}") == 2  # fmt: skip
    assert "perf.offload_recomputed_inputs=true" in capsys.readouterr().out and not any(tmp_path.iterdir())


def test_a_cached_probe_plans_a_job_and_none_is_one_sentence_before_any_folder(tmp_path, monkeypatch, capsys):
    from trainbench.measure import probe
    from trainbench.measure.plan import planned

    monkeypatch.setenv("TRAINBENCH_CACHE_DIR", str(tmp_path / "cache"))
    bench, cfg = _lora_cfg()
    with pytest.raises(UserError, match="none is cached for llama2_70b_lora/llama2-70b") as refused:
        planned(bench, cfg, print, here=False)
    assert "run `trainbench bench llama2_70b_lora --preset llama2-70b --steps 1 --warmup 0` once" in str(refused.value)
    data = probe_data(P70, "NVIDIA H100 80GB HBM3", H100.gpu_bytes, 80 * GIB, 120 * GIB)
    path = probe.save(bench.probe_config(cfg), data)
    assert json.loads(path.read_text())["kept_bytes"] == P70.kept_bytes
    done, lines = planned(bench, cfg, print, here=False)
    assert done.perf.offload_blocks > 20 and "NVIDIA H100 80GB HBM3" in lines[0] and "probe:" in lines[-1]
    assert lines[-1].endswith("host link 52 GB/s out, 50 GB/s back"), lines[-1]  # no busy rates were probed
    probe.save(bench.probe_config(cfg), data | {"to_host_busy_bytes_s": 41e9, "to_gpu_busy_bytes_s": 38e9})
    busy_plan, lines = planned(bench, cfg, print, here=False)
    assert lines[-1].endswith("52 GB/s out, 50 GB/s back idle, 41 and 38 GB/s while a step runs (the plan's)")
    assert busy_plan.perf.offload_blocks < done.perf.offload_blocks  # the slower link carries fewer blocks' copies
    # a hand key changes the probed base: the FP8 probe is not used for a bf16 base
    bench, manual = _lora_cfg(**{"perf.plan": "manual"})
    assert planned(bench, manual, print, here=False) == (manual, [])
    # a dry run with nothing cached writes the script and says the layout was not planned
    monkeypatch.setenv("TRAINBENCH_CACHE_DIR", str(tmp_path / "empty"))
    assert run_cli("submit", "llama2_70b_lora", "--system", "dgxh100_1x8", "--dry-run",
                   f"output.results_dir={tmp_path / 'r'}") == 0  # fmt: skip
    assert "dry run, layout not planned" in capsys.readouterr().out


def test_a_run_on_a_cpu_has_nothing_to_plan():
    from trainbench.measure.plan import planned
    from trainbench.resolve import build_config

    bench, cfg = build_config("llama2_70b_lora", "llama2-70b", [], {"device": "cpu"})
    same, lines = planned(bench, cfg, print)
    assert same is cfg and "no GPU here, nothing to plan" in lines[0]
    bench, cfg = build_config("bert", "tiny", [], {"perf.plan": "auto"})
    with pytest.raises(ConfigError, match="bert has no layout to plan"):
        planned(bench, cfg, print)


def test_a_truncated_depth_is_planned_for_its_own_blocks():
    """bench --blocks under perf.plan=auto: each truncated model gets a plan of its own depth (the full model's
    recompute count could exceed it)."""
    bench, cfg = _lora_cfg()
    full, _ = bench.plan_layout(cfg, H100, P70)
    shallow = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=4))
    four, lines = bench.plan_layout(shallow, H100, P70)
    assert full.perf.recompute_blocks > 4 and four.perf.recompute_blocks <= 4
    assert four.perf.offload_blocks + four.perf.recompute_blocks <= 4 and "of 79.1 GiB" in lines[0]


def test_where_no_replica_fits_several_gpus_shard_the_fp8_base():
    bench, cfg = _lora_cfg()
    small = Resources(gpu_bytes=int(60 * GIB), host_bytes=400 * GIB, gpus=8, gpu_name="GPU-60GB")
    planned, lines = bench.plan_layout(cfg, small, P70)
    assert planned.model.base_precision == "fp8" and planned.model.base_sharding == "fsdp"
    assert planned.perf.activation_checkpointing and planned.perf.offload_blocks == 0
    assert "sharded by FSDP2 over the 8 GPUs (gathered in FP8" in lines[0]
    with pytest.raises(ConfigError, match="nor does the FP8 base sharded over 2 GPUs"):
        bench.plan_layout(cfg, dataclasses.replace(small, gpu_bytes=int(30 * GIB), gpus=2), P70)
    bench, given = _lora_cfg(**{"model.base_sharding": "fsdp"})  # given by hand: kept, on one GPU too
    assert bench.plan_layout(given, H200, P70)[0].model.base_sharding == "fsdp"
    with pytest.raises(ConfigError, match="needs model.base_sharding=replicate"):
        _lora_cfg(**{"model.base_precision": "fp8", "model.base_sharding": "fsdp", "perf.offload_blocks": "2",
                     "perf.plan": "manual"})  # fmt: skip


def test_a_gpu_memory_limit_plans_a_smaller_gpu_and_is_refused_without_a_gpu(tmp_path, monkeypatch, capsys):
    """perf.gpu_memory_gib: an H200's probe planned as an 80 GB GPU (what the H200 had taken, the context, counted
    as taken there too) plans as an H100 does; on the CPU the key is one sentence before any folder."""
    import torch

    from trainbench.measure import probe
    from trainbench.measure.plan import planned
    from trainbench.train.setup import limit_gpu_memory

    monkeypatch.setenv("TRAINBENCH_CACHE_DIR", str(tmp_path / "cache"))
    bench, cfg = _lora_cfg()
    data = probe_data(P70, "NVIDIA H200", int(139.3 * GIB), int(139.8 * GIB), 120 * GIB)
    probe.save(bench.probe_config(cfg), data)
    whole, _ = planned(bench, cfg, print, here=False)
    limited_cfg = dataclasses.replace(cfg, perf=dataclasses.replace(cfg.perf, gpu_memory_gib=79.6))
    limited, lines = planned(bench, limited_cfg, print, here=False)
    as_h100, _ = bench.plan_layout(cfg, dataclasses.replace(H100, gpu_bytes=int(79.1 * GIB)), P70)
    assert "NVIDIA H200 (perf.gpu_memory_gib=79.6) of 79.1 GiB" in lines[0], lines[0]
    assert limited.perf.offload_blocks == as_h100.perf.offload_blocks != whole.perf.offload_blocks
    assert limited.perf.recompute_blocks == as_h100.perf.recompute_blocks > whole.perf.recompute_blocks
    with pytest.raises(ConfigError, match="perf.gpu_memory_gib=79.6 limits a GPU's memory, and this run is on cpu"):
        limit_gpu_memory(limited_cfg, torch.device("cpu"))
    assert run_cli("run", "bert", "--preset", "tiny", "perf.gpu_memory_gib=10", "device=cpu",
                   f"output.results_dir={tmp_path / 'r'}") == 2  # fmt: skip
    assert "perf.gpu_memory_gib=10 limits a GPU's memory: it needs a GPU" in capsys.readouterr().out
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())


# A block of Llama 3.1 8B in FP8 at one 8,192-token row: 218.1 M parameters (fp32 weights 0.81 GiB; fp32 gradient
# and AdamW's two moments 2.44 GiB), 0.86 GiB kept for its backward (docs/performance.md, "memory the forward keeps"),
# its fp32 input 128 MiB; 6.0 + 12.4 ms (18.4 ms a row on one H100, notes/llm.md, "One H100 at HEAD"). Outside the
# blocks: the embedding and the output layer, 1.05 B parameters (3.91 GiB; 11.74 GiB of gradients and state).
P8 = BlockProbe(kept_bytes=int(0.86 * GIB), input_bytes=8192 * 4096 * 4, block_weight_bytes=int(0.812 * GIB),
                other_weight_bytes=int(3.91 * GIB), optimizer_bytes_per_block=int(2.437 * GIB), working_bytes=6 * GIB,
                forward_s=0.006, backward_s=0.0124, head_s=0.046, to_host_bytes_s=52e9, to_gpu_bytes_s=50e9,
                other_optimizer_bytes=int(11.74 * GIB))  # fmt: skip


def _llama_cfg(**keys):
    from trainbench.resolve import build_config

    return build_config("llama31_8b", "llama31-8b", [], {"device": "cuda", "model.precision": "fp8",
                                                          "perf.plan": "auto", **keys})  # fmt: skip


def test_fsdp2_shares_the_weights_gradients_and_state_of_the_8b_and_recomputes_only_where_they_crowd_a_gpu():
    """The 8B sharded over 4 H100: nothing recomputed, about the 66.0 GiB a GPU measured there (notes/node.md); over
    2 H100 (where nothing recomputed did not fit: refused at 76.2 GiB held) the fewest blocks recomputed that fit;
    over 2 H200 nothing; one H200 fits only with most blocks recomputed; one H100 not at all."""
    from trainbench.families.planner import sharded

    bench, cfg = _llama_cfg()
    four, lines = bench.plan_layout(cfg, dataclasses.replace(H100, gpus=4), P8)
    assert not four.perf.activation_checkpointing and four.perf.recompute_blocks == 0
    memory = evaluate(32, sharded(P8, 4), 0, 0, False).gpu_bytes
    assert 62 * GIB < memory < 70 * GIB
    assert "4 x H100" in lines[0] and "FSDP2 over the 4 ranks" in lines[0] and "not counted" in lines[-1]
    two, lines = bench.plan_layout(cfg, dataclasses.replace(H100, gpus=2), P8)
    assert two.perf.activation_checkpointing and 20 <= two.perf.recompute_blocks < 32
    assert two.perf.offload_blocks == 0  # the plan recomputes; it offloads only where told to
    fewer = evaluate(32, sharded(P8, 2), two.perf.recompute_blocks - 1, 0, False)
    assert fewer.gpu_bytes > H100.gpu_bytes * 0.97  # one block fewer recomputed would not fit
    assert "gradients and optimizer state" in lines[2]
    h200s, lines = bench.plan_layout(cfg, dataclasses.replace(H200, gpus=2), P8)
    assert h200s.perf.recompute_blocks == 0
    # two rows a micro-batch fit there with nothing recomputed (the 4 H100 would need blocks recomputed for them)
    assert h200s.data.micro_batch_size == 2 and four.data.micro_batch_size == 1 and two.data.micro_batch_size == 1
    assert "micro-batches of 2 rows" in lines[0] and "rows: 2 a micro-batch" in lines[3], lines
    assert h200s.data.global_batch_size == cfg.data.global_batch_size and cfg.data.micro_batch_size == 1
    one, lines = bench.plan_layout(cfg, H200, P8)
    assert one.perf.recompute_blocks > 20 and "the whole model on the GPU" in lines[0]
    with pytest.raises(ConfigError, match=r"does not fit 1 x H100 of 79.1 GiB: even with every block recomputed it "
                                          r"needs .* use more GPUs \(--nproc N\)"):  # fmt: skip
        bench.plan_layout(cfg, H100, P8)


def test_the_8b_keeps_layout_keys_given_by_hand_and_refuses_a_plan_with_tensor_parallelism():
    bench, cfg = _llama_cfg(**{"perf.activation_checkpointing": "true", "perf.recompute_blocks": "30"})
    planned, lines = bench.plan_layout(cfg, dataclasses.replace(H100, gpus=2), P8)
    assert planned.perf.recompute_blocks == 30 and "kept as given: perf.activation_checkpointing=True" in lines[0]
    # rows a micro-batch: a number given is kept; two only where a rank's share of the global batch divides by two
    bench, cfg = _llama_cfg(**{"data.micro_batch_size": "4"})
    planned, lines = bench.plan_layout(cfg, dataclasses.replace(H200, gpus=2), with_rows(P8, 4))
    assert planned.data.micro_batch_size == 4 and "micro-batches of 4 rows" in lines[0]
    bench, cfg = _llama_cfg(**{"data.global_batch_size": "16"})
    planned, _ = bench.plan_layout(cfg, dataclasses.replace(H200, gpus=16), P8)
    assert planned.data.micro_batch_size == 1
    bench, tp = _llama_cfg(**{"distributed.tp": "2", "distributed.nproc": "2", "model.fused_qkv": "false"})
    with pytest.raises(ConfigError, match="with distributed.tp=2 set the layout keys by hand"):
        bench.plan_layout(tp, dataclasses.replace(H100, gpus=2), P8)


def test_gpt_oss_has_no_plan_of_its_own():
    from trainbench.benchmarks import get_benchmark

    assert get_benchmark("llama31_8b").family.plans_layout and not get_benchmark("gpt_oss_20b").family.plans_layout


def test_a_cached_probe_of_the_8b_plans_two_ranks_through_the_launcher(tmp_path, monkeypatch):
    """The launcher's planner (measure/plan.planned) with a probe of the 8B cached as the probe would write it: 2
    ranks of H100 recompute blocks, with the probe's line; the gradients and state outside the blocks are read from it,
    and a probe of the older format (without them) is not used."""
    from trainbench.measure import probe
    from trainbench.measure.plan import planned

    monkeypatch.setenv("TRAINBENCH_CACHE_DIR", str(tmp_path / "cache"))
    bench, cfg = _llama_cfg(**{"distributed.nproc": "2"})
    data = probe_data(P8, "NVIDIA H100 80GB HBM3", H100.gpu_bytes, 80 * GIB, 480 * GIB)
    probe.save(bench.probe_config(cfg), data)
    done, lines = planned(bench, cfg, print, here=False)
    assert done.perf.activation_checkpointing and 20 <= done.perf.recompute_blocks < 32
    assert "2 x NVIDIA H100 80GB HBM3" in lines[0] and "FSDP2 over the 2 ranks" in lines[0]
    assert "gradients and optimizer state 44.9 GiB" in lines[2]  # (32 x 2.437 + 11.74) / 2: the embedding's too
    assert lines[-1].startswith("  probe: NVIDIA H100 80GB HBM3, a block keeps 0.86 GiB, forward 6.0 ms")
    assert "MHz" not in lines[-1]  # a probe without the clock its steps ran at (older, or no NVML)
    probe.save(bench.probe_config(cfg), data | {"sm_clock_mhz": 1755.0, "power_w": 698.2})
    _, lines = planned(bench, cfg, print, here=False)
    assert "backward 12.4 ms (at 1,755 MHz, 698 W); host link" in lines[-1], lines[-1]
    # perf.probe_sustained_s and perf.probe_blocks away from their defaults: another probe each, cached apart (none
    # of them yet); its line says how long it ran first, and how many blocks it stepped
    sustained = _llama_cfg(**{"distributed.nproc": "2", "perf.probe_sustained_s": "40"})[1]
    more = _llama_cfg(**{"distributed.nproc": "2", "perf.probe_blocks": "8"})[1]
    assert len({probe.probe_key(c) for c in (cfg, sustained, more)}) == 3
    assert probe.probe_key(cfg) == probe.probe_key(_llama_cfg(**{
        "distributed.nproc": "2", "perf.probe_sustained_s": "0", "perf.probe_blocks": "2"})[1])  # fmt: skip
    # the probe builds no more blocks than the model has: a probe of 8 and one of 32 of a 4-block model are one
    four = [_llama_cfg(**{"model.num_layers": "4", "perf.probe_blocks": n})[1] for n in ("8", "32")]
    assert probe.probe_blocks(four[0]) == 4 and probe.probe_key(four[0]) == probe.probe_key(four[1])
    assert probe.probe_config(four[0]).model.num_layers == 4 and probe.probe_config(more).model.num_layers == 8
    assert probe.probe_config(cfg).model.num_layers == 2
    for shaped, key in ((sustained, "perf.probe_sustained_s=40.0"), (more, "perf.probe_blocks=8")):
        with pytest.raises(UserError, match="none is cached for llama31_8b/llama31-8b") as refused:
            planned(bench, shaped, print, here=False)
        # the command that caches it is given what shapes the probe: the plan (by hand in the preset), the precision,
        # the key away from its default
        assert (
            f"run `trainbench bench llama31_8b --preset llama31-8b perf.plan=auto model.precision=fp8 {key} "
            "--steps 1 --warmup 0` once"
        ) in str(refused.value), refused.value
    probe.save(bench.probe_config(sustained), data | {"sm_clock_mhz": 1500.0, "power_w": 690.0, "sustained_s": 40.0,
                                                      "sustained_steps": 311, "blocks": 8})  # fmt: skip
    _, lines = planned(bench, sustained, print, here=False)
    assert "backward 12.4 ms (at 1,500 MHz, 690 W, after 40 s of steps, 8 blocks a step); host link" in lines[-1]
    probe.save(bench.probe_config(cfg), data | {"device_copy_bytes_s": 2.1e12})  # the GPU's own copies: FSDP2's
    _, lines = planned(bench, cfg, print, here=False)
    assert lines[-1].endswith("; the GPU's memory copies 2,100 GB/s (FSDP2's are charged at it)"), lines[-1]
    assert "FSDP2's copies" in lines[1], lines
    monkeypatch.setattr(probe, "PROBE_FORMAT", 2)  # another format's key: this cache is not found
    with pytest.raises(UserError, match="none is cached for llama31_8b/llama31-8b"):
        planned(bench, cfg, print, here=False)


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "synced"])
def test_the_probe_times_three_steps_after_the_seconds_of_steps_asked_for(monkeypatch, streamed):
    """measure/probe._timed_steps with perf.probe_sustained_s: two steps (compile, settle), steps until the seconds
    asked for have passed (the GPU held at the clock its power cap allows, as through a run), then the three it
    times; with none, five in all. Streamed, the steps after the first two are queued while the one before runs (the
    host waits on the end of the step before the one it just queued, never on the whole GPU) and a step is timed
    from the end of the one before; synced, the GPU is waited on before each. The CUDA calls are stood in for (host
    clocks for events): what is tested is the count and the order of the steps and waits, and that the times kept are
    the fastest timed step's own."""
    from trainbench.measure import probe

    log = []

    class Event:
        def __init__(self):
            self.t, self.after = time.perf_counter(), len([e for e in log if e[0] == "step"])
            log.append(("mark", self.after))

        def elapsed_time(self, end) -> float:
            return (end.t - self.t) * 1e3

        def synchronize(self) -> None:
            log.append(("wait", self.after))

    monkeypatch.setattr(probe, "_mark", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: log.append(("sync",)))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 0)
    ran = []

    class Marks:
        def taken(self):
            i = ran[-1]  # the step's own index: which step's times were kept
            return {"forward_s": lambda: float(i), "backward_s": lambda: i / 2}

    def step(i: int) -> None:
        ran.append(i)
        log.append(("step", i))
        time.sleep(0.06 if i % 3 == 0 else 0.02)  # (the fastest timed step is one whose index is not a multiple of 3)

    quick = probe._timed_steps(step, torch.device("cpu"), Marks(), streamed=streamed)
    assert ran == [0, 1, 2, 3, 4] and quick["steps"] == 5
    assert quick["forward_s"] in (2.0, 4.0) and quick["backward_s"] == quick["forward_s"] / 2
    assert 0.02 <= quick["step_s"] < 0.06  # its own time, not the slow one's beside it
    ran.clear()
    log.clear()
    t = time.perf_counter()
    held = probe._timed_steps(step, torch.device("cpu"), Marks(), sustained_s=0.3, streamed=streamed)
    n = held["steps"]
    assert time.perf_counter() - t >= 0.3 + 5 * 0.02 and ran == list(range(n)) and n >= 5 + 3
    assert held["forward_s"] in {float(i) for i in range(n - 3, n) if i % 3}
    held_steps = [i for (what, *i) in log if what == "step"][2:-3]
    waits = [e for e in log[log.index(("step", 2)) : log.index(("step", n - 3))] if e[0] in ("sync", "wait")]
    if streamed:  # after queuing step i (i past the first held one), the host waits on step i-1's end alone
        assert waits == [("wait", i) for (i,) in held_steps[1:]], waits
    else:
        assert waits == [("sync",)] * (len(held_steps) + 1), waits  # after each held step, and before the first timed


def test_the_probe_reports_the_clock_and_power_of_the_gpu_its_steps_kept_busy():
    """measure/probe.busiest_gpu over telemetry.measured_window's summary: the GPU with the most busy samples (on a
    node, the probe's one; the idle ones are not in the summary or have fewer), or None where nothing was sampled."""
    from trainbench.measure.probe import busiest_gpu

    summary = {"node_gpu0": {"busy_samples": 9, "sm_clock_mhz": 1755.0, "power_w": 698.2},
               "node_gpu3": {"busy_samples": 1, "sm_clock_mhz": 1980.0, "power_w": 120.0}}  # fmt: skip
    assert busiest_gpu(summary) == {"sm_clock_mhz": 1755.0, "power_w": 698.2}
    assert busiest_gpu({}) == {"sm_clock_mhz": None, "power_w": None}


@pytest.mark.parametrize("blocks", [2, 3])
def test_the_probe_counts_a_block_s_own_optimizer_state_and_puts_the_embedding_s_outside_the_blocks(blocks):
    """measure/probe._optimizer_bytes after an AdamW step of a model whose embedding and output layer train too: a
    block's share is its own state (two fp32 moments) and gradient; the rest (what the step left beyond the weights,
    less the blocks' share, plus the gradients outside the blocks) is the embedding's and the output layer's."""
    import types

    import torch

    from trainbench.measure.probe import _optimizer_bytes

    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(100, 8)
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(blocks))
    model.head = torch.nn.Linear(8, 100, bias=False)
    optimizer = torch.optim.AdamW(model.parameters())
    x = model.embed(torch.arange(4))
    for layer in model.model.layers:
        x = layer(x)
    loss = model.head(x).sum()
    loss.backward()
    optimizer.step()
    run = types.SimpleNamespace(placed=types.SimpleNamespace(module=model), optimizer=optimizer)
    block = (8 * 8 + 8) * 4  # a Linear(8, 8)'s fp32 parameters
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values())
    ours, others = _optimizer_bytes(run, model.model.layers[1], persistent=state, blocks=blocks)
    outside = (100 * 8 + 8 * 100) * 4  # the embedding's and the head's parameters
    assert ours == 2 * block + block + 2 * 4  # two moments, the gradient, AdamW's step count a parameter (4 bytes)
    assert others == 2 * outside + outside + 2 * 4


def test_the_probe_marks_a_compiled_block_from_outside_its_graph(monkeypatch):
    """The probe's hooks around a block compiled with ``Module.compile`` (as the 8B's blocks are) run eagerly in
    every step: traced into the block's graph, their CUDA events were never recorded and the probe failed."""
    import torch

    from trainbench.measure import probe

    calls = []
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(probe._BlockMarks, "_event",
                        lambda self, name: calls.append((name, torch.compiler.is_compiling())))  # fmt: skip
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    block.compile(dynamic=False, backend="eager")
    marks = probe._BlockMarks(block, torch.device("cpu"))
    for _ in range(2):
        block(torch.randn(4, 8, requires_grad=True)).sum().backward()
    marks.remove()
    assert [name for name, _ in calls] == ["forward_start", "forward_end", "backward_start", "backward_end"] * 2
    assert not any(compiling for _, compiling in calls), calls


def test_the_plan_counts_the_collectives_no_block_hides_and_prints_the_split_it_expects():
    """Sharded over N ranks, a micro-batch waits for the gather of the embedding and output layer (1.05 B parameters,
    bf16) and their gradients' reduce-scatter (fp32, or bf16 under distributed.grad_reduce_dtype=bf16), each rank
    sending (N - 1) / N of them at 200 GB/s; reduced once a step, once in the step's micro-batches. On 2 H200 this
    adds 15.7 ms to a micro-batch of two rows: the plan that predicted 14,709 tokens/s a GPU where 14,095 were
    measured (docs/performance.md) would now predict about 14,500. The predicted line splits the time."""
    from trainbench.families.planner import NODE_COLLECTIVE_BYTES_S, sharded

    params = P8.other_weight_bytes / 4
    assert sharded(P8, 1).exposed_comm_s == 0.0
    two, four = sharded(P8, 2).exposed_comm_s, sharded(P8, 4).exposed_comm_s
    assert two == pytest.approx(params * 6 / 2 / NODE_COLLECTIVE_BYTES_S) and two == pytest.approx(0.0157, abs=1e-4)
    assert four == pytest.approx(two * 1.5)  # 3/4 of the bytes leave each rank, not 1/2
    assert sharded(P8, 2, reduce_bytes=2).exposed_comm_s == pytest.approx(two * 4 / 6)
    assert sharded(P8, 2, reduce_once_a_step=True, micro_batches=8).exposed_comm_s == pytest.approx(two / 8)
    plain, shared = evaluate(32, P8, 0, 0, False), evaluate(32, sharded(P8, 2), 0, 0, False)
    assert shared.seconds - plain.seconds == pytest.approx(two) and shared.comm_s == two and plain.comm_s == 0
    predicted = 2 * 8192 / 14_709  # the 2-H200 plan's micro-batch, seconds
    assert 2 * 8192 / (predicted + two) == pytest.approx(14_504, rel=1e-3)
    bench, cfg = _llama_cfg(**{"distributed.nproc": "2", "distributed.keep_outer_gathered": "false"})
    _, lines = bench.plan_layout(cfg, dataclasses.replace(H200, gpus=2), P8)
    assert "exposed communication 0.016 s" in lines[1] and "waiting for host copies 0.000 s" in lines[1], lines
    assert (
        "the embedding's and output layer's gathers each micro-batch and their reduce-scatters each micro-batch"
        in lines[-1]
    ), lines
    one_bench, one_cfg = _llama_cfg()
    _, one = one_bench.plan_layout(one_cfg, H200, P8)
    assert "compute" in one[1] and "exposed communication" not in one[1], one


def test_the_layers_outside_the_blocks_kept_gathered_are_gathered_once_a_step():
    """distributed.keep_outer_gathered (on by default): the embedding and output layer gathered once in a step's
    micro-batches, their reduce-scatters still each micro-batch: on 2 H200 at 8 micro-batches a rank, bf16
    reduce-scatters, 5.9 ms a micro-batch against 10.5. distributed.output_layer_apart (off by default): the output
    layer's reduce-scatter runs beside the blocks' backward, leaving the embedding's (half the rest) after the last
    block, and at the step's peak of memory: its gradient once more in bf16 and its fp32 shard in the working set
    (2.9 GiB for the 8B on 2 GPUs; 3.0 measured)."""
    from trainbench.families.planner import NODE_COLLECTIVE_BYTES_S, sharded

    params = P8.other_weight_bytes / 4
    each = sharded(P8, 2, reduce_bytes=2, micro_batches=8)
    kept = sharded(P8, 2, reduce_bytes=2, micro_batches=8, outer_kept=True)
    both = sharded(P8, 2, reduce_bytes=2, micro_batches=8, outer_kept=True, head_apart=True)
    assert each.exposed_comm_s == pytest.approx(params * (2 + 2) / 2 / NODE_COLLECTIVE_BYTES_S)
    assert kept.exposed_comm_s == pytest.approx(params * (2 / 8 + 2) / 2 / NODE_COLLECTIVE_BYTES_S)
    assert both.exposed_comm_s == pytest.approx(params * (2 / 8 + 1) / 2 / NODE_COLLECTIVE_BYTES_S)
    assert 3.2e-3 < both.exposed_comm_s < 3.4e-3 < 5.8e-3 < kept.exposed_comm_s < 6.0e-3 < each.exposed_comm_s < 10.6e-3
    assert kept.working_bytes == each.working_bytes  # gathered through each micro-batch anyway
    # distributed.keep_gathered keeps the root's unit gathered with the blocks (its context recurses from the root)
    blocks_kept = sharded(P8, 2, reduce_bytes=2, micro_batches=8, gather_bytes=1, gathered_as=1)
    assert blocks_kept.exposed_comm_s == pytest.approx(kept.exposed_comm_s)
    assert both.working_bytes - kept.working_bytes == pytest.approx(params / 2 * (2 * 2 + 4 / 2), abs=1)
    assert 2.8 < (both.working_bytes - kept.working_bytes) / 2**30 < 3.0
    # reduced once a step, everything is kept gathered between micro-batches already: once in the step
    once = sharded(P8, 2, reduce_once_a_step=True, reduce_bytes=2, micro_batches=8, outer_kept=True).exposed_comm_s
    assert once == pytest.approx(each.exposed_comm_s / 8)
    gpus = dataclasses.replace(H200, gpus=2)
    for keys, says in (
        ({}, "gathers once a step (kept between micro-batches) and their reduce-scatters each micro-batch"),
        ({"distributed.output_layer_apart": "true"}, "gathers once a step (kept between micro-batches) and the "
         "embedding's reduce-scatter each micro-batch (the output layer's runs beside the blocks')"),
        ({"distributed.keep_outer_gathered": "false"}, "gathers each micro-batch and their reduce-scatters each"),
    ):  # fmt: skip
        bench, cfg = _llama_cfg(**{"distributed.nproc": "2", "distributed.grad_reduce_dtype": "bf16"} | keys)
        _, lines = bench.plan_layout(cfg, gpus, P8)
        assert "  communication: " in lines[-1] and says in lines[-1], (keys, lines)


def test_the_plan_counts_the_whole_gradients_and_gathered_weights_of_reducing_once_a_step():
    """distributed.reduce_once_a_step keeps every block's fp32 gradient and gathered weights whole between
    micro-batches: the plan counts them (twice a block's weights, an upper bound), names them in its memory line, and
    on 2 H200, where the 8B fits sharded with nothing recomputed, recomputes blocks (or takes fewer rows) to make
    room."""
    from trainbench.families.planner import sharded

    each = evaluate(32, sharded(P8, 2), 0, 0, False)
    once = evaluate(32, sharded(P8, 2, reduce_once_a_step=True), 0, 0, False)
    assert once.gpu_bytes - each.gpu_bytes == 32 * 2 * P8.block_weight_bytes
    bench, cfg = _llama_cfg(**{"distributed.nproc": "2", "distributed.reduce_once_a_step": "true"})
    _, plain = _llama_cfg(**{"distributed.nproc": "2"})
    h200s, lines = bench.plan_layout(cfg, dataclasses.replace(H200, gpus=2), P8)
    before, _ = bench.plan_layout(plain, dataclasses.replace(H200, gpus=2), P8)
    assert before.perf.recompute_blocks == 0 and before.data.micro_batch_size == 2
    assert h200s.perf.recompute_blocks > 0 or h200s.data.micro_batch_size < 2, lines
    assert "gradients kept whole and weights gathered (distributed.reduce_once_a_step)" in lines[2], lines


def test_the_plan_counts_the_weights_kept_gathered_through_a_step_at_the_bytes_they_are_gathered_in():
    """distributed.keep_gathered holds every block's gathered weights through a step: the plan counts them at the
    gather's bytes (FP8: a quarter of the probe's fp32 weights; bf16: half), nothing more where
    distributed.reduce_once_a_step counts them already, and names them in its memory line; on 2 H200 the 8B in FP8
    keeps the plan it has without them (nothing recomputed, 2 rows a micro-batch)."""
    from trainbench.families.planner import sharded

    each = evaluate(32, sharded(P8, 2), 0, 0, False)
    fp8 = evaluate(32, sharded(P8, 2, gather_bytes=1), 0, 0, False)
    bf16 = evaluate(32, sharded(P8, 2, gather_bytes=2), 0, 0, False)
    assert fp8.gpu_bytes - each.gpu_bytes == 32 * (P8.block_weight_bytes // 4)
    assert bf16.gpu_bytes - each.gpu_bytes == 32 * (P8.block_weight_bytes // 2)
    once = evaluate(32, sharded(P8, 2, reduce_once_a_step=True), 0, 0, False)
    both = evaluate(32, sharded(P8, 2, reduce_once_a_step=True, gather_bytes=1), 0, 0, False)
    assert both.gpu_bytes == once.gpu_bytes
    two = dataclasses.replace(H200, gpus=2)
    bench, cfg = _llama_cfg(**{"distributed.nproc": "2", "distributed.keep_gathered": "true",
                               "model.precision": "fp8"})  # fmt: skip
    planned, lines = bench.plan_layout(cfg, two, P8)
    assert "weights kept gathered through a step (distributed.keep_gathered)" in lines[2], lines
    assert planned.perf.recompute_blocks == 0 and planned.data.micro_batch_size == 2, lines  # the plan without it
    gathered = 32 * (P8.block_weight_bytes // 4) / 2**30
    assert f"weights kept gathered through a step (distributed.keep_gathered) {gathered:.1f} GiB" in lines[2], lines
    assert not any("distributed.keep_gathered: with the weights" in line for line in lines), lines  # it cost nothing
    # On a GPU of 134 GiB the 2 rows fit without them (128.5 GiB) and not with them: the plan says what the key cost
    smaller = dataclasses.replace(two, gpu_bytes=134 * GIB)
    planned, lines = bench.plan_layout(cfg, smaller, P8)
    assert planned.data.micro_batch_size == 1 and planned.perf.recompute_blocks == 0, lines
    assert lines[-1] == (
        "  distributed.keep_gathered: with the weights kept gathered the plan holds 1 row a "
        "micro-batch and 0 blocks recomputed; without the key 2 and 0, predicted 12,792 tokens/s a "
        "GPU against this plan's 12,689 (on 2 H200 the key measured 3.2 % slower so: docs/llm.md)"
    )
    without, _ = bench.plan_layout(dataclasses.replace(cfg, distributed=dataclasses.replace(
        cfg.distributed, keep_gathered=False)), smaller, P8)  # fmt: skip
    assert without.data.micro_batch_size == 2


def test_the_plan_counts_fsdp2_s_own_copies_of_every_block_at_the_gpu_s_copy_rate():
    """Sharded, each micro-batch gathers every block twice and reduce-scatters it once, and FSDP2's own kernels copy
    and cast around each (one GPU has none of them): in FP8 gathers and bf16 reduce-scatters over 2 ranks, 24 bytes
    read and written a parameter, charged at twice the probe's copy rate (a copy reads and writes each byte). The
    weights kept gathered gather twice a step, reduced once a step reduce-scatters once a step; more rows a
    micro-batch leave the copies as they are (fewer micro-batches a step carry them); the predicted line says them;
    a probe without the copy rate (an older one) charges nothing."""
    from trainbench.families.planner import MASTER_BYTES, shard_copy_bytes, sharded, with_rows

    # FP8 gather: cast 5/2, copy into the buffer 2/2, copy out 2; twice. bf16 reduce-scatter: into the buffer 4,
    # the shard to fp32 6/2, added to its fp32 gradient 12/2
    assert shard_copy_bytes(2, 1, 2, gathers=2, reduces=1) == pytest.approx(2 * (2.5 + 1 + 2) + 4 + 3 + 6)  # 24
    assert shard_copy_bytes(2, 1, 4, gathers=2, reduces=1) == pytest.approx(11 + 8 + 6)  # fp32: no cast back
    assert shard_copy_bytes(2, 2, 2, gathers=2, reduces=1) == pytest.approx(2 * (3 + 4) + 13)  # bf16 gathers
    assert shard_copy_bytes(4, 1, 2, 2, 1) < shard_copy_bytes(2, 1, 2, 2, 1)  # a smaller shard to cast and add
    rate = 2.0e12
    p = dataclasses.replace(P8, device_copy_bytes_s=rate)
    params = P8.block_weight_bytes / MASTER_BYTES  # 218 M
    each = sharded(p, 2, reduce_bytes=2, micro_batches=8, gathered_as=1)
    assert each.shard_copy_s == pytest.approx(params * 24 / (2 * rate)) and 1.2e-3 < each.shard_copy_s < 1.4e-3
    plan = evaluate(32, each, 0, 0, False)
    without = evaluate(32, sharded(P8, 2, reduce_bytes=2, micro_batches=8, gathered_as=1), 0, 0, False)
    assert plan.shard_copy_s == pytest.approx(32 * each.shard_copy_s) and without.shard_copy_s == 0.0
    assert plan.seconds - without.seconds == pytest.approx(plan.shard_copy_s)
    # kept gathered: two gathers a step (the first forward's, the last backward's); reduced once a step: every
    # backward's gather and the first forward's, one reduce-scatter a step; both: two gathers and one
    kept = sharded(p, 2, reduce_bytes=2, micro_batches=8, gather_bytes=1, gathered_as=1)
    assert kept.shard_copy_s == pytest.approx(params * shard_copy_bytes(2, 1, 2, 2 / 8, 1) / (2 * rate))
    once = sharded(p, 2, reduce_once_a_step=True, reduce_bytes=2, micro_batches=8, gathered_as=1)
    assert once.shard_copy_s == pytest.approx(params * shard_copy_bytes(2, 1, 2, 1 + 1 / 8, 1 / 8) / (2 * rate))
    both = sharded(p, 2, reduce_once_a_step=True, reduce_bytes=2, micro_batches=8, gather_bytes=1, gathered_as=1)
    assert both.shard_copy_s == pytest.approx(params * shard_copy_bytes(2, 1, 2, 2 / 8, 1 / 8) / (2 * rate))
    assert both.shard_copy_s < once.shard_copy_s < kept.shard_copy_s < each.shard_copy_s
    assert sharded(p, 1).shard_copy_s == 0.0
    rows2 = sharded(with_rows(p, 2), 2, reduce_bytes=2, micro_batches=8, gathered_as=1)
    assert rows2.shard_copy_s == each.shard_copy_s and rows2.forward_s == 2 * p.forward_s
    bench, cfg = _llama_cfg(**{"distributed.nproc": "2", "distributed.grad_reduce_dtype": "bf16"})
    _, lines = bench.plan_layout(cfg, dataclasses.replace(H200, gpus=2), p)
    copies = 32 * each.shard_copy_s  # the plan's 2 rows a micro-batch: 8 of them in a rank's 16 rows a step
    assert f"FSDP2's copies {copies:.3f} s" in lines[1], lines
    _, old = bench.plan_layout(cfg, dataclasses.replace(H200, gpus=2), P8)
    assert "FSDP2's copies" not in old[1]
