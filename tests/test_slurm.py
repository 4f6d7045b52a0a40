"""`trainbench submit`: system files, the sbatch script, cluster checks, and real jobs on a local Slurm."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import needs_two_nodes, run_cli

from trainbench.benchmarks.bert import large
from trainbench.errors import UserError
from trainbench.launch import slurm
from trainbench.launch.systems import load_system


def _error(capsys) -> str:
    out = capsys.readouterr().out.strip()
    assert out.startswith("error:") and "Traceback" not in out, out
    return out


# -- system files --------------------------------------------------------------------------------------------


def test_unknown_system_lists_the_known_ones(capsys, small_data):
    assert run_cli("submit", "bert", "--system", "dgx_nonexistent", "--dry-run", f"data.dir={small_data}") == 2
    out = _error(capsys)
    assert "unknown system 'dgx_nonexistent'" in out and "dgxh100_1x8" in out and "local_cpu_1x2" in out


def test_system_layout_gives_batch_per_gpu_accumulation_and_cpu_binding():
    from trainbench.benchmarks.bert import large
    from trainbench.resolve import fit_micro_batch

    one = load_system("dgxh100_1x8")
    cfg = fit_micro_batch(large(), one)
    assert one.naming(cfg.data.global_batch_size, cfg.data.micro_batch_size) == "1x8x48x2"
    eight = load_system("dgxh100_8x8")
    cfg = fit_micro_batch(large(), eight)
    assert eight.naming(cfg.data.global_batch_size, cfg.data.micro_batch_size) == "8x8x12x1"
    # GPUs 0-3 share socket 0 (cores 0-55 and their hyperthreads 112-167), each gets a quarter of both.
    assert one.cpu_map()[:2] == ["0-13,112-125", "14-27,126-139"]
    assert one.cpu_map()[7] == "98-111,210-223"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nodes: 1\ngpus: 8\n", "unknown key(s) gpus"),
        ("nodes: two\n", "nodes should be int"),
        ("gpus_per_node: 2\ncpus_per_node: 8\nnuma: ['0-15']\n", "names CPU 15 but cpus_per_node is 8"),
        ("gpus_per_node: 2\nnuma: ['0-3']\ngpu_numa: [0, 1]\n", "gpu_numa needs one NUMA index"),
        ("time: 'soon'\n", "time must be HH:MM:SS"),
    ],
)
def test_bad_system_files_are_one_clear_error(tmp_path, text, message):
    path = tmp_path / "mine.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_system(str(path))


# -- the script ------------------------------------------------------------------------------------------------


def test_dry_run_script_has_the_slurm_and_container_flags(small_data, tmp_path, capsys):
    code = run_cli(
        "submit", "bert", "--system", "dgxh100_1x8", "--nodes", "2", "--time", "00:20:00", "--nexp", "3",
        "--preset", "tiny", "--dry-run", f"data.dir={small_data}", f"output.results_dir={tmp_path}",
        "data.global_batch_size=768", "data.micro_batch_size=48", "eval_samples=256",
    )  # fmt: skip
    assert code == 0
    script = (next(tmp_path.iterdir()) / "submit.sbatch").read_text()
    for line in [
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --time=00:20:00",
        "#SBATCH --partition=batch",
        "#SBATCH --exclusive",
        "#SBATCH --mem=0",  # an exclusive job: each node's whole memory too
        "#SBATCH --array=0-2%1",  # the runs one after another: none shares the network or storage it measures
        "#SBATCH --requeue",
        "#SBATCH --signal=USR1@120",
        "# layout 2x8x48x1",
    ]:
        assert line in script, line
    sruns = [line for line in script.splitlines() if line.startswith("srun ")]
    start, worker = sruns[0], next(line for line in sruns if "trainbench.launch.worker" in line)
    # pyxis: the first step imports the image once on each node under the job's name; the ranks' steps reuse it
    assert "--ntasks-per-node=1 '--container-image=registry.local#trainbench:0.1.0'" in start
    assert "--container-name=trainbench_${SLURM_JOB_ID} true" in start
    run_dir = next(tmp_path.iterdir())
    for flag in ["--mpi=pmi2", "--gres=gpu:8", "--cpu-bind=none", "--container-name=trainbench_${SLURM_JOB_ID}",
                 f"--container-mounts=/lustre/fsw/mlperf:/lustre/fsw/mlperf,{run_dir}:{run_dir},{small_data}:{small_data}",
                 "/opt/trainbench/venv/bin/python -m trainbench.launch.worker"]:  # fmt: skip
        assert flag in worker.replace("'", ""), flag
    assert "--container-image" not in worker
    preflight = next(line for line in sruns if "trainbench.launch.preflight" in line)
    assert preflight.split(" /opt/trainbench")[0] == worker.split(" /opt/trainbench")[0]  # the same placement
    assert "export TRAINBENCH_CPU_MAP='0-13,112-125;" in script
    assert "export NCCL_SOCKET_IFNAME='^docker,lo'" in script
    assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0
    assert "not submitted" in capsys.readouterr().out


def test_a_sites_sbatch_options_throttled_array_and_cache_clear_command_reach_the_script(small_data, tmp_path,
                                                                                          capsys):  # fmt: skip
    system = tmp_path / "site.yaml"
    system.write_text("nodes: 1\ntasks_per_node: 2\ndevice: cpu\nexclusive: true\narray_parallel: 2\n"
                      'sbatch_options: ["--qos=high", "--constraint=h100", "--reservation=mlperf_2026"]\n'
                      'cache_clear_command: "sudo /usr/local/sbin/drop-caches --all"\n')  # fmt: skip
    common = ["--preset", "tiny", "--dry-run", f"data.dir={small_data}", "eval_samples=256"]
    assert run_cli("submit", "bert", "--system", system, "--nexp", "5", *common,
                   f"output.results_dir={tmp_path / 'a'}") == 0  # fmt: skip
    printed = capsys.readouterr().out
    for line in ["#SBATCH --exclusive", "#SBATCH --mem=0", "#SBATCH --qos=high", "#SBATCH --constraint=h100",
                 "#SBATCH --reservation=mlperf_2026", "#SBATCH --array=0-4%2"]:  # fmt: skip
        assert line in printed, line
    script = (next((tmp_path / "a").iterdir()) / "submit.sbatch").read_text()
    lines = script.splitlines()
    clear = next(i for i, line in enumerate(lines) if "drop-caches" in line)
    assert lines[clear] == (
        'srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 '
        "bash -c 'sudo /usr/local/sbin/drop-caches --all'; export TRAINBENCH_CACHE_CLEAR_RC=$?"
    )
    worker = next(i for i, line in enumerate(lines) if "trainbench.launch.worker" in line)
    preflight = next(i for i, line in enumerate(lines) if "trainbench.launch.preflight" in line)
    assert preflight < clear < worker  # on nodes that passed the preflight, right before the run
    assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0
    # --array-parallel over the system file's; one run is no array
    assert run_cli("submit", "bert", "--system", system, "--nexp", "3", "--array-parallel", "3", *common,
                   f"output.results_dir={tmp_path / 'b'}") == 0  # fmt: skip
    assert "#SBATCH --array=0-2%3\n" in capsys.readouterr().out
    assert run_cli("submit", "bert", "--system", "local_cpu_1x2", *common, f"output.results_dir={tmp_path / 'c'}") == 0
    assert "--array" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("option", "says"),
    [
        ('"--qos=high\\n#SBATCH --wrap=id"', "sbatch_options[1] holds a control character"),
        ('"--qos=high #SBATCH --wrap=id"', "sbatch_options[1] '--qos=high #SBATCH --wrap=id' is not one long sbatch"),
        ('"--comment=$(touch PWNED)"', "sbatch_options[1] '--comment=$(touch PWNED)' is not one long sbatch option"),
        ('"--constraint=a&b;id"', "is not one long sbatch option"),
        ('"qos=high"', "sbatch_options[1] 'qos=high' is not one long sbatch option"),
        ('"-q high"', "is not one long sbatch option"),
        ('"--time=99:00:00"', "sbatch_options[1] sets --time, which trainbench writes from time; set it there"),
        ('"--mem=100G"', "sets --mem, but an exclusive job asks for all of each node's memory"),
        ("3", "sbatch_options[1] should be a string"),
    ],
)
def test_an_sbatch_option_that_could_smuggle_anything_is_refused_naming_the_field(option, says, small_data, tmp_path,
                                                                                 capsys):  # fmt: skip
    system = tmp_path / "site.yaml"
    system.write_text(
        f'nodes: 1\ntasks_per_node: 2\ndevice: cpu\nexclusive: true\nsbatch_options: ["--qos=low", {option}]\n'
    )
    assert run_cli("submit", "bert", "--system", system, "--preset", "tiny", "--dry-run", f"data.dir={small_data}",
                   f"output.results_dir={tmp_path / 'r'}") == 2  # fmt: skip
    out = _error(capsys)
    assert says in " ".join(out.split()), out
    assert not (tmp_path / "r").exists() and not list(tmp_path.rglob("PWNED"))


def test_array_parallel_below_one_is_refused(tmp_path, small_data, capsys):
    system = tmp_path / "site.yaml"
    system.write_text("nodes: 1\ntasks_per_node: 2\ndevice: cpu\narray_parallel: 0\n")
    assert run_cli("submit", "bert", "--system", system, "--dry-run", "--preset", "tiny", f"data.dir={small_data}") == 2
    assert "array_parallel must be at least 1" in _error(capsys)


def _fake_tools(folder: Path, log: Path) -> dict:
    """srun and scontrol stand-ins that record their arguments, one per line, and do nothing."""
    folder.mkdir()
    for name in ("srun", "scontrol"):
        tool = folder / name
        tool.write_text(f'#!/bin/bash\nfor a in "$@"; do printf "%s\\n" "$a"; done >> {log}\necho --- >> {log}\n')
        tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return dict(os.environ, PATH=f"{folder}:{os.environ['PATH']}", SLURM_JOB_ID="77", SLURM_JOB_NODELIST="n1")


def test_names_paths_and_values_with_shell_syntax_are_never_executed(small_data, tmp_path):
    evil = "$(touch PWNED1); touch PWNED2 `touch PWNED3` 'q\" x"
    results = tmp_path / f"res {evil}"
    system = tmp_path / "evil.yaml"
    system.write_text(
        "nodes: 1\ntasks_per_node: 2\ndevice: cpu\ncpu_bind: null\n"
        f"env:\n  MY_FLAG: {json.dumps(evil)}\n"
        f"container_mounts: [{json.dumps('/a b:/c;$(touch PWNED4)')}]\n"
        f"container_image: {json.dumps('reg#img:$(touch PWNED5)')}\n"
    )
    code = run_cli(
        "submit", "bert", "--preset", "tiny", "--system", system, "--dry-run", f"data.dir={small_data}",
        f"output.results_dir={results}", f"output.submission_org={evil}", "eval_samples=256",
    )  # fmt: skip
    assert code == 0
    run_dir = next(results.iterdir())
    log = tmp_path / "calls.log"
    env = _fake_tools(tmp_path / "bin", log)
    proc = subprocess.run(["bash", str(run_dir / "submit.sbatch")], cwd=tmp_path, env=env, capture_output=True,
                          text=True)  # fmt: skip
    assert not list(tmp_path.glob("PWNED*")), proc.stderr
    args = log.read_text().split("\n")
    assert str(run_dir) in args  # the folder reached srun as one argument, as it is
    assert "--container-image=reg#img:$(touch PWNED5)" in args
    assert any(a.startswith("--container-mounts=/a b:/c;$(touch PWNED4),") for a in args)
    # The override is data in config.yaml, not text in the script.
    from trainbench.resolve import load_run_config

    assert load_run_config(run_dir / "config.yaml")[1].output.submission_org == evil


def _fake_sinfo(tmp_path: Path, lines: str) -> None:
    folder = tmp_path / "sinfo-bin"
    folder.mkdir(exist_ok=True)
    tool = folder / "sinfo"
    tool.write_text(f"#!/bin/bash\ncat <<'EOF'\n{lines}\nEOF\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    os.environ["PATH"] = f"{folder}:{os.environ['PATH']}"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"partition": "gpu"}, "partition 'gpu' does not exist on this cluster; partitions: batch, debug"),
        ({"nodes": 9}, "9 nodes were asked for but partition batch has 8"),
        ({"gpus_per_node": 16}, "16 GPUs per node were asked for but nodes of batch have 8"),
        ({"time": "05:00:00"}, "time 05:00:00 exceeds partition batch's limit 4:00:00"),
    ],
)
def test_requests_the_cluster_cannot_meet_fail_before_submitting(tmp_path, monkeypatch, changes, message):
    import dataclasses

    monkeypatch.setenv("PATH", os.environ["PATH"])
    _fake_sinfo(tmp_path, "batch*|up|4:00:00|8|224|gpu:h100:8(S:0-1)\ndebug|up|30:00|2|16|(null)")
    system = dataclasses.replace(load_system("dgxh100_1x8"), **changes)
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        slurm.check_cluster(system)
    assert slurm.check_cluster(load_system("dgxh100_1x8")) == "batch"


def test_resubmit_sends_the_folders_script_again_for_the_runs_that_have_not_ended(small_data, tmp_path, monkeypatch,
                                                                                  capsys):  # fmt: skip
    """Stand-in sinfo/squeue/sbatch: which runs go again (a job array of those without result_<i>.txt), with which
    time limit, what the folder says meanwhile, and each refusal as one sentence."""
    import dataclasses

    assert run_cli("submit", "bert", "--preset", "tiny", "--system", "local_cpu_2x1", "--nexp", "3", "--dry-run",
                   f"data.dir={small_data}", f"output.results_dir={tmp_path / 'r'}",
                   "eval_samples=256") == 0  # fmt: skip
    run_dir = next((tmp_path / "r").iterdir())
    saved = load_system(str(run_dir / "system.yaml"))
    assert dataclasses.replace(saved, path="") == dataclasses.replace(load_system("local_cpu_2x1"), path="")
    bin_dir, calls = tmp_path / "bin", tmp_path / "sbatch.log"
    bin_dir.mkdir()
    queue = tmp_path / "queue"
    queue.write_text("")
    tools = {
        "sinfo": "echo 'debug*|up|infinite|2|2|(null)'",
        "squeue": f"cat {queue}",
        "sbatch": f'echo "$@" >> {calls}; echo 4242',
        "srun": "echo 'MPI plugin types are...'; echo '        pmi2'",
    }
    for name, body in tools.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    (run_dir / "result_1.txt").write_text("ended\n")
    assert run_cli("resubmit", run_dir, "--time", "00:20:00") == 0
    assert calls.read_text().split() == ["--parsable", "--array=0,2%1", "--time=00:20:00",
                                         str(run_dir / "submit.sbatch")]  # fmt: skip
    assert "job 4242: run(s) 0, 2 of" in capsys.readouterr().out
    states = {i: json.loads((run_dir / f"slurm_{i}.json").read_text())["state"] for i in (0, 2)}
    assert states == {0: "PENDING", 2: "PENDING"} and not (run_dir / "slurm_1.json").exists()
    assert json.loads((run_dir / "job.json").read_text())["job_ids"] == ["4242"]
    queue.write_text("4242|4242_0|RUNNING\n")
    assert run_cli("resubmit", run_dir) == 2
    message = _error(capsys)
    assert "job 4242_0 of" in message and "is still RUNNING: wait for it or scancel it" in message
    queue.write_text("")
    for i in (0, 2):
        (run_dir / f"result_{i}.txt").write_text("ended\n")
    assert run_cli("resubmit", run_dir) == 2
    assert "has ended (result_*.txt): nothing to resubmit" in _error(capsys)
    assert run_cli("resubmit", tmp_path) == 2
    assert "is not a results folder written by `trainbench submit`" in _error(capsys)
    assert len(calls.read_text().splitlines()) == 1  # nothing else was submitted


def test_system_question_mark_lists_the_systems_and_whether_the_cluster_fits_each(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", os.environ["PATH"])
    from trainbench.console import console

    monkeypatch.setenv("COLUMNS", "250")
    monkeypatch.setattr(console, "width", 250)  # fixed when the console was made, where COLUMNS was set then
    _fake_sinfo(tmp_path, "debug*|up|infinite|2|2|(null)")
    assert run_cli("submit", "--system", "?") == 0
    rows = {line.split("│")[1].strip(): line for line in capsys.readouterr().out.splitlines() if line.count("│") > 4}
    assert {"dgxh100_8x8", "local_cpu_2x1", "local_cpu_2x2"} <= set(rows)
    assert "yes (debug)" in rows["local_cpu_2x2"] and "2 x 2 cpu" in rows["local_cpu_2x2"]
    assert "no: partition 'batch' does not exist on this cluster" in rows["dgxh100_8x8"]
    assert run_cli("submit", "--system", "local_cpu_2x1") == 2
    assert "name the benchmark to submit" in _error(capsys)


def test_missing_container_image_is_caught_before_submit(tmp_path, small_data, capsys):
    system = tmp_path / "sq.yaml"
    system.write_text(f"nodes: 1\ntasks_per_node: 2\ndevice: cpu\ncontainer_image: {tmp_path / 'nope.sqsh'}\n")
    assert run_cli("submit", "bert", "--preset", "tiny", "--system", system, f"data.dir={small_data}") == 2
    assert "nope.sqsh" in _error(capsys) and not (Path("results").exists() and any(Path("results").glob("*-sq")))


def test_cpu_map_beyond_the_node_is_a_readable_error():
    from trainbench.distributed import DistInfo
    from trainbench.launch.worker import bind_cpus

    info = DistInfo(rank=1, local_rank=1, world_size=2, device=None)
    with pytest.raises(UserError, match=f"should run on CPUs .* but this node has {os.cpu_count()} CPUs"):
        bind_cpus(info, {"TRAINBENCH_CPU_MAP": f"0;{os.cpu_count() + 100}-{os.cpu_count() + 110}"})


def test_ranks_pin_to_their_share_of_the_jobs_allocation(tmp_path, monkeypatch):
    """Under Slurm the ranks of a node split the CPUs the job was allocated there (the task's affinity), NUMA node by
    NUMA node and whole cores; the system file's NUMA map is cut to the allocation; Slurm's own binding stands."""
    from trainbench.distributed import DistInfo
    from trainbench.launch import worker
    from trainbench.launch.systems import allocation_shares

    # A node of 2 NUMA nodes of 4 cores with 2 threads each: CPU c and c + 8 share a core.
    sysfs = tmp_path / "system"
    for n, cpus in enumerate(("0-3,8-11", "4-7,12-15")):
        (sysfs / "node" / f"node{n}").mkdir(parents=True)
        (sysfs / "node" / f"node{n}" / "cpulist").write_text(cpus + "\n")
    for c in range(16):
        (sysfs / "cpu" / f"cpu{c}" / "topology").mkdir(parents=True)
        (sysfs / "cpu" / f"cpu{c}" / "topology" / "thread_siblings_list").write_text(f"{c % 8},{c % 8 + 8}\n")
    every = set(range(16))
    assert allocation_shares(every, 4, sysfs) == [{0, 1, 8, 9}, {2, 3, 10, 11}, {4, 5, 12, 13}, {6, 7, 14, 15}]
    # A job given 3 cores of NUMA node 0 and 1 of node 1 (a shared node): one rank a NUMA node, whole cores each.
    assert allocation_shares({0, 1, 2, 8, 9, 10, 4, 12}, 2, sysfs) == [{0, 1, 2, 8, 9, 10}, {4, 12}]
    assert allocation_shares({0, 8}, 2, sysfs) == [set(), {0, 8}]  # fewer cores than ranks: a rank gets none

    pinned = []
    monkeypatch.setattr(worker.os, "sched_setaffinity", lambda pid, cpus: pinned.append(set(cpus)))
    allowed = set(sorted(os.sched_getaffinity(0))[:1])
    monkeypatch.setattr(worker.os, "sched_getaffinity", lambda pid: allowed)
    info = DistInfo(rank=0, local_rank=0, world_size=2, device=None, local_world_size=2)
    assert worker.bind_cpus(info, {}) is None and not pinned  # not under Slurm, no map: the OS places the ranks
    said = worker.bind_cpus(info, {"SLURM_JOB_ID": "7", "SLURM_CPU_BIND_TYPE": "mask_cpu:"})
    assert "as Slurm bound the task (mask_cpu)" in said and not pinned
    cpu = min(allowed)
    said = worker.bind_cpus(info, {"SLURM_JOB_ID": "7", "TRAINBENCH_CPU_MAP": f"{cpu},{os.cpu_count() - 1};"})
    part = "" if cpu == os.cpu_count() - 1 else "the part of the system file's"
    assert pinned == [{cpu}] and "the system file's NUMA map" in said and part in said
    outside = next(c for c in range(os.cpu_count()) if c not in allowed) if os.cpu_count() > 1 else None
    if outside is not None:
        with pytest.raises(UserError, match="the job's allocation holds none of them"):
            worker.bind_cpus(info, {"TRAINBENCH_CPU_MAP": f"{outside};"})


# -- a real Slurm ---------------------------------------------------------------------------------------------


def _start_now(job_id: str) -> None:
    """Lift the hold Slurm puts on a requeued job (its begin time, about two minutes on), 3 s after it is pending
    with no step of its earlier start left on the nodes. A requeued job keeps its id: started while a step of the
    earlier start was still being cleaned up, or within a second of its requeue, the new start was killed ("Job
    credential revoked")."""
    deadline = time.time() + 60
    while time.time() < deadline:
        out = subprocess.run(["scontrol", "show", "job", job_id, "-o"], capture_output=True, text=True).stdout
        steps = subprocess.run(["pgrep", "-f", f"slurmstepd: \\[{job_id}\\."], capture_output=True).stdout
        if "JobState=PENDING" in out and not steps:
            time.sleep(3)
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], capture_output=True)
            return
        time.sleep(0.5)
    pytest.fail(f"job {job_id} was not pending with its earlier steps ended within 60 s")


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _log_values(run_dir: Path) -> dict:
    lines = (run_dir / "result_0.txt").read_text().splitlines()
    return {e["key"]: e["value"] for e in (json.loads(x.split(":::MLLOG ")[1]) for x in lines if ":::MLLOG" in x)}


