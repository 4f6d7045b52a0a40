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
    assert "20 linear layers of the blocks train in FP8" in capsys.readouterr().out
    events = [json.loads(line.split(":::MLLOG ")[1]) for line in (run_dir / "result_0.txt").read_text().splitlines()]
    assert {e["key"]: e["value"] for e in events}["lowest_numerical_precision_in_linear"] == "fp8"
