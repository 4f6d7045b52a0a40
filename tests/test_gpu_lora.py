"""LoRA on one GPU: the tiny preset to its target (bf16 or FP8 base, offloaded blocks), and offloaded or
host-recomputed blocks against kept ones.

Part of the single-GPU tier (``make test-gpu``, every tests/test_gpu_*.py but test_gpu_multi.py), skipped where no
CUDA device is visible."""

import pytest
import torch
from conftest import single_gpu_tier, tiny_run_to_target_on_cuda

pytestmark = single_gpu_tier()


@pytest.mark.parametrize("base", ["auto", "fp8"])
def test_tiny_lora_reaches_its_target_with_a_bf16_or_fp8_base_compiled_on_cuda(tmp_path, base):
    tiny_run_to_target_on_cuda(tmp_path, "llama2_70b_lora", "perf.compile=true", "perf.activation_checkpointing=true",
                               f"model.base_precision={base}")  # fmt: skip


def test_offloaded_blocks_train_like_kept_ones_with_less_gpu_memory_on_cuda(monkeypatch):
    """Four FP8 LoRA blocks, compiled inside their checkpointing as `trainbench run` places them: with two blocks'
    saved activations in host memory the loss is the same and the adapters' gradients too, and the GPU holds less
    between forward and backward."""
    import dataclasses

    from trainbench.benchmarks.lora import TINY
    from trainbench.config import PerfConfig
    from trainbench.distributed import DistInfo
    from trainbench.families.decoder import offload
    from trainbench.families.decoder.lora_placement import place_lora
    from trainbench.families.decoder.model import DecoderLM

    monkeypatch.setattr(offload, "MIN_BYTES", 1 << 20)
    cfg = dataclasses.replace(TINY, hidden_size=1024, num_heads=8, num_kv_heads=2, intermediate_size=2816,
                              num_layers=4, vocab_size=1000, max_seq_length=2048, base_precision="fp8")  # fmt: skip
    with torch.device("meta"):
        model = DecoderLM(cfg)
    one = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cuda", 0))
    model = place_lora(model, cfg, one, 1, True, PerfConfig(compile=True), 0).module
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 1000, (2, 2048), generator=gen).cuda()

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens, targets=tokens)
        held = torch.cuda.memory_allocated()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads, held

    step()  # compile
    loss, grads, held = step()
    _, again, _ = step()  # the attention backward's own run-to-run differences (its atomics)
    moved = offload.offload_blocks(model.model.layers, 2, one.device)
    assert moved.offloaded == [0, 2]
    step()
    loss_off, grads_off, held_off = step()
    assert moved.bytes_per_step > 2 * 2048 * 1024 * 2  # at least a block's input and its attention output
    assert torch.equal(loss_off, loss)
    for name, g in grads.items():
        noise = float((again[name] - g).abs().max())
        err = float((grads_off[name] - g).abs().max())
        scale = float(g.abs().max())
        assert err <= max(2 * noise, 1e-3 * scale), (name, err, noise, scale)
    assert all(float(g.abs().max()) > 0 for n, g in grads.items() if "lora_B" in n)  # (lora_B starts at 0: A's are 0)
    assert held - held_off > moved.bytes_per_step / 4  # block 0's copies are released during the forward
    moved.remove()
    assert all(b.saved_to_host is None for b in model.model.layers)


def test_recomputed_blocks_with_their_inputs_on_the_host_train_like_kept_ones_on_cuda(monkeypatch):
    """The last two of four FP8 LoRA blocks recomputed, their inputs in host memory (offload.recompute_from_host):
    the same loss and adapters' gradients as recomputing them with the inputs on the GPU, and the GPU holds less
    between forward and backward."""
    import dataclasses

    from trainbench.benchmarks.lora import TINY
    from trainbench.config import PerfConfig
    from trainbench.distributed import DistInfo
    from trainbench.families.decoder import offload
    from trainbench.families.decoder.lora_placement import place_lora
    from trainbench.families.decoder.memory import recompute_last
    from trainbench.families.decoder.model import DecoderLM

    monkeypatch.setattr(offload, "MIN_BYTES", 1 << 20)
    cfg = dataclasses.replace(TINY, hidden_size=1024, num_heads=8, num_kv_heads=2, intermediate_size=2816,
                              num_layers=4, vocab_size=1000, max_seq_length=2048, base_precision="fp8")  # fmt: skip
    with torch.device("meta"):
        model = DecoderLM(cfg)
    one = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cuda", 0))
    model = place_lora(model, cfg, one, 1, True, PerfConfig(compile=True), 0).module
    recompute_last(model, 4)  # all four (the first's input needs no gradient): 0 and 1 are released in the forward
    tokens = torch.randint(0, 1000, (2, 2048), generator=torch.Generator().manual_seed(0)).cuda()

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens, targets=tokens)
        held = torch.cuda.memory_allocated()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads, held

    step()
    loss, grads, held = step()
    _, again, _ = step()
    moved = offload.offload_blocks(model.model.layers, 0, one.device, recomputed_inputs=True)
    assert moved.offloaded == [0, 1, 2, 3]
    step()
    loss_off, grads_off, held_off = step()
    assert moved.bytes_per_step == 4 * 2 * 2048 * 1024 * 2  # four blocks' inputs, bf16 [2, 2048, 1024]
    assert torch.equal(loss_off, loss)
    for name, g in grads.items():
        noise = float((again[name] - g).abs().max())
        err = float((grads_off[name] - g).abs().max())
        assert err <= max(2 * noise, 1e-3 * float(g.abs().max())), (name, err, noise)
    assert all(float(g.abs().max()) > 0 for n, g in grads_off.items() if "lora_B" in n)
    # blocks 0 and 1's inputs (8 MiB each) left the GPU during the forward: more than one input's bytes are freed
    # (measured on an H200: 13.75 MiB fewer held; one input alone would be 8 MiB)
    assert held - held_off >= 1.5 * 2 * 2048 * 1024 * 2, held - held_off
    moved.remove()


def test_tiny_lora_reaches_its_target_with_offloaded_blocks_on_cuda(tmp_path, monkeypatch):
    from trainbench.families.decoder import offload

    monkeypatch.setattr(offload, "MIN_BYTES", 0)  # the tiny model's tensors are small: move them all
    tiny_run_to_target_on_cuda(tmp_path, "llama2_70b_lora", "perf.compile=true", "perf.activation_checkpointing=true",
                               "perf.recompute_blocks=1", "perf.offload_blocks=1",
                               "model.base_precision=fp8")  # fmt: skip
