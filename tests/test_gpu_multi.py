"""Multi-GPU tier (``make test-gpu-multi``, ``pytest -m multigpu``): every parallel path over NCCL on 2 GPUs of one
host. Skipped, with the reason, where fewer than 2 GPUs are visible (always on CI, which has none). Each path trains
a few steps on 2 GPUs and on one, with the same micro-batches, and the losses agree within what the path's precision
allows; each benchmark's tiny preset reaches its target on 2 GPUs (but gpt3's, whose log from scratch is never
compliant); and the optimizer's own kernel updates FSDP2's
shards of 2 ranks (padded, uneven, empty, FP8-gathered) as torch's fused update does."""

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import free_port, only_run_dir, read_metrics, run_cli, tiny_run_to_target_on_cuda

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multigpu,
    pytest.mark.usefixtures("empty_compile_caches"),
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason=f"needs 2 CUDA GPUs; {torch.cuda.device_count() if torch.cuda.is_available() else 0} visible",
    ),
]


def _needs_torchao() -> None:
    pytest.importorskip("torchao", reason="torchao is the optional extra trainbench[fp8]")


# -- the optimizer's own kernel on FSDP2's shards of 2 ranks -------------------------------------------------------


class _Shards(torch.nn.Module):
    """Parameters whose FSDP2 shards over 2 ranks are each a case of their own: ``proj`` an FP8 layer whose weight
    FSDP2 gathers in FP8 (its shard a torchao wrapper subclass, 1,032 rows a rank), ``odd`` 2,049 rows (1,025 and
    1,024 a rank: uneven, rank 1's padded), ``row`` one row (rank 1's shard empty), ``small`` under the kernel's
    size (torch's update). All but ``small`` are large enough for ``tb_adamw`` on every rank that holds elements."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(1024, 2064, bias=False)
        self.odd = torch.nn.Parameter(torch.randn(2049, 1024) * 0.02)
        self.row = torch.nn.Parameter(torch.randn(1, 1 << 21) * 0.02)
        self.small = torch.nn.Parameter(torch.randn(3, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = self.proj(x)
        return (y.float().square().mean() + (x @ self.odd.t()).square().mean() + 1e-3 * self.row.square().sum()
                + self.small.square().sum())  # fmt: skip


def _adamw_rank(rank: int, port: int, out: str) -> None:
    """One of 2 ranks: the model sharded by FSDP2, 3 steps of AdamClipped with torch's fused update alone, then the
    same with ``tb_adamw``; each rank writes its shards after each and which parameters took the kernel."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainbench.families import fp8
    from trainbench.optim.adamw import AdamClipped

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    mesh = init_device_mesh("cuda", (2,))
    seen = {}
    for own in (False, True):
        torch.manual_seed(0)
        model = _Shards().cuda()
        assert fp8.train_blocks_in_fp8(model, sharded=True, in_blocks=lambda name: name == "proj") == 1
        fully_shard(model, mesh=mesh)
        after_step = fp8.precompute_scales(model)
        opt = AdamClipped(model.parameters(), 1.0, own_kernel=own, lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                          weight_decay=0.1, fused=True)  # fmt: skip
        for step in range(3):
            x = torch.randn(16, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(10 * step + rank))
            model(x).backward()
            names = [n for n, _ in model.named_parameters()]
            took = [opt._own(opt.param_groups[0], p) for p in model.parameters()]
            opt.step()
            opt.zero_grad(set_to_none=True)
            after_step()
            if step == 0:  # (both runs' gradients of this step are the same: its updates compare bit for bit)
                first = {
                    n: getattr(p.to_local(), "_tensor", p.to_local()).detach().cpu()
                    for n, p in model.named_parameters()
                }
                torch.save(first, f"{out}/{own}_{rank}_first.pt")
        torch.cuda.synchronize()
        locals_ = {n: p.to_local() for n, p in model.named_parameters()}
        seen[own] = {"took": dict(zip(names, took, strict=True)),
                     "wrapper": {n: type(t).__name__ for n, t in locals_.items()},
                     "rows": {n: t.shape[0] for n, t in locals_.items()}}  # fmt: skip
        torch.save({n: getattr(t, "_tensor", t).detach().cpu() for n, t in locals_.items()}, f"{out}/{own}_{rank}.pt")
    Path(f"{out}/{rank}.json").write_text(json.dumps({str(k): v for k, v in seen.items()}))
    dist.destroy_process_group()


