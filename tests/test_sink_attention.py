"""Attention with learned sinks and a sliding window (families/decoder/sink_attention.py) against `transformers`'
GPT-OSS attention (the sink as an extra softmax column), values and gradients, with and without the window."""

from __future__ import annotations

import pytest
import torch

from trainbench.families.decoder.sink_attention import sink_attention, window_mask


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


def _dense_kernel_forward(kernel, q, k, v, window):
    """A fused kernel's forward in float64 on the CPU: attention without sinks, its output and log-sum-exp."""
    groups = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(groups, 1).transpose(-1, -2) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~window_mask(q.shape[2], window), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return torch.softmax(scores, -1) @ v.repeat_interleave(groups, 1), lse, ()


def _dense_kernel_backward(kernel, grad, q, k, v, out, lse, aux, window):
    """A fused kernel's backward as flash attention computes it: the probabilities recomputed from ``lse``, the
    correction D = rowsum(grad x out) from the ``out`` it is given, the grouped heads' key and value gradients
    summed."""
    groups = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scale = q.shape[-1] ** -0.5
    scores = (q @ kk.transpose(-1, -2) * scale).masked_fill(~window_mask(q.shape[2], window), float("-inf"))
    p = torch.exp(scores - lse[..., None])
    ds = p * (grad @ vv.transpose(-1, -2) - (grad * out).sum(-1, keepdim=True))
    dq = ds @ kk * scale
    dk, dv = ds.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ grad

    def by_kv_head(t):
        return t.unflatten(1, (k.shape[1], groups)).sum(2)

    return dq, by_kv_head(dk), by_kv_head(dv)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("with_sinks", [True, False])
def test_the_fused_path_backward_equals_autograd_of_the_dense_form(monkeypatch, window, with_sinks):
    """fused_sink_attention's own backward (the kernel's backward given s x grad and the sinked output, the sinks'
    gradient outside it) against autograd through the dense form, in float64: run on the CPU with a dense stand-in
    for the GPU kernel that computes its backward as flash attention does."""
    from trainbench.families.decoder import sink_attention as sa

    monkeypatch.setattr(sa, "_kernel_forward", _dense_kernel_forward)
    monkeypatch.setattr(sa, "_kernel_backward", _dense_kernel_backward)
    torch.manual_seed(0)
    b, h, kv, s, d = 2, 4, 2, 11, 8
    q, k, v = (torch.randn(b, n, s, d, dtype=torch.float64, requires_grad=True) for n in (h, kv, kv))
    sinks = torch.randn(h, dtype=torch.float64, requires_grad=True) if with_sinks else None
    direction = torch.randn(b, h, s, d, dtype=torch.float64)
    inputs = (q, k, v) + ((sinks,) if with_sinks else ())
    dense = sink_attention(q, k, v, sinks if with_sinks else torch.full((h,), -torch.inf, dtype=torch.float64), window)
    fused = sa.fused_sink_attention(q, k, v, sinks, window, "flash")
    assert torch.allclose(fused, dense, rtol=1e-12, atol=1e-12)
    want = torch.autograd.grad((dense * direction).sum(), inputs)
    got = torch.autograd.grad((fused * direction).sum(), inputs)
    for name, g, w in zip("q k v sinks".split(), got, want, strict=False):
        assert torch.allclose(g, w, rtol=1e-10, atol=1e-12), name
    if with_sinks:
        assert float(got[3].abs().min()) > 0


def test_cudnn_has_no_window():
    from trainbench.families.decoder.sink_attention import fused_sink_attention

    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="no sliding window"):
        fused_sink_attention(q, q, q, None, 3, "cudnn")
