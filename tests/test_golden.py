"""A restructure keeps the numbers: five short runs reproduce their recorded losses, evals and MLPerf logs bit for bit.

The fixtures in tests/golden/ were recorded by tests/golden/record.py before the code was restructured (tiny BERT on
1 rank, on 2 ranks and with accumulation 4; tiny llama31_8b and gpt3; 30 steps each, same seed, CPU).
"""

import json
from pathlib import Path

import pytest
from golden.record import RUNS, prepare_data, run

GOLDEN = Path(__file__).resolve().parent / "golden"


@pytest.fixture(scope="module")
def golden_data(tmp_path_factory):
    return prepare_data(tmp_path_factory.mktemp("golden-data"))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_run_reproduces_its_recorded_numbers_bit_for_bit(name, golden_data, tmp_path):
    expected = json.loads((GOLDEN / f"{name}.json").read_text())
    got = run(name, golden_data, tmp_path)
    assert len(got["losses"]) == 30 and len(got["evals"]) == 3
    assert got["losses"] == expected["losses"], "per-step losses differ from the recorded run"
    assert got["evals"] == expected["evals"], "eval values differ from the recorded run"
    assert got["log"] == expected["log"], "the MLPerf log (times and call sites stripped) differs"
