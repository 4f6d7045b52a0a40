"""Llama-2-70B LoRA training throughput at MLPerf's shape (seq 8192, one row per micro-batch), random weights.

Modes (``--mode``), each printing one JSON line per configuration and writing them to ``--out``:

- ``single`` (one GPU): the bf16 and FP8 rowwise matmul peaks, then ``--layers`` blocks (default 8) of the 70B
  width: HF ``LlamaForCausalLM`` + ``peft`` LoRA (q/k/v/o, eager, gradient checkpointing, as users run it) against
  ours (fused qkv, compiled blocks) with a bf16 and an FP8 frozen base, checkpointing every block or none, and with
  a packed row of two sequences (the masked attention path). Seconds per layer scale to 80 layers.
- ``fp8-one`` (one GPU): all 80 layers with the FP8 base on one H200, built block by block (the bf16 model never
  exists whole), ``--checkpointed`` blocks recomputed (the rest keep their activations), ``--offloaded`` of the
  kept ones with their saved activations in pinned host memory (``models/offload.py``); first the pinned copy
  rates each way.
- ``fsdp`` (torchrun, N GPUs): 80 layers, bf16 base, FSDP2 over the GPUs, ``--checkpointed`` blocks recomputed.
- ``fp8-dp`` (torchrun, N GPUs): the FP8 base whole on every GPU (65 GiB), each GPU its own row, DDP over the
  adapters (44.6 M parameters); ``--checkpointed`` and ``--offloaded`` as for ``fp8-one``.

Every model is placed by ``trainbench.models.lora_parallel.place_lora``, the function ``trainbench run`` uses.
- ``profile`` (one GPU): ``--layers`` FP8 blocks, nothing recomputed: the CUDA time per block by kernel group and
  the 25 longest kernels (torch.profiler self times), and the memory a block keeps for its backward.
- ``load`` (torchrun, N GPUs): rank 0 writes a random ``--layers``-block checkpoint of the 70B width as sharded
  safetensors (fused qkv, bf16); every rank then reads its FSDP2 shards from it. Reported: bytes read per rank,
  seconds, and host memory: peak anonymous memory (sampled every 5 ms) and peak resident set, which also counts
  the checkpoint's memory-mapped pages a rank touched.

MFU by NVIDIA's count for this benchmark: 2,598 TFLOP per 8192-token row (forward and backward of the frozen base
and adapters, recompute excluded), against the H200's dense bf16 peak of 989 TFLOP/s.

    python perf/lora_throughput.py --mode single --out OUT/single.json
    python perf/lora_throughput.py --mode fp8-one --checkpointed 80 --out OUT/fp8_one.json
    torchrun --nproc-per-node 2 perf/lora_throughput.py --mode fsdp --checkpointed 80 --out OUT/fsdp.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "perf"))

from llm_throughput import energy_fields, timed_steps  # noqa: E402

from trainbench.benchmarks.lora import LLAMA2_70B, LoraBenchmark  # noqa: E402
from trainbench.distributed import DistInfo  # noqa: E402
from trainbench.models import fp8  # noqa: E402
from trainbench.models.decoder import DecoderLM, recompute_last, silu_mul  # noqa: E402
from trainbench.models.lora_parallel import place_lora  # noqa: E402
from trainbench.models.offload import offload_blocks  # noqa: E402
from trainbench.optim.adamw import AdamClipped  # noqa: E402
from trainbench.report.projection import project  # noqa: E402
from trainbench.train.profiling import bf16_matmul_peak_tflops  # noqa: E402

SEQ = 8192
TFLOP_PER_ROW = 2598.0  # NVIDIA's count for one 8192-token row of Llama-2-70B LoRA
DENSE_BF16_PEAK = 989.0  # H200 (and H100 SXM) dense bf16 TFLOP/s, the MFU denominator NVIDIA uses
ANSWER_FRACTION = 0.1  # GovReport: about a tenth of a row's tokens are summary tokens
ONE_GPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cuda", 0))


def fp8_matmul_peak_tflops(n: int = 8192, reps: int = 30) -> float:
    a, sa = fp8.quantize_rows(torch.randn(n, n, device="cuda"))
    b, sb = fp8.quantize_rows(torch.randn(n, n, device="cuda"))
    run = lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb.t(), out_dtype=torch.bfloat16)
    return 2 * n**3 / timed_steps(run, reps, 5) / 1e12


def mix_lengths(seed: int = 0) -> list[int]:
    """The sequences of one packed row of raw GovReport: lengths drawn uniformly from 1,024 to 8,192 tokens (what
    is left after MLPerf's 8192-token filter, each a report and its summary) and placed until the row is full; the
    last room, where at least 256 tokens, holds a shorter one, else padding. Over 1,000 seeds: 1 sequence a row 5 %,
    2 65 %, 3 27 %, 4 or 5 4 %; the row measured (seed 0) holds 5,713 + 2,479 tokens."""
    rng = torch.Generator().manual_seed(seed)
    lengths, room = [], SEQ
    while room >= 256:
        n = int(torch.randint(1024, SEQ + 1, (1,), generator=rng))
        lengths.append(min(n, room))
        room -= lengths[-1]
    return lengths


def batch(packed: bool | str = False) -> dict[str, torch.Tensor]:
    """One row: a single sequence (MLPerf's rows), ``True``/``"two"``: two of half a row, ``"mix"``: GovReport's
    length mix (:func:`mix_lengths`)."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 32000, (1, SEQ), generator=g)
    targets = tokens.roll(-1, 1)
    targets[:, : int(SEQ * (1 - ANSWER_FRACTION))] = -100
    out = {"tokens": tokens, "targets": targets}
    if packed:
        lengths = mix_lengths() if packed == "mix" else [SEQ // 2, SEQ // 2]
        pad = SEQ - sum(lengths)
        out["positions"] = torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(pad)]).long()[None]
        out["segments"] = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]
                                    + [torch.full((pad,), -1)]).long()[None]  # fmt: skip
    return {k: v.cuda() for k, v in out.items()}


