"""dlrmv4 on one GPU with its tables sharded (``perf.sharded_tables``, world 1): the tiny preset's steps in bf16
autocast finite and those of every table held whole, and `trainbench bench` at the reference's layer shape with its
tables truncated to fit.

Part of the single-GPU tier (``make test-gpu``, every tests/test_gpu_*.py but test_gpu_multi.py), skipped where no
CUDA device is visible."""

import json
import math

from conftest import only_run_dir, read_metrics, run_cli, single_gpu_tier

pytestmark = single_gpu_tier()


def _losses(results) -> list[float]:
    return [r["loss"] for r in read_metrics(only_run_dir(results)) if "loss" in r]


def test_sharded_tables_train_the_tiny_presets_losses_of_whole_tables_on_one_gpu_in_bf16(tmp_path):
    """10 steps of the tiny preset on CUDA in bf16 autocast (precision=auto), the tables sharded over the one rank
    (the exchange without peers, RowWiseAdagrad on the touched rows) against every table held whole (dense gradients):
    every loss finite, falling, and within 2e-2 of the other's (bf16: the sums' order differs)."""
    data = tmp_path / "data"
    assert run_cli("prepare", "dlrmv4", "--synthetic", "--preset", "tiny", "--out", data, "--no-progress") == 0
    common = ["run", "dlrmv4", "--preset", "tiny", f"data.dir={data}", "device=cuda", "progress=false",
              "log_every_steps=1", "telemetry_hz=0", "schedule.max_samples=1280", "eval.every_samples=640",
              "eval_samples=512"]  # fmt: skip
    run_cli(*common, f"output.results_dir={tmp_path / 'whole'}")
    run_cli(*common, "perf.sharded_tables=true", f"output.results_dir={tmp_path / 'sharded'}")
    whole, sharded = _losses(tmp_path / "whole"), _losses(tmp_path / "sharded")
    assert len(whole) == len(sharded) == 10 and all(math.isfinite(x) for x in sharded), (whole, sharded)
    assert sharded[-1] < sharded[0], sharded
    assert max(abs(a - b) / abs(b) for a, b in zip(sharded, whole, strict=True)) <= 2e-2, (whole, sharded)
    console = (only_run_dir(tmp_path / "sharded") / "console.log").read_text()
    assert "embedding tables sharded row-wise over 1 rank(s)" in console


def test_bench_at_the_reference_layer_shape_runs_on_one_gpu_with_its_tables_truncated(tmp_path):
    """`trainbench bench dlrmv4` at the reference's layers (dim 512, 5 HSTU layers of 4 heads, a history of 2,048
    events) with every table cut to 1 M rows (the reference's 559 GiB of tables do not fit one GPU), sharded: it
    measures, and bench.json and the summary say the tables were truncated. A smaller batch than the reference's
    (the attention's [batch, heads, T, T] scores at T = 2,055 take 34 MB a sample in bf16)."""
    code = run_cli("bench", "dlrmv4", "--steps", "2", "--warmup", "1", "--profile-steps", "0", "--table-rows",
                   "1000000", "perf.sharded_tables=true", "device=cuda", "data.global_batch_size=64",
                   "data.micro_batch_size=32", "optimizer.lr=7.8125e-9", f"output.results_dir={tmp_path}")  # fmt: skip
    assert code == 0
    run_dir = only_run_dir(tmp_path)
    result = json.loads((run_dir / "bench.json").read_text())
    assert result["tables_truncated_to_rows"] == 1_000_000 and result["step_seconds"] > 0
    assert "truncated to at most 1,000,000 rows" in (run_dir / "console.log").read_text()
