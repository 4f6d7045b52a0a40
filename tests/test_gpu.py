"""GPU tier: runs only where CUDA is present (skipped on CI, which has no GPU)."""

import json

import pytest
import torch
from conftest import only_run_dir, run_cli

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is visible"),
]


def test_bf16_forward_agrees_with_fp32_on_cuda():
    from trainbench.models.bert import BertConfig, BertForPreTraining

    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig(hidden_dropout=0.0, attention_dropout=0.0, num_layers=4)).cuda().eval()
    ids = torch.randint(0, 30522, (4, 512), device="cuda")
    types = torch.zeros_like(ids)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ref, _ = model(ids, types, mask)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            low, _ = model(ids, types, mask)
    assert (low.float() - ref).abs().max() / ref.abs().max() < 5e-2
    assert (low.float().argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_tiny_preset_trains_on_cuda(small_data, tmp_path):
    run_cli(
        "run",
        "bert",
        f"data.dir={small_data}",
        f"output.results_dir={tmp_path}",
        "device=cuda",
        "eval_samples=256",
        "eval.every_samples=640",
        "schedule.max_samples=1280",
        "progress=false",
    )
    outcome = json.loads((only_run_dir(tmp_path) / "run_0.json").read_text())
    assert outcome["steps"] == 20 and outcome["peak_memory_gib"] > 0
