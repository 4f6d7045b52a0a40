"""What users would run instead, timed the way `trainbench bench` times ours (``--compare hf``): HF `transformers`
(`LlamaForCausalLM`, `GptOssForCausalLM`, `BertForPreTraining`), with `peft`'s LoRA for the fine-tuning benchmark,
and `diffusers`' `FluxTransformer2DModel` for FLUX.1's MMDiT, built from the same config at the same depth, fed the
same rows cut into the same micro-batches, trained with AdamW under bf16 autocast and the same gradient clip, eager
and compiled. One process only; transformers, peft and diffusers are optional. Each model family's twin is its
families/<family>/hf.py, which the benchmark names (:attr:`~trainbench.families.base.ModelFamily.hf_twin`)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import time
from types import ModuleType
from typing import Any

import torch

from trainbench.benchmarks.base import Benchmark
from trainbench.config import RunConfig
from trainbench.errors import UserError


def twin(bench: Benchmark) -> ModuleType | None:
    """The module that builds HF's model of the benchmark's architecture (its family's hf.py); None for none."""
    return importlib.import_module(bench.family.hf_twin) if bench.family.hf_twin else None


def require(bench: Benchmark, cfg: RunConfig) -> str:
    """The HF peer to compare with (its name, for the console), or one sentence why none can run here."""
    hf = twin(bench)
    name = hf.peer(cfg) if hf is not None else None
    if name is None:
        instead = f" ({bench.family.peer_elsewhere})" if bench.family.peer_elsewhere else ""
        raise UserError(f"--compare hf: transformers has no model of {bench.name}'s architecture to compare "
                        f"with{instead}")  # fmt: skip
    hf.check(cfg)
    missing = [package for package in hf.packages(cfg) if importlib.util.find_spec(package) is None]
    if missing:
        raise UserError(f"--compare hf needs {' and '.join(missing)}: pip install {' '.join(missing)} "
                        "(or pip install -e '.[test]' in trainbench's clone)")  # fmt: skip
    if cfg.distributed.world_size > 1:
        raise UserError("--compare hf runs in one process: drop --nproc")
    return name


def _adamw(model: torch.nn.Module, cfg: RunConfig, device: torch.device):
    """The trainable parameters and the AdamW HF users train them with, at our optimizer's settings."""
    params = [p for p in model.parameters() if p.requires_grad]
    o = cfg.optimizer
    opt = torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.epsilon, weight_decay=o.weight_decay,
                            fused=device.type == "cuda")  # fmt: skip
    return params, opt


def measure(bench: Benchmark, cfg: RunConfig, compiled: bool, steps: int, warmup: int,
            device: torch.device) -> dict[str, Any]:  # fmt: skip
    """HF's seconds for ``steps`` optimizer steps of the global batch after ``warmup``; an out-of-memory is recorded
    as such (HF's peer does not fit where ours does), not raised. HF's BERT has no packed rows: where ours trains on
    packed rows, HF trains on fixed rows of the same length mix (padded, as its users train), and the two are
    compared by samples per second."""
    if cfg.data.layout == "packed":
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, layout="fixed"))
    torch.manual_seed(cfg.seed)
    hf, model = twin(bench), None
    try:
        model = hf.build(cfg, device)
        called = torch.compile(model) if compiled else model
        params, opt = _adamw(model, cfg, device)
        o = cfg.optimizer
        data = bench.bench_data(cfg, 0, 1)
        source = iter(data.train)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for i in range(warmup + steps):
            if i == warmup:
                torch.cuda.synchronize(device) if device.type == "cuda" else None
                start = time.perf_counter()
            micro = next(source)
            samples = micro.samples
            for batch in micro:
                with hf.kernels():
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                        loss = hf.loss(bench, cfg, called, batch, device) / len(micro)
                    loss.backward()
            torch.nn.utils.clip_grad_norm_(params, o.max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        return {
            "steps": steps,
            "warmup": warmup,
            "seconds": seconds,
            "samples_per_step": samples,
            "peak_memory_gib": peak,
        }
    except torch.OutOfMemoryError as exc:
        return {"error": f"out of memory: {str(exc).splitlines()[0]}"}
    finally:
        del model
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
