"""Telemetry: the sampler against a fake NVML, the choice of the GPUs it samples, the CPU fallback, and energy
integration."""

from __future__ import annotations

import sys
import time
import types

import pytest

from trainbench import telemetry
from trainbench.errors import UserError
from trainbench.telemetry import NvmlDevice, Sampler, gpu_energy, integrate_power, read_csv, run_energy, select_gpus

UUIDS = [f"GPU-{i}a1b2c3d-0000-1111-2222-33334444555{i}" for i in range(4)]


def fake_nvml(watts: tuple[float, ...] = (300.0, 300.001), start_energy_j: float = 1000.0) -> types.ModuleType:
    """A stand-in for pynvml: GPU i (UUID ``UUIDS[i]``, minor number i, no MIG) draws ``watts[i]``; its energy counter
    rises accordingly."""
    nv = types.ModuleType("pynvml")
    t0 = time.time()
    nv.NVML_TEMPERATURE_GPU, nv.NVML_CLOCK_SM, nv.NVML_CLOCK_MEM = 0, 1, 2
    nv.calls = []
    nv.nvmlInit = lambda: nv.calls.append("init")
    nv.nvmlShutdown = lambda: nv.calls.append("shutdown")
    nv.nvmlDeviceGetCount = lambda: len(watts)
    nv.nvmlDeviceGetHandleByIndex = lambda i: i
    nv.nvmlDeviceGetUUID = lambda h: UUIDS[h]
    nv.nvmlDeviceGetMinorNumber = lambda h: h
    nv.nvmlDeviceGetMaxMigDeviceCount = lambda h: 0
    nv.nvmlDeviceGetPowerUsage = lambda h: watts[h] * 1000  # mW
    nv.nvmlDeviceGetTotalEnergyConsumption = lambda h: (start_energy_j + watts[h] * (time.time() - t0)) * 1000  # mJ
    nv.nvmlDeviceGetTemperature = lambda h, sensor: 60 + h
    nv.nvmlDeviceGetClockInfo = lambda h, clock: {1: 1980, 2: 3201}[clock]
    nv.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=97, memory=41)
    nv.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=70 * 2**30)

    def throttle(h):
        raise RuntimeError("not supported")  # one sensor failing must leave the others

    nv.nvmlDeviceGetCurrentClocksThrottleReasons = throttle
    return nv


def test_sampler_writes_one_csv_per_gpu_at_its_rate(tmp_path, monkeypatch):
    nv = fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    sampler = Sampler(tmp_path, rate_hz=10, host="node1", gpus_used=2, env={}).start()
    time.sleep(1.05)
    sampler.stop()
    assert sampler.note == ("GPU telemetry through NVML: GPUs 0 (GPU-0a1b2c3d), 1 (GPU-1a1b2c3d) of this host's 2, "
                            "taken in NVML's order for 2 ranks on this node (none of SLURM_STEP_GPUS, SLURM_JOB_GPUS, "
                            "CUDA_VISIBLE_DEVICES is set)")  # fmt: skip
    assert nv.calls == ["init", "shutdown"]
    for gpu in (0, 1):
        rows = read_csv(tmp_path / f"telemetry_node1_gpu{gpu}.csv")
        assert 9 <= len(rows) <= 14  # 10 Hz for a second, plus the first and last rows
        first = rows[0]
        assert float(first["power_w"]) == pytest.approx(300 + gpu / 1000)
        assert first["gpu_temp_c"] == str(60 + gpu) and first["sm_clock_mhz"] == "1980"
        assert first["gpu_util_pct"] == "97" and first["mem_used_mib"] == "71680.0"
        assert first["throttle_reasons"] == ""
        times = [int(r["time_ms"]) for r in rows]
        assert times == sorted(times) and abs(times[0] - time.time() * 1000) < 5000