def _said(command: list[str]) -> str:
    """What a Slurm command prints, for a failure's message; why not, where it cannot run."""
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"({command[0]}: {e})\n"


def _wait_for(what: str, ready, timeout: float, run_dir: Path) -> float:
    """Seconds until ``ready()``; after ``timeout`` the test fails with Slurm's view of the queue and the nodes (a job
    left COMPLETING names its reason there) and the job's output."""
    start = time.time()
    while not ready():
        if time.time() - start > timeout:
            log = "".join(p.read_text() for p in run_dir.glob("slurm-*.out"))
            queue = _said(["squeue", "-h", "-o", "%i %T %r %M %N"])
            nodes = _said(["sinfo", "-h", "-N", "-o", "%N %T %E"])
            pytest.fail(f"{what} did not happen in {timeout} s; squeue (id, state, reason, time, nodes):\n{queue}"
                        f"sinfo:\n{nodes}the job's output:\n{log[-3000:]}")  # fmt: skip
        time.sleep(0.2)
    return time.time() - start


def _wait_state(run_dir: Path, want: set[str], timeout: float) -> dict:
    """The job's state file (slurm_0.json) once its state is one of ``want``, as read then."""
    path, seen = run_dir / "slurm_0.json", {}

    def reached() -> bool:
        if path.exists():
            seen.update(json.loads(path.read_text()))
        return seen.get("state") in want

    _wait_for(f"the job's state {sorted(want)}", reached, timeout, run_dir)
    return seen


