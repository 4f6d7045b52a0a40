"""The forecast of several GPUs (measure/forecast.py) for several layouts at once, from one GPU's measured steps.

`trainbench bench --nproc N` forecasts the one layout it runs, from the step a one-GPU bench kept on that machine.
This takes the one GPU's steps at two depths from a measurement already written down (docs/performance.md), forecasts
each depth and takes the forecast to the model's depth along the line through them (as `trainbench bench` does), and
prints the forecast of each layout given (a set of `distributed` keys) on N GPUs of one node, split as the bench
prints it: which layout to measure first, and what to expect of it. A forecast, not a measurement: the device says
what the layouts do.

    python perf/forecast_layouts.py gpt_oss_20b --preset gpt-oss-20b --nproc 2 --depths 2,4 --steps 0.973,1.418 \\
        --copy-rate 2.011e12 --key model.precision=fp8 --key perf.compile=true \\
        --layout distributed.ep=2 --layout "distributed.ep=1 distributed.grad_reduce_dtype=bf16"

The one GPU's copy rate (`--copy-rate`, bytes copied a second) is what the one-GPU bench timed (`device_copy_bytes_s`
in its kept step); without it FSDP2's own copies are not counted. `--loads` reads a one-GPU bench.json's router loads
(each block's tokens per expert) for a mixture's busiest rank under expert parallelism; without, it is not counted.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from trainbench.config import parse_key_values
from trainbench.errors import UserError
from trainbench.measure.forecast import split_text


def _pair(text: str, kind: type, what: str) -> tuple:
    try:
        a, b = (kind(v) for v in text.split(","))
    except ValueError:
        raise UserError(f"{what} takes two numbers split by a comma, not {text!r}") from None
    return a, b


def forecasts(name: str, preset: str | None, keys: dict[str, str], layouts: list[dict[str, str]], nproc: int,
              depths: tuple[int, int], steps: tuple[float, float], copy_rate: float | None, gpu: str = "GPU",
              loads: list[list[int]] | None = None) -> list[dict]:  # fmt: skip
    """Each layout's forecast on ``nproc`` GPUs from one GPU's ``steps`` (s) at ``depths``, as `trainbench bench`
    takes it: forecast at each depth (the model built that deep), then along the line through the two to the model's
    own depth; ``keys`` on both; ``loads``: the one GPU's tokens per expert per block at the deeper depth (a
    one-GPU bench.json's ``router.loads``; the shallower depth takes its first blocks), for the busiest rank.
    Each: ``layout``, ``depth``, ``one_gpu_step_s`` and, where forecast, ``step_s``, ``split_s``,
    ``tokens_per_s_per_rank`` and ``of_one`` (the rate a GPU over the one GPU's); else ``none``."""
    import torch

    from trainbench.measure import forecast
    from trainbench.report.bench_report import at_depth
    from trainbench.resolve import build_config

    if depths[0] == depths[1] or min(depths) < 1 or min(steps) <= 0:
        raise UserError("--depths takes two different depths of 1 or more, --steps two positive seconds")
    bench, one_cfg = build_config(name, preset, None, dict(keys))
    if loads is not None and len(loads) < max(depths):
        raise UserError(f"the loads hold {len(loads)} blocks, fewer than the depth {max(depths)}")
    depth, gbs = one_cfg.model.num_layers, str(one_cfg.data.global_batch_size)
    for d, step_d in zip(depths, steps, strict=True):  # one GPU's step at each depth, kept as a one-GPU bench keeps it
        _, cfg_d = build_config(name, preset, None, dict(keys) | {"model.num_layers": str(d)})
        with torch.device("meta"):
            model = bench.family.build_model(cfg_d)
        forecast.save(cfg_d, forecast.measured(cfg_d, bench, model, step_d, gpu, copy_rate,
                                               None if loads is None else loads[:d]))  # fmt: skip
    one_step = at_depth(dict(zip(depths, steps, strict=True)), depth)
    tokens = bench.family.tokens_per_sample(one_cfg)
    out = []
    for layout in layouts:
        row: dict = {"layout": layout, "one_gpu_step_s": one_step, "depth": depth}
        got = {}
        for d in depths:  # each rank 1 / nproc of the one GPU's global batch
            shape = {"model.num_layers": str(d), "data.global_batch_size": gbs, "distributed.nproc": str(nproc)}
            _, cfg = build_config(name, preset, None, dict(keys) | shape | layout)
            got[d] = forecast.forecast(bench, cfg, nproc, gpu)
        if any("none" in f for f in got.values()):
            out.append(row | {"none": next(f["none"] for f in got.values() if "none" in f)})
            continue
        deeper = got[max(depths)]["split_s"]
        row["split_s"] = {k: at_depth({d: f["split_s"].get(k, 0.0) for d, f in got.items()}, depth) for k in deeper}
        row["step_s"] = at_depth({d: f["step_s"] for d, f in got.items()}, depth)
        samples = forecast.micro_batches(cfg, nproc) * cfg.data.micro_batch_size
        row["tokens_per_s_per_rank"] = samples * tokens / row["step_s"]
        row["of_one"] = row["tokens_per_s_per_rank"] / (one_cfg.data.global_batch_size * tokens / one_step)
        out.append(row)
    return out


def read_loads(path: Path) -> list[list[int]]:
    """A one-GPU bench.json's ``router.loads`` (its folder or the file): each block's tokens per expert."""
    from trainbench.report import bench_report

    record = bench_report.read(path.parent if path.is_file() else path)
    loads = (record.get("router") or {}).get("loads")
    good = isinstance(loads, list) and loads and all(
        isinstance(b, list) and b and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in b)
        for b in loads)  # fmt: skip
    if not good:
        raise UserError(f"{path} holds no router.loads (each block's tokens per expert, whole numbers): measure a "
                        "mixture of experts on one GPU with `trainbench bench`")  # fmt: skip
    return loads


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
    p.add_argument("--loads", type=Path, help="a one-GPU bench.json (or its folder) whose router.loads to read")
    args = p.parse_args()
    try:  # bad input (an unknown benchmark, a key or layout the configuration refuses, a bench.json): one sentence
        rows = _forecast_args(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    for row in rows:
        name = " ".join(f"{k}={v}" for k, v in row["layout"].items()) or "the default layout"
        if "none" in row:
            print(f"{name}: no forecast ({row['none']})")
            continue
        print(f"{name}: {row['step_s']:.3f} s a step at {row['depth']} blocks, {row['tokens_per_s_per_rank']:,.0f} "
              f"tokens/s a GPU, {row['of_one']:.3f} of one GPU's ({split_text(row['split_s'])})")  # fmt: skip
    sys.stdout.flush()


def _forecast_args(args) -> list[dict]:
    """:func:`forecasts` of the command line's arguments."""
    if args.nproc < 2:
        raise UserError("--nproc takes 2 or more GPUs")
    depths, steps = _pair(args.depths, int, "--depths"), _pair(args.steps, float, "--steps")
    layouts = [parse_key_values(layout.split()) for layout in args.layout] or [{}]
    keys = parse_key_values([pair for item in args.key for pair in item.split()])
    loads = read_loads(args.loads) if args.loads else None
    os.environ["TRAINBENCH_CACHE_DIR"] = tempfile.mkdtemp(prefix="forecast-layouts-")  # (the kept step goes here)
    return forecasts(args.benchmark, args.preset, keys, layouts, args.nproc, depths, steps, args.copy_rate, args.gpu,
                     loads)  # fmt: skip


if __name__ == "__main__":
    main()