def optimizer(model: torch.nn.Module) -> AdamClipped:
    params = [p for p in model.parameters() if p.requires_grad]
    return AdamClipped([{"params": params, "weight_decay": 1e-4}], 0.3, lr=4e-4, betas=(0.9, 0.999), eps=1e-8,
                       fused=True)  # fmt: skip


def forward_fn(model, b):
    return lambda: model(b["tokens"], positions=b.get("positions"), segments=b.get("segments"))


def step_fn(model, opt, b):
    count = (b["targets"] != -100).sum()

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(b["tokens"], targets=b["targets"], positions=b.get("positions"),
                         segments=b.get("segments")) / count  # fmt: skip
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def build_ours(layers: int, info: DistInfo, base_precision: str):
    """The 70B shape with ``layers`` blocks and random weights, placed as ``trainbench run`` places it (FSDP2 for a
    bf16 base; for FP8 the whole base on every rank, built block by block, DDP over the adapters), compiled, every
    block checkpointed (``recompute_last`` changes that, as perf.recompute_blocks does in a run). Returns (the
    module, what the step calls)."""
    cfg = dataclasses.replace(LLAMA2_70B, num_layers=layers, base_precision=base_precision)
    with torch.device("meta"):
        model = DecoderLM(cfg)
    placed = place_lora(model, cfg, info, 1, True, True, True, 0)
    return placed.module, placed.model


def forward_seconds(model, forward, reps: int = 2) -> float:
    """One eval forward of a row (no gradients), as the eval runs it."""
    model.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        sec = timed_steps(forward, reps, 1)
    model.train()
    return sec