@needs_two_nodes
def test_tiny_bert_on_2_x_2_trains_the_losses_of_one_process_and_logs_the_true_split(tiny_data, converged, tmp_path):
    """2 nodes x 2 ranks (4 ranks on this machine's cores) against one process at the same global batch (the
    `converged` run: 64 = 32 x 2 accumulation), its first 20 steps. (2 nodes x 1 rank to the target: the chain test
    below.)"""
    reference = _losses(converged)
    # 16 x 1 accumulation x 4 ranks
    assert run_cli("submit", "bert", "--preset", "tiny", "--system", "local_cpu_2x2", f"data.dir={tiny_data}",
                   f"output.results_dir={tmp_path / 'x2'}", "schedule.max_samples=1280") == 0  # fmt: skip
    run_dir = next((tmp_path / "x2").iterdir())
    state = _wait_state(run_dir, {"COMPLETED", "FAILED"}, timeout=600)
    assert state["exit_code"] in (0, 1), (run_dir / f"slurm-{state['job_id']}.out").read_text()[-3000:]
    logged = _log_values(run_dir)
    assert (logged["global_batch_size"], logged["gradient_accumulation_steps"]) == (64, 1)
    assert "(16 x 1 accumulation x 4 ranks)" in (run_dir / "console.log").read_text()
    ours = _losses(run_dir)
    assert sorted(ours) == [10, 20] and max(abs(ours[s] - reference[s]) for s in ours) <= 1e-5
    assert sorted(p.name.split("_")[1] for p in run_dir.glob("telemetry_*_cpu.csv")) == ["tbn1", "tbn2"]


