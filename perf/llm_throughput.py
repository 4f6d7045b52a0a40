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
extrapolated to 32 blocks.

    python perf/llm_throughput.py --out OUT [--steps 10] [--gpus 8 --tps 1 2 --acs on off]
    python perf/llm_throughput.py --out OUT --layers 4 8 --steps 6 --warmup 3
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
        times = {}
        for layers in args.layers:
            cfg = dataclasses.replace(LLAMA31_8B, num_layers=layers, precision="fp8" if impl == "ours_fp8" else "auto")
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
                model = parallelize(model, torch.device("cuda"), 1, 1, False, False, True, None, 0).train()
                mean_loss = ours_mean_loss(model)
            opt = AdamClipped(model.parameters(), 1.0, lr=1e-4, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1,
                              fused=True)  # fmt: skip
            gen = torch.Generator(device="cuda").manual_seed(layers)
            tokens = torch.randint(0, cfg.vocab_size, (args.steps + args.warmup, 1, seq + 1), device="cuda",
                                   generator=gen)  # fmt: skip
            torch.cuda.reset_peak_memory_stats()
            gpus: dict = {}
            step = train_step(mean_loss, opt, tokens, autocast=after_step is None and not impl.endswith("_fsdp1"))
            if after_step is not None:
                step = (lambda s, f: lambda: (s(), f()))(step, after_step)
            try:
                seconds = timed_steps(step, args.steps, args.warmup, gpus)
            except torch.OutOfMemoryError:
                seconds = None
            row = {"config": f"llama31-8b-width/{impl}/{layers}_blocks", "layers": layers, "step_s": seconds,
                   "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}  # fmt: skip
            if seconds:
                row |= energy_fields(gpus, seq * args.steps, seq)
                times[layers] = seconds
            print(json.dumps(row), flush=True)
            results.append(row)
            del model, opt
            torch._dynamo.reset()
            torch.cuda.empty_cache()
        if len(times) == 2:
            (l1, t1), (l2, t2) = sorted(times.items())
            block = (t2 - t1) / (l2 - l1)
            rest = t1 - l1 * block
            step32 = rest + 32 * block
            tok = seq / step32
            row = {"config": f"llama31-8b/{impl}/32_blocks_extrapolated", "block_ms": block * 1e3,
                   "rest_ms": rest * 1e3, "step_s": step32, "tokens_per_s": tok,
                   "model_tflops": tok * flops_per_token(LLAMA31_8B, seq) / 1e12}  # fmt: skip
            row["mfu_vs_measured_bf16_peak"] = row["model_tflops"] / peak
            print(json.dumps(row), flush=True)
            results.append(row)
    return results


def worker(args) -> None:
    """One rank of the sharded 8B measurement (under torchrun)."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))
    cfg, seq = LLAMA31_8B, args.seq
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
    impls = ["hf_compiled", "ours_bf16", "ours_fp8", "ours_bf16_fsdp1", "ours_fp8_fsdp1"]
    p.add_argument("--impls", nargs="+", default=impls, choices=impls, help="with --layers: which to measure")
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
