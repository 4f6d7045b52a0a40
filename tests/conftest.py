"""Shared fixtures: small synthetic data sets and a way to run the CLI in-process."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from trainbench.cli import main as cli_main
from trainbench.data.synthetic_bert import SyntheticSpec, prepare_synthetic

REPO = Path(__file__).resolve().parents[1]


def tiny_spec(**changes) -> SyntheticSpec:
    base = dict(
        seq_length=128,
        max_predictions=20,
        vocab_size=1024,
        num_train_samples=2048,
        num_eval_samples=256,
        num_shards=3,
        seed=7,
    )
    return SyntheticSpec(**(base | changes))


@pytest.fixture(scope="session")
def small_data(tmp_path_factory) -> Path:
    """A few thousand samples in the tiny preset's shapes: enough for short runs."""
    out = tmp_path_factory.mktemp("bert-small")
    prepare_synthetic(out, tiny_spec())
    return out


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """The data set `make demo` uses (`prepare bert --synthetic --preset tiny`)."""
    out = tmp_path_factory.mktemp("bert-tiny")
    assert cli_main(["prepare", "bert", "--synthetic", "--preset", "tiny", "--out", str(out)]) == 0
    return out


@contextlib.contextmanager
def lock_held_elsewhere(folder: Path, what: str):
    """Another process holding ``folder``'s lock (runfiles.FolderLock) while the block runs; yields its pid."""
    import subprocess
    import sys

    code = ("import time; from trainbench.runfiles import FolderLock; "
            f"FolderLock({str(folder)!r}, {what!r}).acquire(); print('held', flush=True); time.sleep(60)")  # fmt: skip
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder.pid
    finally:
        holder.kill()
        holder.wait()


def run_cli(*args: str) -> int:
    return cli_main([str(a) for a in args])


def only_run_dir(results: Path) -> Path:
    dirs = [d for d in results.iterdir() if d.is_dir()]
    assert len(dirs) == 1, f"expected one run folder in {results}, found {dirs}"
    return dirs[0]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def converged(tiny_data, tmp_path_factory) -> Path:
    """One tiny run to its target (``run bert --preset tiny``), with telemetry at 4 Hz: a finished, compliant results
    folder; what it printed is ``stdout.txt`` beside the folder."""
    out = tmp_path_factory.mktemp("converged")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = run_cli("run", "bert", f"data.dir={tiny_data}", f"output.results_dir={out}", "progress=false",
                       "telemetry_hz=4")  # fmt: skip
    (out / "stdout.txt").write_text(printed.getvalue())  # what the run printed (beside its folder)
    assert code == 0, printed.getvalue()
    return only_run_dir(out)
