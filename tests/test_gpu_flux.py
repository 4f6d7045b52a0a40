"""flux1 on one GPU: its tiny preset to its target in bf16 (eager, compiled and checkpointed) and in FP8.

Part of the single-GPU tier (``make test-gpu``, every tests/test_gpu_*.py but test_gpu_multi.py), skipped where no
CUDA device is visible."""

import json

import pytest
from conftest import single_gpu_tier, tiny_run_to_target_on_cuda

pytestmark = single_gpu_tier()


@pytest.mark.parametrize("placement", [[], ["perf.compile=true", "perf.activation_checkpointing=true"]])
def test_tiny_flux_reaches_its_target_on_cuda(tmp_path, placement):
    """flux1's tiny preset in bf16 on CUDA: the rectified-flow loss to 0.586, the log compliant but for the scaled-down
    eval cadence; eager as one module, and compiled block by block with every block recomputed."""
    tiny_run_to_target_on_cuda(tmp_path, "flux1", "--preset", "tiny", *placement)


def test_tiny_flux_reaches_its_target_training_in_fp8_on_cuda(tmp_path, capsys):
    """flux1's tiny preset with model.precision=fp8, compiled: its blocks' attention and MLP layers in torchao's float8
    training, their modulation not; the same target, a compliant log that discloses fp8."""
    pytest.importorskip("torchao", reason="torchao is the optional extra trainbench[fp8]")
    run_dir = tiny_run_to_target_on_cuda(
        tmp_path, "flux1", "--preset", "tiny", "perf.compile=true", "model.precision=fp8"
    )
    # 2 double blocks x 2 streams x (qkv, proj, 2 MLP layers) + 2 single blocks x (linear1, linear2)
    out = capsys.readouterr().out
    assert "20 linear layers of the blocks train in FP8" in out
    assert "their weights cast to FP8 once a step" in out  # one rank: fp8.cast_placed_weights_once_a_step
    events = [json.loads(line.split(":::MLLOG ")[1]) for line in (run_dir / "result_0.txt").read_text().splitlines()]
    assert {e["key"]: e["value"] for e in events}["lowest_numerical_precision_in_linear"] == "fp8"


def test_fp8_weights_cast_once_a_step_train_the_per_call_casts_losses_compiled_on_cuda(tmp_path, monkeypatch):
    """flux1's tiny preset in FP8 compiled as one graph on one GPU, 2 micro-batches a step: the weights cast once a
    step by a hook outside the graph (fp8.cast_placed_weights_once_a_step) train the losses and evals of the layers
    casting in every call within FP8's rounding (the compiled per-call casts may round a scale's product otherwise),
    and the console says which."""
    pytest.importorskip("torchao", reason="torchao is the optional extra trainbench[fp8]")
    from conftest import losses_and_evals, only_run_dir, run_cli

    from trainbench.families import fp8

    data = tmp_path / "data"
    assert run_cli("prepare", "flux1", "--synthetic", "--preset", "tiny", "--out", data) == 0
    common = ["run", "flux1", "--preset", "tiny", f"data.dir={data}", "device=cuda", "perf.compile=true",
              "model.precision=fp8", "micro_batch_size=16", "progress=false", "log_every_steps=1", "telemetry_hz=0",
              "schedule.max_samples=128", "eval.every_samples=64", "eval_samples=64"]  # fmt: skip
    losses, evals = losses_and_evals(common, {"once": []}, tmp_path, "eval_loss")
    monkeypatch.setattr(fp8, "cast_weights_once_a_step", lambda *a, **k: None)
    per_call, per_call_evals = losses_and_evals(common, {"per_call": []}, tmp_path, "eval_loss")
    once_console = (only_run_dir(tmp_path / "once") / "console.log").read_text()
    assert "their weights cast to FP8 once a step, their gradients added into fp32 in one pass" in once_console
    assert "once a step" not in (only_run_dir(tmp_path / "per_call") / "console.log").read_text()
    assert len(losses["once"]) == len(per_call["per_call"]) == 4 and len(evals["once"]) == 2
    pairs = [*zip(losses["once"], per_call["per_call"], strict=True),
             *zip(evals["once"], per_call_evals["per_call"], strict=True)]  # fmt: skip
    assert all(abs(a - b) <= 1e-2 * abs(b) for a, b in pairs), pairs
