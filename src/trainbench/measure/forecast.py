"""Several GPUs of one node forecast from one: `trainbench bench` on one GPU keeps its measured step at each depth
(cached per GPU model, software and shape, beside the layout probe's cache), and `trainbench bench --nproc N` at the
same shape and micro-batch forecasts its own step before it times it: the one GPU's step, scaled to the micro-batches
each rank runs, plus what the family says N ranks add (``ModelFamily.node_costs``: the collectives no compute hides,
FSDP2's own copies; families/node_costs.py). Rank 0 says the forecast before its timed steps and how far the
measurement fell from it after; bench.json holds both, at the model's depth where the depths are extrapolated.

What the one GPU's step counts once a step (the optimizer's update) is scaled with the micro-batches too: a small
error where the ranks run fewer micro-batches each than the one GPU did. The families that plan their layout
(``perf.plan=auto``: the LoRA, the 8B) print the plan's prediction as well, from their probe."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from trainbench.families.node_costs import OneGpu, micro_batches

FORMAT = 1


def cache_dir() -> Path:
    from trainbench.measure.probe import cache_dir as probes

    return probes().parent / "one-gpu"


def shape_key(cfg) -> str:
    """What one GPU's step depends on beyond its GPU: the benchmark, the model (at its depth), the sequence, the
    micro-batch, the rows' layout, the speed keys (``perf``: compile, recomputation, offload), the optimizer and the
    software; not the global batch (the forecast scales by micro-batches) nor the distributed keys (the forecast
    adds what they cost)."""
    import torch

    import trainbench

    shape = {"format": FORMAT, "benchmark": cfg.benchmark, "model": dataclasses.asdict(cfg.model),
             "seq": cfg.data.seq_length, "micro": cfg.data.micro_batch_size, "layout": cfg.data.layout,
             "perf": dataclasses.asdict(cfg.perf), "optimizer": dataclasses.asdict(cfg.optimizer),
             "torch": torch.__version__, "trainbench": trainbench.__version__}  # fmt: skip
    return hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _path(cfg, gpu_name: str) -> Path:
    name = "".join(c if c.isalnum() else "_" for c in gpu_name)
    return cache_dir() / f"{shape_key(cfg)}-{name}.json"


def save(cfg, one: OneGpu) -> Path:
    """Keep ``one`` (this shape's step on one GPU) for a later measurement of the shape on several GPUs."""
    path = _path(cfg, one.gpu_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dataclasses.asdict(one), indent=2) + "\n")
    os.replace(tmp, path)
    return path


def cached(cfg, gpu_name: str) -> OneGpu | None:
    """The one-GPU step kept for ``cfg``'s shape on ``gpu_name``; None where there is none, or the file does not
    hold one (written by another version, or damaged: it is measured again by the next one-GPU bench)."""
    path = _path(cfg, gpu_name)
    try:
        data = json.loads(path.read_text())
        one = OneGpu(**{f.name: data[f.name] for f in dataclasses.fields(OneGpu) if f.name in data})
    except (OSError, ValueError, TypeError):
        return None
    numbers = [one.step_s, one.micro_batches, one.block_params, one.other_params, one.expert_params]
    if one.family_rates is not None:
        if not isinstance(one.family_rates, dict) or not all(isinstance(k, str) for k in one.family_rates):
            return None
        numbers += list(one.family_rates.values())
    if one.expert_loads is not None:
        if not isinstance(one.expert_loads, list) or not all(isinstance(b, list) for b in one.expert_loads):
            return None
        numbers += [n for block in one.expert_loads for n in block]
    if not all(isinstance(n, (int, float)) and not isinstance(n, bool) and n >= 0 for n in numbers) or \
            one.step_s <= 0 or one.micro_batches < 1:  # fmt: skip
        return None
    return one


def measured(cfg, bench, model, step_s: float, gpu_name: str, copy_rate: float | None,
             expert_loads: list[list[int]] | None = None,
             family_rates: dict[str, float] | None = None) -> OneGpu:  # fmt: skip
    """This process's one-GPU step at ``cfg``'s shape, with ``model``'s trained parameters split as the family
    counts its blocks (and a mixture's tokens per expert, per block, where it has experts; and what the family timed
    for its own costs, where it did)."""
    blocks = bench.family.blocks_of(model)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    in_blocks = sum(p.numel() for b in blocks for p in b.parameters() if p.requires_grad)
    return OneGpu(step_s=step_s, micro_batches=micro_batches(cfg, 1), block_params=in_blocks,
                  other_params=trained - in_blocks, expert_params=bench.family.expert_params(model),
                  device_copy_bytes_s=copy_rate, gpu_name=gpu_name, expert_loads=expert_loads,
                  family_rates=family_rates or None,
                  measured_at=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))  # fmt: skip


def forecast(bench, cfg, ranks: int, gpu_name: str) -> dict[str, Any]:
    """This shape's step on ``ranks`` GPUs of one node, forecast: ``{"step_s", "split_s": {what: seconds a step},
    "one_gpu": {...}}``, or ``{"none": why}`` where it cannot be (no one-GPU step kept for the shape on this GPU
    model, or a family with no model of what the ranks add)."""
    if cfg.distributed.nodes > 1:
        return {"none": "the forecast models the GPUs of one node (the collectives' rate is NVLink's)"}
    one = cached(cfg, gpu_name)
    if one is None:
        return {
            "none": f"no step of this shape on one {gpu_name} is kept (measure it with `trainbench bench` on "
            "one GPU first, at the same depths, micro-batch and keys but the distributed ones)"
        }
    costs = bench.family.node_costs(cfg, ranks, one)
    if isinstance(costs, str):
        return {"none": costs}
    compute = one.step_s * micro_batches(cfg, ranks) / one.micro_batches
    split = {"compute (one GPU's step)": compute} | costs
    return {"step_s": sum(split.values()), "split_s": split, "one_gpu": dataclasses.asdict(one)}


def split_text(split_s: dict[str, float]) -> str:
    """A forecast's split (seconds a step by what) in words, in ms."""
    return ", ".join(f"{what} {s * 1e3:,.1f} ms" for what, s in split_s.items())


def line(f: dict[str, Any]) -> str:
    """The forecast in a sentence: the step and its split."""
    if "none" in f:
        return f"no forecast from one GPU: {f['none']}"
    return (f"forecast from one GPU's step (measured {f['one_gpu']['measured_at']}): {f['step_s']:.3f} s a step "
            f"({split_text(f['split_s'])})")  # fmt: skip
