"""Eight ranks on the CPU over gloo: the layouts of a node of 8 GPUs whose shape depends on the number of ranks, each
tiny preset trained to its target, its log checked. The experts of ``gpt_oss_20b`` one a rank (its all-to-all over
8) and ``dlrmv4``'s tables sharded row-wise over the 8 (one all-to-all of the lookups). Every other test runs 2 ranks
at the most; these catch what only a larger world breaks (a split, a count, an exchange's sizes). This machine has
fewer than 8 cores: the launcher's count of them is stood in for, and the 8 ranks share the cores (about 30 s a
test on 2 cores)."""

from __future__ import annotations

import pytest
from conftest import _prepared, only_run_dir, run_cli

import trainbench.launch.local as local


@pytest.mark.full
@pytest.mark.parametrize(
    ("benchmark", "keys", "layout"),
    [
        ("gpt_oss_20b", ["model.num_experts=8", "distributed.ep=8"],
         ["8 experts, 2 a token", "1 experts on each of 8 ranks (all-to-all)"]),
        ("dlrmv4", ["perf.sharded_tables=true"], ["7 embedding tables sharded row-wise over 8 rank(s)"]),
    ],
)  # fmt: skip
def test_a_tiny_preset_on_eight_cpu_ranks_reaches_its_target_in_the_node_layout(
    benchmark, keys, layout, tmp_path_factory, tmp_path, monkeypatch
):
    monkeypatch.setattr(local, "available_slots", lambda device: 8)
    data = _prepared(tmp_path_factory, benchmark)
    code = run_cli("run", benchmark, "--preset", "tiny", "--nproc", "8", "device=cpu", f"data.dir={data}",
                   f"output.results_dir={tmp_path}", "progress=false", "telemetry_hz=0", *keys)  # fmt: skip
    run_dir = only_run_dir(tmp_path)
    console = (run_dir / "console.log").read_text()
    assert code == 0, console[-3000:]
    assert "8 x cpu" in console and all(line in console for line in layout), console[:3000]
    assert "run 0: success" in console and run_cli("check", run_dir) == 0
