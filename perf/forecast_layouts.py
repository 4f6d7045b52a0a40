"""The forecast of several GPUs (measure/forecast.py) for several layouts at once, from one GPU's measured steps.

`trainbench bench --nproc N` forecasts the one layout it runs, from the step a one-GPU bench kept on that machine.
This takes the one GPU's steps at two depths from a measurement already written down (docs/performance.md), takes
them to the model's depth along the line through them (as `trainbench bench` does), and prints the forecast of each
layout given (a set of `distributed` keys) on N GPUs of one node, split as the bench prints it: which layout to
measure first, and what to expect of it. A forecast, not a measurement: the device says what the layouts do.

    python perf/forecast_layouts.py gpt_oss_20b --preset gpt-oss-20b --nproc 2 --depths 2,4 --steps 0.973,1.418 \\
        --copy-rate 2.011e12 --key model.precision=fp8 --key perf.compile=true \\
        --layout distributed.ep=2 --layout "distributed.ep=1 distributed.grad_reduce_dtype=bf16"

The one GPU's FSDP2 copy rate (`--copy-rate`, bytes copied a second) is what the one-GPU bench's probe timed
(`device_copy_bytes_s` in its kept step); without it FSDP2's own copies are not counted.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile


def _pair(text: str, kind: type, what: str) -> tuple:
    try:
        a, b = (kind(v) for v in text.split(","))
    except ValueError:
        raise SystemExit(f"error: {what} takes two numbers split by a comma, not {text!r}") from None
    return a, b


def _keys(items: list[str]) -> dict[str, str]:
    keys = {}
    for item in items:
        for pair in item.split():
            if "=" not in pair:
                raise SystemExit(f"error: {pair!r} is not a key=value pair")
            key, value = pair.split("=", 1)
            keys[key] = value
    return keys


def forecasts(name: str, preset: str | None, keys: dict[str, str], layouts: list[dict[str, str]], nproc: int,
              depths: tuple[int, int], steps: tuple[float, float], copy_rate: float | None,
              gpu: str = "GPU") -> list[dict]:  # fmt: skip
    """Each layout's forecast on ``nproc`` GPUs (measure/forecast.forecast's dict, with ``tokens_per_s_per_rank``
    and ``of_one``: the rate a GPU over the one GPU's), from one GPU's ``steps`` (s) at ``depths``, at the model's
    own depth, ``keys`` on both."""
    import torch

    from trainbench.measure import forecast
    from trainbench.resolve import build_config

    (d1, d2), (s1, s2) = depths, steps
    if d1 == d2 or min(d1, d2) < 1 or min(s1, s2) <= 0:
        raise SystemExit("error: --depths takes two different depths of 1 or more, --steps two positive seconds")
    bench, one_cfg = build_config(name, preset, None, dict(keys))
    depth = one_cfg.model.num_layers
    step = s1 + (s2 - s1) / (d2 - d1) * (depth - d1)  # the line through the two depths, to the model's
    with torch.device("meta"):
        model = bench.family.build_model(one_cfg)
    one = forecast.measured(one_cfg, bench, model, step, gpu, copy_rate)
    forecast.save(one_cfg, one)
    tokens = bench.family.tokens_per_sample(one_cfg)
    out = []
    for layout in layouts:
        gbs = str(one_cfg.data.global_batch_size)  # the one GPU's global batch: each rank 1 / nproc of it
        _, cfg = build_config(name, preset, None, dict(keys) | {"distributed.nproc": str(nproc),
                                                                "data.global_batch_size": gbs} | layout)  # fmt: skip
        got = forecast.forecast(bench, cfg, nproc, gpu)
        if "step_s" in got:
            samples = forecast.micro_batches(cfg, nproc) * cfg.data.micro_batch_size
            got["tokens_per_s_per_rank"] = samples * tokens / got["step_s"]
            got["of_one"] = got["tokens_per_s_per_rank"] / (one_cfg.data.global_batch_size * tokens / step)
        out.append({"layout": layout, "one_gpu_step_s": step, "depth": depth} | got)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("benchmark")
    p.add_argument("--preset")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--depths", required=True, help="the two depths the one GPU measured, e.g. 2,4")
    p.add_argument("--steps", required=True, help="its step (s) at each, e.g. 0.973,1.418")
    p.add_argument("--copy-rate", type=float, help="the one GPU's copy rate, bytes copied a second")
    p.add_argument("--gpu", default="GPU", help="the GPU's name (a label)")
    p.add_argument("--key", action="append", default=[], help="key=value on both (repeat)")
    p.add_argument("--layout", action="append", default=[], help="the distributed keys of a layout (repeat)")
    args = p.parse_args()
    if args.nproc < 2:
        raise SystemExit("error: --nproc takes 2 or more GPUs")
    depths, steps = _pair(args.depths, int, "--depths"), _pair(args.steps, float, "--steps")
    layouts = [_keys([layout]) for layout in args.layout] or [{}]
    os.environ["TRAINBENCH_CACHE_DIR"] = tempfile.mkdtemp(prefix="forecast-layouts-")  # (the kept step goes here)
    for row in forecasts(args.benchmark, args.preset, _keys(args.key), layouts, args.nproc, depths, steps,
                         args.copy_rate, args.gpu):  # fmt: skip
        name = " ".join(f"{k}={v}" for k, v in row["layout"].items()) or "the default layout"
        if "none" in row:
            print(f"{name}: no forecast ({row['none']})")
            continue
        split = ", ".join(f"{what} {s * 1000:,.1f} ms" for what, s in row["split_s"].items())
        print(f"{name}: {row['step_s']:.3f} s a step at {row['depth']} blocks, {row['tokens_per_s_per_rank']:,.0f} "
              f"tokens/s a GPU, {row['of_one']:.3f} of one GPU's ({split})")  # fmt: skip
    sys.stdout.flush()


if __name__ == "__main__":
    main()
