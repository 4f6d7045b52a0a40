"""The layout probe (measure/probe.py) timed several ways on this GPU, in turn: its steps queued back to back, as a
run's micro-batches are (streamed, what `perf.plan=auto` uses), or each after the one before has ended (synced, the
GPU idle a moment between steps, as the probe was before 2026-12-01); with as many blocks as asked (`--blocks`, a
list of `perf.probe_blocks`: 8 by default, 2 before 2026-12-01); with copies to and from the host beside each step
(`--copies-gib`: GiB each way a block and step on a side stream, as an offloaded run's). For each: a block's forward
and backward, the clock and power the timed steps ran at, and the plan those figures give (its layout and predicted
rate), to set beside what the planned run measures (`perf/bench_figures.sh lora-auto`).

    python perf/probe_modes.py llama2_70b_lora --preset llama2-70b --rounds 2 --blocks 2 perf.probe_sustained_s=20
    python perf/probe_modes.py llama2_70b_lora --preset llama2-70b --modes streamed --blocks 2,8 --copies-gib 0,0.69 \\
        perf.probe_sustained_s=20

Needs a CUDA GPU; each probe builds its blocks anew, in this process.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import itertools
import sys

from trainbench.config import parse_key_values
from trainbench.errors import UserError


@contextlib.contextmanager
def _beside_copies(copies_gib: float, blocks: int):
    """measure/probe with, where ``copies_gib``, that many GiB a block of its ``blocks`` copied to the host and as many
    back on a side stream of their own, queued before each of its training steps."""
    import torch

    from trainbench.measure import probe

    stepper = probe._stepper

    def with_copies(*args):
        step = stepper(*args)
        n = int(copies_gib * blocks * 2**30)
        device = torch.device("cuda", torch.cuda.current_device())
        out = (torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, pin_memory=True))
        back = (torch.empty(n, dtype=torch.uint8, pin_memory=True), torch.empty(n, dtype=torch.uint8, device=device))
        side = torch.cuda.Stream(device)

        def stepped(i: int) -> None:
            with torch.cuda.stream(side):
                for src, dst in (out, back):
                    dst.copy_(src, non_blocking=True)
            step(i)

        return stepped

    if copies_gib:
        probe._stepper = with_copies
    try:
        yield
    finally:
        probe._stepper = stepper


def probe_each_way(name: str, preset: str | None, keys: dict[str, str], rounds: int, modes: list[str],
                   blocks: list[int], copies_gib: list[float]) -> list[dict]:  # fmt: skip
    """``rounds`` x each of ``modes`` x ``blocks`` (``perf.probe_blocks``) x ``copies_gib``, probes of ``name`` at
    ``keys``; each with its way, its block's times, clock, power, and the plan's lines."""
    import torch

    from trainbench.measure import probe
    from trainbench.measure.plan import block_probe, resources
    from trainbench.resolve import allocator_settings, build_config

    bench, cfg = build_config(name, preset, None, {"device": "cuda", "perf.plan": "auto", **keys})
    allocator_settings(bench)
    found = []
    for r in range(rounds):
        for mode, n, gib in itertools.product(modes, blocks, copies_gib):
            shaped = dataclasses.replace(cfg, perf=dataclasses.replace(cfg.perf, probe_blocks=n))
            with _beside_copies(gib, probe.probe_blocks(shaped)):
                data = probe.measure(bench.probe_config(shaped), bench, streamed=mode == "streamed")
            gc.collect()
            torch.cuda.empty_cache()
            _, lines = bench.plan_layout(shaped, resources(shaped, data, True), block_probe(data))
            kept = ("forward_s", "backward_s", "head_s", "sm_clock_mhz", "power_w", "blocks")
            found.append({"round": r, "mode": mode, "copies_gib": gib, "lines": lines, **{k: data[k] for k in kept}})
    return found


def _listed(text: str, kind: type, what: str) -> list:
    try:
        values = [kind(v) for v in text.split(",")]
    except ValueError:
        raise UserError(f"{what} takes a comma-separated list, not {text!r}") from None
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="perf/probe_modes.py")
    parser.add_argument("benchmark")
    parser.add_argument("--preset")
    parser.add_argument("--rounds", type=int, default=2, help="times each way is probed, in turn")
    parser.add_argument("--modes", default="synced,streamed", help="synced, streamed or both (default)")
    parser.add_argument("--blocks", default="8", help="blocks in the probe's model, a list (perf.probe_blocks: 8)")
    parser.add_argument(
        "--copies-gib", default="0", help="GiB a block copied each way beside each step, a list (default 0)"
    )
    parser.add_argument("keys", nargs="*", help="config keys, key=value")
    args = parser.parse_intermixed_args(argv)
    try:
        modes = _listed(args.modes, str, "--modes")
        blocks, copies = _listed(args.blocks, int, "--blocks"), _listed(args.copies_gib, float, "--copies-gib")
        if args.rounds < 1:
            raise UserError("--rounds takes 1 or more")
        if not set(modes) <= {"synced", "streamed"} or min(blocks) < 2 or min(copies) < 0:
            raise UserError("--modes takes synced and streamed, --blocks 2 or more, --copies-gib 0 or more")
        found = probe_each_way(args.benchmark, args.preset, parse_key_values(args.keys), args.rounds, modes, blocks,
                               copies)  # fmt: skip
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for f in found:
        clock = f"{f['sm_clock_mhz']:,.0f} MHz, {f['power_w']:.0f} W" if f["sm_clock_mhz"] else "clock not sampled"
        way = f"{f['mode']}, {f['blocks']} blocks" + (
            f", {f['copies_gib']:g} GiB a block copied each way" * bool(f["copies_gib"])
        )
        print(f"round {f['round']}, {way}: forward {f['forward_s'] * 1e3:.2f} ms, backward "
              f"{f['backward_s'] * 1e3:.2f} ms, outside the blocks {f['head_s'] * 1e3:.1f} ms, at {clock}")  # fmt: skip
        for line in f["lines"]:
            if "predicted" in line or "layout" in line:
                print(f"  {line.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
