"""A benchmark from outside the tree: examples/ctr_benchmark, a click-through-rate model (embedding tables, MLPs, an
AUC target), installed by pip as a package of its own and found through its ``trainbench.benchmarks`` entry point.
Every step goes through the `trainbench` command in a process of its own, as a user's would: list, prepare, run to
the target, check and report; a broken plugin is named and the others still load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import only_run_dir, read_metrics, run_cli


def trainbench(*args, cwd: Path, path: list[Path]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in path), COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "trainbench", *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip


def test_an_installed_benchmark_is_listed_prepared_trained_checked_and_reported(ctr_site, tmp_path):
    run = lambda *args: trainbench(*args, cwd=tmp_path, path=[ctr_site])  # noqa: E731
    listed = run("list")
    assert listed.returncode == 0 and "ctr_tiny (trainbench-ctr 0.1.0, entry point ctr_tiny)" in listed.stdout
    # Its own preparation options, and only those.
    helped = run("prepare", "ctr_tiny", "--help").stdout
    assert "--train-samples" in helped and "--out" in helped and "--vocab" not in helped and "--source" not in helped
    refused = run("prepare", "ctr_tiny", "--synthetic", "--vocab", "v.txt", "--out", "data")
    assert refused.returncode == 2 and "--vocab is an option of `prepare bert`" in refused.stdout, refused.stdout
    assert not (tmp_path / "data").exists()
    assert run("prepare", "ctr_tiny", "--synthetic", "--out", "data").returncode == 0
    # An AUC target at or below 0.5 (a model that guesses) means nothing: refused before any folder is made.
    low = run("run", "ctr_tiny", "data.dir=data", "eval.target=0.4", "output.results_dir=low")
    assert low.returncode == 2 and "must be above 0.5" in low.stdout and "an AUC" in low.stdout, low.stdout
    assert not (tmp_path / "low").exists()
    trained = run("run", "ctr_tiny", "data.dir=data", "output.results_dir=results", "progress=false", "telemetry_hz=0")
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    run_dir = only_run_dir(tmp_path / "results")
    summary = json.loads((run_dir / "summary.json").read_text())
    outcome = summary["runs"][0]
    assert outcome["status"] == "success" and outcome["compliance"]["passed"], outcome
    assert outcome["metric_name"] == "auc" and outcome["final_metric"] >= 0.86
    assert len(outcome["evals"]) >= 2  # the target is not met at the first eval: the loop's cadence is exercised
    checked = run("check", run_dir)
    assert checked.returncode == 0 and "SUCCESS (not an MLPerf benchmark" in checked.stdout, checked.stdout
    assert run("report", run_dir).returncode == 0
    report = (run_dir / "report.md").read_text()
    assert "auc is the area under the ROC curve" in report and "ctr_tiny is not an MLPerf benchmark" in report
    # The report explains the metric from summary.json: this process, which has not got the plugin, reports it too.
    assert run_cli("report", run_dir) == 0
    assert "auc is the area under the ROC curve" in (run_dir / "report.md").read_text()


def test_a_broken_plugin_is_named_in_one_sentence_and_the_others_still_load(ctr_site, tmp_path):
    broken = tmp_path / "broken"
    (broken / "broken_bench-0.1.dist-info").mkdir(parents=True)
    (broken / "broken_bench-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-bench\n"
                                                                    "Version: 0.1\n")  # fmt: skip
    (broken / "broken_bench-0.1.dist-info" / "entry_points.txt").write_text(
        "[trainbench.benchmarks]\nbroken = broken_bench:Benchmark\nnot_one = broken_bench_other:VALUE\n"
    )
    (broken / "broken_bench.py").write_text("raise ImportError('it needs a library that is not installed')\n")
    (broken / "broken_bench_other.py").write_text("VALUE = 42\n")
    listed = trainbench("list", cwd=tmp_path, path=[ctr_site, broken])
    assert listed.returncode == 0 and "ctr_tiny (trainbench-ctr 0.1.0" in listed.stdout, listed.stdout
    lines = [ln for ln in listed.stdout.splitlines() if ln.startswith("benchmark plugin not loaded")]
    assert len(lines) == 2, listed.stdout
    assert ("entry point broken = broken_bench:Benchmark of broken-bench 0.1): ImportError: it needs a library that "
            "is not installed") in lines[0]  # fmt: skip
    assert "names a int, not a Benchmark subclass or instance" in lines[1]
    unknown = trainbench("run", "broken", cwd=tmp_path, path=[ctr_site, broken])
    assert unknown.returncode == 2 and "unknown benchmark 'broken'" in unknown.stdout
    assert "benchmark plugin not loaded" in unknown.stdout and "Traceback" not in unknown.stdout + unknown.stderr


def test_the_auc_from_summed_bins_is_the_auc_of_the_scores(ctr_site, monkeypatch):
    """AUC does not add up across batches: the eval sums counts of bins, per label, and the metric is computed once
    from them. Against the exact AUC from the scores' ranks, on three batches summed."""
    monkeypatch.syspath_prepend(str(ctr_site))
    from trainbench_ctr.benchmark import CtrBenchmark

    bench = CtrBenchmark()
    rng = np.random.default_rng(0)
    labels = (rng.random(30_000) < 0.3).astype(np.float32)
    logits = rng.normal(0, 1, labels.size) + 1.2 * labels
    model = lambda dense, sparse: dense[:, 0]  # noqa: E731 - a "model" that returns the given logits
    sums = sum(
        bench.eval_sums(
            model, {"dense": torch.tensor(logits[s, None]), "sparse": torch.zeros(0), "label": torch.tensor(labels[s])}
        )  # fmt: skip
        for s in (slice(0, 7_000), slice(7_000, 19_000), slice(19_000, None))
    )
    ranks = np.argsort(np.argsort(logits)) + 1
    clicks, others = labels.sum(), labels.size - labels.sum()
    exact = (ranks[labels == 1].sum() - clicks * (clicks + 1) / 2) / (clicks * others)
    assert bench.eval_metric(sums) == pytest.approx(exact, abs=2e-4)
    assert 0.75 < exact < 0.85


@pytest.mark.full
def test_two_ranks_train_as_one_and_every_rank_finds_the_installed_benchmark(ctr_site, tmp_path):
    """torchrun's ranks are processes of their own: each loads the benchmark through its entry point. The shared
    data-parallel placement gives 2 ranks the losses of 1 rank."""
    assert (
        trainbench("prepare", "ctr_tiny", "--synthetic", "--out", "data", cwd=tmp_path, path=[ctr_site]).returncode == 0
    )
    losses = {}
    for nproc in (1, 2):
        done = trainbench("run", "ctr_tiny", "--nproc", nproc, "data.dir=data", f"output.run_dir=r{nproc}",
                          "progress=false", "telemetry_hz=0", "log_every_steps=1", "schedule.max_samples=5120",
                          "eval.every_samples=2560", cwd=tmp_path, path=[ctr_site])  # fmt: skip
        assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]
        losses[nproc] = [m["loss"] for m in read_metrics(tmp_path / f"r{nproc}") if "loss" in m]
    assert len(losses[1]) == 20 and losses[1] == pytest.approx(losses[2], rel=1e-5, abs=1e-6)
