"""LLM training throughput: trainbench's decoder against HF LlamaForCausalLM of the same shape, and 8B sharded.

Single GPU (default): the bf16 matmul peak (8192^3 GEMMs), then the `llama-1b` preset's shape (Llama 3.2 1B:
16 x 2048, GQA 32/8, SwiGLU 8192, vocab 128,256, tied embeddings), seq 8192, one sequence per micro-batch and
`--accum` (default 1, then 32, the preset's global batch) micro-batches per AdamW step, bf16 autocast, on the same
random tokens: HF `LlamaForCausalLM` (SDPA, torch.compile, labels in and the loss computed inside the model, as
HF users train) and ours (compiled per block, and the output layer with its loss compiled as one function).
Reported: tokens/s, MFU against the measured peak (6 x parameters + causal attention per token, the embedding
lookup excluded), peak memory.

Multi GPU (`--gpus N`, run on N GPUs): the `llama31-8b` preset's shape under torchrun, FSDP2 over N, then FSDP
x TP 2 (`--tps`), each with and/or without activation checkpointing (`--acs on off`), compiled blocks, bf16
parameters and fp32 gradient reduction, one sequence per rank (per TP group) per step.

Every configuration also reports each GPU's median power and SM clock, the throttle reasons seen and its energy over
the timed steps (NVML at 10 Hz), and the energy per token and per sequence.

One GPU, the 8B width (`--layers L1 L2`): HF compiled, ours in bf16 and ours with FP8 linear layers (torchao's
float8 training, `model.precision=fp8`), nothing recomputed, each at L1 and L2 blocks; a block's cost and the rest
extrapolated to 32 blocks. With `--profile`, each run's step is also split into forward+backward, gradient clip and
AdamW update (CUDA events), its kernels are tabled (torch.profiler, CUDA time a step by kernel and by kind: FP8 GEMM,
bf16 GEMM, attention, optimizer, compiled elementwise, ...) and the difference between the two block counts gives a
block's cost by kind; the causal attention of the 8B shape is also timed through each SDPA backend.

    python perf/llm_throughput.py --out OUT [--steps 10] [--gpus 8 --tps 1 2 --acs on off]
    python perf/llm_throughput.py --out OUT --layers 4 8 --steps 6 --warmup 3 [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from trainbench.benchmarks.llm import LLAMA31_8B, LLAMA_1B  # noqa: E402
from trainbench.models.decoder import DecoderConfig, DecoderLM  # noqa: E402
from trainbench.models.decoder_parallel import parallelize  # noqa: E402
from trainbench.optim.adamw import AdamClipped  # noqa: E402
from trainbench.telemetry import measured_window  # noqa: E402
from trainbench.train.profiling import bf16_matmul_peak_tflops  # noqa: E402


def flops_per_token(cfg: DecoderConfig, seq: int) -> float:
    """6 x (parameters in matmuls) + causal attention (QK^T and AV over half the positions on average) x 3."""
    matmul_params = cfg.num_params(embeddings=False) + cfg.vocab_size * cfg.hidden_size
    attention = 2 * 2 * cfg.num_layers * cfg.hidden_size * seq / 2
    return 6 * matmul_params + 3 * attention


def train_step(mean_loss, opt, tokens: torch.Tensor, autocast: bool, accum: int = 1):
    """A function running one optimizer step per call, over the next ``accum`` of ``tokens`` [n, batch, seq + 1]
    (one micro-batch each); ``mean_loss(batch)`` is the model's mean next-token loss on a micro-batch."""
    it = iter(range(len(tokens)))

    def step():
        for _ in range(accum):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = mean_loss(tokens[next(it)]) / accum
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def ours_mean_loss(model):
    """Our model's loss: the output layer and the cross entropy in one compiled function (``targets=``)."""
    return lambda batch: model(batch[:, :-1], targets=batch[:, 1:]) / batch[:, 1:].numel()


