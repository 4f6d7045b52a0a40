"""The forecast of several GPUs from one (measure/forecast.py, families/node_costs.py): the models of what the ranks
add against hand-computed figures and the planner's, the one-GPU step kept per shape and read back with its fields
checked, each family's choice of model, and the forecast at the model's depth in bench.json and its report. The
paths that run it (a one-GPU bench keeping its step, a bench on several GPUs forecasting before it times) run only
on GPUs: tests/test_gpu_multi.py."""

import dataclasses
import json

import pytest

from trainbench.errors import UserError
from trainbench.families import node_costs
from trainbench.families.decoder.expert_placement import balanced
from trainbench.families.node_costs import OneGpu
from trainbench.families.planner import NODE_COLLECTIVE_BYTES_S, BlockProbe, sharded
from trainbench.measure import forecast
from trainbench.report import bench_report
from trainbench.resolve import build_config

ONE = OneGpu(step_s=0.5, micro_batches=4, block_params=100_000_000, other_params=50_000_000,
             device_copy_bytes_s=2e12, gpu_name="NVIDIA H200", measured_at="2026-11-30T00:00:00Z")  # fmt: skip


def test_a_replicas_all_reduce_sends_twice_its_gradients_share_once_a_step_and_a_split_graph_leaves_one_bucket():
    whole = node_costs.replicated(ONE, 2, 4, None)["exposed communication"]
    assert whole == pytest.approx(150e6 * 4 * 2 * (1 / 2) / NODE_COLLECTIVE_BYTES_S)  # 3.0 ms
    four = node_costs.replicated(ONE, 4, 2, None)["exposed communication"]
    assert four == pytest.approx(150e6 * 2 * 2 * (3 / 4) / NODE_COLLECTIVE_BYTES_S)
    bucket = node_costs.replicated(ONE, 2, 4, 25 * 2**20)["exposed communication"]
    assert bucket == pytest.approx(25 * 2**20 / NODE_COLLECTIVE_BYTES_S)
    assert node_costs.replicated(ONE, 2, 4, 1e12)["exposed communication"] == pytest.approx(whole)  # at most all