@needs_two_nodes
def test_tiny_llama_on_two_nodes_trains_the_losses_of_one_process(llm_data, tmp_path):
    """2 nodes x 1 rank and 2 nodes x 2 ranks (FSDP over 2 and 4 ranks), each against one process at GBS 32."""
    data = llm_data
    short = [f"data.dir={data}", "log_every_steps=1", "schedule.max_samples=320", "eval.every_samples=320",
             "eval_samples=64", "telemetry_hz=0"]  # fmt: skip
    assert run_cli("run", "llama31_8b", *short, f"output.results_dir={tmp_path / 'one'}", "progress=false") == 1
    one = _losses(next((tmp_path / "one").iterdir()))
    for system, micro in (("local_cpu_2x1", 16), ("local_cpu_2x2", 8)):
        assert run_cli("submit", "llama31_8b", "--preset", "tiny", "--system", system, *short,
                       f"output.results_dir={tmp_path / system}") == 0  # fmt: skip
        run_dir = next((tmp_path / system).iterdir())
        state = _wait_state(run_dir, {"COMPLETED", "FAILED"}, timeout=600)
        assert state["exit_code"] in (0, 1), (run_dir / f"slurm-{state['job_id']}.out").read_text()[-3000:]
        logged = _log_values(run_dir)
        assert (logged["global_batch_size"], logged["gradient_accumulation_steps"]) == (32, 1)
        assert f"({micro} x 1 accumulation x {32 // micro} ranks)" in (run_dir / "console.log").read_text()
        two = _losses(run_dir)
        assert sorted(two) == list(range(1, 11)) and max(abs(one[s] - two[s]) for s in one) <= 1e-5, (system, two)


