"""A run that ended stays ended: every thread a rank starts is joined before the process exits, and a rank that
crashes on its way out after run_stop does not turn a whole result into a failed run.

A daemon thread still inside torch's C++ code when the interpreter exits is ended by a forced unwind that aborts the
process ("terminate called without an active exception", exit -6). The batch prefetcher's thread did exactly that
to rank 1 of 2-rank CPU runs under load, after the run's last eval."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from conftest import only_run_dir, run_cli

from trainbench.data.prefetch import prefetch
from trainbench.launch import slurm
from trainbench.runfiles import RunFiles


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "prefetch"]


def test_leaving_the_prefetcher_early_joins_its_thread_and_stops_producing():
    produced = []

    def slow():
        for i in itertools.count():
            time.sleep(0.02)
            produced.append(i)
            yield i

    for depth in (1, 3):
        produced.clear()
        for item in prefetch(slow(), depth):
            if item == 2:
                break  # as the loop leaves at its last eval
        assert not _prefetch_threads()
        count = len(produced)
        time.sleep(0.1)
        assert len(produced) == count, "the producer went on after the consumer left"


def test_an_error_in_the_producer_reaches_the_consumer_and_the_thread_ends():
    def failing():
        yield 1
        raise ValueError("a corrupt shard")

    with pytest.raises(ValueError, match="a corrupt shard"):
        list(prefetch(failing(), 1))
    assert not _prefetch_threads()


def test_a_process_that_leaves_the_prefetcher_over_torch_work_exits_cleanly(tmp_path):
    """The producer is busy in torch's C++ code (the GIL released) when the consumer leaves and the process exits.
    With the thread left running, this aborted on every try."""
    script = tmp_path / "leave.py"
    script.write_text(
        textwrap.dedent("""
        import torch
        from trainbench.data.prefetch import prefetch

        def batches():
            x = torch.randn(256, 256)
            while True:
                for _ in range(20):
                    x = torch.tanh(x @ x)
                yield x

        for i, _ in enumerate(prefetch(batches(), 2)):
            if i == 3:
                break
    """)
    )
    for _ in range(5):
        proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "terminate called" not in proc.stderr, (proc.returncode, proc.stderr[-2000:])


def test_a_rank_leaves_with_its_code_and_its_output_flushed_without_finalization(tmp_path):
    """A rank ends through ``distributed.leave``: a Gloo worker thread freeing a finished collective's tensors while
    the interpreter finalizes aborts the process, so a rank never reaches finalization (atexit's handlers stand in
    for it here), yet what it printed and logged is kept and its exit code is the one it gave."""
    log = tmp_path / "rank.log"
    script = textwrap.dedent(f"""
        import atexit, logging
        from trainbench.distributed import leave

        atexit.register(lambda: print("finalized"))
        logger = logging.getLogger("rank")
        logger.addHandler(logging.FileHandler({str(log)!r}))
        logger.warning("logged")
        print("printed", end="")
        leave(3)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout) == (3, "printed"), (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert log.read_text() == "logged\n"


# -- a crash after run_stop ----------------------------------------------------------------------------------------

QUICK = ["progress=false", "telemetry_hz=0", "eval_samples=256", "eval.every_samples=320", "schedule.max_samples=320"]


def _abort_at_exit_on_rank_1(tmp_path: Path) -> str:
    """A sitecustomize that aborts rank 1 of any torchrun child as its process ends (``os._exit``, which
    ``distributed.leave`` ends a rank with): after the rank's work, its run_stop, its process group's end and its
    return code, as a library's thread at exit would."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\nif os.environ.get('RANK') == '1':\n    os._exit = lambda code: os.abort()\n"
    )
    return os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))


@pytest.mark.full
def test_a_rank_that_crashes_after_run_stop_leaves_the_result_standing(small_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PYTHONPATH", _abort_at_exit_on_rank_1(tmp_path))
    code = run_cli("run", "bert", "--preset", "tiny", "--nproc", "2", f"data.dir={small_data}",
                   f"output.results_dir={tmp_path / 'r'}", *QUICK)  # fmt: skip
    printed = capsys.readouterr().out
    run_dir = only_run_dir(tmp_path / "r")
    assert "after the run had ended (its log holds run_stop): a rank crashed on its way out" in printed, printed[-3000:]
    outcome = json.loads((run_dir / "run_0.json").read_text())
    assert RunFiles(run_dir, 0).finished and outcome["status"] == "aborted"  # 320 samples: short of the target
    assert code == 1  # an aborted run's exit code, as without the crash; not the launcher's failure
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["runs"][0]["status"] == "aborted" and "failed under torchrun" not in printed


@pytest.mark.full
def test_a_rank_that_crashes_after_the_figures_are_written_leaves_the_measurement_standing(tmp_path, monkeypatch,
                                                                                          capsys):  # fmt: skip
    monkeypatch.setenv("PYTHONPATH", _abort_at_exit_on_rank_1(tmp_path))
    code = run_cli("bench", "bert", "--preset", "tiny", "--nproc", "2", "--steps", "2", "--warmup", "1",
                   f"output.results_dir={tmp_path / 'r'}", "progress=false", "telemetry_hz=0")  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed[-3000:]
    assert "after rank 0 had written the figures" in printed and "a rank failed after them" in printed, printed[-3000:]
    result = json.loads((only_run_dir(tmp_path / "r") / "bench.json").read_text())
    assert result["tokens_per_s"] > 0


def test_the_slurm_job_of_a_run_whose_log_holds_run_stop_completes_whatever_a_rank_exited_with(converged, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(converged, run_dir)
    assert slurm.finish(run_dir, 0, 134) == 0
    state = json.loads((run_dir / "slurm_0.json").read_text())
    assert state["state"] == "COMPLETED" and state["exit_code"] == 134
    (run_dir / "result_0.txt").rename(run_dir / "result_0.txt.partial")  # the run did not end
    assert slurm.finish(run_dir, 0, 134) == 134
    assert json.loads((run_dir / "slurm_0.json").read_text())["state"] == "FAILED"


# -- the 2-rank LoRA run of the report, repeated under load ---------------------------------------------------------


@pytest.mark.full
def test_two_rank_lora_runs_end_cleanly_with_the_cpu_loaded(lora_data, tmp_path):
    """The case that lost its result under load: a 2-rank FSDP LoRA run on the CPU ends at its last eval while its
    prefetcher is mid-batch. Repeated with two busy processes competing for the cores."""
    data = lora_data
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        for attempt in range(3):
            out = tmp_path / f"r{attempt}"
            proc = subprocess.run(
                [sys.executable, "-m", "trainbench", "run", "llama2_70b_lora", "--nproc", "2", f"data.dir={data}",
                 f"output.results_dir={out}", "progress=false", "telemetry_hz=0", "log_every_steps=1",
                 "eval.every_samples=32", "schedule.max_samples=128", "model.lora_dropout=0"],
                capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            printed = proc.stdout + proc.stderr
            assert "terminate called" not in printed and "failed under torchrun" not in printed, printed[-3000:]
            assert proc.returncode == 1 and RunFiles(only_run_dir(out), 0).finished, printed[-3000:]  # aborted
    finally:
        for p in load:
            p.kill()
            p.wait()


def test_after_an_error_nccl_is_aborted_not_flushed_and_a_stuck_abort_ends_the_rank(monkeypatch):
    """torch's destroy_process_group lets NCCL's collectives in flight finish first, and one a failed rank left its
    peers waiting in never does: after an error the communicators are aborted instead (stood in for here: the CPU
    has no NCCL), and an abort that itself hangs ends the rank with exit code 1 after the wait, not never."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from trainbench import distributed

    calls, stuck = [], threading.Event()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.append("destroy"))
    monkeypatch.setattr(dist, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(c10d, "_abort_process_group", lambda: calls.append("abort"))
    distributed.shutdown()
    assert calls == ["abort"]

    calls.clear()
    distributed.shutdown(drain=True)  # every rank ended normally: flushed, as before
    assert calls == ["barrier", "destroy"]

    calls.clear()
    monkeypatch.setattr(dist, "get_backend", lambda: "gloo")
    distributed.shutdown()  # gloo's destroy does not wait for its peers
    assert calls == ["destroy"]

    monkeypatch.setattr(dist, "get_backend", lambda: "nccl")
    monkeypatch.setattr(c10d, "_abort_process_group", stuck.wait)
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    began = time.monotonic()
    distributed.shutdown(abort_wait_s=0.2)
    assert exits == [1] and time.monotonic() - began < 5
    stuck.set()


def test_what_other_ranks_said_is_named_once_with_how_many_said_it(tmp_path):
    from trainbench.runfiles import other_ranks_error, rank_error

    assert other_ranks_error(tmp_path, "run0") == ""
    rank_error(tmp_path, "run0", 3).write_text("the shard is short\n")
    rank_error(tmp_path, "run0", 1).write_text("the shard is short\n")
    rank_error(tmp_path, "run0", 2).write_text("something else\n")
    rank_error(tmp_path, "run1", 1).write_text("another run's\n")
    (tmp_path / "error_run0_rankX.txt").write_text("not a rank's\n")
    assert other_ranks_error(tmp_path, "run0") == "rank 1 (and 1 more rank): the shard is short"
    assert other_ranks_error(tmp_path, "run1") == "rank 1: another run's"


_RANK_ONE_FAILS = """
import os
if os.environ.get("RANK") == "1":
    import trainbench.measure.throughput
    import trainbench.train.loop
    from trainbench.errors import UserError

    def fail(*args, **kwargs):
        raise UserError("rank 1 alone could not go on")

    trainbench.measure.throughput.measure = trainbench.train.loop.train = fail
"""


@pytest.mark.parametrize("command", ["bench", "run"])
def test_an_error_on_a_rank_other_than_0_alone_reaches_the_console(command, llm_data, tmp_path):
    """Only rank 0 prints its errors; a sentence that only rank 1 raised is named by the launcher's own, and the
    command exits non-zero (rank 1 raises here through a start-up hook; rank 0's next collective then fails)."""
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(_RANK_ONE_FAILS)
    src = Path(__file__).resolve().parents[1] / "src"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "hook"), str(src)]), COLUMNS="300")
    extra = ["--steps", "2", "--warmup", "1"] if command == "bench" else [f"data.dir={llm_data}"]
    done = subprocess.run([sys.executable, "-m", "trainbench", command, "llama31_8b", "--preset", "tiny", "--nproc",
                           "2", "progress=false", "telemetry_hz=0", f"output.results_dir={tmp_path / 'r'}", *extra],
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode != 0
    assert "failed under torchrun" in done.stdout and "rank 1: rank 1 alone could not go on" in done.stdout, (
        done.stdout[-3000:] + done.stderr[-3000:]
    )