def test_without_nvml_the_sampler_records_cpu_and_says_gpu_telemetry_is_absent(tmp_path, monkeypatch):
    broken = types.ModuleType("pynvml")

    def no_driver():
        raise OSError("NVML Shared Library Not Found")

    broken.nvmlInit = no_driver
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    sampler = Sampler(tmp_path, rate_hz=20, host="laptop", gpus_used=1, env={}).start()
    time.sleep(0.3)
    sampler.stop()
    assert sampler.note.startswith("GPU telemetry absent")
    rows = read_csv(tmp_path / "telemetry_laptop_cpu.csv")
    assert len(rows) >= 3 and float(rows[-1]["mem_total_mib"]) > 0
    assert not list(tmp_path.glob("*gpu*"))


def test_power_integration_matches_a_hand_computed_value():
    # 100 W for 2 s, a ramp to 300 W over 2 s, 300 W for 1 s: 200 + 400 + 300 = 900 J.
    times = [0, 1000, 2000, 4000, 5000]
    watts = [100, 100, 100, 300, 300]
    assert integrate_power(times, watts, 0, 5000) == pytest.approx(900)
    # A window inside the samples: [500, 3000] ms: 100 W for 1.5 s, then 100 -> 200 W over 1 s = 150 + 150.
    assert integrate_power(times, watts, 500, 3000) == pytest.approx(300)
    # Beyond the last sample the last power holds: 300 W for 1 s more.
    assert integrate_power(times, watts, 4000, 6000) == pytest.approx(600)


def test_energy_prefers_the_counter_and_falls_back_to_power(tmp_path):
    path = tmp_path / "telemetry_n_gpu0.csv"
    header = ",".join(telemetry.GPU_FIELDS)
    rows = [
        # time_ms, gpu, power_w, energy_j, ...
        "0,0,100,5000,,,,,,,,",
        "1000,0,100,5100,,,,,,,,",
        "2000,0,300,5300,,,,,,,,",
    ]
    path.write_text(header + "\n" + "\n".join(rows) + "\n")
    energy = gpu_energy(path, 500, 1500)
    assert energy.method == "counter" and energy.joules == pytest.approx(5200 - 5050)
    without_counter = ["0,0,100,,,,,,,,,", "1000,0,100,,,,,,,,,", "2000,0,300,,,,,,,,,"]
    path.write_text(header + "\n" + "\n".join(without_counter) + "\n")
    no_counter = gpu_energy(path, 0, 2000)
    assert no_counter.method == "power" and no_counter.joules == pytest.approx(100 + 200)
    total = run_energy(tmp_path, 0, 2000)
    assert total["total_joules"] == pytest.approx(300) and total["total_kwh"] == pytest.approx(300 / 3.6e6)


def test_a_window_summary_gives_busy_medians_named_throttle_reasons_and_energy(tmp_path):
    header = ",".join(telemetry.GPU_FIELDS)
    # time_ms, gpu, power_w, energy_j, gpu_temp, mem_temp, sm_clock, mem_clock, gpu_util, mem_util, mem_used, throttle
    rows = [
        "0,0,90,1000,,,345,,0,,,1",  # idle, before the window
        "1000,0,600,1100,,,1980,,100,,,0",
        "2000,0,700,1750,,,1830,,100,,,4",  # the software power cap
        "3000,0,650,2400,,,1900,,95,,,4",
        "4000,0,100,2500,,,345,,10,,,1",  # idle: not busy, but its reasons count
        "9000,0,80,3000,,,345,,0,,,1",  # after the window
    ]
    (tmp_path / "telemetry_n_gpu0.csv").write_text(header + "\n" + "\n".join(rows) + "\n")
    summary = telemetry.window_summary(tmp_path, 1000, 4000)
    assert summary == {"n_gpu0": {"busy_samples": 3, "power_w": 650.0, "sm_clock_mhz": 1900.0,
                                  "throttle_reasons": ["GpuIdle", "SwPowerCap"], "energy_j": 1400.0}}  # fmt: skip
    assert telemetry.throttle_names(0x4 | 0x40) == ["SwPowerCap", "HwThermalSlowdown"]
    assert telemetry.throttle_names(0) == [] and telemetry.throttle_names(1 << 20) == ["0x100000"]


