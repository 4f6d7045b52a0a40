"""A run folder is never trained in by two processes, nor overwritten: a new run refuses a folder that holds a run,
resume=true refuses a folder without one, and a stop signal sent to a launcher of several ranks reaches every rank,
which checkpoints and stops before the launcher ends and gives the folder up."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import read_metrics, run_cli
from test_resume import events, wait_for

from trainbench.mlperf import check_compliance

QUICK = ["progress=false", "telemetry_hz=0", "eval_samples=256", "eval.every_samples=320", "schedule.max_samples=320"]


def one_error(code: int, printed: str) -> str:
    """The refusal: exit code 2 and one line, ``error: ...``; returns that line."""
    lines = [ln for ln in printed.strip().splitlines() if ln.strip()]
    assert code == 2 and "Traceback" not in printed and len(lines) == 1 and lines[0].startswith("error:"), printed
    return lines[0]


def contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_new_run_into_a_folder_that_holds_a_run_is_refused_and_leaves_every_file_as_it_was(
    converged, small_data, tmp_path, capsys
):
    finished = Path(shutil.copytree(converged, tmp_path / "run"))  # a run that ended, compliant
    before = contents(finished)
    capsys.readouterr()
    code = run_cli("run", "bert", f"data.dir={small_data}", f"output.run_dir={finished}", *QUICK)
    error = one_error(code, capsys.readouterr().out)
    assert f"output.run_dir={finished} already holds a run" in error and "resume=true" in error, error
    assert contents(finished) == before


@pytest.mark.parametrize("made", [False, True], ids=["no-folder", "an-empty-folder"])
def test_resume_where_there_is_no_run_is_refused_and_makes_nothing(small_data, tmp_path, capsys, made):
    run_dir = tmp_path / "typo"
    if made:
        run_dir.mkdir()
    code = run_cli("run", "bert", f"data.dir={small_data}", f"output.run_dir={run_dir}", "resume=true", *QUICK[:1])
    error = one_error(code, capsys.readouterr().out)
    assert "no run to resume" in error and "without resume=true" in error, error
    assert (list(run_dir.iterdir()) == []) if made else not run_dir.exists()


def two_rank_run(data: Path, run_dir: Path, *keys: str) -> subprocess.Popen:
    """`trainbench run bert --nproc 2` into ``run_dir``, started; returns once it has logged three steps."""
    command = [sys.executable, "-m", "trainbench", "run", "bert", "--nproc", "2", f"data.dir={data}",
               f"output.run_dir={run_dir}", "progress=false", "telemetry_hz=0", "log_every_steps=1", *keys]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = run_dir / "metrics.jsonl"
    wait_for(lambda: proc.poll() is not None or (metrics.exists() and metrics.read_text().count('"loss"') >= 3),
             "three logged steps", timeout=180)  # fmt: skip
    assert proc.poll() is None, proc.communicate()[0]
    return proc


def ranks_of(launcher: subprocess.Popen) -> list:
    import psutil

    return [p for p in psutil.Process(launcher.pid).children(recursive=True)
            if "trainbench.launch.worker" in p.cmdline() and "torch.distributed.run" not in p.cmdline()]  # fmt: skip


def resume(run_dir: Path, timeout: float = 600) -> tuple[int, str]:
    """resume=true of ``run_dir`` in a process of its own: its exit code and what it printed. One still running after
    ``timeout`` is ended with every process it started."""
    import psutil

    proc = subprocess.Popen([sys.executable, "-m", "trainbench", "run", "bert", f"output.run_dir={run_dir}",
                             "resume=true"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        printed = proc.communicate(timeout=timeout)[0]
        return proc.returncode, printed
    except subprocess.TimeoutExpired:
        for child in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
            child.kill()
        proc.wait()
        pytest.fail(f"resume=true of {run_dir} still ran after {timeout} s: it was not refused")


@pytest.mark.full
def test_sigterm_to_a_two_rank_launcher_stops_every_rank_with_a_checkpoint_and_resume_ends_the_log_whole(
    small_data, tmp_path
):
    run_dir = tmp_path / "run"
    launcher = two_rank_run(small_data, run_dir, "checkpoint_every_steps=0", "schedule.max_samples=3200",
                            "eval.every_samples=640", "eval_samples=256")  # fmt: skip
    ranks = ranks_of(launcher)
    assert len(ranks) == 2
    launcher.send_signal(signal.SIGTERM)
    try:
        output, _ = launcher.communicate(timeout=180)
    finally:
        launcher.kill()
        for rank in ranks:
            if rank.is_running():
                rank.kill()
    assert launcher.returncode == 3, output  # preempted: a checkpoint saved, the run not over
    assert not [rank.pid for rank in ranks if rank.is_running()], "a rank outlived its launcher"
    assert (run_dir / "checkpoint_0" / "meta.json").exists() and (run_dir / "result_0.txt.partial").exists()
    stopped_at = json.loads((run_dir / "checkpoint_0" / "meta.json").read_text())["step"]

    code, printed = resume(run_dir)
    assert code == 1, printed[-3000:]  # 3,200 samples end the run short of the target: aborted
    run = json.loads((run_dir / "summary.json").read_text())["runs"][0]
    assert run["status"] == "aborted" and run["samples"] == 3200, run
    steps = [row["step"] for row in read_metrics(run_dir) if "loss" in row]
    assert stopped_at in steps and steps == sorted(set(steps)) == list(range(1, 51)), steps  # none logged twice
    log = run_dir / "result_0.txt"
    evals = [e["metadata"]["epoch_num"] for e in events(log) if e["key"] == "eval_accuracy"]
    assert evals == [640, 1280, 1920, 2560, 3200] and [s for s, _ in run["evals"]] == evals, (evals, run["evals"])
    keys = [e["key"] for e in events(log)]
    assert keys.count("run_start") == 1 and keys.count("run_stop") == 1 and keys.count("trainbench_resumed") == 1
    # Short of the target, that must be the checker's only complaint: none about the stop or the resume.
    result = check_compliance(log, "5.0.0")
    complaints = [ln for ln in result.output.splitlines() if "Failed" in ln or "Required" in ln or "Unknown" in ln]
    assert len(complaints) == 1 and "eval_accuracy" in complaints[0], result.output[-2000:]


@pytest.mark.full
def test_while_the_ranks_of_a_run_live_a_resume_is_refused_even_with_their_launcher_gone(small_data, tmp_path):
    run_dir = tmp_path / "run"
    launcher = two_rank_run(small_data, run_dir, "schedule.max_samples=64000", "eval.every_samples=32000",
                            "eval_samples=256")  # fmt: skip
    ranks = ranks_of(launcher)
    try:
        code, printed = resume(run_dir, timeout=120)
        error = one_error(code, printed)
        assert f"{run_dir} is in use" in error and f"process {launcher.pid}" in error, error

        os.kill(launcher.pid, signal.SIGKILL)  # no launcher left to stop them: the ranks train on
        launcher.wait()
        time.sleep(1)
        assert all(rank.is_running() for rank in ranks)
        code, printed = resume(run_dir, timeout=120)
        error = one_error(code, printed)
        assert f"{run_dir} is in use" in error and "2 ranks of run 0" in error, error
    finally:
        launcher.kill()
        for rank in ranks:
            if rank.is_running():
                rank.kill()


def test_a_stop_signal_to_a_process_running_a_child_to_its_end_ends_the_child_and_what_it_started(tmp_path):
    """launch.local.run_to_end (a measurement's torchrun, a layout probe): SIGTERM sent to the parent alone reaches the
    child; a grandchild that its parent left running (a rank whose torchrun was killed) is ended too."""
    import psutil

    grandchild = tmp_path / "grandchild.pid"
    child = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
             f"time.sleep(600)'], start_new_session=True); open({str(grandchild)!r}, 'w').write(str(p.pid)); "
             "time.sleep(600)")  # fmt: skip
    parent = ("import sys; from trainbench.errors import UserError; from trainbench.launch.local import run_to_end\n"
              f"try: run_to_end([sys.executable, '-c', {child!r}], what='the test child')\n"
              "except UserError as e: print(e); sys.exit(7)\n")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    wait_for(lambda: grandchild.exists() and grandchild.read_text() != "", "the grandchild started", timeout=60)
    time.sleep(0.5)  # the parent sees it among its child's processes (it looks every 0.2 s)
    started = [p for p in psutil.Process(proc.pid).children(recursive=True)]
    assert len(started) == 2
    proc.send_signal(signal.SIGTERM)  # to the parent alone, as `timeout` or `kill` sends it
    printed = proc.communicate(timeout=60)[0]
    assert proc.returncode == 7 and "the test child was stopped by SIGTERM" in printed, printed
    assert not [p.pid for p in started if p.is_running()], "a process outlived the one that started it"


@pytest.mark.full
def test_sigterm_to_a_two_rank_measurement_ends_its_torchrun_and_ranks_in_one_sentence(tmp_path):
    """`trainbench bench --nproc 2` stopped by a signal to its own process (`timeout`, `kill`): its ranks do not go on
    holding the GPUs."""
    import psutil

    command = [sys.executable, "-m", "trainbench", "bench", "llama31_8b", "--preset", "tiny", "--nproc", "2",
               "--steps", "100000", "--warmup", "1", "progress=false", "telemetry_hz=0",
               f"output.results_dir={tmp_path / 'r'}"]  # fmt: skip
    bench = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def ranks() -> list:
        with contextlib.suppress(psutil.Error):
            return [
                p
                for p in psutil.Process(bench.pid).children(recursive=True)
                if "trainbench.measure.bench" in p.cmdline() and "torch.distributed.run" not in p.cmdline()
            ]
        return []

    wait_for(lambda: bench.poll() is not None or len(ranks()) == 2, "two ranks started", timeout=180)
    assert bench.poll() is None, bench.communicate()[0]
    started = psutil.Process(bench.pid).children(recursive=True)
    time.sleep(5)  # into their imports or steps
    bench.send_signal(signal.SIGTERM)
    try:
        printed = bench.communicate(timeout=120)[0]
    finally:
        for p in started:
            with contextlib.suppress(psutil.Error):
                p.kill()
    assert bench.returncode != 0 and "was stopped by SIGTERM" in printed, printed[-3000:]
    assert "Traceback" not in printed.split("was stopped by")[-1]
    assert not [p.pid for p in started if p.is_running()], "a rank or torchrun outlived the measurement"
