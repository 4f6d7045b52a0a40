"""Llama-2-70B LoRA's pieces against code nobody here wrote: base weights read from `transformers`' sharded
safetensors (both layouts, 1 and 2 ranks), adapters against `peft` (outputs, gradients, export), bad checkpoints."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import spawn_ranks

from trainbench.config import PerfConfig
from trainbench.errors import DataError
from trainbench.families.decoder import lora
from trainbench.families.decoder.hf_checkpoint import load_into, save_sharded
from trainbench.families.decoder.lora import LoraModelConfig
from trainbench.families.decoder.model import DecoderLM

transformers = pytest.importorskip("transformers")

CFG = LoraModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=160, rope_theta=10000.0)  # fmt: skip


def hf_config():
    return transformers.LlamaConfig(
        vocab_size=CFG.vocab_size, hidden_size=CFG.hidden_size, num_hidden_layers=CFG.num_layers,
        num_attention_heads=CFG.num_heads, num_key_value_heads=CFG.kv_heads, intermediate_size=CFG.intermediate_size,
        rope_theta=CFG.rope_theta, rms_norm_eps=CFG.norm_eps, tie_word_embeddings=False, max_position_embeddings=512,
    )  # fmt: skip


def fuse_qkv(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """MLPerf's layout: q, k and v stacked by rows in one qkv_proj."""
    out = {}
    for k, v in state.items():
        if ".q_proj." in k:
            parts = [v, state[k.replace("q_proj", "k_proj")], state[k.replace("q_proj", "v_proj")]]
            out[k.replace("q_proj", "qkv_proj")] = torch.cat(parts)
        elif ".k_proj." not in k and ".v_proj." not in k:
            out[k] = v
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A random Llama saved by transformers in 50 KB shards (HF layout) and the same weights fused by our writer."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_config()).eval()
    hf.save_pretrained(root / "standard", max_shard_size="50KB")
    save_sharded(fuse_qkv(hf.state_dict()), root / "fused", 40_000)
    assert len(list((root / "standard").glob("*.safetensors"))) > 3 and len(list((root / "fused").glob("*.sa*"))) > 3
    return root, hf


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("file_layout", ["standard", "fused"])
@pytest.mark.parametrize("fused_model", [False, True])
def test_sharded_checkpoint_loads_to_transformers_logits(checkpoints, file_layout, fused_model):
    root, hf = checkpoints
    cfg = dataclasses.replace(CFG, fused_qkv=fused_model)
    with torch.device("meta"):
        model = DecoderLM(cfg)
    model.to_empty(device="cpu")
    read = load_into(model, root / file_layout, cfg)
    assert read == sum(p.numel() * 4 for p in model.parameters())  # every parameter read once, nothing more
    ids = torch.randint(0, CFG.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel_err(model(ids), hf(ids).logits) <= 1e-5


def _fsdp_worker(rank: int, world: int, port: int, root: str, out: str) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from trainbench.families.decoder.placement import parallelize

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    for layout in ("standard", "fused"):
        cfg = dataclasses.replace(CFG, fused_qkv=layout == "fused")
        with torch.device("meta"):
            model = DecoderLM(cfg)
        read: dict[str, int] = {}
        model = parallelize(
            model,
            torch.device("cpu"),
            world,
            1,
            False,
            False,
            False,
            None,
            0,
            fill=lambda m, c=cfg, p=Path(root) / layout, r=read: r.setdefault("b", load_into(m, p, c)),
        )
        assert all(isinstance(p, DTensor) for p in model.parameters())
        ids = torch.randint(0, CFG.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            results[layout] = {"logits": model(ids).tolist(), "bytes": read["b"]}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()  # neither rank tears its connections down while the other still uses them
    dist.destroy_process_group()


@pytest.mark.full
def test_two_fsdp_ranks_read_only_their_slices_and_give_transformers_logits(checkpoints, tmp_path):
    root, hf = checkpoints
    got = spawn_ranks(_fsdp_worker, 2, tmp_path / "fsdp.json", str(root))
    ids = torch.randint(0, CFG.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    total = sum(p.numel() * 4 for p in hf.parameters())
    for layout in ("standard", "fused"):
        assert rel_err(torch.tensor(got[layout]["logits"]), ref) <= 1e-5, layout
        # rank 0 read its half of every parameter (rows split evenly), never the whole model
        assert got[layout]["bytes"] <= total // 2 + 4 * CFG.vocab_size * CFG.hidden_size, (layout, got[layout], total)


# -- bad checkpoints: one sentence naming the file, nothing loaded ---------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _load_error(folder: Path, cfg=CFG) -> str:
    with torch.device("meta"):
        model = DecoderLM(cfg)
    model.to_empty(device="cpu")
    for p in model.parameters():
        p.detach().zero_()
    with pytest.raises(DataError) as e:
        load_into(model, folder, cfg)
    assert all(not p.any() for p in model.parameters())  # nothing half-loaded
    assert "\n" not in str(e.value)
    return str(e.value)


def test_bad_checkpoints_are_one_sentence_naming_the_file(checkpoints, tmp_path):
    root, _ = checkpoints
    broken = _copy(root / "standard", tmp_path / "missing")
    shard = sorted(broken.glob("*.safetensors"))[2]
    shard.unlink()
    msg = _load_error(broken)
    assert str(shard) in msg and "missing" in msg and "download" in msg

    wrong = _copy(root / "standard", tmp_path / "index")
    index = json.loads((wrong / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = "model-99999-of-99999.safetensors"
    (wrong / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "model-99999-of-99999.safetensors: named in model.safetensors.index.json but missing" in _load_error(wrong)

    small = dataclasses.replace(CFG, intermediate_size=128)
    msg = _load_error(root / "standard", small)
    assert ".safetensors: tensor model.layers.0.mlp." in msg and "needs [128, 64]" in msg and "model.*" in msg

    assert "neither model.safetensors.index.json nor model.safetensors" in _load_error(tmp_path)


# -- LoRA against peft -----------------------------------------------------------------------------------------

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _ours_and_peft(root: Path, hf, dropout: float):
    peft = pytest.importorskip("peft")
    cfg = dataclasses.replace(CFG, lora_targets=",".join(TARGETS), lora_dropout=dropout)
    ours = DecoderLM(cfg)
    load_into(ours, root / "standard", cfg)
    assert lora.attach(ours, cfg.targets, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout) == 4 * CFG.num_layers
    ref = transformers.LlamaForCausalLM(hf_config())
    ref.load_state_dict(hf.state_dict())
    ref = peft.get_peft_model(ref, peft.LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=dropout,
                                                   target_modules=list(TARGETS), bias="none"))  # fmt: skip
    # Non-zero B, so the adapters change the output; the same tensors in both.
    gen = torch.Generator().manual_seed(3)
    state = {}
    for name, p in ref.named_parameters():
        if "lora_" in name:
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            state[name.removeprefix("base_model.model.").replace(".default", "")] = p.detach().clone()
    lora.load_adapters(ours, state)
    return cfg, ours, ref, state


def test_adapters_give_peft_outputs_and_gradients(checkpoints):
    root, hf = checkpoints
    _, ours, ref, _ = _ours_and_peft(root, hf, dropout=0.0)
    assert {n for n, p in ours.named_parameters() if p.requires_grad} == {
        n.removeprefix("base_model.model.").replace(".default", "")
        for n, p in ref.named_parameters() if p.requires_grad
    }  # fmt: skip
    ids = torch.randint(0, CFG.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, CFG.vocab_size, (2, 17), generator=torch.Generator().manual_seed(2))
    targets[:, :5] = -100  # a prompt: no loss there
    mine = ours(ids, targets=targets)
    logits = ref(input_ids=ids).logits
    theirs = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    assert rel_err(ours(ids), logits) <= 1e-5 and abs(float(mine - theirs)) <= 1e-5 * abs(float(theirs))
    mine.backward()
    theirs.backward()
    grads = {n.removeprefix("base_model.model.").replace(".default", ""): p.grad
             for n, p in ref.named_parameters() if p.requires_grad}  # fmt: skip
    for name, p in ours.named_parameters():
        if p.requires_grad:
            assert rel_err(p.grad, grads[name]) <= 1e-5, name
        else:
            assert p.grad is None


def test_dropout_applies_in_training_only(checkpoints):
    root, hf = checkpoints
    _, ours, _, _ = _ours_and_peft(root, hf, dropout=0.1)
    ids = torch.randint(0, CFG.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours.train()
        assert not torch.equal(ours(ids), ours(ids))
        ours.eval()
        assert torch.equal(ours(ids), ours(ids))


def test_merged_and_exported_adapters_give_the_same_logits_in_peft(checkpoints, tmp_path):
    peft = pytest.importorskip("peft")
    root, hf = checkpoints
    cfg, ours, _, state = _ours_and_peft(root, hf, dropout=0.1)
    ours.eval()
    ids = torch.randint(0, CFG.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        adapted = ours(ids)
        exported = lora.export_peft(lora.adapter_state(ours), cfg, tmp_path / "adapter")
        base = transformers.LlamaForCausalLM.from_pretrained(root / "standard")
        loaded = peft.PeftModel.from_pretrained(base, str(exported)).eval()
        assert rel_err(loaded(input_ids=ids).logits, adapted) <= 1e-5
        lora.merge(ours)
        assert not lora.adapted(ours) and not any("lora" in n for n, _ in ours.named_parameters())
        assert rel_err(ours(ids), adapted) <= 1e-5


# -- the FP8 frozen base ---------------------------------------------------------------------------------------


def test_fp8_base_keeps_outputs_and_input_gradients_close_and_adapters_train():
    from trainbench.families import fp8

    torch.manual_seed(0)
    ref = torch.nn.Linear(64, 48, bias=False)
    ref.weight.requires_grad_(False)
    q = torch.nn.Linear(64, 48, bias=False)
    q.load_state_dict(ref.state_dict())
    q.weight.requires_grad_(False)
    parent = torch.nn.Sequential(q)
    assert lora.attach(parent, ("0",), 4, 8.0, 0.0) == 1
    lora.load_adapters(parent, {k: torch.randn(v.shape) * 0.1 for k, v in lora.full_init(parent, 0).items()})
    assert fp8.quantize_frozen(parent) == 1 and isinstance(q, fp8.Fp8Linear) and q.weight_fp8.dtype == fp8.E4M3
    # e4m3 keeps 3 mantissa bits: each weight within 1/16 of itself (relative), per-channel scale exact at the max
    assert torch.allclose(fp8.dequantized(q), ref.weight, rtol=1 / 16, atol=q.weight_scale.max().item())
    x = torch.randn(5, 64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y = parent(x)
    delta = q.lora_B(q.lora_A(x_ref)) * q.lora_scale
    y_ref = ref(x_ref) + delta
    assert rel_err(y, y_ref) < 0.08  # two 3-bit-mantissa operands
    y.square().sum().backward()
    y_ref.square().sum().backward()
    assert rel_err(x.grad, x_ref.grad) < 0.1
    assert q.lora_A.weight.grad is not None and not any(b.requires_grad for b in q.buffers())


def test_the_sharded_fp8_base_holds_fp8_shards_equal_to_the_replicated_base(tmp_path):
    """model.base_sharding=fsdp on one rank (FSDP2 over a process group of one): every block's FP8 weight and its
    scales are sharded parameters in e4m3 and fp32, and gathered they are the replicated placement's, bit for bit
    (rows quantise alone: a row's scale is its own)."""
    import dataclasses

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from trainbench.benchmarks.lora import TINY
    from trainbench.distributed import DistInfo
    from trainbench.families.decoder.lora_placement import place_lora
    from trainbench.families.decoder.model import DecoderLM

    one = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    placed = {}
    try:
        for sharding in ("replicate", "fsdp"):
            cfg = dataclasses.replace(TINY, base_precision="fp8", base_sharding=sharding)
            with torch.device("meta"):
                model = DecoderLM(cfg)
            placed[sharding] = place_lora(model, cfg, one, 1, False, PerfConfig(), 7)
        sharded = dict(placed["fsdp"].module.named_parameters())
        whole = dict(placed["replicate"].module.named_buffers()) | dict(placed["replicate"].module.named_parameters())
        fp8_names = [n for n in sharded if n.endswith(("weight_fp8", "weight_scale"))]
        assert len(fp8_names) == 2 * 5 * TINY.num_layers  # q/k/v fused, o, gate, up, down: weights and scales
        for name in fp8_names:
            p = sharded[name]
            assert isinstance(p, DTensor) and not p.requires_grad
            assert p.dtype == (torch.float8_e4m3fn if name.endswith("weight_fp8") else torch.float32)
            assert torch.equal(
                p.full_tensor().view(torch.uint8) if p.dtype != torch.float32 else p.full_tensor(),
                whole[name].view(torch.uint8) if p.dtype != torch.float32 else whole[name],
            )
        assert "FP8 base sharded by FSDP2, gathered in FP8" in placed["fsdp"].notes[-1]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