def measure(name: str, layers: int, model, step, steps: int, warmup: int, gpus: int = 1, extra=None,
            forward=None) -> dict:  # fmt: skip
    torch.cuda.reset_peak_memory_stats()
    # rank 0 samples every GPU of the node over the timed steps
    window: dict | None = {} if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0 else None
    try:
        sec = timed_steps(step, steps, warmup, window)
        fwd = forward_seconds(model, forward) if forward is not None else None
    except torch.OutOfMemoryError as e:
        return {"config": name, "error": f"out of memory: {str(e).splitlines()[0]}"}
    tok = SEQ / sec
    out = {
        "config": name, "layers": layers, "gpus": gpus, "step_s": sec, "tokens_per_s_per_gpu": tok,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30, "ms_per_layer": sec / layers * 1e3,
        "tokens_per_s_per_gpu_at_80_layers": SEQ / (sec * 80 / layers),
    }  # fmt: skip
    if layers == 80:
        out["mfu"] = TFLOP_PER_ROW / sec / DENSE_BF16_PEAK
    if fwd is not None:
        out["eval_forward_s_per_row_at_80_layers"] = fwd * 80 / layers
    if window is not None:
        out |= energy_fields(window, SEQ * gpus * steps, SEQ)  # one row per GPU per step
    return out | (extra or {})


def hf_peft(layers: int, steps: int, warmup: int) -> dict:
    import peft
    import transformers

    c = LLAMA2_70B
    hf = transformers.LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=layers,
                                  num_attention_heads=c.num_heads, num_key_value_heads=c.kv_heads,
                                  intermediate_size=c.intermediate_size, rope_theta=c.rope_theta,
                                  max_position_embeddings=SEQ, attn_implementation="sdpa")  # fmt: skip
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(hf).to(torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.1, bias="none",
                                target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))  # fmt: skip
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=4e-4, weight_decay=1e-4,
                            fused=True)  # fmt: skip
    b = batch()
    labels = b["tokens"].clone()
    labels[:, : int(SEQ * (1 - ANSWER_FRACTION))] = -100

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=b["tokens"], labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 0.3)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return measure("hf_peft_eager_gradckpt", layers, model, step, steps, warmup,
                   forward=lambda: model(input_ids=b["tokens"]).logits)  # fmt: skip


def ours_single(layers: int, fp8_base: bool, checkpointed: int, packed: bool, steps: int, warmup: int) -> dict:
    name = f"ours_{'fp8' if fp8_base else 'bf16'}_ckpt{checkpointed}{'_packed2' if packed else ''}"
    model, _ = build_ours(layers, ONE_GPU, "fp8" if fp8_base else "auto")
    recompute_last(model, checkpointed)
    opt = optimizer(model)
    b = batch(packed)
    out = measure(name, layers, model, step_fn(model, opt, b), steps, warmup, forward=forward_fn(model, b))
    del model, opt
    torch.cuda.empty_cache()
    return out


def mode_single(args) -> list[dict]:
    results = [{"bf16_matmul_peak_tflops": bf16_matmul_peak_tflops(), "fp8_rowwise_matmul_peak_tflops":
                fp8_matmul_peak_tflops(), "gpu": torch.cuda.get_device_name()}]  # fmt: skip
    print(json.dumps(results[0]), flush=True)
    runs = [lambda: hf_peft(args.layers, args.steps, args.warmup)]
    for fp8_base, ckpt, packed in ((False, args.layers, False), (False, 0, False), (True, args.layers, False),
                                   (True, 0, False), (False, 0, True)):  # fmt: skip
        runs.append(lambda f=fp8_base, c=ckpt, p=packed: ours_single(args.layers, f, c, p, args.steps, args.warmup))
    for run in runs:
        results.append(run())
        torch.cuda.empty_cache()  # the run's model is gone
        print(json.dumps(results[-1]), flush=True)
    return results