def timed_steps(step, steps: int, warmup: int, gpus: dict | None = None) -> float:
    """Seconds per ``step`` over ``steps`` after ``warmup``. With ``gpus`` (a dict), every GPU of this machine is
    sampled at 10 Hz over the timed steps and ``gpus`` gets each one's power, SM clock, throttle reasons and energy
    (trainbench.telemetry.window_summary)."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with measured_window() if gpus is not None else contextlib.nullcontext({}) as summary:
        t = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - t) / steps
    if gpus is not None:
        gpus.update(summary)
    return seconds


def step_phases(mean_loss, opt, tokens: torch.Tensor, autocast: bool, steps: int = 3) -> dict:
    """Milliseconds a step spends, median over ``steps``: forward+backward, the gradient clip (the norm, and the
    in-place scaling unless the update takes it) and the AdamW update with ``zero_grad`` (CUDA events)."""
    marks = []
    for i in range(steps):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        ev[0].record()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = mean_loss(tokens[i % len(tokens)])
        loss.backward()
        ev[1].record()
        opt.clip_grads()
        ev[2].record()
        opt.update()
        opt.zero_grad(set_to_none=True)
        ev[3].record()
        marks.append(ev)
    torch.cuda.synchronize()

    def median(a: int, b: int) -> float:
        return sorted(ev[a].elapsed_time(ev[b]) for ev in marks)[steps // 2]

    return {"forward_backward_ms": median(0, 1), "clip_ms": median(1, 2), "update_ms": median(2, 3)}


KERNEL_KINDS = (  # first match wins: (kind, substrings of the lower-cased kernel name)
    ("nccl", ("nccl",)),
    ("compiled elementwise", ("triton_",)),  # Inductor's kernels, named after the ops they fuse
    ("attention", ("flash", "fmha", "attn", "attention", "sdpa", "cudnn")),
    ("fp8 gemm", ("e4m3", "f8f8", "fp8", "qgmma", "_qq", "_qr", "_rq")),  # cuBLAS's nvjet: q = e4m3, r = e5m2
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "wgmma", "sm90")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "norm_kernel")),
    ("copy", ("memcpy", "memset", "copy")),
    ("other", ("",)),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next(kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys))


def kernel_table(step, steps: int = 2, top: int = 60) -> dict:
    """CUDA time a step by kernel (the ``top`` longest, microseconds) and by kind, over ``steps`` profiled steps,
    the kernels' total and the wall time a step."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    wall_us = (time.perf_counter() - t) * 1e6 / steps
    kernels = [(a.key, a.self_device_time_total / steps, a.count // steps) for a in prof.key_averages()
               if a.self_device_time_total > 0]  # fmt: skip
    kernels.sort(key=lambda k: -k[1])
    kinds: dict[str, float] = {}
    for name, us, _ in kernels:
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + us
    busy = sum(us for _, us, _ in kernels)
    table = [{"name": n[:160], "us": us, "calls": c, "kind": kernel_kind(n)} for n, us, c in kernels[:top]]
    return {"wall_us": wall_us, "kernel_us": busy, "by_kind_us": kinds, "kernels": table}


def attention_backends(cfg: DecoderConfig, seq: int, reps: int = 10) -> list[dict]:
    """Causal attention of ``cfg``'s shape (one sequence of ``seq``), forward and backward, through each SDPA
    backend: with grouped-query heads as they are (``enable_gqa``) and with the key/value heads repeated."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    d = cfg.hidden_size // cfg.num_heads
    q = torch.randn(1, cfg.num_heads, seq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kv = [torch.randn(1, cfg.kv_heads, seq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "kv"]
    flops = 2 * 2 * seq * seq * d * cfg.num_heads / 2 * 3.5  # causal: forward (2 GEMMs) and backward (2.5 times)
    rows = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        for gqa in ("enable_gqa", "repeated"):

            def run(gqa=gqa):
                k, v = kv
                if gqa == "repeated":
                    rep = cfg.num_heads // cfg.kv_heads
                    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                       enable_gqa=gqa == "enable_gqa")  # fmt: skip
                out.backward(torch.ones_like(out))

            row = {"backend": backend.name, "heads": gqa}
            try:
                with sdpa_kernel([backend]):
                    run()
                    torch.cuda.synchronize()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(reps):
                        run()
                    end.record()
                    torch.cuda.synchronize()
                ms = start.elapsed_time(end) / reps
                row |= {"forward_backward_ms": ms, "tflops": flops / ms / 1e9}
            except RuntimeError as e:
                row["error"] = str(e).splitlines()[0][:200]
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def energy_fields(gpus: dict, tokens: float, seq: int) -> dict:
    """The window's telemetry and its energy per token and per sequence (all GPUs' energy over all their tokens)."""
    joules = sum(g["energy_j"] or 0.0 for g in gpus.values())
    per_token = joules / tokens if joules and tokens else None
    return {"gpus_while_timed": gpus, "energy_j_per_token": per_token,
            "energy_j_per_sequence": per_token * seq if per_token else None}  # fmt: skip


def hf_llama(cfg: DecoderConfig, seq: int):
    import transformers

    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads,
        intermediate_size=cfg.intermediate_size, max_position_embeddings=seq, rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings, attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(hf_cfg).cuda().train()


def single(args, peak: float) -> list[dict]:
    cfg, seq = LLAMA_1B, args.seq
    results = []
    for impl in ("hf_compiled", "ours_compiled"):
        torch.manual_seed(0)
        if impl == "hf_compiled":
            model = torch.compile(hf_llama(cfg, seq))

            def mean_loss(batch, m=model):  # as HF users train: labels in, the loss computed inside the model
                return m(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        else:
            with torch.device("meta"):
                model = DecoderLM(cfg)
            model = parallelize(model, torch.device("cuda"), 1, 1, False, False, True, None, 0).train()
            mean_loss = ours_mean_loss(model)
        n_params = sum(p.numel() for p in model.parameters())
        opt = AdamClipped(model.parameters(), 1.0, lr=1e-4, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1, fused=True)
        for accum in args.accum:
            # --steps and --warmup count sequences' worth of work: at least 2 timed optimizer steps and 1 warm-up
            steps, warmup = max(2, args.steps // accum), max(1, args.warmup // accum)
            gen = torch.Generator(device="cuda").manual_seed(accum)
            shape = ((steps + warmup) * accum, 1, seq + 1)
            tokens = torch.randint(0, cfg.vocab_size, shape, device="cuda", generator=gen)
            step = train_step(mean_loss, opt, tokens, autocast=True, accum=accum)
            torch.cuda.reset_peak_memory_stats()
            gpus: dict = {}
            seconds = timed_steps(step, steps, warmup, gpus)
            tok_s = seq * accum / seconds
            out = {
                "config": f"llama-1b/{impl}/accum{accum}",
                "sequences_per_optimizer_step": accum,
                "parameters": n_params,
                "tokens_per_s": tok_s,
                "optimizer_step_ms": seconds * 1000,
                "model_tflops": tok_s * flops_per_token(cfg, seq) / 1e12,
                "mfu_vs_measured_peak": tok_s * flops_per_token(cfg, seq) / 1e12 / peak,
                "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
            } | energy_fields(gpus, seq * accum * steps, seq)
            print(json.dumps(out), flush=True)
            results.append(out)
        del model, opt
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return results


def fsdp_on_one_gpu(cfg: DecoderConfig, fp8: bool):
    """Ours under FSDP2 over one GPU, as a multi-GPU run places it: bf16 parameters for compute from fp32 shards (the
    optimizer's), fp32 gradient reduction; with ``fp8``, torchao's FP8 all-gather of the weights and their scales
    computed once a step after the optimizer. Returns (model, what runs after each optimizer step)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from trainbench.models.decoder_parallel import apply_fsdp, wrap_blocks

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1)
    mesh = init_device_mesh("cuda", (1,))
    with torch.device("meta"):
        model = DecoderLM(dataclasses.replace(cfg, precision="auto"))
    after = None
    if fp8:
        from torchao.float8 import (
            Float8LinearConfig,
            convert_to_float8_training,
            precompute_float8_dynamic_scale_for_fsdp,
        )

        config = Float8LinearConfig.from_recipe_name("tensorwise")
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True,
                                     force_recompute_fp8_weight_in_bwd=True)  # fmt: skip
        convert_to_float8_training(model, config=config, module_filter_fn=lambda m, n: n.startswith("model.layers."))
        after = lambda: precompute_float8_dynamic_scale_for_fsdp(model)  # noqa: E731
    wrap_blocks(model, False, True)
    apply_fsdp(model, mesh, bf16=True)
    model.to_empty(device="cuda")
    model.init_weights(0)
    return model.train(), after


