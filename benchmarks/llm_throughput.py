"""LLM training throughput: trainbench's decoder against HF LlamaForCausalLM of the same shape, and 8B sharded.

Single GPU (default): the bf16 matmul peak (8192^3 GEMMs), then the `llama-1b` preset's shape (Llama 3.2 1B:
16 x 2048, GQA 32/8, SwiGLU 8192, vocab 128,256, tied embeddings), seq 8192, one sequence per step, bf16
autocast, AdamW, on the same random tokens: HF `LlamaForCausalLM` (SDPA, torch.compile) and ours (compiled per
block). Reported: tokens/s, MFU against the measured peak (6 x parameters + causal attention per token, the
embedding lookup excluded), peak memory.

Multi GPU (`--gpus N`, run on N GPUs): the `llama31-8b` preset's shape under torchrun, FSDP2 over N, then FSDP
x TP 2, both with activation checkpointing, compiled blocks, bf16 parameters and fp32 gradient reduction.

    python benchmarks/llm_throughput.py --out OUT [--steps 10] [--gpus 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from trainbench.benchmarks.llm import LLAMA31_8B, LLAMA_1B, AdamClipped  # noqa: E402
from trainbench.models.decoder import DecoderConfig, DecoderLM  # noqa: E402
from trainbench.train.parallel import parallelize  # noqa: E402
from trainbench.train.profiling import bf16_matmul_peak_tflops  # noqa: E402


def flops_per_token(cfg: DecoderConfig, seq: int) -> float:
    """6 x (parameters in matmuls) + causal attention (QK^T and AV over half the positions on average) x 3."""
    matmul_params = cfg.num_params(embeddings=False) + cfg.vocab_size * cfg.hidden_size
    attention = 2 * 2 * cfg.num_layers * cfg.hidden_size * seq / 2
    return 6 * matmul_params + 3 * attention


def train_step(forward, opt, tokens: torch.Tensor, autocast: bool):
    """A function running one training step on the next of ``tokens`` [steps, batch, seq + 1] per call."""
    it = iter(range(len(tokens)))

    def step():
        batch = tokens[next(it)]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits = forward(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def timed_steps(step, steps: int, warmup: int) -> float:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps


def single(args, peak: float) -> list[dict]:
    cfg, seq = LLAMA_1B, args.seq
    tokens = torch.randint(0, cfg.vocab_size, (args.steps + args.warmup, 1, seq + 1), device="cuda")
    results = []
    for impl in ("hf_compiled", "ours_compiled"):
        torch.manual_seed(0)
        if impl == "hf_compiled":
            import transformers

            hf_cfg = transformers.LlamaConfig(
                vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads,
                intermediate_size=cfg.intermediate_size, max_position_embeddings=seq, rope_theta=cfg.rope_theta,
                tie_word_embeddings=cfg.tie_embeddings, attn_implementation="sdpa",
            )  # fmt: skip
            model = transformers.LlamaForCausalLM(hf_cfg).cuda().train()
            model = torch.compile(model)

            def forward(x, m=model):
                return m(input_ids=x).logits
        else:
            with torch.device("meta"):
                model = DecoderLM(cfg)
            model = parallelize(model, torch.device("cuda"), 1, 1, False, False, True, None, 0).train()
            forward = model
        n_params = sum(p.numel() for p in model.parameters())
        opt = AdamClipped(model.parameters(), 1.0, lr=1e-4, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1, fused=True)
        step = train_step(forward, opt, tokens, autocast=True)

        torch.cuda.reset_peak_memory_stats()
        seconds = timed_steps(step, args.steps, args.warmup)
        tok_s = seq / seconds
        out = {
            "config": f"llama-1b/{impl}",
            "parameters": n_params,
            "tokens_per_s": tok_s,
            "step_ms": seconds * 1000,
            "model_tflops": tok_s * flops_per_token(cfg, seq) / 1e12,
            "mfu_vs_measured_peak": tok_s * flops_per_token(cfg, seq) / 1e12 / peak,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        }
        print(json.dumps(out), flush=True)
        results.append(out)
        del model, opt
        torch._dynamo.reset()
        torch.cuda.empty_cache()
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
    model = parallelize(model, torch.device("cuda"), world, args.tp, True, args.ac, True, None, 0).train()
    opt = AdamClipped(model.parameters(), 1.0, lr=1e-4, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1, fused=True)
    dp_rank = rank // args.tp
    gen = torch.Generator(device="cuda").manual_seed(dp_rank)
    tokens = torch.randint(0, cfg.vocab_size, (args.steps + args.warmup, 1, seq + 1), device="cuda", generator=gen)
    step = train_step(model, opt, tokens, autocast=False)  # FSDP's policy computes in bf16

    torch.cuda.reset_peak_memory_stats()
    seconds = timed_steps(step, args.steps, args.warmup)
    replicas = world // args.tp
    tok_s = seq * replicas / seconds
    out = {
        "config": f"llama31-8b/fsdp{replicas}" + (f"_tp{args.tp}" if args.tp > 1 else ""),
        "gpus": world,
        "tokens_per_s_per_gpu": tok_s / world,
        "step_ms": seconds * 1000,
        "model_tflops_per_gpu": tok_s * flops_per_token(cfg, seq) / world / 1e12,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    if rank == 0:
        out["mfu_vs_measured_peak"] = out["model_tflops_per_gpu"] / args.peak
        print(json.dumps(out), flush=True)
        Path(args.out, f"{out['config'].replace('/', '_')}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--gpus", type=int, default=1, help="N > 1: the sharded 8B measurement on N GPUs")
    p.add_argument("--tps", type=int, nargs="+", default=[1, 2], help="tensor-parallel degrees to measure (--gpus > 1)")
    p.add_argument("--ac", action=argparse.BooleanOptionalAction, default=True, help="activation checkpointing (8B)")
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
    if args.gpus == 1:
        report["runs"] = single(args, peak)
        hf, ours = report["runs"]
        ours["ratio_to_hf"] = ours["tokens_per_s"] / hf["tokens_per_s"]
    else:
        for tp in args.tps:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.gpus}",
                   __file__, "--worker", "--out", str(args.out), "--steps", str(args.steps), "--warmup",
                   str(args.warmup), "--seq", str(args.seq), "--tp", str(tp), "--peak", str(peak)]  # fmt: skip
            subprocess.run(cmd, check=True)
        report["runs"] = [json.loads(f.read_text()) for f in sorted(args.out.glob("llama31-8b_*.json"))]
    (args.out / "llm_throughput.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