def test_fsdp2s_forecast_counts_each_block_as_the_planner_counts_one_of_the_same_size():
    """The forecast (all the blocks' parameters at once) and the plan (a block's, times the blocks) agree, for every
    key the decoder's FSDP2 reads: one model of a sharded step, whichever asks."""
    blocks, per_block = 8, ONE.block_params // 8
    probe = BlockProbe(kept_bytes=0, input_bytes=0, block_weight_bytes=per_block * 4, other_weight_bytes=50_000_000 * 4,
                       optimizer_bytes_per_block=0, working_bytes=0, forward_s=0.0, backward_s=0.0, head_s=0.0,
                       to_host_bytes_s=1.0, to_gpu_bytes_s=1.0, device_copy_bytes_s=2e12)  # fmt: skip
    for keys in ({}, {"reduce_once_a_step": True}, {"keep_gathered": True}, {"outer_kept": True},
                 {"outer_kept": True, "head_apart": True}):  # fmt: skip
        got = node_costs.fully_sharded(ONE, 2, 4, 2, 1, **keys)
        plan = sharded(probe, 2, keys.get("reduce_once_a_step", False), 2, 4, 1 if keys.get("keep_gathered") else 0,
                       1, keys.get("outer_kept", False), keys.get("head_apart", False))  # fmt: skip
        assert got["FSDP2's copies"] == pytest.approx(blocks * plan.shard_copy_s * 4), keys
        assert got["exposed communication"] == pytest.approx(plan.exposed_comm_s * 4), keys
        assert got["exposed communication"] > 0 and got["FSDP2's copies"] > 0
    kept = node_costs.fully_sharded(ONE, 2, 4, 2, 1, outer_kept=True)["exposed communication"]
    assert kept < node_costs.fully_sharded(ONE, 2, 4, 2, 1)["exposed communication"]  # gathered once, not 4 times
    without_rate = node_costs.fully_sharded(dataclasses.replace(ONE, device_copy_bytes_s=None), 2, 4, 2, 1)
    assert "FSDP2's copies" not in without_rate  # not measured: not guessed
    dense = node_costs.fully_sharded(ONE, 2, 4, 2, 1, params=ONE.block_params // 10)
    assert dense["FSDP2's copies"] == pytest.approx(node_costs.fully_sharded(ONE, 2, 4, 2, 1)["FSDP2's copies"] / 10)


def test_a_mixtures_exchange_is_four_all_to_alls_a_block_of_the_rows_that_leave_the_gpu():
    # 16,384 rows, 4 experts each, 2,880 bf16 values, 24 blocks, 2 ranks: half the copies leave
    got = node_costs.all_to_all_s(16_384, 2_880, 4, 24, 2)
    assert got == pytest.approx(4 * 24 * 16_384 * 4 * 2_880 * 2 * 0.5 / NODE_COLLECTIVE_BYTES_S)  # 45.3 ms
    assert node_costs.all_to_all_s(16_384, 2_880, 4, 24, 4) == pytest.approx(got * 1.5)
    # distributed.expert_exchange=fp8: two of the four at a byte a value and a byte a row
    fp8 = node_costs.all_to_all_s(16_384, 2_880, 4, 24, 2, fp8_halves=True)
    assert fp8 == pytest.approx(got * (2 * 2 * 2_880 + 2 * 2_881) / (4 * 2 * 2_880))  # 0.75 of bf16's


def test_a_mixtures_busiest_rank_is_waited_for_in_each_block_by_its_experts_share_of_the_tokens():
    # 4 experts over 2 ranks: block 0 even, block 1 rank 0's experts get 6 of 8 tokens (1.5x the mean of 4)
    loads = [[1, 1, 1, 1], [3, 3, 1, 1]]
    assert node_costs.busiest_rank_s(loads, 2, 0.2) == pytest.approx(0.2 * (0 + 0.5) / 2)
    assert node_costs.busiest_rank_s(loads, 4, 0.2) == pytest.approx(0.2 * (0 + 0.5) / 2)  # 3 of a mean of 2
    assert node_costs.busiest_rank_s([[2, 2, 2, 2]], 2, 1.0) == 0.0
    assert node_costs.busiest_rank_s([[0, 0, 0, 0]], 2, 1.0) == 0.0  # no token routed: nothing to wait for
    # the experts dealt out by their load (distributed.expert_rebalance_every): a 3 and a 1 on each rank, even
    assert node_costs.busiest_rank_s(loads, 2, 0.2, deal=balanced) == 0.0
    assert node_costs.busiest_rank_s([[6, 1, 1, 0]], 2, 1.0, deal=balanced) == pytest.approx(6 / 4 - 1)  # 6 and 0


def test_a_forecast_with_the_experts_dealt_out_waits_for_no_busiest_rank_where_the_deal_evens_them(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("TRAINBENCH_CACHE_DIR", str(tmp_path))
    bench, one_cfg = _cfg("gpt_oss_20b")
    half = one_cfg.model.num_experts // 2
    loads = [[4, 1] * half] * one_cfg.model.num_layers  # contiguous halves even; [[4] * half + [1] * half]: 1.6x
    waits = {}
    for name, block in (("even", loads), ("uneven", [[4] * half + [1] * half] * one_cfg.model.num_layers)):
        one = dataclasses.replace(ONE, micro_batches=forecast.micro_batches(one_cfg, 1),
                                  expert_params=ONE.block_params // 2, expert_loads=block)  # fmt: skip
        forecast.save(one_cfg, one)
        for dealt in ("0", "4"):
            _, two = _cfg("gpt_oss_20b", "distributed.nproc=2", "distributed.ep=2",
                          f"distributed.expert_rebalance_every={dealt}",
                          f"data.global_batch_size={2 * one_cfg.data.global_batch_size}")  # fmt: skip
            waits[name, dealt] = forecast.forecast(bench, two, 2, ONE.gpu_name)["split_s"]["the router's busiest rank"]
    assert waits["uneven", "0"] > 0 and waits["uneven", "4"] == 0.0  # the deal puts a 4 and a 1 on each rank
    assert waits["even", "0"] == waits["even", "4"] == 0.0


def test_a_mixture_in_fp8_under_expert_parallelism_counts_the_row_casts_the_one_gpu_timed(tmp_path, monkeypatch):
    """The casts expert parallelism makes outside the compiled blocks in FP8, a block and micro-batch as the one GPU
    timed them (GptOssFamily.one_gpu_rates), times the blocks and each rank's micro-batches: compiled, or by the
    kernel (distributed.expert_row_casts), the FP8 wire's own beside them; none where the one GPU timed none.
    Uncompiled, the one GPU's step casts the rows too: the wire's casts alone."""
    monkeypatch.setenv("TRAINBENCH_CACHE_DIR", str(tmp_path))

    def in_fp8(cfg, **distributed):  # (FP8 needs a GPU to pass the config's checks: set past them)
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, precision="fp8"),
                                   distributed=dataclasses.replace(cfg.distributed, **distributed))  # fmt: skip

    rates = {"expert_casts_compiled_s": 2e-3, "expert_casts_kernel_s": 8e-4, "expert_casts_wire_s": 7e-4}
    for compiled, kept, keys, want in (
        ("true", rates, {}, 2e-3),
        ("true", rates, {"expert_row_casts": "kernel"}, 8e-4),
        ("true", rates, {"expert_exchange": "fp8"}, 2e-3 + 7e-4),
        ("true", None, {}, None),
        ("false", rates, {}, None),
        ("false", rates, {"expert_row_casts": "kernel"}, None),
        ("false", rates, {"expert_exchange": "fp8"}, 7e-4),
        ("false", None, {"expert_exchange": "fp8"}, None),
    ):
        bench, one_cfg = _cfg("gpt_oss_20b", f"perf.compile={compiled}")
        one_cfg = in_fp8(one_cfg)
        _, two = _cfg("gpt_oss_20b", "distributed.nproc=2", "distributed.ep=2", f"perf.compile={compiled}",
                      f"data.global_batch_size={2 * one_cfg.data.global_batch_size}")  # fmt: skip
        blocks, micro = one_cfg.model.num_layers, forecast.micro_batches(one_cfg, 1)
        one = dataclasses.replace(ONE, micro_batches=micro, expert_params=ONE.block_params // 2, family_rates=kept)
        forecast.save(one_cfg, one)
        assert forecast.cached(one_cfg, ONE.gpu_name) == one  # the rates kept and read back
        split = forecast.forecast(bench, in_fp8(two, **keys), 2, ONE.gpu_name)["split_s"]
        if want is None:
            assert "the experts' row casts" not in split, (compiled, keys)
        else:  # each rank runs the one GPU's micro-batches (twice the global batch)
            assert split["the experts' row casts"] == pytest.approx(want * blocks * micro), (compiled, keys)
    forecast.save(one_cfg, dataclasses.replace(ONE, family_rates={"expert_casts_compiled_s": -1.0}))
    assert forecast.cached(one_cfg, ONE.gpu_name) is None  # a damaged file is measured again


def test_the_one_gpu_times_the_mixtures_casts_only_in_fp8_on_a_gpu():
    import torch

    bench, cfg = _cfg("gpt_oss_20b")
    assert bench.family.one_gpu_rates(cfg, torch.device("cpu")) == {}
    fp8 = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, precision="fp8"))
    assert bench.family.one_gpu_rates(fp8, torch.device("cpu")) == {}  # (the casts are CUDA's)
    bert, bert_cfg = _cfg("bert")
    assert bert.family.one_gpu_rates(bert_cfg, torch.device("cuda")) == {}


