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
from conftest import run_cli

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
    from trainbench.launch.systems import fit_micro_batch

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
        "#SBATCH --array=0-2",
        "#SBATCH --requeue",
        "#SBATCH --signal=USR1@120",
        "# layout 2x8x48x1",
    ]:
        assert line in script, line
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    for flag in ["--mpi=pmi2", "--gres=gpu:8", "--cpu-bind=none", "--container-image=nvcr.io#nvidia/pytorch:25.01-py3",
                 "--container-mounts=/lustre/fsw/mlperf:/data"]:  # fmt: skip
        assert flag in srun, flag
    assert "export TRAINBENCH_CPU_MAP='0-13,112-125;" in script
    assert "export NCCL_SOCKET_IFNAME='^docker,lo'" in script
    assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0
    assert "not submitted" in capsys.readouterr().out


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
    assert "--container-mounts=/a b:/c;$(touch PWNED4)" in args
    # The override is data in config.yaml, not text in the script.
    from trainbench.launch.local import load_run_config

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


def test_missing_container_image_is_caught_before_submit(tmp_path, small_data, capsys):
    system = tmp_path / "sq.yaml"
    system.write_text(f"nodes: 1\ntasks_per_node: 2\ndevice: cpu\ncontainer_image: {tmp_path / 'nope.sqsh'}\n")
    assert run_cli("submit", "bert", "--preset", "tiny", "--system", system, f"data.dir={small_data}") == 2
    assert "nope.sqsh" in _error(capsys) and not (Path("results").exists() and any(Path("results").glob("*-sq")))


def test_cpu_map_beyond_the_node_is_a_readable_error(monkeypatch):
    from trainbench.distributed import DistInfo
    from trainbench.launch.worker import bind_cpus

    monkeypatch.setenv("TRAINBENCH_CPU_MAP", f"0;{os.cpu_count() + 100}-{os.cpu_count() + 110}")
    info = DistInfo(rank=1, local_rank=1, world_size=2, device=None)
    with pytest.raises(UserError, match="should run on CPUs .* but this node offers only"):
        bind_cpus(info)


# -- a real Slurm ---------------------------------------------------------------------------------------------


def _slurm_ready() -> str | None:
    if shutil.which("sbatch") is None:
        return "sbatch is not installed (CI starts a local cluster with ../shared/scripts/local-slurm)"
    proc = subprocess.run(["sinfo", "-h", "-o", "%a"], capture_output=True, text=True)
    if proc.returncode != 0 or "up" not in proc.stdout:
        return f"no Slurm cluster answers sinfo ({(proc.stderr or proc.stdout).strip()[:100]})"
    return None


needs_slurm = pytest.mark.skipif(_slurm_ready() is not None, reason=str(_slurm_ready()))


def _wait_state(run_dir: Path, want: set[str], timeout: float) -> dict:
    path = run_dir / "slurm_0.json"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists():
            state = json.loads(path.read_text())
            if state["state"] in want:
                return state
        time.sleep(0.5)
    log = "".join(p.read_text() for p in run_dir.glob("slurm-*.out"))
    pytest.fail(f"job did not reach {want} in {timeout} s; its output:\n{log[-3000:]}")