@needs_two_nodes
def test_tiny_lora_on_two_nodes_reaches_the_mlperf_target(lora_data, tmp_path, capsys):
    data = lora_data
    code = run_cli("submit", "llama2_70b_lora", "--preset", "tiny", "--system", "local_cpu_2x1", f"data.dir={data}",
                   f"output.results_dir={tmp_path / 'results'}")  # fmt: skip
    assert code == 0 and "submitted job" in capsys.readouterr().out
    run_dir = next((tmp_path / "results").iterdir())
    state = _wait_state(run_dir, {"COMPLETED", "FAILED"}, timeout=600)
    assert state["state"] == "COMPLETED", (run_dir / f"slurm-{state['job_id']}.out").read_text()[-3000:]
    run = json.loads((run_dir / "summary.json").read_text())["runs"][0]
    assert run["status"] == "success" and run["compliance"]["passed"], run
    assert run_cli("check", run_dir) == 0


@needs_two_nodes
def test_cancelled_job_is_recorded_in_the_results_folder(small_data, tmp_path):
    """scancel of a run on two nodes: state CANCELLED, the log kept as partial, nothing looks finished."""
    code = run_cli("submit", "bert", "--preset", "tiny", "--system", "local_cpu_2x1", f"data.dir={small_data}",
                   f"output.results_dir={tmp_path}", "schedule.max_samples=10000000", "eval_samples=256")  # fmt: skip
    assert code == 0
    run_dir = next(tmp_path.iterdir())
    job_id = json.loads((run_dir / "job.json").read_text())["job_id"]
    _wait_state(run_dir, {"RUNNING"}, timeout=120)
    partial = run_dir / "result_0.txt.partial"
    deadline = time.time() + 120
    while not partial.exists() and time.time() < deadline:  # the run has started training
        time.sleep(0.2)
    subprocess.run(["scancel", job_id], check=True)
    state = _wait_state(run_dir, {"CANCELLED"}, timeout=120)
    assert state["job_id"] == job_id
    deadline = time.time() + 60
    while time.time() < deadline and subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True,
                                                    text=True).stdout.strip():  # fmt: skip
        time.sleep(0.5)
    assert partial.exists() and "run_start" in partial.read_text()  # kept, as partial
    assert not (run_dir / "result_0.txt").exists()  # never looks finished


def test_python_running_the_jobs_is_this_one(small_data, tmp_path):
    assert run_cli("submit", "bert", "--preset", "tiny", "--system", "local_cpu_1x2", "--dry-run",
                   f"data.dir={small_data}", f"output.results_dir={tmp_path}", "eval_samples=256") == 0  # fmt: skip
    script = (next(tmp_path.iterdir()) / "submit.sbatch").read_text()
    assert f"PYTHON={sys.executable}" in script or f"PYTHON='{sys.executable}'" in script


@pytest.mark.parametrize("where", ["override", "system file", "script"])
def test_a_line_break_never_reaches_the_job_script(small_data, tmp_path, capsys, where):
    """No quoting keeps a newline from ending a shell line: values holding one are refused, wherever they come from,
    and nothing is written."""
    evil = "res/a\n$(touch PWNED)"
    system, overrides = "local_cpu_1x2", [f"output.results_dir={tmp_path / evil}"]
    if where == "system file":
        system = tmp_path / "evil.yaml"
        system.write_text(f"nodes: 1\ntasks_per_node: 2\ndevice: cpu\naccount: {json.dumps('acct' + evil)}\n")
        overrides = [f"output.results_dir={tmp_path / 'res'}"]
    if where == "script":  # the last guard, should a value get past the config and the system file
        from trainbench.launch.slurm import render_script
        from trainbench.launch.systems import load_system

        with pytest.raises(UserError, match="control character"):
            render_script(load_system("local_cpu_1x2"), large(), tmp_path / evil, 1, ["trainbench"], "python3")
        return
    code = run_cli("submit", "bert", "--preset", "tiny", "--system", system, "--dry-run", f"data.dir={small_data}",
                   *overrides)  # fmt: skip
    out = capsys.readouterr().out
    assert code == 2 and "control character" in out and "Traceback" not in out
    assert not list(tmp_path.rglob("submit.sbatch")) and not list(tmp_path.rglob("PWNED"))


def test_a_dry_run_does_not_need_the_data_on_this_machine(tmp_path, capsys):
    code = run_cli("submit", "bert", "--preset", "tiny", "--system", "local_cpu_1x2", "--dry-run",
                   "data.dir=/lustre/not/here", f"output.results_dir={tmp_path}")  # fmt: skip
    assert code == 0, capsys.readouterr().out
    assert "not submitted" in capsys.readouterr().out


# -- several nodes: one world size, the network interface -------------------------------------------------------


def test_a_two_node_job_computes_accumulation_from_every_rank_of_every_node(small_data, tmp_path, capsys):
    """submit once set distributed.nproc to one node's ranks and computed the accumulation from it: 2 nodes x 1 rank
    logged accumulation 2 where each rank trained one micro-batch of 32 (global batch 64)."""
    from trainbench.resolve import load_run_config

    assert run_cli("submit", "bert", "--preset", "tiny", "--system", "local_cpu_2x1", "--dry-run",
                   f"data.dir={small_data}", f"output.results_dir={tmp_path}") == 0  # fmt: skip
    run_dir = next(tmp_path.iterdir())
    bench, cfg = load_run_config(run_dir / "config.yaml")  # what every rank of the job loads
    d = cfg.distributed
    assert (d.nodes, d.nproc, d.world_size) == (2, 1, 2)
    assert (cfg.data.global_batch_size, cfg.data.micro_batch_size, bench.accumulation_steps(cfg)) == (64, 32, 1)
    script = (run_dir / "submit.sbatch").read_text()
    assert "#SBATCH --nodes=2" in script and "# layout 2x1x32x1" in script and "GLOO_SOCKET_IFNAME" not in script
    # The same global batch on one node of 2 ranks: the same split.
    assert run_cli("submit", "bert", "--preset", "tiny", "--system", "local_cpu_1x2", "--dry-run",
                   f"data.dir={small_data}", f"output.results_dir={tmp_path / 'one'}") == 0  # fmt: skip
    _, one = load_run_config(next((tmp_path / "one").iterdir()) / "config.yaml")
    assert one.distributed.world_size == 2 and bench.accumulation_steps(one) == 1


def test_a_job_whose_ranks_differ_from_its_config_stops_before_training(small_data):
    import torch

    from trainbench.benchmarks import get_benchmark
    from trainbench.distributed import DistInfo
    from trainbench.errors import ConfigError
    from trainbench.resolve import build_config
    from trainbench.train.setup import build_run

    bench, cfg = build_config("bert", "tiny", overrides={"data.dir": str(small_data), "distributed.nodes": "2"})
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"the config says 2 ranks \(2 nodes x distributed.nproc=1\) but this job"):
        build_run(cfg, get_benchmark("bert"), info, None)
    assert bench.accumulation_steps(cfg) == 1  # 64 = 32 x 1 x 2 ranks


