"""Attention with learned sinks and a sliding window (models/sink_attention.py) against `transformers`' GPT-OSS
attention (the sink as an extra softmax column), values and gradients, with and without the window."""

from __future__ import annotations

import pytest
import torch

from trainbench.models.sink_attention import sink_attention, window_mask


def test_the_window_is_causal_and_keeps_the_last_positions_only():
    m = window_mask(6, 3)
    assert m[5].tolist() == [False, False, False, True, True, True] and m[0].tolist() == [True] + [False] * 5
    assert window_mask(4, None).tolist() == torch.ones(4, 4, dtype=torch.bool).tril().tolist()


@pytest.mark.parametrize("window", [None, 5])
def test_sinks_match_transformers_gpt_oss_attention_with_gradients(window):
    pytest.importorskip("transformers", reason="transformers is the optional extra trainbench[test]")
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    torch.manual_seed(0)
    b, h, kv, s, d = 2, 4, 2, 11, 8
    q, k, v = (torch.randn(b, n, s, d, dtype=torch.float64, requires_grad=True) for n in (h, kv, kv))
    sinks = torch.randn(h, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(s, s, dtype=torch.float64).masked_fill(~window_mask(s, window), float("-inf"))
    module = SimpleNamespace(num_key_value_groups=h // kv, sinks=sinks, training=False)
    theirs, _ = eager_attention_forward(module, q, k, v, mask[None, None], scaling=d**-0.5)  # [b, s, h, d]
    ours = sink_attention(q, k, v, sinks, window).transpose(1, 2)
    assert torch.allclose(ours, theirs, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(theirs.square().sum(), (q, k, v, sinks))
    mine = torch.autograd.grad(ours.square().sum(), (q, k, v, sinks))
    for a, g in zip(grads, mine, strict=True):
        assert torch.allclose(a, g, rtol=1e-10, atol=1e-12)
    assert float(mine[3].abs().min()) > 0  # every sink learns