def _cfg(name: str, *keys: str):
    return build_config(name, "tiny", None, dict(k.split("=", 1) for k in keys))


def test_one_gpus_step_is_kept_by_shape_not_by_global_batch_or_distributed_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINBENCH_CACHE_DIR", str(tmp_path))
    _, cfg = _cfg("bert")
    forecast.save(cfg, ONE)
    assert forecast.cached(cfg, ONE.gpu_name) == ONE
    assert forecast.cached(cfg, "NVIDIA H100 80GB HBM3") is None  # another GPU model
    _, same = _cfg("bert", f"data.global_batch_size={2 * cfg.data.global_batch_size}", "distributed.nproc=2",
                   "distributed.grad_reduce_dtype=bf16")  # fmt: skip
    assert forecast.cached(same, ONE.gpu_name) == ONE
    for key in (f"data.micro_batch_size={cfg.data.micro_batch_size // 2}", "model.num_layers=3",
                "perf.compile=true", "optimizer.lr=0.5"):  # fmt: skip
        assert forecast.cached(_cfg("bert", key)[1], ONE.gpu_name) is None, key


@pytest.mark.parametrize("text", ["{", "[]", '{"step_s": 0.5}', json.dumps(dataclasses.asdict(ONE) | {"step_s": -1}),
                                  json.dumps(dataclasses.asdict(ONE) | {"micro_batches": 0}),
                                  json.dumps(dataclasses.asdict(ONE) | {"block_params": "many"}),
                                  json.dumps(dataclasses.asdict(ONE) | {"other_params": True}),
                                  json.dumps(dataclasses.asdict(ONE) | {"expert_loads": [[1, "2"]]}),
                                  json.dumps(dataclasses.asdict(ONE) | {"expert_loads": [1, 2]}),
                                  json.dumps(dataclasses.asdict(ONE) | {"expert_loads": [[1, -2]]})])  # fmt: skip