def test_own_adamw_kernel_updates_fsdp2_shards_of_two_ranks_as_torchs_fused_update(tmp_path):
    """optim/adamw's ``tb_adamw`` on FSDP2's shards over 2 GPUs: an FP8-gathered weight (its shard a torchao wrapper
    whose own data pointer is 0: handed to the kernel, every rank faulted with an illegal memory access), uneven
    shards, an empty one; 3 steps against torch's fused update, every shard within rounding."""
    import multiprocessing

    _needs_torchao()
    port, spawn = free_port(), multiprocessing.get_context("spawn")
    ranks = [spawn.Process(target=_adamw_rank, args=(r, port, str(tmp_path))) for r in (0, 1)]
    for p in ranks:
        p.start()
    try:
        for p in ranks:
            p.join(300)
        assert [p.exitcode for p in ranks] == [0, 0], "a rank failed: its output above says why"
    finally:
        for p in ranks:
            p.kill()
            p.join()
    seen = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    assert [s["True"]["rows"] for s in seen] == [{"proj.weight": 1032, "odd": 1025, "row": 1, "small": 2},
                                                 {"proj.weight": 1032, "odd": 1024, "row": 0, "small": 1}]  # fmt: skip
    assert seen[0]["True"]["wrapper"]["proj.weight"] == "WeightWithDynamicFloat8CastTensor"
    assert [s["True"]["took"] for s in seen] == [
        {"proj.weight": True, "odd": True, "row": True, "small": False},
        {"proj.weight": True, "odd": True, "row": False, "small": False},
    ]
    assert not any(any(s["False"]["took"].values()) for s in seen)
    torch.manual_seed(0)
    start = dict(_Shards().named_parameters())  # what both runs started from (the FP8 swap keeps the weight)

    def shards(own: bool, name: str, when: str = "") -> torch.Tensor:
        return torch.cat([torch.load(tmp_path / f"{own}_{r}{when}.pt")[name] for r in (0, 1)])

    for name in ("proj.weight", "odd", "row", "small"):
        torchs, ours = shards(False, name, "_first"), shards(True, name, "_first")
        change = float((torchs - start[name].detach()).abs().max())
        assert change > 1e-3, name  # the step moved it
        torch.testing.assert_close(ours, torchs, rtol=2e-6, atol=2e-6 * change, msg=name)
        # After 3 steps, a rounding apart: the FP8 layer's later gradients come from casts of weights a rounding apart
        # (a cast that rounds the other way changes an element's gradient by FP8's step), and the clip's factor,
        # taken over every gradient, carries that to the others.
        torchs, ours = shards(False, name), shards(True, name)
        assert float((ours - torchs).abs().mean()) <= 0.05 * float((torchs - start[name].detach()).abs().mean()), name


# -- each parallel path against one GPU ----------------------------------------------------------------------------


def _losses(results: Path) -> tuple[list[float], Path]:
    run_dir = only_run_dir(results)
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r], run_dir


def _log(run_dir: Path) -> dict:
    lines = (run_dir / "result_0.txt").read_text().splitlines()
    return {e["key"]: e["value"] for e in (json.loads(line.split(":::MLLOG ")[1]) for line in lines)}


def _agree(one: list[float], two: list[float], steps: int, rtol: float) -> None:
    """The first ``steps`` losses of the two runs agree within ``rtol`` of one GPU's."""
    assert len(one) >= steps and len(two) >= steps, (one, two)
    worst = max(abs(a - b) / abs(a) for a, b in zip(one[:steps], two[:steps], strict=True))
    assert worst <= rtol, (worst, one[:steps], two[:steps])


STEPS = 8  # steps compared
QUIET = ("log_every_steps=1", "telemetry_hz=0")
GLOBAL_BATCH = {"bert": 64, "gpt3": 32, "llama31_8b": 32, "gpt_oss_20b": 32, "llama2_70b_lora": 8, "flux1": 32}