def test_a_measured_window_samples_the_gpus_it_is_told_in_a_folder_of_its_own_and_removes_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(watts=(300.0, 300.0, 50.0)))
    for var in telemetry.GPU_LISTS:
        monkeypatch.delenv(var, raising=False)
    folders = []
    real_sampler = telemetry.Sampler
    monkeypatch.setattr(telemetry, "Sampler", lambda folder, rate, gpus_used: folders.append(folder)
                        or real_sampler(folder, rate, gpus_used=gpus_used))  # fmt: skip
    with telemetry.measured_window(rate_hz=20, gpus_used=2) as summary:
        time.sleep(0.6)
    assert len(folders) == 1 and not folders[0].exists()
    assert sorted(g.split("_gpu")[1] for g in summary) == ["0", "1"]  # not GPU 2, which the block does not use
    for gpu in summary.values():
        assert gpu["power_w"] == pytest.approx(300, abs=0.01) and gpu["sm_clock_mhz"] == 1980
        assert gpu["energy_j"] == pytest.approx(300 * 0.6, rel=0.15)  # the counter's rise over the window
    with telemetry.measured_window(rate_hz=20) as summary:  # a process on one GPU: its cuda:0
        time.sleep(0.2)
    assert [g.split("_gpu")[1] for g in summary] == ["0"]


# -- which GPUs are sampled ----------------------------------------------------------------------------------------

HOST = [NvmlDevice(i, UUIDS[i], minor=i) for i in range(4)]


def chosen(env: dict[str, str], used: int = 4, devices: list[NvmlDevice] = HOST) -> list[int]:
    """The NVML indices that select_gpus picks."""
    return [d.index for d in select_gpus(env, devices, used)]


def test_cuda_visible_devices_names_gpus_by_index_in_its_own_order_with_whitespace_around():
    """CUDA's indices, taken as NVML's (both PCI bus order), in the order given: rank 0 runs on the first one."""
    assert chosen({"CUDA_VISIBLE_DEVICES": "1"}) == [1]
    assert chosen({"CUDA_VISIBLE_DEVICES": "3,1"}) == [3, 1]
    assert chosen({"CUDA_VISIBLE_DEVICES": " 2 , 0 "}) == [2, 0]
    assert chosen({"CUDA_VISIBLE_DEVICES": "1,1,2"}) == [1, 2]  # a GPU listed twice is sampled once


def test_cuda_visible_devices_names_gpus_by_uuid_by_a_unique_prefix_or_by_a_mig_device_of_theirs():
    """A MIG device stands for its GPU: NVML's power and energy are the physical GPU's, and the note says that the
    GPU is shared."""
    assert chosen({"CUDA_VISIBLE_DEVICES": f"{UUIDS[2]},{UUIDS[0]}"}) == [2, 0]
    assert chosen({"CUDA_VISIBLE_DEVICES": "GPU-3a1b"}) == [3]
    mig = [*HOST[:3], NvmlDevice(3, UUIDS[3], 3, ("MIG-5e6f7a8b-0000-1111-2222-333344445555", "MIG-9c0d1e2f-0000"))]
    assert chosen({"CUDA_VISIBLE_DEVICES": "MIG-9c0d1e2f-0000"}, devices=mig) == [3]
    assert chosen({"CUDA_VISIBLE_DEVICES": "MIG-5e6f,MIG-9c0d,0"}, used=2, devices=mig) == [3]  # two ranks, one GPU
    env = {"CUDA_VISIBLE_DEVICES": "MIG-5e6f"}
    assert telemetry.sampled_note(select_gpus(env, mig, 1), 4, env, 1) == (
        "GPU telemetry through NVML: GPU 3 (GPU-3a1b2c3d) of this host's 4, chosen by CUDA_VISIBLE_DEVICES=MIG-5e6f "
        "for 1 rank on this node; GPU 3 is shared by its MIG devices: its power and energy are the whole GPU's"
    )


