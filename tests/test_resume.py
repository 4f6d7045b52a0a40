"""Checkpoints and resume: a run killed with SIGKILL and resumed trains exactly like one never stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import only_run_dir, read_metrics, run_cli

from trainbench.mlperf import check_compliance

RUN = [
    "progress=false",
    "log_every_steps=1",
    "checkpoint_every_steps=10",
    "schedule.max_samples=3200",  # 50 steps of 64
    "eval.every_samples=1600",
    "eval_samples=256",
]


def losses(run_dir: Path) -> dict[int, float]:
    """Loss by step; after a resume the steps past the checkpoint appear twice, the later row wins."""
    return {row["step"]: row["loss"] for row in read_metrics(run_dir) if "loss" in row}


def events(log: Path) -> list[dict]:
    return [json.loads(line.split(":::MLLOG", 1)[1]) for line in log.read_text().splitlines() if ":::MLLOG" in line]


def wait_for(predicate, what: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    pytest.fail(f"{what} did not happen within {timeout} s")


def kill_after_checkpoint(command: list[str], run_dir: Path, step: int) -> int:
    """Start ``command`` (a run writing into ``run_dir``), SIGKILL it once a checkpoint at ``step`` or later exists;
    returns the step of the checkpoint it left."""
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    meta = run_dir / "checkpoint_0" / "meta.json"
    try:
        wait_for(lambda: meta.exists() and json.loads(meta.read_text())["step"] >= step, f"a checkpoint at step {step}")
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    return json.loads(meta.read_text())["step"]


@pytest.mark.full
def test_sigkilled_run_resumes_with_the_losses_of_an_uninterrupted_run(small_data, tmp_path):
    reference = tmp_path / "reference"
    assert run_cli("run", "bert", f"data.dir={small_data}", f"output.results_dir={reference}", *RUN) == 1
    expected = losses(only_run_dir(reference))
    assert sorted(expected) == list(range(1, 51))

    killed = tmp_path / "killed"
    command = [sys.executable, "-m", "trainbench", "run", "bert", f"data.dir={small_data}", *RUN]
    stopped_at = kill_after_checkpoint([*command, f"output.run_dir={killed}"], killed, 20)
    assert stopped_at < 50 and (killed / "result_0.txt.partial").exists()

    assert run_cli("run", "bert", f"data.dir={small_data}", f"output.run_dir={killed}", "resume=true") == 1
    resumed = losses(killed)
    assert sorted(resumed) == list(range(1, 51))
    for step in range(stopped_at + 1, 51):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), step
    # The log is one run: one run_start, the resume marked, one run_stop, and it passes the checker.
    log = killed / "result_0.txt"
    keys = [e["key"] for e in events(log)]
    assert keys.count("run_start") == 1 and keys.count("run_stop") == 1
    marks = [e for e in events(log) if e["key"] == "trainbench_resumed"]
    assert len(marks) == 1 and marks[0]["metadata"]["step"] == stopped_at
    assert json.loads((killed / "run_0.json").read_text())["steps"] == 50
    # 50 steps stop short of the target; that must be the checker's only complaint.
    result = check_compliance(log, "5.0.0")
    complaints = [ln for ln in result.output.splitlines() if "Failed" in ln or "Required" in ln or "Unknown" in ln]
    assert len(complaints) == 1 and "eval_accuracy" in complaints[0], result.output[-2000:]


@pytest.mark.full
@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGINT], ids=["SIGUSR1", "SIGINT"])
def test_a_stop_signal_checkpoints_and_stops_then_resume_finishes(small_data, tmp_path, sig):
    """Slurm's SIGUSR1 and a Ctrl-C (SIGINT) alike: checkpoint, stop with the run unfinished and saying why."""
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "trainbench", "run", "bert", f"data.dir={small_data}", *RUN[:1], *RUN[2:]]
    proc = subprocess.Popen(
        [*command, "log_every_steps=1", "checkpoint_every_steps=0", f"output.run_dir={run_dir}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = run_dir / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 3, "three logged steps")
    proc.send_signal(sig)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 3, output  # preempted: checkpoint saved, run not over
    assert "checkpoint saved" in output and "resume=true" in output and "Traceback" not in output
    assert (run_dir / "checkpoint_0" / "meta.json").exists()
    assert (run_dir / "result_0.txt.partial").exists() and not (run_dir / "result_0.txt").exists()
    assert "run_stop" not in (run_dir / "result_0.txt.partial").read_text()
    outcome = json.loads((run_dir / "run_0.json").read_text())
    assert outcome["status"] == "interrupted" and "stopped by a signal" in outcome["reason"]
    assert run_cli("run", "bert", f"data.dir={small_data}", f"output.run_dir={run_dir}", "resume=true") == 1
    assert json.loads((run_dir / "run_0.json").read_text())["samples"] == 3200


@pytest.mark.full
def test_the_printed_resume_command_works_with_relative_paths(lora_data, tmp_path):
    """Stopped by a signal, a run started with a relative data.dir and results folder is continued by the command the
    console prints (the same command plus resume=true, from the same folder) and finishes at its target, compliant:
    the saved paths are absolute, the given ones are compared resolved."""
    work = tmp_path / "work"
    work.mkdir()
    data = os.path.relpath(lora_data, work)
    command = [sys.executable, "-m", "trainbench", "run", "llama2_70b_lora", f"data.dir={data}",
               "output.results_dir=results", "progress=false", "log_every_steps=1", "checkpoint_every_steps=0",
               "telemetry_hz=0"]  # fmt: skip
    proc = subprocess.Popen(command, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: any(p.read_text().count("\n") >= 3 for p in (work / "results").glob("*/metrics.jsonl")),
             "three logged steps")  # fmt: skip
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 3 and "continue with the same command plus resume=true" in output, output
    resumed = subprocess.run([*command, "resume=true"], cwd=work, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    run_dir = only_run_dir(work / "results")
    run = json.loads((run_dir / "summary.json").read_text())["runs"][0]
    assert run["status"] == "success" and run["compliance"]["passed"], run
    assert "trainbench_resumed" in (run_dir / "result_0.txt").read_text()


def test_resume_with_nothing_to_resume_is_a_clear_error(small_data, tmp_path, capsys):
    code = run_cli("run", "bert", f"data.dir={small_data}", f"output.results_dir={tmp_path / 'none'}", "resume=true")
    assert code == 2
    assert "no bert/tiny run folder" in capsys.readouterr().out


def _unfinished(run_dir: Path, cause: str) -> None:
    """The run is left as not finished: its log without run_stop under its unfinished name, the cause named."""
    assert (run_dir / "result_0.txt.partial").exists() and not (run_dir / "result_0.txt").exists()
    assert "run_stop" not in (run_dir / "result_0.txt.partial").read_text()
    outcome = json.loads((run_dir / "run_0.json").read_text())
    assert outcome["status"] == "interrupted" and cause in outcome["reason"], outcome["reason"]


def _resumed_once(small_data, run_dir: Path) -> None:
    assert run_cli("run", "bert", f"data.dir={small_data}", f"output.run_dir={run_dir}", "resume=true") == 1
    keys = [e["key"] for e in events(run_dir / "result_0.txt")]
    assert keys.count("run_start") == 1 and keys.count("run_stop") == 1 and keys.count("trainbench_resumed") == 1
    assert keys.count("eval_start") == keys.count("eval_stop")
    assert not (run_dir / "result_0.txt.partial").exists()
    assert json.loads((run_dir / "run_0.json").read_text())["samples"] == 1280


SHORT = ["progress=false", "log_every_steps=1", "checkpoint_every_steps=4", "schedule.max_samples=1280",
         "eval.every_samples=640", "eval_samples=256", "telemetry_hz=0"]  # fmt: skip


@pytest.mark.full
def test_an_error_mid_run_leaves_it_unfinished_naming_the_cause_and_resume_continues(
    small_data, tmp_path, monkeypatch, capsys
):
    """A full disk at step 10: one sentence, the log left unfinished, run_0.json naming the cause; resume goes on."""
    import errno

    from trainbench.train import duties

    record, calls = duties.Metrics.record, []

    def full_disk(self, step, samples, row):
        calls.append(step)
        if step == 10:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.file.name))
        record(self, step, samples, row)

    run_dir = tmp_path / "run"
    monkeypatch.setattr(duties.Metrics, "record", full_disk)
    assert run_cli("run", "bert", f"data.dir={small_data}", f"output.run_dir={run_dir}", *SHORT) == 1
    out = capsys.readouterr().out
    assert "error: No space left on device" in out and "Traceback" not in out
    _unfinished(run_dir, "No space left on device")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["runs"][0]["finished"] is False and "No space left" in summary["runs"][0]["stopped"]
    monkeypatch.setattr(duties.Metrics, "record", record)
    _resumed_once(small_data, run_dir)


@pytest.mark.full
def test_a_kill_between_run_stop_and_the_final_name_leaves_the_run_unfinished(small_data, tmp_path, monkeypatch):
    """The finish is atomic: killed as the finished log is renamed, the run stays unfinished (no run_stop in the
    log it keeps), and resume ends it with exactly one run_stop."""
    from trainbench.train import record

    replace = os.replace

    def killed(src, dst):
        if str(dst).endswith("result_0.txt"):
            raise KeyboardInterrupt
        replace(src, dst)

    run_dir = tmp_path / "run"
    monkeypatch.setattr(record.os, "replace", killed)
    assert run_cli("run", "bert", f"data.dir={small_data}", f"output.run_dir={run_dir}", *SHORT) == 130
    _unfinished(run_dir, "Ctrl-C")
    monkeypatch.setattr(record.os, "replace", replace)
    _resumed_once(small_data, run_dir)


@pytest.mark.full
def test_a_rank_killed_mid_run_ends_the_job_unfinished_and_resume_continues(small_data, tmp_path):
    """kill -9 of rank 1 of 2: rank 0 stops within seconds (its collective fails), the run is left unfinished with
    the cause, and resuming on 2 ranks ends it."""
    import psutil

    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "trainbench", "run", "bert", "--nproc", "2", f"data.dir={small_data}",
               f"output.run_dir={run_dir}", "micro_batch_size=32", *SHORT]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    meta = run_dir / "checkpoint_0" / "meta.json"
    try:
        wait_for(lambda: meta.exists() and json.loads(meta.read_text())["step"] >= 4, "a checkpoint at step 4")
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if "trainbench.launch.worker" in " ".join(p.cmdline())]  # fmt: skip
        (rank1,) = [p for p in workers if p.environ().get("RANK") == "1"]
        rank1.kill()
        started = time.time()
        output, _ = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert time.time() - started < 60 and proc.returncode not in (0, None), output
    assert "failed under torchrun" in output and "resume=true" in output
    _unfinished(run_dir, "stopped by")
    assert run_cli("run", "bert", "--nproc", "2", f"data.dir={small_data}", f"output.run_dir={run_dir}",
                   "resume=true") == 1  # fmt: skip
    keys = [e["key"] for e in events(run_dir / "result_0.txt")]
    assert keys.count("run_start") == 1 and keys.count("run_stop") == 1