def test_a_kept_step_that_is_damaged_or_odd_is_no_step(tmp_path, monkeypatch, text):
    monkeypatch.setenv("TRAINBENCH_CACHE_DIR", str(tmp_path))
    _, cfg = _cfg("bert")
    forecast.save(cfg, ONE).write_text(text)
    assert forecast.cached(cfg, ONE.gpu_name) is None


def test_each_family_forecasts_with_its_own_placements_costs_or_says_why_not(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINBENCH_CACHE_DIR", str(tmp_path))
    cases = {
        "bert": ([], ["exposed communication"]),
        "flux1": ([], ["exposed communication", "FSDP2's copies"]),
        "llama31_8b": ([], ["exposed communication", "FSDP2's copies"]),
        "gpt_oss_20b": (
            ["distributed.ep=2"],
            ["exposed communication", "FSDP2's copies", "the experts' all-to-all", "the router's busiest rank"],
        ),
    }
    for name, (keys, costs) in cases.items():
        bench, one_cfg = _cfg(name)
        bench, two = _cfg(name, "distributed.nproc=2", *keys,
                          f"data.global_batch_size={2 * one_cfg.data.global_batch_size}")  # fmt: skip
        said = forecast.forecast(bench, two, 2, ONE.gpu_name)
        assert "no step of this shape on one NVIDIA H200 is kept" in said["none"], name
        half = one_cfg.model.num_experts // 2 if name == "gpt_oss_20b" else 0
        loads = [[4] * half + [1] * half] * one_cfg.model.num_layers if half else None  # rank 0's experts 1.6x
        one = dataclasses.replace(ONE, micro_batches=forecast.micro_batches(one_cfg, 1),
                                  expert_params=ONE.block_params // 2, expert_loads=loads)  # fmt: skip
        forecast.save(one_cfg, one)
        got = forecast.forecast(bench, two, 2, ONE.gpu_name)
        assert list(got["split_s"]) == ["compute (one GPU's step)", *costs], name
        assert got["split_s"]["compute (one GPU's step)"] == pytest.approx(ONE.step_s), name  # the same micro-batches
        assert got["step_s"] == pytest.approx(sum(got["split_s"].values()))
        assert all(s > 0 for s in got["split_s"].values()), name
        assert "s a step (compute (one GPU's step) 500.0 ms, exposed communication" in forecast.line(got)
    bench, one_cfg = _cfg("bert")
    bench, fewer = _cfg("bert", "distributed.nproc=2")  # half the micro-batches a rank: half the one GPU's compute
    got = forecast.forecast(bench, fewer, 2, ONE.gpu_name)
    if forecast.micro_batches(one_cfg, 1) > 1:
        assert got["split_s"]["compute (one GPU's step)"] < ONE.step_s
    bench, lora = _cfg("llama2_70b_lora", "distributed.nproc=2")
    forecast.save(lora, ONE)  # (the key leaves out the distributed keys: as one GPU's step at this shape)
    assert "perf.plan=auto predicts the LoRA's step" in forecast.forecast(bench, lora, 2, ONE.gpu_name)["none"]
    bench, nodes = _cfg("bert", "distributed.nproc=2", "distributed.nodes=2")
    assert "one node" in forecast.forecast(bench, nodes, 4, ONE.gpu_name)["none"]
    bench, dlrm = _cfg("dlrmv4", "distributed.nproc=2")
    forecast.save(dlrm, ONE)
    assert "has no model of what several GPUs add" in forecast.forecast(bench, dlrm, 2, ONE.gpu_name)["none"]


def test_a_mixture_sharded_by_fsdp2_in_fp8_gathers_its_experts_in_bf16_and_casts_them_in_every_micro_batch(
        tmp_path, monkeypatch):  # fmt: skip
    """gpt_oss_20b over 2 ranks without distributed.ep: in bf16 the decoder's FSDP2 model over every parameter; in FP8
    the linear layers' copies at FP8's byte, the experts' at bf16's 2, and the experts' casts each micro-batch beyond
    the one GPU's one a step."""
    monkeypatch.setenv("TRAINBENCH_CACHE_DIR", str(tmp_path))
    for precision in ("auto", "fp8"):
        _, tiny = _cfg("gpt_oss_20b")
        gbs = 4 * tiny.data.micro_batch_size  # 4 micro-batches on one GPU, as many on each of 2
        bench, one_cfg = _cfg("gpt_oss_20b", f"model.precision={precision}", f"data.global_batch_size={gbs}")
        micro_one = forecast.micro_batches(one_cfg, 1)
        assert micro_one == 4
        one = dataclasses.replace(ONE, micro_batches=micro_one, expert_params=ONE.block_params * 3 // 4)
        forecast.save(one_cfg, one)
        bench, two = _cfg("gpt_oss_20b", f"model.precision={precision}", "distributed.nproc=2",
                          f"data.global_batch_size={2 * gbs}")  # fmt: skip
        got = forecast.forecast(bench, two, 2, ONE.gpu_name)["split_s"]
        micro, keys = forecast.micro_batches(two, 2), bench.family._sharding(two)  # the run's FSDP2 keys
        dense, experts = one.block_params - one.expert_params, one.expert_params
        if precision == "auto":
            assert got == {"compute (one GPU's step)": pytest.approx(ONE.step_s),
                           **node_costs.fully_sharded(one, 2, micro, **keys)}  # fmt: skip
            continue
        assert list(got) == ["compute (one GPU's step)", "exposed communication", "FSDP2's copies",
                             "the experts' FP8 casts"]  # fmt: skip
        rest = node_costs.fully_sharded(one, 2, micro, **keys)["exposed communication"]
        assert got["exposed communication"] == pytest.approx(rest)  # the rest's, as without the experts apart
        assert keys["gathered_as"] == 1  # the linear layers' FP8 gathers
        per_param = node_costs.fully_sharded(ONE, 2, micro, **keys)["FSDP2's copies"] / ONE.block_params
        per_bf16 = node_costs.fully_sharded(ONE, 2, micro, **keys | {"gathered_as": 2})["FSDP2's copies"]
        per_bf16 /= ONE.block_params
        assert per_bf16 > per_param
        assert got["FSDP2's copies"] == pytest.approx(dense * per_param + experts * per_bf16)
        casts = micro - micro / micro_one  # 4 - 1: one GPU cast once in its 4
        assert casts == 3
        assert got["the experts' FP8 casts"] == pytest.approx(experts * 12 * casts / (2 * ONE.device_copy_bytes_s))
        assert got["the experts' FP8 casts"] > 0


@pytest.mark.parametrize("name", ["bert", "flux1", "gpt_oss_20b"])
def test_the_kept_step_splits_the_trained_parameters_into_the_blocks_and_the_rest(name):
    bench, cfg = _cfg(name)
    model = bench.family.build_model(cfg)
    if any(p.is_meta for p in model.parameters()):
        model = model.to_empty(device="cpu")
    one = forecast.measured(cfg, bench, model, 0.25, "cpu", None)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    blocks = bench.family.blocks_of(model)
    assert len(blocks) == sum(1 for m in model.modules() if m in set(blocks)) > 0
    assert one.block_params + one.other_params == trained
    assert 0 < one.block_params < trained
    assert one.micro_batches == cfg.data.global_batch_size // cfg.data.micro_batch_size
    if name == "gpt_oss_20b":
        assert 0 < one.expert_params < one.block_params
    else:
        assert one.expert_params == 0
    if name == "flux1":
        assert len(blocks) == cfg.model.double_blocks + cfg.model.single_blocks


def _raw(step_s: float, forecast_s: float | None) -> dict:
    raw = {"seconds": step_s * 2, "steps": 2}
    if forecast_s is not None:
        raw["forecast"] = {"step_s": forecast_s, "split_s": {"compute (one GPU's step)": forecast_s * 0.9,
                                                             "exposed communication": forecast_s * 0.1},
                           "one_gpu": {"measured_at": "2026-11-30T00:00:00Z"}}  # fmt: skip
    return raw


def test_the_forecast_is_taken_to_the_models_depth_as_the_step_is_and_its_miss_said():
    raws = {2: _raw(1.0, 0.9), 4: _raw(1.5, 1.3)}
    got = bench_report.forecast_at_depth(raws, 24, 1000.0, 6.5)
    assert got["step_seconds"] == pytest.approx(0.9 + 0.2 * 22)  # 5.3 s on the line through 0.9 and 1.3
    assert got["split_s"]["exposed communication"] == pytest.approx(0.53)
    assert got["tokens_per_s_per_rank"] == pytest.approx(1000.0 / 5.3)
    assert got["miss"] == pytest.approx(5.3 / 6.5 - 1)  # measured 18.5 % below the forecast's rate
    assert "measured -18.5% against it" in bench_report.forecast_line(got)
    raws[4]["forecast"] = {"none": "no step of this shape on one GPU is kept"}
    assert bench_report.forecast_at_depth(raws, 24, 1000.0, 6.5) == {"none": "no step of this shape on one GPU is kept"}
    assert bench_report.forecast_at_depth({2: _raw(1.0, None)}, None, 1000.0, 1.0) is None  # one GPU: none asked


def test_a_bench_json_whose_forecast_is_odd_is_refused_in_one_sentence(tmp_path):
    base = {"kind": "k", "benchmark": "bert", "preset": "tiny", "figures": "measured", "ranks": 2, "device": "cpu"}
    good = {"step_seconds": 1.0, "tokens_per_s_per_rank": 5.0, "miss": -0.02, "split_s": {"compute": 1.0}}
    (tmp_path / "bench.json").write_text(json.dumps(base | {"forecast": good}))
    assert bench_report.read(tmp_path)["forecast"] == good
    for odd, said in (({"split_s": {"compute": "x"}}, "forecast.split_s.compute should be a number"),
                      ({"miss": "far"}, "forecast.miss should be a number"),
                      ({"split_s": None}, "field forecast.split_s is missing")):  # fmt: skip
        record = good | odd
        if record.get("split_s") is None:
            record.pop("split_s")
        (tmp_path / "bench.json").write_text(json.dumps(base | {"forecast": record}))
        with pytest.raises(UserError, match=said) as caught:
            bench_report.read(tmp_path)
        assert str(caught.value).count(". ") == 0
    (tmp_path / "bench.json").write_text(json.dumps(base | {"forecast": {"none": "no model"}}))
    assert bench_report.read(tmp_path)["forecast"] == {"none": "no model"}


def test_the_kept_steps_folder_is_beside_the_probes(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINBENCH_CACHE_DIR", str(tmp_path))
    from trainbench.measure.probe import cache_dir

    assert forecast.cache_dir().parent == cache_dir().parent