def test_an_empty_cuda_visible_devices_hides_every_gpu_and_a_negative_index_ends_the_list():
    """As CUDA reads it: ``-1`` is the usual way to hide the GPUs, and entries after a negative one are not seen."""
    assert chosen({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert chosen({"CUDA_VISIBLE_DEVICES": "-1"}) == []
    assert chosen({"CUDA_VISIBLE_DEVICES": "2,-1,3"}) == [2]


def test_the_ranks_of_a_node_use_the_first_visible_gpus_one_each():
    """Each rank takes the visible GPU of its local rank, so ``used`` ranks use the first ``used``; without a list
    every GPU NVML lists is visible."""
    assert chosen({"CUDA_VISIBLE_DEVICES": "3,2,1,0"}, used=2) == [3, 2]
    assert chosen({}, used=2) == [0, 1]
    assert chosen({}) == [0, 1, 2, 3]


# A node whose Slurm job may see only /dev/nvidia2 and /dev/nvidia3: NVML lists those two, as indices 0 and 1.
CONFINED = [NvmlDevice(0, UUIDS[2], minor=2), NvmlDevice(1, UUIDS[3], minor=3)]


def test_slurm_s_gpu_ids_are_minor_numbers_and_come_before_cuda_visible_devices():
    """A step's GPUs on the node (SLURM_STEP_GPUS, else the batch step's SLURM_JOB_GPUS) are /dev/nvidiaN numbers,
    whatever the confinement; they list every rank's GPU where a rank's CUDA_VISIBLE_DEVICES holds its own alone."""
    assert chosen({"SLURM_STEP_GPUS": "2,3", "CUDA_VISIBLE_DEVICES": "0"}, used=2, devices=CONFINED) == [0, 1]
    assert chosen({"SLURM_JOB_GPUS": "3", "CUDA_VISIBLE_DEVICES": "0"}, used=1, devices=CONFINED) == [1]
    assert chosen({"SLURM_STEP_GPUS": "3", "SLURM_JOB_GPUS": "2,3"}, used=2, devices=CONFINED) == [1]
    assert chosen({"SLURM_JOB_GPUS": "1-3"}) == [1, 2, 3]
    no_minor = [NvmlDevice(i, UUIDS[i]) for i in range(4)]  # NVML's index stands in
    assert chosen({"SLURM_JOB_GPUS": "0,2"}, devices=no_minor) == [0, 2]


@pytest.mark.parametrize("env, message", [
    ({"CUDA_VISIBLE_DEVICES": "1,7"}, "CUDA_VISIBLE_DEVICES=1,7 names GPU 7, but this host has 4 GPUs (0-3)"),
    ({"CUDA_VISIBLE_DEVICES": "GPU-9f"}, "CUDA_VISIBLE_DEVICES=GPU-9f names GPU-9f, which matches none of this "
                                         "host's 4 GPUs (0-3): GPU-0a1b2c3d, GPU-1a1b2c3d, GPU-2a1b2c3d, GPU-3a1b2c3d"),
    ({"CUDA_VISIBLE_DEVICES": "GPU-"}, "CUDA_VISIBLE_DEVICES=GPU- names GPU-, which matches 4 of this host's 4 GPUs"),
    ({"CUDA_VISIBLE_DEVICES": "0,cuda:1"}, "CUDA_VISIBLE_DEVICES=0,cuda:1 names 'cuda:1', which is neither a GPU index "
                                           "nor a GPU or MIG UUID; this host has 4 GPUs (0-3)"),
    ({"SLURM_STEP_GPUS": "4,5"}, "SLURM_STEP_GPUS=4,5 names GPU 5, but this host's 2 GPUs (0, 1) have the ids 4, "
                                 "6 (their /dev/nvidiaN numbers)"),
    ({"SLURM_JOB_GPUS": "gpu4"}, "SLURM_JOB_GPUS=gpu4 names GPU 'gpu4', which is not a GPU id (a number)"),
])  # fmt: skip
def test_a_listed_gpu_this_host_lacks_is_refused_in_one_sentence(env, message):
    devices = HOST if "CUDA_VISIBLE_DEVICES" in env else [NvmlDevice(0, UUIDS[0], 4), NvmlDevice(1, UUIDS[1], 6)]
    with pytest.raises(UserError) as refused:
        select_gpus(env, devices, 1)
    assert str(refused.value).startswith(message), str(refused.value)
    assert "\n" not in str(refused.value) and ". " not in str(refused.value)


def test_a_run_on_one_gpu_of_four_records_that_gpu_alone_and_counts_its_energy_alone(tmp_path, monkeypatch):
    """Beside other work on the host, the run's files and energy to train are those of the GPU it runs on."""
    nv = fake_nvml(watts=(100.0, 200.0, 300.0, 400.0))
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    sampler = Sampler(tmp_path, rate_hz=20, host="node1", gpus_used=1, env={"CUDA_VISIBLE_DEVICES": "1"}).start()
    time.sleep(0.5)
    sampler.stop()
    assert sampler.note == ("GPU telemetry through NVML: GPU 1 (GPU-1a1b2c3d) of this host's 4, chosen by "
                            "CUDA_VISIBLE_DEVICES=1 for 1 rank on this node")  # fmt: skip
    assert [p.name for p in tmp_path.iterdir()] == ["telemetry_node1_gpu1.csv"]
    rows = read_csv(tmp_path / "telemetry_node1_gpu1.csv")
    assert {r["gpu"] for r in rows} == {"1"} and {float(r["power_w"]) for r in rows} == {200.0}
    start, stop = int(rows[0]["time_ms"]), int(rows[-1]["time_ms"])
    energy = run_energy(tmp_path, start, stop)
    assert list(energy["per_gpu"]) == ["node1_gpu1"]
    assert energy["total_joules"] == pytest.approx(200 * (stop - start) / 1000, rel=0.05)


def test_a_cpu_run_records_the_cpu_alone_on_a_host_with_gpus(tmp_path, monkeypatch):
    nv = fake_nvml(watts=(100.0, 200.0))
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    sampler = Sampler(tmp_path, rate_hz=20, host="node1", gpus_used=0, env={}).start()
    sampler.stop()
    assert sampler.note == "GPU telemetry off (a CPU run); recording CPU and memory" and nv.calls == []
    assert [p.name for p in tmp_path.iterdir()] == ["telemetry_node1_cpu.csv"]


def test_a_gpu_list_naming_a_gpu_the_host_lacks_stops_the_sampler_before_it_writes(tmp_path, monkeypatch):
    """The one failure of telemetry that stops a run, before training: the run would otherwise record the wrong GPUs
    or none."""
    nv = fake_nvml(watts=(100.0, 200.0))
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    sampler = Sampler(tmp_path, host="node1", gpus_used=1, env={"CUDA_VISIBLE_DEVICES": "2"})
    with pytest.raises(UserError, match="CUDA_VISIBLE_DEVICES=2 names GPU 2, but this host has 2 GPUs \\(0, 1\\)"):
        sampler.start()
    assert nv.calls == ["init", "shutdown"] and not list(tmp_path.iterdir())
    hidden = Sampler(tmp_path, host="node1", gpus_used=1, env={"CUDA_VISIBLE_DEVICES": ""}).start()
    hidden.stop()
    assert hidden.note == "GPU telemetry absent (CUDA_VISIBLE_DEVICES= leaves no GPU visible); recording CPU and memory"


def test_a_cpu_run_records_telemetry_without_failing(small_data, tmp_path):
    import json

    from conftest import only_run_dir, run_cli

    code = run_cli(
        "run", "bert", f"data.dir={small_data}", f"output.results_dir={tmp_path}", "progress=false",
        "schedule.max_samples=640", "eval.every_samples=640", "eval_samples=256", "telemetry_hz=10",
    )  # fmt: skip
    assert code == 1  # too short to reach the target
    run_dir = only_run_dir(tmp_path)
    csvs = list(run_dir.glob("telemetry_*.csv"))
    assert csvs and all(len(read_csv(p)) >= 2 for p in csvs)
    outcome = json.loads((run_dir / "run_0.json").read_text())
    assert "energy" in outcome


def test_profile_writes_a_kernel_table_and_a_chrome_trace_on_every_rank(small_data, tmp_path):
    import csv
    import json

    from conftest import only_run_dir, run_cli

    code = run_cli(
        "run", "bert", f"data.dir={small_data}", f"output.results_dir={tmp_path}", "progress=false",
        "schedule.max_samples=640", "eval.every_samples=640", "eval_samples=256", "profile=true",
        "profile_start_step=2", "profile_steps=2", "--nproc", "2", "micro_batch_size=32",
    )  # fmt: skip
    assert code == 1
    run_dir = only_run_dir(tmp_path)
    for prefix in ("profile_0_", "profile_0_rank1_"):  # every rank profiles its own steps
        with open(run_dir / f"{prefix}kernels.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        assert len(rows) >= 10 and any(r["name"] in ("aten::mm", "aten::addmm") for r in rows)
        trace = json.loads((run_dir / f"{prefix}trace.json").read_text())
        assert len(trace["traceEvents"]) > 100
    assert not list(run_dir.glob("*timeline.json"))  # no GPU time to split on a CPU run


def test_profile_timeline_splits_gpu_time_into_compute_exposed_communication_and_idle():
    import pytest

    from trainbench.train.profiling import timeline

    def kernel(name, ts, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    # Two steps over 0-1000 us: compute 0-300 and 350-600 (a copy 590-650 inside the second), an all-reduce
    # 250-450 (hidden behind compute but for 300-350) and another 700-900 (nothing beside it), idle 650-700
    # and 900-1000 except a last kernel 950-1000. CPU events are not GPU time.
    trace = {"traceEvents": [
        kernel("sm90_gemm", 0, 300), kernel("gelu", 350, 250), kernel("Memcpy HtoD", 590, 60, "gpu_memcpy"),
        kernel("ncclDevKernel_AllReduce_Sum_f32", 250, 200), kernel("ncclDevKernel_AllReduce_Sum_f32", 700, 200),
        kernel("layer_norm", 950, 50), kernel("aten::mm", 0, 5000, "cpu_op"), {"ph": "i", "name": "marker"},
    ]}  # fmt: skip
    t = timeline(trace, steps=2)
    assert t["window_ms"] == pytest.approx(1.0 / 2)
    assert t["busy_ms"] == pytest.approx((650 + 200 + 50) / 2e3)
    assert t["compute_ms"] == pytest.approx((300 + 300 + 50) / 2e3)
    assert t["compute_kernels_ms"] == pytest.approx((300 + 250 + 50) / 2e3)
    assert t["comm_ms"] == pytest.approx(400 / 2e3)
    assert t["comm_exposed_ms"] == pytest.approx((50 + 200) / 2e3)
    assert t["idle_ms"] == pytest.approx((50 + 50) / 2e3)
    assert t["comm_kernels"] == 2
    with pytest.raises(ValueError, match="no GPU activity"):
        timeline({"traceEvents": [kernel("aten::mm", 0, 10, "cpu_op")]}, steps=1)


def test_a_gpu_with_no_busy_sample_in_a_short_window_keeps_its_energy_and_a_node_counts_every_gpu(tmp_path):
    """A window shorter than the sampling's period can hold a busy sample of one GPU and none of its peer: the peer
    keeps its entry and its energy (no medians), so the window's energy is both GPUs'. Before, the peer was left out
    and a 2-GPU bench's energy a token was half of what the GPUs spent. Where a GPU's energy is unknown or a rank's
    GPU was not sampled, the node's energy is None, never a partial sum."""
    from trainbench.measure.throughput import node_energy

    header = ",".join(telemetry.GPU_FIELDS)
    busy = ["0,0,100,1000,,,1980,,100,,,4", "1000,0,600,1500,,,1980,,100,,,4", "2000,0,600,2100,,,1980,,100,,,4"]
    idle_then = ["400,1,100,1000,,,1980,,100,,,4", "1400,1,600,1600,,,1980,,30,,,4", "2400,1,600,2200,,,1980,,100,,,4"]
    (tmp_path / "telemetry_n_gpu0.csv").write_text(header + "\n" + "\n".join(busy) + "\n")
    (tmp_path / "telemetry_n_gpu1.csv").write_text(header + "\n" + "\n".join(idle_then) + "\n")
    summary = telemetry.window_summary(tmp_path, 900, 1900)
    assert summary["n_gpu0"]["busy_samples"] == 1 and summary["n_gpu0"]["power_w"] == 600.0
    assert summary["n_gpu1"] == {"busy_samples": 0, "power_w": None, "sm_clock_mhz": None,
                                 "throttle_reasons": ["SwPowerCap"], "energy_j": 600.0}  # fmt: skip
    assert node_energy(summary, 2) == summary["n_gpu0"]["energy_j"] + 600.0
    assert node_energy(summary, 4) is None  # two of the node's four ranks' GPUs not sampled
    assert node_energy({**summary, "n_gpu1": {**summary["n_gpu1"], "energy_j": None}}, 2) is None
    assert node_energy({}, 1) is None


def test_the_machine_names_its_gpus_by_their_uuids_and_nothing_without_nvml(monkeypatch):
    """system.gpu_ids: what tells two machines of one host name and kind apart, for a comparison's warning."""
    from trainbench import telemetry

    nv = fake_nvml(watts=(300.0, 300.0, 300.0))
    nv.nvmlDeviceGetName = lambda h: "NVIDIA H200"
    nv.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=70 * 2**30, total=140 * 2**30)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    assert telemetry.gpus() == (3, "NVIDIA H200", "140 GB", "GPU-0a1b2c3d, GPU-1a1b2c3d, GPU-2a1b2c3d")
    assert nv.calls == ["init", "shutdown"]
    assert telemetry.machine()["gpu_ids"] == "GPU-0a1b2c3d, GPU-1a1b2c3d, GPU-2a1b2c3d"
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: import fails
    assert telemetry.gpus() == (0, "", "", "")
    assert "gpu_ids" not in telemetry.machine()


def test_the_machine_says_how_its_gpus_are_linked_by_their_active_nvlinks(monkeypatch):
    """system.gpu_links: two machines of one kind whose pairs of GPUs scale differently may differ in their links.
    NVML refuses the NVLink query on a GPU without NVLink (counted as 0) and on links past a GPU's last."""
    from trainbench import telemetry

    def nvml(up_by_gpu: list[int], links: int = 18):
        nv = fake_nvml(watts=(300.0,) * len(up_by_gpu))
        nv.NVML_NVLINK_MAX_LINKS, nv.NVML_FEATURE_ENABLED = links, 1

        def state(handle, link):
            if up_by_gpu[handle] == 0 or link >= 18:
                raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
            return 1 if link < up_by_gpu[handle] else 0

        nv.nvmlDeviceGetNvLinkState = state
        monkeypatch.setitem(sys.modules, "pynvml", nv)
        return nv

    nv = nvml([18, 18, 18, 18], links=20)
    assert telemetry.gpu_links() == "18 active NVLinks on each of 4 GPUs" and nv.calls == ["init", "shutdown"]
    assert telemetry.machine(links=True)["gpu_links"] == "18 active NVLinks on each of 4 GPUs"
    assert "gpu_links" not in telemetry.machine()  # output.gpu_links=false (or a run on the CPU): not read
    nvml([0, 0])
    assert telemetry.gpu_links() == "no active NVLink on its 2 GPUs (PCIe between GPUs)"
    nvml([18, 12])  # a link down on the second GPU
    assert telemetry.gpu_links() == "active NVLinks by GPU: 18, 12"
    nvml([18])  # one GPU: nothing to link
    assert telemetry.gpu_links() is None and "gpu_links" not in telemetry.machine(links=True)
    nv = nvml([18, 18])
    del nv.nvmlDeviceGetNvLinkState  # an NVML that cannot be asked
    assert telemetry.gpu_links() is None
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert telemetry.gpu_links() is None
