"""A restructure keeps the numbers: five short runs reproduce their recorded losses, evals and MLPerf logs bit for bit.

The fixtures in tests/golden/ come from the code before it was restructured (tiny BERT on 1 rank, on 2 ranks and with
accumulation 4; tiny llama31_8b and gpt3; 30 steps each, same seed, CPU), on the numeric path that record.py pins so
that any x86-64 machine computes the same bits. The five runs execute once, in one process started with that path.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from golden.record import RUNS, pinned_path_missing

GOLDEN = Path(__file__).resolve().parent / "golden"


@pytest.fixture(scope="module")
def rerun(tmp_path_factory) -> Path:
    why = pinned_path_missing()
    if why:
        pytest.skip(why)
    out = tmp_path_factory.mktemp("golden-rerun")
    command = [sys.executable, str(GOLDEN / "record.py"), "--out", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_run_reproduces_its_recorded_numbers_bit_for_bit(name, rerun):
    expected = json.loads((GOLDEN / f"{name}.json").read_text())
    got = json.loads((rerun / f"{name}.json").read_text())
    assert len(got["losses"]) == 30 and len(got["evals"]) == 3
    assert got["losses"] == expected["losses"], "per-step losses differ from the recorded run"
    assert got["evals"] == expected["evals"], "eval values differ from the recorded run"
    assert got["log"] == expected["log"], "the MLPerf log (times and call sites stripped) differs"