def test_a_named_interface_must_exist_and_an_unnamed_one_is_found(monkeypatch):
    import psutil

    from trainbench.distributed import choose_interface, interface_towards

    names = sorted(psutil.net_if_addrs())
    with pytest.raises(UserError, match=r"GLOO_SOCKET_IFNAME=nosuch0 names no network interface of .* \(it has "):
        choose_interface({"GLOO_SOCKET_IFNAME": "nosuch0", "MASTER_ADDR": "127.0.0.1"})
    with pytest.raises(UserError, match="NCCL_SOCKET_IFNAME=zz"):
        choose_interface({"NCCL_SOCKET_IFNAME": "zz"})
    choose_interface({"NCCL_SOCKET_IFNAME": f"^docker,{names[0][:1]}"})  # an exclusion and a prefix NCCL accepts
    assert interface_towards("127.0.0.1") in names
    env = {"MASTER_ADDR": "127.0.0.1"}
    choose_interface(env)
    assert "GLOO_SOCKET_IFNAME" not in env  # one node: left to torch
    outward = [(n, a.address) for n, addrs in psutil.net_if_addrs().items() for a in addrs
               if a.family.name == "AF_INET" and not a.address.startswith("127.")]  # fmt: skip
    if outward:
        name, address = outward[0]
        env = {"MASTER_ADDR": address}
        choose_interface(env)
        assert env["GLOO_SOCKET_IFNAME"] == name == env["NCCL_SOCKET_IFNAME"]


# -- reruns that share checkpoints: --chain K --------------------------------------------------------------------