def one_gpu_8b(args, peak: float) -> list[dict]:
    """The 8B width on one GPU with ``--layers`` blocks (two counts): nothing recomputed, compiled, AdamW (fused) on
    fp32 weights with bf16 autocast, one 8192-token sequence a step. The step time is measured at both counts; the
    slope is a block's cost (forward, backward and its share of the optimizer step), the intercept the rest
    (embedding, output layer and loss, their optimizer step), and 32 blocks are extrapolated from them. For HF
    ``LlamaForCausalLM`` compiled, ours in bf16 and ours with FP8 linear layers (torchao, tensorwise)."""
    seq, results = args.seq, []
    for impl in args.impls:
        times, profiles = {}, {}
        for layers in args.layers:
            fp8 = impl in ("ours_fp8", "ours_fp8_sepclip", "ours_fp8_ac")
            cfg = dataclasses.replace(LLAMA31_8B, num_layers=layers, precision="fp8" if fp8 else "auto",
                                      fused_qkv=not args.separate_qkv)  # fmt: skip
            torch.manual_seed(0)
            after_step = None
            if impl == "hf_compiled":
                model = torch.compile(hf_llama(cfg, seq))
                mean_loss = lambda batch, m=model: m(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss  # noqa: E731
            elif impl.endswith("_fsdp1"):
                model, after_step = fsdp_on_one_gpu(cfg, fp8=impl.startswith("ours_fp8"))
                mean_loss = ours_mean_loss(model)
            else:
                with torch.device("meta"):
                    model = DecoderLM(cfg)
                # _ac: every block recomputed in the backward (activation checkpointing)
                model = parallelize(model, torch.device("cuda"), 1, 1, False, impl.endswith("_ac"), True, None,
                                    0).train()  # fmt: skip
                mean_loss = ours_mean_loss(model)
            # _sepclip: the clip as a pass of its own over the gradients instead of inside the fused update
            opt = AdamClipped(model.parameters(), 1.0, fold_clip=not impl.endswith("_sepclip"), lr=1e-4,
                              betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1, fused=True)  # fmt: skip
            gen = torch.Generator(device="cuda").manual_seed(layers)
            tokens = torch.randint(0, cfg.vocab_size, (args.steps + args.warmup, 1, seq + 1), device="cuda",
                                   generator=gen)  # fmt: skip
            gpus: dict = {}
            autocast = after_step is None and not impl.endswith("_fsdp1")
            weights_and_state = saved = None
            try:  # what the forward keeps for the backward, on top of weights, gradients and optimizer state
                train_step(mean_loss, opt, tokens, autocast=autocast)()  # the optimizer's state exists from here
                torch.cuda.synchronize()
                weights_and_state = torch.cuda.memory_allocated()
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                    loss = mean_loss(tokens[0])
                saved = torch.cuda.memory_allocated() - weights_and_state
                loss.backward()
                opt.zero_grad(set_to_none=True)
                del loss
            except torch.OutOfMemoryError:
                pass
            torch.cuda.reset_peak_memory_stats()
            step = train_step(mean_loss, opt, tokens, autocast=autocast)
            if after_step is not None:
                step = (lambda s, f: lambda: (s(), f()))(step, after_step)
            try:
                seconds = timed_steps(step, args.steps, args.warmup, gpus)
            except torch.OutOfMemoryError:
                seconds = None
            name = impl + ("_separate_qkv" if args.separate_qkv and impl.startswith("ours") else "")
            row = {"config": f"llama31-8b-width/{name}/{layers}_blocks", "layers": layers, "step_s": seconds,
                   "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
                   "weights_and_state_gib": weights_and_state / 2**30 if weights_and_state else None,
                   "saved_for_backward_gib": saved / 2**30 if saved is not None else None}  # fmt: skip
            if seconds:
                row |= energy_fields(gpus, seq * args.steps, seq)
                times[layers] = seconds
                if args.profile:
                    row["phases"] = step_phases(mean_loss, opt, tokens, autocast)
                    if after_step is not None:
                        after_step()
                    # timed_steps used up its tokens: the profiled steps reuse the first ones
                    row["kernels"] = kernel_table(train_step(mean_loss, opt, tokens, autocast=autocast))
                    profiles[layers] = row
            print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
            results.append(row)
            del model, opt, step, mean_loss, tokens  # nothing of this model may stay alive into the next one
            torch._dynamo.reset()
            torch.cuda.empty_cache()
        if len(times) == 2:
            (l1, t1), (l2, t2) = sorted(times.items())
            by_layers = {r["layers"]: r for r in results[-2:]}

            def per_block(v1: float, v2: float, span: int = l2 - l1) -> float:  # the slope between the counts
                return (v2 - v1) / span

            block = per_block(t1, t2)
            rest = t1 - l1 * block
            step32 = rest + 32 * block
            tok = seq / step32
            row = {"config": f"llama31-8b/{name}/32_blocks_extrapolated", "block_ms": block * 1e3,
                   "rest_ms": rest * 1e3, "step_s": step32, "tokens_per_s": tok,
                   "model_tflops": tok * flops_per_token(LLAMA31_8B, seq) / 1e12}  # fmt: skip
            row["mfu_vs_measured_bf16_peak"] = row["model_tflops"] / peak
            # the same extrapolation for the energy a token and the memory the forward keeps
            for key in ("energy_j_per_token", "saved_for_backward_gib", "weights_and_state_gib"):
                v1, v2 = by_layers[l1].get(key), by_layers[l2].get(key)
                if v1 is not None and v2 is not None:
                    row[f"{key}_per_block"] = per_block(v1, v2)
                    row[f"{key}_32_blocks"] = v1 + (32 - l1) * per_block(v1, v2)
            if len(profiles) == 2:  # a block's share of each kind of kernel, and of each phase
                p1, p2 = profiles[l1], profiles[l2]
                k1, k2 = p1["kernels"]["by_kind_us"], p2["kernels"]["by_kind_us"]
                row["block_by_kind_ms"] = {k: per_block(k1.get(k, 0.0), k2[k]) / 1e3 for k in k2}
                row["block_phases_ms"] = {k: per_block(p1["phases"][k], p2["phases"][k]) for k in p2["phases"]}
                row["block_kernel_ms"] = per_block(p1["kernels"]["kernel_us"], p2["kernels"]["kernel_us"]) / 1e3
            print(json.dumps(row), flush=True)
            results.append(row)
    return results


def worker(args) -> None:
    """One rank of the sharded 8B measurement (under torchrun)."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))
    cfg, seq = dataclasses.replace(LLAMA31_8B, fused_qkv=args.tp == 1), args.seq  # fused q/k/v has no TP plan
    with torch.device("meta"):
        model = DecoderLM(cfg)
    model = parallelize(model, torch.device("cuda"), world, args.tp, True, bool(args.ac), True, None, 0).train()
    opt = AdamClipped(model.parameters(), 1.0, lr=1e-4, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1, fused=True)
    dp_rank = rank // args.tp
    gen = torch.Generator(device="cuda").manual_seed(dp_rank)
    tokens = torch.randint(0, cfg.vocab_size, (args.steps + args.warmup, 1, seq + 1), device="cuda", generator=gen)
    step = train_step(ours_mean_loss(model), opt, tokens, autocast=False)  # FSDP's policy computes in bf16

    torch.cuda.reset_peak_memory_stats()
    gpus: dict | None = {} if rank == 0 else None  # rank 0 samples every GPU of the node
    seconds = timed_steps(step, args.steps, args.warmup, gpus)
    replicas = world // args.tp
    tok_s = seq * replicas / seconds
    layout = f"fsdp{replicas}" + (f"_tp{args.tp}" if args.tp > 1 else "") + ("" if args.ac else "_no_ac")
    out = {
        "config": f"llama31-8b/{layout}",
        "gpus": world,
        "tokens_per_s_per_gpu": tok_s / world,
        "step_ms": seconds * 1000,
        "model_tflops_per_gpu": tok_s * flops_per_token(cfg, seq) / world / 1e12,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    if rank == 0:
        out["mfu_vs_measured_peak"] = out["model_tflops_per_gpu"] / args.peak
        out |= energy_fields(gpus, seq * replicas * args.steps, seq)
        print(json.dumps(out), flush=True)
        Path(args.out, f"{out['config'].replace('/', '_')}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument(
        "--accum",
        type=int,
        nargs="+",
        default=[1, 32],
        help="one GPU: sequences per optimizer step (the llama-1b preset: global batch 32, micro-batch 1)",
    )
    p.add_argument("--layers", type=int, nargs=2, help="one GPU: the 8B width at these two block counts, HF against "
                   "ours in bf16 and FP8, extrapolated to 32 blocks")  # fmt: skip
    impls = [
        "hf_compiled",
        "ours_bf16",
        "ours_fp8",
        "ours_fp8_sepclip",
        "ours_fp8_ac",
        "ours_bf16_fsdp1",
        "ours_fp8_fsdp1",
    ]
    p.add_argument("--impls", nargs="+", default=impls, choices=impls, help="with --layers: which to measure")
    p.add_argument("--separate-qkv", action="store_true", help="with --layers: ours with q/k/v_proj instead of the "
                   "preset's one qkv_proj (model.fused_qkv=false)")  # fmt: skip
    p.add_argument("--profile", action="store_true", help="with --layers: each run's phases and kernels, a block's "
                   "cost by kind of kernel, and the 8B shape's attention through each SDPA backend")  # fmt: skip
    p.add_argument("--gpus", type=int, default=1, help="N > 1: the sharded 8B measurement on N GPUs")
    p.add_argument("--tps", type=int, nargs="+", default=[1, 2], help="tensor-parallel degrees to measure (--gpus > 1)")
    p.add_argument("--acs", nargs="+", choices=["on", "off"], default=["on"],
                   help="activation checkpointing settings to measure (--gpus > 1)")  # fmt: skip
    p.add_argument("--ac", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--peak", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        return worker(args)
    torch.backends.cuda.matmul.allow_tf32 = True
    peak = bf16_matmul_peak_tflops()
    report = {"bf16_matmul_peak_tflops": peak, "gpu": torch.cuda.get_device_name(), "runs": []}
    print(json.dumps({"bf16_matmul_peak_tflops": peak}), flush=True)
    if args.layers:
        if args.profile:
            report["attention_backends"] = attention_backends(LLAMA31_8B, args.seq)
        report["runs"] = one_gpu_8b(args, peak)
    elif args.gpus == 1:
        report["runs"] = single(args, peak)
        for hf, ours in zip(report["runs"][: len(args.accum)], report["runs"][len(args.accum) :], strict=True):
            ours["ratio_to_hf"] = ours["tokens_per_s"] / hf["tokens_per_s"]
    else:
        for tp in args.tps:
            for ac in args.acs:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.gpus}",
                       __file__, "--worker", "--out", str(args.out), "--steps", str(args.steps), "--warmup",
                       str(args.warmup), "--seq", str(args.seq), "--tp", str(tp), "--peak", str(peak),
                       "--ac", str(int(ac == "on"))]  # fmt: skip
                # without checkpointing a layout may not fit: record that and go on
                done = subprocess.run(cmd)
                if done.returncode != 0:
                    failed = {"config": f"llama31-8b/tp{tp}_ac_{ac}", "error": f"exit {done.returncode}"}
                    (args.out / f"llama31-8b_tp{tp}_ac_{ac}_failed.json").write_text(json.dumps(failed))
        report["runs"] = [json.loads(f.read_text()) for f in sorted(args.out.glob("llama31-8b_*.json"))]
    (args.out / "llm_throughput.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
