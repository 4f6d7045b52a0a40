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


def test_sigkilled_run_resumes_with_the_losses_of_an_uninterrupted_run(small_data, tmp_path):
    reference = tmp_path / "reference"
    assert run_cli("run", "bert", f"data.dir={small_data}", f"output.results_dir={reference}", *RUN) == 1
    expected = losses(only_run_dir(reference))
    assert sorted(expected) == list(range(1, 51))

    killed = tmp_path / "killed"
    command = [sys.executable, "-m", "trainbench", "run", "bert", f"data.dir={small_data}", *RUN]
    proc = subprocess.Popen(
        [*command, f"output.run_dir={killed}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    meta = killed / "checkpoint_0" / "meta.json"
    try:
        wait_for(lambda: meta.exists() and json.loads(meta.read_text())["step"] >= 20, "a checkpoint at step 20")
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    stopped_at = json.loads(meta.read_text())["step"]
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


def test_sigusr1_checkpoints_and_stops_then_resume_finishes(small_data, tmp_path):
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
    proc.send_signal(signal.SIGUSR1)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 3, output  # preempted: checkpoint saved, run not over
    assert "checkpoint saved" in output and "resume=true" in output
    assert (run_dir / "checkpoint_0" / "meta.json").exists()
    assert (run_dir / "result_0.txt.partial").exists() and not (run_dir / "result_0.txt").exists()
    assert run_cli("run", "bert", f"data.dir={small_data}", f"output.run_dir={run_dir}", "resume=true") == 1
    assert json.loads((run_dir / "run_0.json").read_text())["samples"] == 3200


def test_resume_with_nothing_to_resume_is_a_clear_error(small_data, tmp_path, capsys):
    code = run_cli("run", "bert", f"data.dir={small_data}", f"output.results_dir={tmp_path / 'none'}", "resume=true")
    assert code == 2
    assert "no bert/tiny run folder" in capsys.readouterr().out
