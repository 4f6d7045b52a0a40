"""A restructure keeps the numbers: short runs reproduce their recorded losses, evals and MLPerf logs bit for bit.

The fixtures in tests/golden/ come from the code before it was restructured (tiny BERT on 1 rank, on 2 ranks and with
accumulation 4; tiny llama31_8b and gpt3; 30 steps each, same seed, CPU; gpt_oss_20b and dlrmv4 recorded when they
were added), on the numeric path that record.py pins so that any x86-64 machine computes the same bits.
Each run executes in a process of its own started with that path.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from golden.record import RUNS, pinned_path_missing

GOLDEN = Path(__file__).resolve().parent / "golden"


# gpt3's run is in the fast tier (make test): it is also that benchmark's one tiny run through the whole CLI.
FAST = {"gpt3"}


def _marks(name: str) -> list:
    """Each run in an xdist group of its own (they share nothing: each runs in its own process into its own folder),
    so that parallel workers can split the module's 7 minutes."""
    return [pytest.mark.xdist_group(f"golden_{name}")] + ([] if name in FAST else [pytest.mark.full])


@pytest.fixture
def rerun(name, tmp_path) -> Path:
    """The run named by the test, executed again by record.py (in a process of its own, on the pinned path)."""
    why = pinned_path_missing()
    if why:
        pytest.skip(why)
    command = [sys.executable, str(GOLDEN / "record.py"), "--out", str(tmp_path), "--only", name]
    proc = subprocess.run(command, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp_path


@pytest.mark.parametrize("name", [pytest.param(n, id=n, marks=_marks(n)) for n in RUNS])
def test_run_reproduces_its_recorded_numbers_bit_for_bit(name, rerun):
    expected = json.loads((GOLDEN / f"{name}.json").read_text())
    got = json.loads((rerun / f"{name}.json").read_text())
    assert len(got["losses"]) == 30 and len(got["evals"]) == 3
    assert got["losses"] == expected["losses"], "per-step losses differ from the recorded run"
    assert got["evals"] == expected["evals"], "eval values differ from the recorded run"
    assert got["log"] == expected["log"], "the MLPerf log (times and call sites stripped) differs"