# the benchmark ("name": a parameter named "benchmark" is pytest-benchmark's fixture), the micro-batch (the tiny
# preset's global batch split over 2 GPUs; one GPU accumulates two), the keys of the 2-GPU run
TO_TARGET = [
    ("bert", 32, []),  # DDP
    ("llama31_8b", 16, []),  # FSDP2 in bf16
    ("gpt_oss_20b", 16, ["distributed.ep=2"]),  # expert parallel in bf16, the rest FSDP2
    ("llama2_70b_lora", 4, []),  # the bf16 base sharded by FSDP2
    ("flux1", 16, []),  # FSDP2 in bf16
]


@pytest.mark.parametrize("name, micro, keys", TO_TARGET, ids=[c[0] for c in TO_TARGET])
def test_each_tiny_preset_reaches_its_target_on_two_gpus_with_the_losses_of_one(tmp_path, name, micro, keys):
    """The benchmark's own layout over NCCL on 2 GPUs trains to the tiny preset's target with a compliant log, and its
    first steps' losses are those of one GPU that accumulates the same micro-batches (bf16: the sums' order
    differs)."""
    two = tiny_run_to_target_on_cuda(tmp_path / "two", name, "--preset", "tiny", "--nproc", "2",
                                     f"data.micro_batch_size={micro}", *keys, *QUIET)  # fmt: skip
    run_cli("run", name, "--preset", "tiny", f"data.dir={tmp_path / 'two' / 'data'}", "device=cuda",
            "progress=false", f"output.results_dir={tmp_path / 'one'}", f"data.micro_batch_size={micro}",
            f"schedule.max_samples={STEPS * GLOBAL_BATCH[name]}", *QUIET)  # fmt: skip
    one, _ = _losses(tmp_path / "one")
    _agree(one, [r["loss"] for r in read_metrics(two) if "loss" in r], STEPS, 1e-2)
    if keys:
        assert _log(two)["expert_parallelism"] == 2


# the case, the benchmark, keys of both runs, keys of the 2-GPU run, the micro-batch, the losses' tolerance, what the
# 2-GPU run's console says of its layout
PATHS = [
    ("gpt3_fsdp2", "gpt3", [], [], 16, 1e-2, None),  # (from scratch, gpt3's log is not compliant: no target run)
    ("fsdp2_fp8", "llama31_8b", ["model.precision=fp8", "perf.compile=true"], [], 16, 2e-2,
     "FSDP2 gathers their weights in FP8"),
    # the same with the gradients reduce-scattered in bf16 (distributed.grad_reduce_dtype=bf16), 2 micro-batches a
    # rank: the embedding and the output layer (its unit apart, called by the compiled loss) kept gathered between
    # them (distributed.keep_outer_gathered, the default)
    ("fsdp2_fp8_bf16_reduce", "llama31_8b", ["model.precision=fp8", "perf.compile=true"],
     ["distributed.grad_reduce_dtype=bf16"], 8, 2e-2, "reduce-scatters the gradients in bf16"),
    # the same with the blocks' FP8 weights kept gathered through a rank's 2 micro-batches (distributed.keep_gathered)
    ("fsdp2_fp8_kept", "llama31_8b", ["model.precision=fp8", "perf.compile=true"], ["distributed.keep_gathered=true"],
     8, 2e-2, "keeps the blocks' weights gathered"),
    ("tp", "llama31_8b", [], ["distributed.tp=2"], 32, 1e-2, None),  # (the whole batch on both ranks of the group)
    ("ep_fp8", "gpt_oss_20b", ["model.precision=fp8", "perf.compile=true"], ["distributed.ep=2"], 16, 2e-2,
     "on each of 2 ranks (all-to-all)"),
    # the same with the experts dealt out again by their load every 2 steps (their FP8 casts made anew after a move)
    ("ep_fp8_dealt", "gpt_oss_20b", ["model.precision=fp8", "perf.compile=true"],
     ["distributed.ep=2", "distributed.expert_rebalance_every=2"], 16, 2e-2, "experts dealt out over the 2 ranks"),
    # the same with the rows to the experts and their outputs' gradients in e4m3 on the wire, and the rows' casts by
    # the Triton kernel
    ("ep_fp8_wire", "gpt_oss_20b", ["model.precision=fp8", "perf.compile=true"],
     ["distributed.ep=2", "distributed.expert_exchange=fp8", "distributed.expert_row_casts=kernel"], 16, 2e-2,
     "in e4m3 on the wire"),
    # a mixture's layout unasked on several GPUs: the experts sharded by FSDP2 with the rest (no distributed.ep),
    # gathered in bf16 for each forward and cast to FP8 there, each rank's own tokens through every expert
    ("fsdp2_fp8_experts", "gpt_oss_20b", ["model.precision=fp8", "perf.compile=true"], [], 16, 2e-2,
     "the experts' grouped products of"),
    ("lora_fp8_replicas", "llama2_70b_lora", ["model.base_precision=fp8"], [], 4, 2e-2, "FP8 base on every rank"),
    # FSDP2 in FP8 (gathered in FP8), 4 micro-batches a rank reduce-scattered once a step
    ("flux_fp8_once", "flux1", ["model.precision=fp8", "perf.compile=true"], ["distributed.reduce_once_a_step=true"],
     4, 2e-2, "reduce-scatters the gradients once a step"),
    ("lora_fp8_sharded", "llama2_70b_lora", ["model.base_precision=fp8", "model.base_sharding=fsdp"], [], 4, 2e-2,
     "FP8 base sharded by FSDP2, gathered in FP8"),
]  # fmt: skip