@needs_slurm
def test_submit_tiny_bert_on_two_tasks_reaches_target_and_passes_compliance(tiny_data, tmp_path, capsys):
    code = run_cli("submit", "bert", "--preset", "tiny", "--system", "local_cpu_1x2", f"data.dir={tiny_data}",
                   f"output.results_dir={tmp_path}")  # fmt: skip
    assert code == 0
    assert "submitted job" in capsys.readouterr().out
    run_dir = next(tmp_path.iterdir())
    state = _wait_state(run_dir, {"COMPLETED", "FAILED"}, timeout=600)
    assert state["state"] == "COMPLETED", (run_dir / f"slurm-{state['job_id']}.out").read_text()[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    run = summary["runs"][0]
    assert run["status"] == "success" and run["compliance"]["passed"], run
    assert run_cli("check", run_dir) == 0


@needs_slurm
def test_submit_tiny_lora_on_two_tasks_reaches_the_mlperf_target(tmp_path, capsys):
    data = tmp_path / "data"
    assert run_cli("prepare", "llama2_70b_lora", "--synthetic", "--preset", "tiny", "--out", data) == 0
    code = run_cli("submit", "llama2_70b_lora", "--preset", "tiny", "--system", "local_cpu_1x2", f"data.dir={data}",
                   f"output.results_dir={tmp_path / 'results'}")  # fmt: skip
    assert code == 0 and "submitted job" in capsys.readouterr().out
    run_dir = next((tmp_path / "results").iterdir())
    state = _wait_state(run_dir, {"COMPLETED", "FAILED"}, timeout=600)
    assert state["state"] == "COMPLETED", (run_dir / f"slurm-{state['job_id']}.out").read_text()[-3000:]
    run = json.loads((run_dir / "summary.json").read_text())["runs"][0]
    assert run["status"] == "success" and run["compliance"]["passed"], run
    assert run_cli("check", run_dir) == 0


@needs_slurm
def test_cancelled_job_is_recorded_in_the_results_folder(small_data, tmp_path):
    code = run_cli("submit", "bert", "--preset", "tiny", "--system", "local_cpu_1x2", f"data.dir={small_data}",
                   f"output.results_dir={tmp_path}", "schedule.max_samples=10000000", "eval_samples=256")  # fmt: skip
    assert code == 0
    run_dir = next(tmp_path.iterdir())
    job_id = json.loads((run_dir / "job.json").read_text())["job_id"]
    _wait_state(run_dir, {"RUNNING"}, timeout=120)
    time.sleep(2)
    subprocess.run(["scancel", job_id], check=True)
    state = _wait_state(run_dir, {"CANCELLED"}, timeout=120)
    assert state["job_id"] == job_id
    deadline = time.time() + 60
    while time.time() < deadline and subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True,
                                                    text=True).stdout.strip():  # fmt: skip
        time.sleep(0.5)
    assert not (run_dir / "result_0.txt").exists()  # never looks finished


def test_python_running_the_jobs_is_this_one(small_data, tmp_path):
    assert run_cli("submit", "bert", "--preset", "tiny", "--system", "local_cpu_1x2", "--dry-run",
                   f"data.dir={small_data}", f"output.results_dir={tmp_path}", "eval_samples=256") == 0  # fmt: skip
    script = (next(tmp_path.iterdir()) / "submit.sbatch").read_text()
    assert f"PYTHON={sys.executable}" in script or f"PYTHON='{sys.executable}'" in script


@needs_slurm
def test_usr1_checkpoints_requeues_and_the_job_finishes_from_its_checkpoint(tiny_data, tmp_path):
    """What the time-limit warning (--signal=USR1@120) does: checkpoint, requeue, resume, finish."""
    code = run_cli("submit", "bert", "--preset", "tiny", "--system", "local_cpu_1x2", f"data.dir={tiny_data}",
                   f"output.results_dir={tmp_path}", "log_every_steps=1")  # fmt: skip
    assert code == 0
    run_dir = next(tmp_path.iterdir())
    job_id = json.loads((run_dir / "job.json").read_text())["job_id"]
    _wait_state(run_dir, {"RUNNING"}, timeout=120)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 300
    while not metrics.exists() or metrics.read_text().count("\n") < 10:
        if time.time() > deadline:
            pytest.fail(
                "the job logged fewer than 10 steps in 300 s: "
                + "".join(p.read_text() for p in run_dir.glob("slurm-*.out"))[-2000:]
            )
        time.sleep(0.5)
    subprocess.run(["scancel", "--signal=USR1", job_id], check=True)  # to every rank, as at the time limit
    # Requeued on rank 0's marker. srun's exit code is 3 (every rank exited with it) or 143: --kill-on-bad-exit
    # may end the other rank with SIGTERM once the first has exited with 3, after the checkpoint was written.
    assert _wait_state(run_dir, {"REQUEUED"}, timeout=120)["exit_code"] in (3, 143)
    # Slurm holds a requeued job for a while (BeginTime) before it starts again.
    state = _wait_state(run_dir, {"COMPLETED", "FAILED"}, timeout=600)
    assert state["state"] == "COMPLETED"
    log = (run_dir / "result_0.txt").read_text()
    assert log.count('"key": "trainbench_resumed"') == 1 and log.count('"key": "run_start"') == 1
    run = json.loads((run_dir / "summary.json").read_text())["runs"][0]
    assert run["status"] == "success" and run["compliance"]["passed"], run


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
