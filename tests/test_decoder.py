"""The decoder model against transformers' Llama on the same random weights, and its configurations."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trainbench.families.decoder.memory import recompute_all
from trainbench.families.decoder.model import DecoderConfig, DecoderLM, load_hf_weights

transformers = pytest.importorskip("transformers")

SMALL = DecoderConfig(
    vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=160,
    max_seq_length=64, rope_theta=10000.0,
)  # fmt: skip


def hf_llama(cfg: DecoderConfig):
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads, intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_seq_length, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, mlp_bias=False, attn_implementation="eager",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(hf_cfg).eval()


@pytest.mark.parametrize(("tie", "fmt"), [(False, "safetensors"), (True, "safetensors"), (False, "pt")])
def test_logits_match_transformers_llama_on_the_same_weights(tie, fmt, tmp_path):
    torch.manual_seed(0)
    cfg = dataclasses.replace(SMALL, tie_embeddings=tie)
    hf = hf_llama(cfg)
    with torch.no_grad():  # HF zero-initialises nothing we could hide behind: make every weight random
        for p in hf.parameters():
            p.normal_(0, 0.2)
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if not (tie and k == "lm_head.weight")}
    if fmt == "pt":
        path = tmp_path / "pytorch_model.bin"
        torch.save(state, path)
    else:
        from safetensors.torch import save_file

        path = tmp_path / "model.safetensors"
        save_file(state, path)
    ours = DecoderLM(cfg).eval()
    load_hf_weights(ours, path)
    ids = torch.randint(0, cfg.vocab_size, (3, 48))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids)
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel <= 1e-5, rel
    assert sorted(ours.state_dict()) == sorted(hf.state_dict())


def test_meta_build_then_init_weights():
    with torch.device("meta"):
        model = DecoderLM(SMALL)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    params = dict(model.named_parameters())
    assert torch.equal(params["model.norm.weight"], torch.ones(64))
    out_std = params["model.layers.0.mlp.down_proj.weight"].std().item()
    in_std = params["model.layers.0.mlp.up_proj.weight"].std().item()
    assert 0.017 < in_std < 0.023 and out_std < in_std * 0.6
    assert torch.isfinite(model(torch.randint(0, 512, (2, 16)))).all()


def test_gpt3_architecture_is_causal_with_learned_positions():
    cfg = dataclasses.replace(SMALL, arch="gpt3", num_kv_heads=None)
    model = DecoderLM(cfg).eval()
    names = dict(model.named_parameters())
    assert "model.embed_positions.weight" in names and "model.layers.0.self_attn.q_proj.bias" in names
    assert "model.layers.0.mlp.gate_proj.weight" not in names
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    ids = torch.randint(0, 512, (1, 32))
    with torch.no_grad():
        full = model(ids)
        changed = ids.clone()
        changed[0, 20:] = (changed[0, 20:] + 1) % 512
        later = model(changed)
    # Tokens after position 19 never change the logits at positions up to 19.
    torch.testing.assert_close(full[0, :20], later[0, :20])
    assert not torch.allclose(full[0, 20:], later[0, 20:])


def test_parameter_count_formula_for_llama():
    for tie in (False, True):
        cfg = dataclasses.replace(SMALL, tie_embeddings=tie)
        assert sum(p.numel() for p in DecoderLM(cfg).parameters()) == cfg.num_params()


def test_materialised_model_keeps_tied_embeddings():
    from trainbench.families.decoder.placement import parallelize

    cfg = dataclasses.replace(SMALL, tie_embeddings=True)
    with torch.device("meta"):
        model = DecoderLM(cfg)
    model = parallelize(model, torch.device("cpu"), 1, 1, False, False, False, None, 0)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


def test_compiled_blocks_take_inductor_options_this_torch_knows():
    """The compile options of a block are checked when the block is wrapped, before any run: a torch that renamed one
    fails here, not at the first step of a GPU run."""
    from trainbench.families.decoder.placement import wrap_blocks

    model = DecoderLM(SMALL)
    wrap_blocks(model, checkpointing=False, compile_blocks=True)
    assert all(block._compiled_call_impl is not None for block in model.model.layers)
    with pytest.raises(RuntimeError, match="Unexpected optimization option"):
        DecoderLM(SMALL).model.layers[0].compile(options={"triton.no_such_option": True})


def test_activation_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    model = DecoderLM(SMALL)
    ids = torch.randint(0, 512, (2, 24))
    grads = []
    for checkpointing in (False, True):
        recompute_all(model, checkpointing)
        model.zero_grad()
        model(ids).logsumexp(-1).mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


def test_recompute_last_checkpoints_only_the_last_blocks():
    from trainbench.families.decoder.memory import recompute_last

    model = DecoderLM(dataclasses.replace(SMALL, num_layers=4))
    recompute_last(model, 3)
    assert [b.checkpointing for b in model.model.layers] == [False, True, True, True]
    recompute_last(model, 0)
    assert not any(b.checkpointing for b in model.model.layers)


def test_recompute_spread_leaves_the_other_blocks_spread_over_the_depth():
    """With host offload the recomputed blocks are interleaved with the others, so that the offloaded blocks (chosen
    evenly among the others) are spread over the whole forward: at the 70B LoRA's H100 plan (80 blocks, 46
    recomputed) no more than 2 of the other blocks are adjacent, and every count from none to all is exact."""
    from trainbench.families.decoder.memory import recompute_spread
    from trainbench.families.decoder.offload import spread

    model = DecoderLM(dataclasses.replace(SMALL, num_layers=8))
    assert recompute_spread(model, 5) == [1, 3, 4, 6, 7]
    assert [b.checkpointing for b in model.model.layers] == [False, True, False, True, True, False, True, True]
    for count in range(9):
        chosen = recompute_spread(model, count)
        assert len(set(chosen)) == count and [b.checkpointing for b in model.model.layers] == [
            i in chosen for i in range(8)
        ]
    deep = DecoderLM(dataclasses.replace(SMALL, num_layers=80, hidden_size=16, intermediate_size=32, vocab_size=64))
    recomputed = set(recompute_spread(deep, 46))
    others = [i for i in range(80) if i not in recomputed]
    offloaded = [others[j] for j in spread(32, len(others))]
    assert len(others) == 34 and max(b - a for a, b in zip(others, others[1:], strict=False)) <= 3
    # a quarter of the depth holds about a quarter of the offloaded blocks (packed at the front before: 32 of 34)
    assert all(7 <= sum(q * 20 <= i < (q + 1) * 20 for i in offloaded) <= 9 for q in range(4))


def test_loss_with_targets_is_the_cross_entropy_of_the_logits_and_of_hf_with_gradients():
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = DecoderLM(dataclasses.replace(SMALL, tie_embeddings=True))
    model.init_weights(0)
    ids = torch.randint(0, SMALL.vocab_size, (2, 33))
    loss = model(ids[:, :-1], targets=ids[:, 1:])
    loss.backward()
    grad = model.lm_head.weight.grad.clone()
    model.zero_grad()
    logits = model(ids[:, :-1])
    reference = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    assert torch.allclose(grad, model.lm_head.weight.grad, rtol=1e-5, atol=1e-7)
    hf = hf_llama(model.cfg)
    hf.load_state_dict(model.state_dict(), strict=False)
    # HF's loss is the mean over the shifted labels of the same tokens
    hf_loss = hf(input_ids=ids, labels=ids).loss
    assert hf_loss.item() * 32 * 2 == pytest.approx(loss.item(), rel=1e-5)


def _forward_runs(model: DecoderLM) -> list[int]:
    """How many times each block's computation has run (its attention's forward counted), from now on."""
    runs = [0] * len(model.model.layers)
    for i, block in enumerate(model.model.layers):
        block.self_attn.register_forward_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
    return runs


@pytest.mark.parametrize(("recompute_blocks", "recomputed"), [(0, [True, True, True]), (2, [False, True, True])])
def test_the_placement_applies_checkpointing_from_the_perf_keys_and_the_blocks_run_again_in_backward(
    recompute_blocks, recomputed
):
    """place_decoder with perf.activation_checkpointing (and perf.recompute_blocks): the blocks it chose run their
    forward again during the backward and the others do not, the state-dict keys stay the unplaced model's, and the
    loss and every gradient equal those of the model placed without checkpointing."""
    from trainbench.config import PerfConfig
    from trainbench.distributed import DistInfo
    from trainbench.families.decoder.placement import place_decoder

    cfg = dataclasses.replace(SMALL, num_layers=3)
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    results = {}
    for checkpointing in (False, True):
        perf = PerfConfig(activation_checkpointing=checkpointing, recompute_blocks=recompute_blocks * checkpointing)
        with torch.device("meta"):
            model = DecoderLM(cfg)
        placed = place_decoder(model, cfg, info, 1, False, perf, 0)
        assert list(placed.module.state_dict()) == list(DecoderLM(cfg).state_dict())
        runs = _forward_runs(placed.module)
        loss = placed.model(ids, targets=ids)
        assert runs == [1, 1, 1]
        loss.backward()
        results[checkpointing] = (runs, loss.detach(), [p.grad for p in placed.module.parameters()], placed.notes)
    runs, loss, grads, notes = results[True]
    assert runs == [2 if r else 1 for r in recomputed]
    assert results[False][0] == [1, 1, 1]
    assert torch.equal(loss, results[False][1])
    for a, b in zip(grads, results[False][2], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    if recompute_blocks:
        assert "activation checkpointing on the last 2 of 3 blocks" in notes
    with torch.no_grad():  # nothing to recompute for: each block runs once
        runs = _forward_runs(placed.module)
        placed.model(ids)
    assert runs == [1, 1, 1]


@pytest.mark.full  # (about 70 s of CPU compilation)
def test_compiled_blocks_with_checkpointing_from_outside_give_the_eager_gradients():
    """wrap_blocks with checkpointing and compilation (the placement's order: checkpointing, then each block's
    compile, which compiles the call that looks the block's forward up, the checkpointed one): the same loss and
    gradients as the eager model without checkpointing, and the checkpoint (offload.py's, where a placed block's
    forward runs) is reached from the compiled call."""
    from trainbench.families.decoder import offload
    from trainbench.families.decoder.placement import wrap_blocks

    torch.manual_seed(0)
    eager, compiled = DecoderLM(SMALL), DecoderLM(SMALL)
    compiled.load_state_dict(eager.state_dict())
    reached = []
    real_checkpoint = offload.checkpoint

    def counted_checkpoint(*args, **kwargs):
        reached.append(1)
        return real_checkpoint(*args, **kwargs)

    offload.checkpoint = counted_checkpoint
    try:
        wrap_blocks(compiled, checkpointing=True, compile_blocks=True)
        assert all(block._compiled_call_impl is not None for block in compiled.model.layers)
        ids = torch.randint(0, 512, (2, 24))
        losses = [model(ids).logsumexp(-1).mean() for model in (eager, compiled)]
        for loss in losses:
            loss.backward()
    finally:
        offload.checkpoint = real_checkpoint
    assert reached
    torch.testing.assert_close(losses[0], losses[1])
    for a, b in zip(eager.parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)