@pytest.mark.parametrize("case, name, keys, two_keys, micro, rtol, says", PATHS, ids=[c[0] for c in PATHS])
def test_each_parallel_path_trains_the_losses_of_one_gpu_on_two(tmp_path, case, name, keys, two_keys, micro,
                                                                   rtol, says):  # fmt: skip
    """FSDP2 with the weights gathered in FP8, tensor parallel, expert parallel in FP8, the LoRA's FP8 base on every
    rank and sharded: 8 steps on 2 GPUs against one GPU with the same micro-batches, within the precision's
    tolerance (FP8: a sum in another order can flip a rounding of a cast)."""
    if any("fp8" in k for k in keys):
        _needs_torchao()
    data = tmp_path / "data"
    assert run_cli("prepare", name, "--synthetic", "--preset", "tiny", "--out", data) == 0
    common = ["run", name, "--preset", "tiny", f"data.dir={data}", "device=cuda", "progress=false",
              f"data.micro_batch_size={micro}", f"schedule.max_samples={STEPS * GLOBAL_BATCH[name]}", *keys,
              *QUIET]  # fmt: skip
    run_cli(*common, f"output.results_dir={tmp_path / 'one'}")
    run_cli(*common, "--nproc", "2", *two_keys, f"output.results_dir={tmp_path / 'two'}")
    (one, _), (two, run_dir) = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    _agree(one, two, STEPS, rtol)
    assert one[STEPS - 1] < one[0], "the loss should fall"
    if two_keys == ["distributed.tp=2"]:
        assert _log(run_dir)["tensor_parallelism"] == 2
    if says is not None:
        assert says in (run_dir / "console.log").read_text()


@pytest.mark.parametrize("micro, keys", [(64, []), (32, ["perf.lookup_once_a_step=true"])],
                         ids=["a_lookup_a_micro_batch", "looked_up_once_a_step"])  # fmt: skip
def test_dlrmv4_tables_sharded_over_two_gpus_reach_the_target_with_the_losses_of_one_gpu_holding_them_whole(
        tmp_path, micro, keys):  # fmt: skip
    """perf.sharded_tables over NCCL: each GPU owns half of every table's rows, the lookups and their gradients go
    through all-to-all, the dense parameters under DDP; and with each rank's 2 micro-batches looked up in one exchange
    a step, their gradients sent back once (perf.lookup_once_a_step). The tiny preset trains to its target with a
    compliant log, and its first steps' losses are those of one GPU holding every table whole and accumulating the
    same micro-batches, within 1e-2 in bf16 (the sums' order differs). (Its first 8 losses do not show the learning:
    the warm-up's 20 steps, and a batch's noise larger than what 8 steps learn; the target, at step 40 or so,
    does.)"""
    two = tiny_run_to_target_on_cuda(tmp_path / "two", "dlrmv4", "--preset", "tiny", "--nproc", "2",
                                     "perf.sharded_tables=true", f"data.micro_batch_size={micro}", *keys,
                                     *QUIET)  # fmt: skip
    run_cli("run", "dlrmv4", "--preset", "tiny", f"data.dir={tmp_path / 'two' / 'data'}", "device=cuda",
            "progress=false", f"output.results_dir={tmp_path / 'one'}", f"data.micro_batch_size={micro}",
            f"schedule.max_samples={STEPS * 128}", *QUIET)  # fmt: skip
    one, _ = _losses(tmp_path / "one")
    _agree(one, [r["loss"] for r in read_metrics(two) if "loss" in r], STEPS, 1e-2)
    console = (two / "console.log").read_text()
    assert "embedding tables sharded row-wise over 2 rank(s)" in console
    assert ("looked up in one exchange before its first forward" in console) == bool(keys)


