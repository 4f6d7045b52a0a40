"""The layout probe (measure/probe.py) timed both ways on this GPU, alternating: its steps queued back to back, as a
run's micro-batches are (streamed, what `perf.plan=auto` uses), and each step after the one before has ended (synced,
the GPU idle a moment between steps, as the probe was before). For each: a block's forward and backward, the clock
and power the timed steps ran at, and the plan those figures give (its layout and predicted rate), to set beside what
the planned run measures (`perf/bench_figures.sh lora-auto`).

    python perf/probe_modes.py llama2_70b_lora --preset llama2-70b --rounds 2 perf.probe_sustained_s=20

Needs a CUDA GPU; each probe builds the probe's two blocks anew, in this process.
"""

from __future__ import annotations

import argparse
import gc
import sys

from trainbench.config import parse_key_values
from trainbench.errors import UserError


def probe_both_ways(name: str, preset: str | None, keys: dict[str, str], rounds: int) -> list[dict]:
    """``rounds`` x (synced, streamed) probes of ``name`` at ``keys``; each with its mode, its block's times, clock,
    power, and the plan's lines."""
    import torch

    from trainbench.measure.plan import block_probe, resources
    from trainbench.measure.probe import measure
    from trainbench.resolve import allocator_settings, build_config

    bench, cfg = build_config(name, preset, None, {"device": "cuda", "perf.plan": "auto", **keys})
    allocator_settings(bench)
    found = []
    for r in range(rounds):
        for streamed in (False, True):
            data = measure(bench.probe_config(cfg), bench, streamed=streamed)
            gc.collect()
            torch.cuda.empty_cache()
            _, lines = bench.plan_layout(cfg, resources(cfg, data, True), block_probe(data))
            kept = ("forward_s", "backward_s", "head_s", "sm_clock_mhz", "power_w")
            found.append({"round": r, "streamed": streamed, "lines": lines, **{k: data[k] for k in kept}})
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="perf/probe_modes.py")
    parser.add_argument("benchmark")
    parser.add_argument("--preset")
    parser.add_argument("--rounds", type=int, default=2, help="pairs of probes, each pair synced then streamed")
    parser.add_argument("keys", nargs="*", help="config keys, key=value")
    args = parser.parse_intermixed_args(argv)
    try:
        if args.rounds < 1:
            raise UserError("--rounds takes 1 or more")
        found = probe_both_ways(args.benchmark, args.preset, parse_key_values(args.keys), args.rounds)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for f in found:
        clock = f"{f['sm_clock_mhz']:,.0f} MHz, {f['power_w']:.0f} W" if f["sm_clock_mhz"] else "clock not sampled"
        mode = "streamed" if f["streamed"] else "synced"
        print(f"round {f['round']}, {mode}: forward {f['forward_s'] * 1e3:.2f} ms, backward "
              f"{f['backward_s'] * 1e3:.2f} ms, outside the blocks {f['head_s'] * 1e3:.1f} ms, at {clock}")  # fmt: skip
        for line in f["lines"]:
            if "predicted" in line or "layout" in line:
                print(f"  {line.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