def mlp_saved(model, how: str) -> None:
    """``fp8``: the placement's FP8-kept SwiGLU inputs; ``bf16``: the plain function (kept in bf16)."""
    if how == "bf16":
        for block in model.model.layers:
            block.mlp.gated = silu_mul


def host_link_gb_per_s(gib: int = 2, reps: int = 5) -> dict:
    """Pinned host <-> GPU copy rates (GB/s), each direction alone: what an offloaded block's bytes travel over."""
    gpu = torch.empty(gib << 30, dtype=torch.uint8, device="cuda")
    host = torch.empty(gib << 30, dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, dst, src in (("device_to_host", host, gpu), ("host_to_device", gpu, host)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out[f"{name}_gb_per_s"] = reps * (gib << 30) / (time.perf_counter() - t) / 1e9
    return out


def mode_fp8_one(args) -> list[dict]:
    model, _ = build_ours(80, ONE_GPU, "fp8")
    mlp_saved(model, args.mlp_saved)
    model.model.packed_kernel = args.packed_kernel
    first = {"fp8_model_gib": torch.cuda.memory_allocated() / 2**30} | host_link_gb_per_s()
    print(json.dumps(first), flush=True)
    results = [first]
    for ckpt, off in args.variants:
        recompute_last(model, ckpt)
        moved = offload_blocks(model.model.layers, off, ONE_GPU.device)
        opt = optimizer(model)
        b = batch(args.packed)
        rows = f"_packed_{args.packed}_{args.packed_kernel}" if args.packed else ""
        name = f"ours_fp8_one_gpu_ckpt{ckpt}_offload{off}_mlp_{args.mlp_saved}{rows}"
        extra = {"recomputed": ckpt, "offloaded": off}
        results.append(measure(name, 80, model, step_fn(model, opt, b), args.steps, args.warmup, extra=extra,
                               forward=forward_fn(model, b)))  # fmt: skip
        if moved is not None:
            results[-1]["offloaded_gib_per_step"] = moved.bytes_per_step / 2**30
            moved.remove()
        print(json.dumps(results[-1]), flush=True)
        del opt, moved
        torch.cuda.empty_cache()
    return results


# Kernel names to the rows of the per-block table (first match wins).
KERNEL_GROUPS = (
    ("FP8 GEMM (_scaled_mm)", ("_qqtst_", "_qqtnt_", "e4m3", "sm90_xmma_gemm_e4m3")),
    ("attention", ("flash", "fmha", "cudnn", "attn", "sdpa", "flex_attention")),
    ("FP8 weight transpose", ("kernel_0d1d2d3d", "transpose", "float8_copy")),
    ("bf16/fp32 GEMM (adapters, lm_head)", ("gemm", "gemv", "cutlass", "sm90_xmma", "nvjet")),
    ("copies", ("copy", "memcpy", "memset", "cat")),
    ("Triton (norms, SwiGLU, quantisation, dropout)", ("triton",)),
)


def _group(name: str) -> str:
    if name == "kernel":  # the Triton transpose of models/fp8.py (its function is named kernel)
        return "FP8 weight transpose"
    low = name.lower()
    for group, keys in KERNEL_GROUPS:
        if any(k in low for k in keys):
            return group
    return "other"


def mode_profile(args) -> list[dict]:
    """``--layers`` FP8 blocks, nothing recomputed, compiled: torch.profiler's CUDA self time per kernel, summed into
    groups and divided by blocks and steps; and the memory each block keeps for its backward."""
    from torch.profiler import ProfilerActivity, profile

    model, _ = build_ours(args.layers, ONE_GPU, "fp8")
    mlp_saved(model, args.mlp_saved)
    model.model.packed_kernel = args.packed_kernel
    recompute_last(model, 0)
    opt = optimizer(model)
    b = batch(args.packed)
    step = step_fn(model, opt, b)
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    weights = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    kept = (torch.cuda.max_memory_allocated() - weights) / args.layers / 2**30
    sec = timed_steps(step, args.steps, 1)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for e in prof.key_averages():
        if e.self_device_time_total > 0:
            kernels[e.key] = kernels.get(e.key, 0.0) + e.self_device_time_total / 1e3 / args.steps / args.layers
    groups: dict[str, float] = {}
    for name, ms in kernels.items():
        groups[_group(name)] = groups.get(_group(name), 0.0) + ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    rows = f"_packed_{args.packed}_{args.packed_kernel}" if args.packed else ""
    return [{"config": f"profile_fp8_{args.layers}_blocks{rows}_mlp_{args.mlp_saved}",
             "layers": args.layers,
             "ms_per_block_wall": sec / args.layers * 1e3, "peak_gib_per_block_above_weights": kept,
             "ms_per_block_by_group": {k: round(v, 3) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
             "top_kernels_ms_per_block": [[k[:120], round(v, 3)] for k, v in top]}]  # fmt: skip


def init_dist() -> DistInfo:
    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local,
                    device=torch.device("cuda", local))  # fmt: skip


def mode_fsdp(args, info: DistInfo) -> list[dict]:
    model, _ = build_ours(80, info, "auto")
    results = []
    for ckpt in args.checkpointed_list:
        recompute_last(model, ckpt)
        opt = optimizer(model)
        b = batch()
        results.append(measure(f"ours_bf16_fsdp{info.world_size}_ckpt{ckpt}", 80, model, step_fn(model, opt, b),
                               args.steps, args.warmup, info.world_size, forward=forward_fn(model, b)))  # fmt: skip
        del opt
        torch.cuda.empty_cache()
    return results


def mode_fp8_dp(args, info: DistInfo) -> list[dict]:
    model, ddp = build_ours(80, info, "fp8")  # the same seed on every rank: the same base and adapters
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    results = []
    for ckpt, off in args.variants:
        recompute_last(model, ckpt)
        moved = offload_blocks(model.model.layers, off, info.device)
        opt = optimizer(model)
        b = batch()
        extra = {"adapter_parameters": adapters, "recomputed": ckpt, "offloaded": off}
        results.append(measure(f"ours_fp8_replicated_ddp{info.world_size}_ckpt{ckpt}_offload{off}", 80, model,
                               step_fn(ddp, opt, b), args.steps, args.warmup, info.world_size, extra,
                               forward=forward_fn(model, b)))  # fmt: skip
        if moved is not None:
            moved.remove()
        del opt, moved
        torch.cuda.empty_cache()
    return results


def _anon_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0


def mode_load(args, info: DistInfo) -> list[dict]:
    import resource

    import torch.distributed as dist

    from trainbench.models.hf_checkpoint import save_sharded

    cfg = dataclasses.replace(LLAMA2_70B, num_layers=args.layers)
    folder = Path(args.ckpt_dir)
    if info.rank == 0 and not (folder / "model.safetensors.index.json").exists():
        model = DecoderLM(dataclasses.replace(cfg, num_layers=1))  # one block at a time on the CPU
        state = {}
        g = torch.Generator().manual_seed(0)
        for name, t in model.state_dict().items():
            shape = t.shape
            names = [name.replace("layers.0.", f"layers.{i}.") for i in range(args.layers)] if ".layers.0." in name \
                else [name]  # fmt: skip
            for n in names:
                state[n] = torch.randn(shape, generator=g, dtype=torch.float32).to(torch.bfloat16) * 0.02
        save_sharded(state, folder, 5 * 2**30)
        del state, model
    dist.barrier()
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    base_anon = _anon_kib()
    peak = [base_anon]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _anon_kib())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t = time.perf_counter()
    with torch.device("meta"):
        model = DecoderLM(cfg)
    model = place_lora(model, dataclasses.replace(cfg, base_weights=str(folder)), info, 1, True, False, False, 0)
    torch.cuda.synchronize()
    sec = time.perf_counter() - t
    done.set()
    sampler.join()
    return [{"config": f"load_{args.layers}_layers_fsdp{info.world_size}", "rank": info.rank,
             "checkpoint_gib": size / 2**30, "seconds": sec, "gib_per_s": size / info.world_size / 2**30 / sec,
             "peak_anon_growth_gib": (peak[0] - base_anon) / 2**20,
             "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}]  # fmt: skip


def projections(rows: list[dict]) -> list[dict]:
    """Projected time to train at GBS 8 for each measured rate, on 1, 2 and 8 GPUs of that rate per GPU
    (trainbench.report.projection: the reference mean samples to target as 8192-token rows, plus every eval of the
    MLPerf cadence on the way, each 173 rows' forwards split over the GPUs: an upper bound, GovReport's validation
    sequences are shorter than a row)."""
    out = []
    for r in rows:
        rate = r.get("tokens_per_s_per_gpu_at_80_layers")
        if not rate:
            continue
        eval_s = 173 * r.get("eval_forward_s_per_row_at_80_layers", 0.0)
        for gpus in (1, 2, 8):
            p = project(LoraBenchmark.name, 8, samples_per_s=rate * gpus / SEQ, eval_seconds=eval_s / gpus)
            out.append({"projection": r["config"], "gpus": gpus, "rcp_mean_samples": p.samples_to_target,
                        "evals": p.evals, "minutes_to_train": p.minutes})  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", required=True, choices=("single", "fp8-one", "fsdp", "fp8-dp", "load", "profile"))
    p.add_argument("--layers", type=int, default=8, help="single, profile: blocks of the 70B width; load: written")
    p.add_argument("--packed", choices=("two", "mix"), help="fp8-one, profile: rows of two sequences, or GovReport's "
                   "length mix (mix_lengths), attention kept inside each")  # fmt: skip
    p.add_argument("--packed-kernel", default="flex", choices=("flex", "dense"),
                   help="fp8-one, profile: packed rows through flex attention's block mask or SDPA's mask")  # fmt: skip
    p.add_argument("--mlp-saved", default="fp8", choices=("fp8", "bf16"),
                   help="fp8-one, profile: SwiGLU inputs kept in FP8 (the placement's) or bf16")  # fmt: skip
    p.add_argument("--checkpointed", default="80", help="blocks recomputed in backward, comma-separated variants")
    p.add_argument("--offloaded", default="0", help="fp8-one, fp8-dp: blocks whose saved activations wait in host "
                   "memory, one count for every --checkpointed variant or one per variant")  # fmt: skip
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--ckpt-dir", default="/tmp/lora70b_ckpt", help="load: where the random checkpoint is written")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    args.checkpointed_list = [int(x) for x in args.checkpointed.split(",")]
    offloaded = [int(x) for x in args.offloaded.split(",")]
    if len(offloaded) not in (1, len(args.checkpointed_list)):
        p.error("--offloaded takes one count or one per --checkpointed variant")
    args.variants = list(zip(args.checkpointed_list, offloaded * len(args.checkpointed_list)
                             if len(offloaded) == 1 else offloaded, strict=True))  # fmt: skip
    distributed = args.mode in ("fsdp", "fp8-dp", "load")
    info = init_dist() if distributed else None
    if args.mode == "single":
        results = mode_single(args)
    elif args.mode == "fp8-one":
        results = mode_fp8_one(args)
    elif args.mode == "profile":
        results = mode_profile(args)
    else:
        results = {"fsdp": mode_fsdp, "fp8-dp": mode_fp8_dp, "load": mode_load}[args.mode](args, info)
    if distributed:
        import torch.distributed as dist

        gathered = [None] * info.world_size
        dist.all_gather_object(gathered, results)
        results = [r for rank in gathered for r in rank] if args.mode == "load" else gathered[0]
        dist.destroy_process_group()
        if info.rank != 0:
            return
    results += projections(results)
    for r in results:
        print(json.dumps(r), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