@pytest.mark.parametrize("precision", ["auto", "fp8"])
def test_tiny_gpt_oss_reaches_its_target_with_its_experts_on_two_gpus_compiled(tmp_path, precision):
    """distributed.ep=2 over NCCL, compiled, in bf16 (auto) and FP8: each GPU holds half the experts, tokens reach
    them by all-to-all; in FP8 each rank pads the rows that arrive for its experts to the grouped product's 16
    (moe._experts_padded)."""
    if precision == "fp8":
        _needs_torchao()
    keys = ("perf.compile=true", "--nproc", "2", "distributed.ep=2", f"model.precision={precision}")
    run_dir = tiny_run_to_target_on_cuda(tmp_path, "gpt_oss_20b", "--preset", "tiny", *keys)
    assert "on each of 2 ranks (all-to-all)" in (run_dir / "console.log").read_text()


# -- NCCL on the way out ---------------------------------------------------------------------------------------------


def _rank_that_fails_beside_a_waiting_peer(rank: int, port: int) -> None:
    """Rank 0 enqueues a second all-reduce that rank 1 never joins (as a rank that failed mid-step left one in
    flight), then leaves the group as a failed rank does (``distributed.shutdown()``) and exits with 3 once it has
    left; rank 1 sleeps."""
    import time

    import torch.distributed as dist

    from trainbench import distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    if rank == 1:
        time.sleep(600)
    dist.all_reduce(x, async_op=True)  # never completes: rank 1 does not come
    distributed.shutdown(abort_wait_s=20)
    os._exit(3)


def test_a_rank_that_failed_leaves_nccl_at_once_while_a_peer_waits_on_it():
    """After an error, a rank aborts NCCL rather than waiting for its collectives to be flushed: it exits within
    seconds although a collective of its own waits for a peer that will never join (destroy_process_group flushes
    it first, and would wait for ever)."""
    import multiprocessing
    import time

    port = free_port()
    spawn = multiprocessing.get_context("spawn")
    ranks = [spawn.Process(target=_rank_that_fails_beside_a_waiting_peer, args=(r, port)) for r in (0, 1)]
    for p in ranks:
        p.start()
    try:
        began = time.monotonic()
        ranks[0].join(90)
        assert ranks[0].exitcode in (1, 3), f"rank 0 still running after {time.monotonic() - began:.0f} s"
    finally:
        for p in ranks:
            p.kill()
            p.join()


def test_the_gpus_active_nvlinks_are_those_nvidia_smi_counts():
    """system.gpu_links (output.gpu_links): each GPU's active NVLinks read through NVML are the links
    `nvidia-smi nvlink -s` lists with a speed for it, and the sentence the run records says the same counts."""
    import re
    import shutil
    import subprocess

    import pynvml

    from trainbench import telemetry

    if shutil.which("nvidia-smi") is None:
        pytest.skip("nvidia-smi is not on PATH: nothing to check NVML's counts against")
    pynvml.nvmlInit()
    try:
        ours = [telemetry.active_nvlinks(pynvml, pynvml.nvmlDeviceGetHandleByIndex(i))
                for i in range(pynvml.nvmlDeviceGetCount())]  # fmt: skip
    finally:
        pynvml.nvmlShutdown()
    theirs = []
    for i in range(len(ours)):
        listing = subprocess.run(["nvidia-smi", "nvlink", "-s", "-i", str(i)], capture_output=True, text=True).stdout
        theirs.append(len(re.findall(r"Link \d+: [\d.]+ GB/s", listing)))
    assert ours == theirs, (ours, theirs)
    said = telemetry.gpu_links()
    if len(set(ours)) > 1:
        assert said == f"active NVLinks by GPU: {', '.join(map(str, ours))}", said
    elif ours[0] == 0:
        assert said == f"no active NVLink on its {len(ours)} GPUs (PCIe between GPUs)", said
    else:
        assert said == f"{ours[0]} active NVLinks on each of {len(ours)} GPUs", said


