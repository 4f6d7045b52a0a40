"""`trainbench bench`: the machine's training throughput on a benchmark, and its summary on the console."""

from __future__ import annotations

import argparse
import sys

from trainbench.cli.common import add_config_arguments
from trainbench.cli.run import list_systems, on_system, run_overrides
from trainbench.errors import UserError

EXAMPLES_BENCH = """examples:
  trainbench bench llama2_70b_lora --preset llama2-70b      (its layout planned for this GPU: perf.plan=auto)
  trainbench bench llama31_8b --preset llama31-8b model.precision=fp8 --blocks 2,6
  trainbench bench bert --preset tiny --steps 5 --warmup 2
"""


def add_bench_parser(sub) -> None:
    bench = sub.add_parser(
        "bench",
        help="measure the machine's training throughput on a benchmark (not a time-to-train result)",
        description="Train BENCH's model, placed as `trainbench run` places it, on rows made in memory and shaped "
        "like its data: time --steps optimizer steps after --warmup, and one eval batch. Prints and writes "
        "bench.json: samples and tokens per second (per rank too), MFU, peak memory, energy per token, and the "
        "time to train projected from the ruleset's reference convergence points. No MLPerf log is written.",
        epilog=EXAMPLES_BENCH,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("benchmark", help="benchmark name (see `trainbench list`)")
    bench.add_argument("--preset", help="starting config (default: the benchmark's MLPerf shape)")
    add_config_arguments(bench)
    bench.add_argument("--steps", type=int, default=10, help="timed optimizer steps (default 10)")
    bench.add_argument("--warmup", type=int, default=3, help="optimizer steps before the timing (default 3)")
    bench.add_argument("--nproc", type=int, help="processes on this node (GPUs or CPU ranks); >1 uses torchrun")
    bench.add_argument(
        "--system",
        help="measure as a Slurm job on this system (systems/NAME.yaml, built in, or a YAML "
        "path; ? lists them): its nodes and ranks, its container",
    )
    bench.add_argument("--blocks", metavar="N,M", help="measure these truncated depths and extrapolate to the "
                       "model's (a model that does not fit); every figure is then labelled extrapolated")  # fmt: skip
    bench.add_argument("--table-rows", type=int, metavar="N", help="cut every embedding table to at most N rows "
                       "(dlrmv4: tables that do not fit); the figures are then labelled truncated")  # fmt: skip
    bench.add_argument(
        "--profile-steps",
        type=int,
        default=2,
        metavar="N",
        help="on a GPU, profile N more steps after the timed ones: the step's split (compute, exposed "
        "communication, idle) and its GPU time by kind of kernel (default 2; 0: none)",
    )
    bench.add_argument(
        "--memory-snapshot",
        action="store_true",
        help="on a GPU, record every allocation: memory_peak.pickle (pytorch.org/memory_viz) and "
        "memory_peak.txt, the bytes held at the end by the code that allocated them (memory_oom.* where "
        "an allocation fails)",
    )
    bench.add_argument("--ruleset", help="ruleset whose reference convergence points the projection uses")
    bench.add_argument("--compare", choices=("hf", "hf-compiled"), help="hf: also time HF transformers (+ peft for "
                       "LoRA; diffusers for flux1), eager and compiled, at the same shape and depth, in the same "
                       "call (one process); hf-compiled: compiled only (at large shapes the eager step is slow "
                       "and may not fit)")  # fmt: skip


# A bench's timed steps last seconds: at a run's 1 Hz the medians of power and clock would rest on a sample or two.
# 10 Hz cost nothing measurable (docs/performance.md, "telemetry sampler's cost"); a value given in a file or on the
# command line is kept.
BENCH_DEFAULTS = {"output.telemetry_hz": 10.0}


def cmd_bench(args) -> int:
    from trainbench.benchmarks import get_benchmark
    from trainbench.console import console
    from trainbench.measure.bench import run_bench
    from trainbench.report import bench_report
    from trainbench.resolve import build_config

    overrides = run_overrides(args)
    system = None
    if args.system == "?":
        return list_systems()
    if args.system is not None:
        if args.nproc is not None:
            raise UserError("--nproc and --system both say how many ranks: the system's file says it for --system")
        system, cfg, bench = on_system(args.benchmark, args.preset, args.config, overrides, args.system,
                                       defaults=BENCH_DEFAULTS)  # fmt: skip
    else:
        preset = args.preset or get_benchmark(args.benchmark).full_preset
        bench, cfg = build_config(args.benchmark, preset, args.config, overrides, defaults=BENCH_DEFAULTS)
    command = ["trainbench", *sys.argv[1:]]
    run_dir, raws, layers, depths, peers = run_bench(
        bench, cfg, args.steps, args.warmup, args.blocks, args.compare, args.profile_steps, system, command,
        args.memory_snapshot, args.table_rows)  # fmt: skip
    result = bench_report.summarise(bench, cfg, raws, layers, depths, peers)
    if args.table_rows is not None:
        result["tables_truncated_to_rows"] = args.table_rows
    bench_report.save(run_dir, result)
    console.print(bench_summary(result), markup=False)
    console.print(f"results: {run_dir}  ({run_dir / 'bench.json'})")
    return 0


def _whole_peak(r: dict) -> str:
    """The peak at the model's depth on the line through the measured depths' peaks, and whether the GPU holds it
    (:func:`~trainbench.report.bench_report.whole_model_fits`)."""
    from trainbench.report.bench_report import ALLOCATABLE_SHARE, whole_model_fits

    whole = r.get("peak_memory_gib_at_depth")
    if whole is None:
        return ""
    fits, gpu = whole_model_fits(r), f"{r.get('gpu_memory_gib') or 0:.1f}"
    said = {
        None: "",
        "no": f", more than the GPU's {gpu}: the whole model would not fit this layout",
        "maybe": f" of the GPU's {gpu}, more than the {ALLOCATABLE_SHARE * 100:.0f} % of it a run can count on "
        "allocating: the whole model may not fit this layout",
        "yes": f" of the GPU's {gpu}",
    }[fits]
    return f" (about {whole:.1f} at {r['blocks']} blocks on the line through the depths measured{said})"


def bench_summary(r: dict) -> str:
    """bench.json in a few lines."""
    how = r["figures"] + (f" from {', '.join(map(str, r['blocks_measured']))} of {r['blocks']} blocks"
                          if r["blocks_measured"] else "")  # fmt: skip
    if r.get("tables_truncated_to_rows"):
        how += f", tables truncated to {r['tables_truncated_to_rows']:,} rows"
    lines = [f"{r['benchmark']}/{r['preset']} on {r['ranks']} x {r['device']} ({how}; {r['kind']}):",
             f"  {r['tokens_per_s']:,.0f} tokens/s ({r['tokens_per_s_per_rank']:,.0f} per rank), "
             f"{r['samples_per_s']:,.2f} samples/s, {r['step_seconds']:.3f} s a step of "
             f"{r['samples_per_step']:,.0f} samples"
             + (f" in {r['global_batch_size']} packed rows" if r["samples_per_step"] != r["global_batch_size"]
                else "")]  # fmt: skip
    extra = []
    if r.get("lookups_per_s"):
        extra.append(f"{r['lookups_per_s']:,.0f} table lookups/s")
    if r["mfu"] is not None:
        extra.append(f"MFU {r['mfu']:.1%}")
    if r["peak_memory_gib"] is not None:
        extra.append(f"peak memory {r['peak_memory_gib']:.1f} GiB" + _whole_peak(r))
    if r["energy_joules_per_token"] is not None:
        extra.append(f"{r['energy_joules_per_token'] * 1e3:.2f} mJ per token")
    for name, g in (r.get("gpus") or {}).items():
        at = f"{g['power_w']:.0f} W, SM {g['sm_clock_mhz']:.0f} MHz (medians)" if g["busy_samples"] else \
            "no busy sample in the timed steps"  # fmt: skip
        extra.append(f"{name}: {at}, throttled by {', '.join(g['throttle_reasons']) or 'nothing'}")
    if extra:
        lines.append("  " + ", ".join(extra))
    for name, peer in (r.get("compare") or {}).items():
        lines.append(f"  {name}: " + (peer["error"] if "error" in peer else f"{peer['tokens_per_s']:,.0f} tokens/s; "
                                      f"ours {peer['ours_over_it']:.2f}x its rate"))  # fmt: skip
    if r.get("router"):
        busiest = r["router"]["busiest_over_mean"]
        worst, median = max(range(len(busiest)), key=busiest.__getitem__), sorted(busiest)[len(busiest) // 2]
        lines.append(f"  router: the busiest of {r['router']['experts']} experts gets {max(busiest):.2f}x the mean "
                     f"tokens (block {worst}), {median:.2f}x in the median block")  # fmt: skip
    if r.get("allocator_retries"):
        lines.append(f"  the CUDA caching allocator ran out of room {r['allocator_retries']:,} times in the timed "
                     "steps (every rank's; each time it frees its cache, waiting on the GPU, and tries again): memory "
                     "pressure slowed these steps, and PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True or a layout "
                     "with more room may run faster")  # fmt: skip
    if r.get("forecast"):
        from trainbench.report.bench_report import forecast_line

        lines.append("  " + forecast_line(r["forecast"]))
    if r.get("profile"):
        from trainbench.report.bench_report import split_line

        lines.append("  " + split_line(r["profile"]))
    p = r["projection"]
    if p:
        lines.append(f"  projected time to train ({r['figures']}, ruleset {r['ruleset']}): {p['minutes']:.1f} min "
                     f"({p['samples_to_target']:,.0f} samples to target, {p['evals']} evals)")  # fmt: skip
    elif r.get("projection_none"):
        lines.append(f"  no projected time to train: {r['projection_none']}")
    return "\n".join(lines)