def test_a_chained_script_waits_for_its_namesake_continues_and_skips_an_ended_run(small_data, tmp_path, capsys):
    assert run_cli("submit", "bert", "--preset", "tiny", "--system", "local_cpu_2x1", "--chain", "3", "--dry-run",
                   f"data.dir={small_data}", f"output.results_dir={tmp_path}") == 0  # fmt: skip
    run_dir = next(tmp_path.iterdir())
    script = (run_dir / "submit.sbatch").read_text()
    assert "#SBATCH --dependency=singleton" in script and "#SBATCH --requeue" in script  # node failures still requeue
    # on USR1 it leaves the rest to a queued namesake; with none queued (the chain's last job) it requeues itself
    assert "state CONTINUES" in script and 'squeue -h -n "$SLURM_JOB_NAME"' in script
    assert json.loads((run_dir / "job.json").read_text())["chain"] == 3
    # A job of the chain that starts after the run has ended leaves at once: no srun, nothing rewritten.
    (run_dir / "result_0.txt").write_text("ended\n")
    log = tmp_path / "calls.log"
    proc = subprocess.run(["bash", str(run_dir / "submit.sbatch")], env=_fake_tools(tmp_path / "bin", log),
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0 and "run 0 has ended: nothing left for job 77" in proc.stdout, proc.stderr
    assert "srun" not in (log.read_text() if log.exists() else "") and not (run_dir / "slurm_0.json").exists()
    # Without --chain the job requeues itself instead.
    assert run_cli("submit", "bert", "--preset", "tiny", "--system", "local_cpu_2x1", "--dry-run",
                   f"data.dir={small_data}", f"output.results_dir={tmp_path / 'plain'}") == 0  # fmt: skip
    plain = (next((tmp_path / "plain").iterdir()) / "submit.sbatch").read_text()
    assert "--dependency" not in plain and "scontrol requeue" in plain
    capsys.readouterr()
    assert run_cli("submit", "bert", "--preset", "tiny", "--system", "local_cpu_2x1", "--chain", "2", "--nexp", "2",
                   "--dry-run", f"data.dir={small_data}", f"output.results_dir={tmp_path / 'x'}") == 2  # fmt: skip
    assert "--chain continues one run across jobs: use it with --nexp 1" in capsys.readouterr().out


@needs_two_nodes
def test_a_chain_of_two_jobs_continues_one_run_to_the_losses_of_an_uninterrupted_one(tiny_data, converged, tmp_path,
                                                                                    capsys):  # fmt: skip
    """Tiny BERT on 2 nodes x 1 rank (tbn1, tbn2, each its own network namespace) to its target, in a chain of two
    jobs: the time-limit warning (USR1) stops the first job after a checkpoint; the second (same name,
    --dependency=singleton) resumes it. The log is one compliant run that logs the true split, with the losses of one
    process at the same global batch (the `converged` run: 64 = 32 x 2 accumulation); each node samples telemetry."""
    code = run_cli("submit", "bert", "--preset", "tiny", "--system", "local_cpu_2x1", "--chain", "2",
                   f"data.dir={tiny_data}", f"output.results_dir={tmp_path}")  # fmt: skip
    assert code == 0
    assert "submitted job" in capsys.readouterr().out
    run_dir = next(tmp_path.iterdir())
    first, second = json.loads((run_dir / "job.json").read_text())["job_ids"]
    _wait_state(run_dir, {"RUNNING"}, timeout=120)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 300
    while not metrics.exists() or metrics.read_text().count("\n") < 3:
        if time.time() > deadline:
            pytest.fail("the first job logged nothing in 300 s")
        time.sleep(0.5)
    subprocess.run(["scancel", "--signal=USR1", first], check=True)  # as at the first job's time limit
    state = _wait_state(run_dir, {"COMPLETED", "FAILED"}, timeout=600)
    assert state["state"] == "COMPLETED" and state["job_id"] == second, state
    log = run_dir / "result_0.txt"
    keys = [json.loads(x.split(":::MLLOG ")[1])["key"] for x in log.read_text().splitlines() if ":::MLLOG" in x]
    assert keys.count("run_start") == 1 and keys.count("run_stop") == 1 and "trainbench_resumed" in keys
    run = json.loads((run_dir / "summary.json").read_text())["runs"][0]
    assert run["status"] == "success" and run["compliance"]["passed"], run
    assert run_cli("check", run_dir) == 0
    logged = _log_values(run_dir)
    assert (logged["global_batch_size"], logged["gradient_accumulation_steps"]) == (64, 1)
    ours, reference = _losses(run_dir), _losses(converged)
    assert sorted(ours) == sorted(reference) and max(abs(ours[s] - reference[s]) for s in ours) <= 1e-5
    hosts = sorted(p.name.split("_")[1] for p in run_dir.glob("telemetry_*_cpu.csv"))
    assert hosts == ["tbn1", "tbn2"], hosts  # each node samples its own
    assert run_cli("report", run_dir) == 0 and (run_dir / "report.html").exists()


def _rank_pids(job_id: str, node: str) -> list[int]:
    """The training processes (not srun, not slurmstepd) of this job on this node: every node of the test cluster
    shares this machine's process table."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or not (proc / "comm").read_text().startswith("python"):
                continue
            env = dict(v.split("=", 1) for v in (proc / "environ").read_text().split("\0") if "=" in v)
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if env.get("SLURM_JOB_ID") == job_id and env.get("SLURMD_NODENAME") == node and "SLURM_PROCID" in env:
            pids.append(int(proc.name))
    return pids


def _link(node: str, up: bool) -> None:
    """The host end of the node's veth (the local cluster's script names it tbv<i> for tbn<i>)."""
    subprocess.run(["ip", "link", "set", f"tbv{node.removeprefix('tbn')}", "up" if up else "down"], check=True)


def _cannot_cut_links() -> str | None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "taking a node's network link down needs root and `ip`"
    if subprocess.run(["ip", "link", "show", "tbv2"], capture_output=True).returncode != 0:
        return "no link tbv2: the two-node cluster is not the local-slurm script's"
    return None


@needs_two_nodes
def test_a_killed_rank_a_lost_node_and_the_time_limit_each_stop_the_job_and_the_run_resumes_to_the_same_losses(
    tiny_data, converged, tmp_path
):
    """Three stops in one run on two nodes, each ending with nothing lost and nothing looking finished.

    1. kill -9 of the rank on tbn2: the rank on tbn1 sees its peer's connection close, srun (--kill-on-bad-exit)
       ends the step, and the job is FAILED within seconds; `trainbench resubmit` continues from the checkpoint.
    2. tbn2 cut off the network: its rank's collective times out (distributed.timeout_s, 15 s here), and once tbn2
       is marked DOWN the job is NODE_FAIL, requeued by Slurm, and resumes when the node is back. Slurm marks a
       silent node DOWN after SlurmdTimeout (300 s by default); the test marks it itself, as a health check would.
    3. the time-limit warning (USR1) to every rank: each checkpoints, the job requeues itself and finishes.

    The final log is one compliant run (one run_start, one run_stop, three resumes) with the losses of one
    uninterrupted process (`converged`)."""
    if _cannot_cut_links() is not None:  # asked once the cluster is up
        pytest.skip(_cannot_cut_links())
    code = run_cli("submit", "bert", "--preset", "tiny", "--system", "local_cpu_2x1", f"data.dir={tiny_data}",
                   f"output.results_dir={tmp_path}", "checkpoint_every_steps=20",
                   "distributed.timeout_s=15")  # fmt: skip
    assert code == 0
    run_dir = next(tmp_path.iterdir())
    job_id = json.loads((run_dir / "job.json").read_text())["job_id"]
    checkpoint = run_dir / "checkpoint_0"
    metrics = run_dir / "metrics.jsonl"

    def last_step() -> int:
        return max((json.loads(r)["step"] for r in metrics.read_text().splitlines()), default=0)

    # 1. kill -9 of the rank on tbn2, once a checkpoint is saved and training has gone past it
    _wait_for("a checkpoint and step 30", lambda: checkpoint.exists() and last_step() >= 30, 300, run_dir)
    (victim,) = _rank_pids(job_id, "tbn2")
    os.kill(victim, 9)
    took = _wait_for("FAILED", lambda: json.loads((run_dir / "slurm_0.json").read_text())["state"] == "FAILED",
                     60, run_dir)  # fmt: skip
    assert took < 30, f"the job took {took:.1f} s to end after its rank on tbn2 was killed"
    assert not (run_dir / "result_0.txt").exists() and (run_dir / "result_0.txt.partial").exists()
    outcome = json.loads((run_dir / "run_0.json").read_text())
    assert outcome["status"] == "interrupted" and "`trainbench resubmit` of this results folder" in outcome["reason"]
    assert json.loads((run_dir / "summary.json").read_text())["runs"][0]["finished"] is False
    # Usually under a second. A job leaves the queue once every node has reported its processes gone: a rank caught
    # in uninterruptible I/O (a checkpoint's write on a busy disk) keeps it COMPLETING for up to Slurm's
    # UnkillableStepTimeout (60 s by default) after KillWait (5 s in the local cluster's slurm.conf).
    _wait_for("the failed job to leave the queue", lambda: not slurm._job_states([job_id]), 60 + 5 + 55, run_dir)
    assert run_cli("resubmit", run_dir) == 0
    second = json.loads((run_dir / "job.json").read_text())["job_id"]
    assert second != job_id and json.loads((run_dir / "slurm_0.json").read_text())["state"] in ("PENDING", "RUNNING")
    assert run_cli("resubmit", run_dir) == 2  # refused while its job is queued or running

    # 2. tbn2 loses its network link, once the resumed run has logged 4 more rows (40 steps: past a checkpoint)
    rows = len(metrics.read_text().splitlines())
    _wait_for("the resumed run to train on", lambda: len(metrics.read_text().splitlines()) >= rows + 4, 300, run_dir)
    (cut_off,) = _rank_pids(second, "tbn2")
    _link("tbn2", up=False)
    cut = time.time()
    try:
        subprocess.run(["scontrol", "update", "NodeName=tbn2", "State=DOWN", "Reason=link down"], check=True)
        _wait_for("NODE_FAIL", lambda: json.loads((run_dir / "slurm_0.json").read_text())["state"] == "NODE_FAIL",
                  60, run_dir)  # fmt: skip
        _wait_for("Slurm's requeue", lambda: slurm._job_states([second]) == {second: "PENDING"}, 60, run_dir)
        _wait_for("tbn2's rank to give up", lambda: not Path(f"/proc/{cut_off}").exists(), 60, run_dir)
        hung = time.time() - cut
        assert hung < 15 + 10, f"the cut-off rank waited {hung:.0f} s in a collective (timeout_s=15)"
        assert not (run_dir / "result_0.txt").exists()
    finally:
        _link("tbn2", up=True)
        subprocess.run(["scontrol", "update", "NodeName=tbn2", "State=RESUME"], check=True)
    _start_now(second)

    # 3. the time-limit warning (--signal=USR1@120), to every rank once the run trains again: each checkpoints, and
    # the job requeues itself on rank 0's marker. srun's exit code is 3 (every rank exited with it) or 143:
    # --kill-on-bad-exit may end the other ranks with SIGTERM once the first has exited with 3, after the checkpoint.
    _wait_for("RUNNING again", lambda: json.loads((run_dir / "slurm_0.json").read_text())["state"] == "RUNNING",
              120, run_dir)  # fmt: skip
    rows = len(metrics.read_text().splitlines())
    _wait_for("the run to train on", lambda: len(metrics.read_text().splitlines()) >= rows + 2, 300, run_dir)
    subprocess.run(["scancel", "--signal=USR1", second], check=True)
    assert _wait_state(run_dir, {"REQUEUED"}, timeout=120)["exit_code"] in (3, 143)
    _start_now(second)
    state = _wait_state(run_dir, {"COMPLETED", "FAILED"}, timeout=600)
    assert state["state"] == "COMPLETED", (run_dir / f"slurm-{second}.out").read_text()[-3000:]
    keys = [json.loads(x.split(":::MLLOG ")[1])["key"] for x in (run_dir / "result_0.txt").read_text().splitlines()
            if ":::MLLOG" in x]  # fmt: skip
    assert (keys.count("run_start"), keys.count("run_stop"), keys.count("trainbench_resumed")) == (1, 1, 3)
    run = json.loads((run_dir / "summary.json").read_text())["runs"][0]
    assert run["status"] == "success" and run["compliance"]["passed"], run
    assert run_cli("check", run_dir) == 0
    ours, reference = _losses(run_dir), _losses(converged)
    assert sorted(ours) == sorted(reference) and max(abs(ours[s] - reference[s]) for s in ours) <= 1e-5


def test_submit_starts_from_each_benchmarks_mlperf_shape_unless_told(tmp_path):
    from trainbench.benchmarks import BENCHMARKS
    from trainbench.resolve import load_run_config

    for name, bench in BENCHMARKS.items():
        assert bench.full_preset in bench.presets, name
    assert run_cli("submit", "llama2_70b_lora", "--system", "local_cpu_1x2", "--dry-run",
                   f"output.results_dir={tmp_path}") == 0  # fmt: skip
    _, cfg = load_run_config(next(tmp_path.iterdir()) / "config.yaml")
    assert cfg.preset == "llama2-70b" and cfg.model.num_layers == 80 and cfg.data.seq_length == 8192


def test_an_mpi_plugin_the_cluster_has_not_got_is_caught_before_submit(tmp_path, monkeypatch):
    import dataclasses

    folder = tmp_path / "srun-bin"
    folder.mkdir()
    tool = folder / "srun"
    tool.write_text("#!/bin/bash\nprintf 'MPI plugin types are...\\n\\tnone\\n\\tpmi2\\n\\tcray_shasta\\n'\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")
    system = load_system("local_cpu_2x1")
    slurm.check_mpi(system)  # pmi2: offered
    with pytest.raises(UserError, match=r"asks for srun --mpi=pmix but this cluster's srun offers cray_shasta, none, "
                                        r"pmi2 \(srun --mpi=list\); set mpi: in the system file"):  # fmt: skip
        slurm.check_mpi(dataclasses.replace(system, mpi="pmix"))


# -- a throughput measurement on a system (trainbench bench --system) ---------------------------------------------


def test_a_measurements_job_script_runs_each_rank_of_the_system_once_with_no_requeue(tmp_path):
    from trainbench.measure.bench import RANK
    from trainbench.resolve import build_config

    system = load_system("dgxh100_1x8")
    _, cfg = build_config("llama31_8b", "llama31-8b", [], {"device": "cuda"})
    run_dir = tmp_path / "a b; $(touch x)"
    script = slurm.render_bench_script(system, cfg, run_dir, ["trainbench", "bench", "llama31_8b"], "/venv/python",
                                       f'{RANK} "$RUN_DIR"')  # fmt: skip
    assert "#SBATCH --nodes=1" in script and "#SBATCH --gpus-per-node=8" in script
    assert "--requeue" not in script and "--signal" not in script and "--array" not in script
    sruns = [line for line in script.splitlines() if line.startswith("srun ")]
    worker = next(line for line in sruns if "trainbench.measure.bench" in line)
    assert worker.endswith('-m trainbench.measure.bench "$RUN_DIR"') and "--ntasks-per-node=8" in worker
    assert f"RUN_DIR='{run_dir}'" in script  # quoted: data, never code
    assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--system", "local_cpu_2x1", "--nproc", "2"], "--nproc and --system both say how many ranks"),
        (["--system", "local_cpu_2x1", "--compare", "hf"], "--compare hf runs in this process: drop --system"),
        (["--system", "no_such_system"], "no_such_system"),
    ],
)
def test_a_measurement_on_a_system_refuses_what_it_cannot_do_in_one_sentence(args, says, tmp_path, capsys):
    assert run_cli("bench", "llama31_8b", "--preset", "tiny", *args, f"output.results_dir={tmp_path / 'r'}") == 2
    assert says in _error(capsys)
    assert not (tmp_path / "r").exists()


@needs_two_nodes
def test_a_measurement_runs_as_one_job_a_depth_on_two_nodes(tmp_path, capsys):
    assert run_cli("bench", "llama31_8b", "--preset", "tiny", "--system", "local_cpu_2x1", "--steps", "2", "--warmup",
                   "1", "--blocks", "1,2", f"output.results_dir={tmp_path}", "telemetry_hz=0") == 0  # fmt: skip
    folder = next(tmp_path.iterdir())
    result = json.loads((folder / "bench.json").read_text())
    assert result["ranks"] == 2 and result["figures"] == "extrapolated" and result["device"] == "cpu"
    assert result["samples_per_s_per_rank"] == pytest.approx(result["samples_per_s"] / 2)
    assert result["nodes"] == 2 and result["tokens_per_s_per_node"] == pytest.approx(result["tokens_per_s"] / 2)
    assert sorted(result["raw"]) == ["1", "2"] and all(r["mean_loss"] > 0 for r in result["raw"].values())
    outputs = sorted(folder.glob("slurm-bench-*.out"))
    assert len(outputs) == 2  # one job a depth
    printed = capsys.readouterr().out
    assert "submitted job" in printed and "not a time-to-train result" in printed
    assert "-m trainbench.measure.bench" in (folder / "bench.sbatch").read_text()


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_a_stop_signal_while_a_measurement_job_runs_cancels_the_job(tmp_path, sig):
    """`trainbench bench --system` waits on `sbatch --wait`: SIGTERM or SIGHUP (`kill`, `timeout`, a closed terminal),
    as Ctrl-C, cancels the job, which would otherwise hold its nodes' GPUs to its time limit. Slurm's tools stood in
    for by scripts on PATH."""
    import os
    import signal
    import subprocess
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho '4321;cluster'\nexec sleep 60\n")
    (bin_dir / "scancel").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scancel.txt"}\n')
    for tool in ("sbatch", "scancel"):
        (bin_dir / tool).chmod(0o755)
    code = (
        "import types, sys; from pathlib import Path; import trainbench.launch.slurm as slurm\n"
        "slurm.render_bench_script = lambda *args: '#!/bin/sh\\n'\n"
        "say = lambda line: print(line, flush=True)\n"
        f"slurm.bench_job(types.SimpleNamespace(container=None), None, Path({str(tmp_path)!r}), [], say, 'x')\n"
    )
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        assert "submitted job 4321" in proc.stdout.readline()
        proc.send_signal(getattr(signal, sig))
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode != 0 and "job 4321 cancelled" in out, (out, err)
    assert (tmp_path / "scancel.txt").read_text().split() == ["4321"]