# -- the forecast of 2 GPUs from one (measure/forecast.py) ----------------------------------------------------------

# the benchmark, keys of both measurements, keys of the 2-GPU one, what the forecast counts beside the compute
FORECASTS = [
    ("bert", [], [], ["exposed communication"]),
    ("flux1", ["model.precision=fp8"], ["distributed.reduce_once_a_step=true"],
     ["exposed communication", "FSDP2's copies"]),
    ("gpt_oss_20b", [], ["distributed.ep=2"], ["exposed communication", "FSDP2's copies", "the experts' all-to-all",
                                               "the router's busiest rank"]),
    # the same mixture with its experts sharded by FSDP2 as the rest (its layout unasked): no exchange, no wait
    ("gpt_oss_20b", [], [], ["exposed communication", "FSDP2's copies"]),
]  # fmt: skip


@pytest.mark.parametrize("name, keys, two_keys, costs", FORECASTS, ids=["bert", "flux1", "gpt_oss_20b_ep2",
                                                                       "gpt_oss_20b_fsdp2"])  # fmt: skip
def test_a_bench_on_two_gpus_forecasts_its_step_from_one_gpus_of_the_same_shape(tmp_path, monkeypatch, name, keys,
                                                                                two_keys, costs):  # fmt: skip
    """`trainbench bench` on one GPU keeps its step; the same shape on 2 GPUs (each rank the one GPU's micro-batches)
    forecasts its step from it before timing (rank 0's console), with the family's costs and the one GPU's step as
    its compute, and bench.json holds the forecast and the miss; another micro-batch finds none and says so."""
    if "model.precision=fp8" in keys:
        _needs_torchao()
    monkeypatch.setenv("TRAINBENCH_CACHE_DIR", str(tmp_path / "cache"))
    quick = ["--preset", "tiny", "--steps", "3", "--warmup", "1", "--profile-steps", "0", "device=cuda",
             "progress=false", "output.telemetry_hz=0", *keys]  # fmt: skip
    from trainbench.resolve import build_config

    micro = build_config(name, "tiny", None, {"device": "cuda"})[1].data.micro_batch_size
    gbs = build_config(name, "tiny", None, {})[1].data.global_batch_size
    shape = [f"data.micro_batch_size={micro}"]
    assert run_cli("bench", name, *quick, *shape, f"data.global_batch_size={gbs}",
                   f"output.results_dir={tmp_path / 'one'}") == 0  # fmt: skip
    one = json.loads((only_run_dir(tmp_path / "one") / "bench.json").read_text())
    assert one.get("forecast") is None  # one GPU forecasts nothing
    assert run_cli("bench", name, *quick, *shape, *two_keys, "--nproc", "2", f"data.global_batch_size={2 * gbs}",
                   f"output.results_dir={tmp_path / 'two'}") == 0  # fmt: skip
    folder = only_run_dir(tmp_path / "two")
    two = json.loads((folder / "bench.json").read_text())
    got = two["forecast"]
    assert list(got["split_s"]) == ["compute (one GPU's step)", *costs]
    assert got["split_s"]["compute (one GPU's step)"] == pytest.approx(one["step_seconds"], rel=1e-6)
    assert all(s > 0 for what, s in got["split_s"].items() if what != "the router's busiest rank")
    assert got["split_s"].get("the router's busiest rank", 0.0) >= 0.0
    assert got["step_seconds"] == pytest.approx(sum(got["split_s"].values()))
    assert got["miss"] == pytest.approx(got["step_seconds"] / two["step_seconds"] - 1)
    console = (folder / "console.log").read_text()
    assert console.index("forecast from one GPU's step") < console.index("against the forecast's")
    assert run_cli("bench", name, *quick, f"data.micro_batch_size={max(1, micro // 2)}", *two_keys, "--nproc", "2",
                   f"data.global_batch_size={2 * gbs}", f"output.results_dir={tmp_path / 'other'}") == 0  # fmt: skip
    other = json.loads((only_run_dir(tmp_path / "other") / "bench.json").read_text())
    assert "no step of this shape on one" in other["forecast"]["none"]
