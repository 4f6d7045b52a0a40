"""The optimizer's step alone at a benchmark's shape: torch's fused AdamW against ``tb_adamw`` (optim/adamw.py) and
torch's foreach AdamW compiled.

The model is the benchmark's own, built by its ``build_model`` at a truncated depth (``--blocks``, default 1) on the
GPU with fp32 weights, and the optimizer its ``build_optimizer`` (the weight-decay groups, ``AdamClipped``). Random
fp32 gradients stand in for a backward's. Ways:
- ``torch_fused``: ``AdamClipped(own_kernel=False)``, torch's fused update for every parameter;
- ``own`` (and ``own_<block>`` for other elements a program): the product's update, ``tb_adamw`` for the large
  parameters;
- ``torch_compiled``: ``torch.optim.AdamW(foreach=True)`` with a tensor learning rate, its ``step`` compiled
  (Inductor's fused kernels over the parameter lists); with the clip, ``clip_grad_norm_`` and the step compiled
  together.
Each way: milliseconds an update (median over ``--steps``), and the bandwidth that means at 28 bytes a parameter (4
read and 3 written, fp32); ``own``'s, ``torch_fused``'s and ``torch_compiled``'s whole step with the clip too; and,
after the same 3 steps from the same state, how far each way's weights are from ``torch_fused``'s.

    python perf/adamw.py --benchmark gpt_oss_20b --preset gpt-oss-20b-hf --out OUT/adamw.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from timing import cuda_ms  # noqa: E402  (perf/timing.py, beside this script)

from trainbench.optim.adamw import OWN_KERNEL_BLOCK, AdamClipped  # noqa: E402
from trainbench.resolve import build_config  # noqa: E402


def model_and_grads(benchmark: str, preset: str, blocks: int):
    bench, cfg = build_config(benchmark, preset, overrides={"model.num_layers": blocks, "perf.compile": True})
    model = bench.family.build_model(cfg).to_empty(device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.detach().normal_(0, 0.02, generator=gen)
    grads = [torch.randn(p.shape, device="cuda", generator=gen) * 1e-3 for p in params]
    return bench, cfg, model, params, grads


def optimizer(way: str, bench, cfg, model, clip: bool):
    """The way's optimizer over ``model`` and the call that runs one update (or, with ``clip``, one whole step)."""
    if way == "torch_compiled":
        o = cfg.optimizer
        groups = bench.build_optimizer(cfg, model).param_groups
        opt = torch.optim.AdamW([{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups],
                                lr=torch.tensor(o.lr, device="cuda"), betas=(o.beta1, o.beta2), eps=o.epsilon,
                                foreach=True, capturable=True)  # fmt: skip
        if not clip:
            return opt, torch.compile(opt.step)
        params = [p for g in opt.param_groups for p in g["params"]]

        def clip_and_step():
            torch.nn.utils.clip_grad_norm_(params, o.max_grad_norm, foreach=True)
            opt.step()

        return opt, torch.compile(clip_and_step)
    opt = bench.build_optimizer(cfg, model)
    assert isinstance(opt, AdamClipped)
    opt.own_kernel = way != "torch_fused"
    opt.own_kernel_block = int(way.split("_")[1]) if way.startswith("own_") else OWN_KERNEL_BLOCK
    if not clip:
        opt.max_grad_norm = 0.0
    return opt, opt.step


def measure(way: str, bench, cfg, model, params, grads, steps: int, clip: bool) -> tuple[dict, list[torch.Tensor]]:
    start = [p.detach().clone() for p in params]
    opt, step = optimizer(way, bench, cfg, model, clip)
    times = []
    for i in range(steps + 3):
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        ms = cuda_ms(step)
        if i == 2:
            after_three = [p.detach().clone() for p in params]
        if i >= 3:
            times.append(ms)
    with torch.no_grad():
        for p, s in zip(params, start, strict=True):
            p.copy_(s)
    numel = sum(p.numel() for p in params)
    ms = statistics.median(times)
    row = {"way": way, "clip": clip, "ms": round(ms, 3), "parameters": numel,
           "tb_s_at_28_bytes": round(28 * numel / ms / 1e9, 3)}  # fmt: skip
    del opt
    torch.cuda.empty_cache()
    return row, after_three


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--benchmark", default="gpt_oss_20b")
    parser.add_argument("--preset", default="gpt-oss-20b-hf")
    parser.add_argument("--blocks", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ways", default="torch_fused,own,own_512,own_2048,own_4096,torch_compiled")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    bench, cfg, model, params, grads = model_and_grads(args.benchmark, args.preset, args.blocks)
    rows, diffs, base = [], {}, None
    for way in args.ways.split(","):
        row, weights = measure(way, bench, cfg, model, params, grads, args.steps, clip=False)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if way == "torch_fused":
            base = weights
        elif base is not None:  # the largest difference from torch's fused weights, relative to their change
            diffs[way] = max(((a - b).abs().max() / (b - s).abs().max().clamp(min=1e-30)).item()
                             for a, b, s in zip(weights, base, [p.detach() for p in params], strict=True))  # fmt: skip
        del weights
    for way in ("torch_fused", "own", "torch_compiled"):
        row, _ = measure(way, bench, cfg, model, params, grads, args.steps, clip=True)
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"benchmark": args.benchmark, "preset": args.preset, "blocks": args.blocks,
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
              "largest_difference_from_torch_fused_relative_to_its_change": diffs}  # fmt: skip
    print(json.dumps(result["largest_difference_from_torch_fused_relative_to_its_change"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
