"""The `trainbench` command: list, prepare, run, check."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trainbench.errors import Preempted, UserError

EXAMPLES_RUN = """examples:
  trainbench run bert --preset tiny data.dir=data/bert-tiny
  trainbench run bert --preset tiny --nproc 2 --nexp 3 data.dir=data/bert-tiny optimizer.lr=3e-3
  trainbench run bert --preset large --config my_system.yaml init_checkpoint=model.ckpt-28252.pt
  trainbench run bert --preset tiny --help-config      (every key, its type, default and meaning)

overrides are key=value; a key is its dotted path (optimizer.lr) or, where unambiguous, its last part (lr).
"""


EXAMPLES_SUBMIT = """examples:
  trainbench submit bert --system dgxh100_8x8 --nexp 10 data.dir=/lustre/bert
  trainbench submit bert --system dgxh100_1x8 --nodes 2 --time 00:45:00 --dry-run data.dir=/data/bert
  trainbench submit llama2_70b_lora --preset llama2-70b --system dgxh100_1x8 --time 00:30:00 --chain 4 \\
      data.dir=/data/govreport
  trainbench submit bert --preset tiny --system local_cpu_1x2 data.dir=data/bert-tiny

systems: the YAML files in ./systems/ and the built-in ones (trainbench submit --system ? lists them).
"""
EXAMPLES_BENCH = """examples:
  trainbench bench llama2_70b_lora --preset llama2-70b      (its layout planned for this GPU: perf.layout=auto)
  trainbench bench llama31_8b --preset llama31-8b model.precision=fp8 --blocks 2,6
  trainbench bench bert --preset tiny --steps 5 --warmup 2
"""
EXAMPLES_PREPARE = """examples:
  trainbench prepare bert --synthetic --preset tiny --out data/bert-tiny
  trainbench prepare bert --input wikitext-2/ --train-vocab 8000 --num-shards 16 --eval-samples 1000 --out data/wt2
  trainbench prepare llama31_8b --source c4/en --tokenizer tokenizer.json --out data/c4
  trainbench prepare llama2_70b_lora --synthetic --preset tiny --out data/lora-tiny

each benchmark's own options: trainbench prepare BENCHMARK --help
"""


def _parser(benchmarks: bool = True) -> argparse.ArgumentParser:
    """The command line's parser; without ``benchmarks``, `prepare` names no benchmark (nothing imports them, nor
    torch: a request for help on anything but `prepare` needs none)."""
    p = argparse.ArgumentParser(
        prog="trainbench",
        description="MLPerf-Training-style benchmarks end to end: prepare data, train to target, "
        "log in the MLPerf format, check compliance.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub.add_parser("list", help="list benchmarks and their presets", description="List benchmarks and presets.")

    prep = sub.add_parser(
        "prepare",
        help="write a benchmark's dataset to disk",
        description="Write a benchmark's dataset in the on-disk format its trainer reads: from its source "
        "(each benchmark's own options: trainbench prepare BENCHMARK --help) or synthetic (--synthetic).",
        epilog=EXAMPLES_PREPARE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # The options every benchmark's preparation takes, documented once; each benchmark adds its own.
    parent = argparse.ArgumentParser(add_help=False)
    common = parent.add_argument_group("every benchmark's options")
    common.add_argument("--out", required=True, help="output folder (its data files and manifest.json)")
    common.add_argument("--seed", type=int, default=12345, help="random seed (default 12345, as MLPerf's)")
    common.add_argument("--force", action="store_true", help="replace a folder that already holds other data")
    common.add_argument("--no-progress", action="store_true", help="no progress bar")
    common.add_argument(
        "--synthetic",
        action="store_true",
        help="generate seeded synthetic data with learnable structure (no download needed)",
    )
    common.add_argument("--preset", default="tiny", help="preset whose shapes (sequence length, vocabulary) the "
                        "synthetic data takes (default tiny)")  # fmt: skip
    benches = prep.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    p.prepare_options = {}  # each benchmark's options: one that another benchmark owns is refused by name
    p.broken_hooks = {}  # benchmark -> the sentence of what its add_prepare_arguments raised
    for bench in _registry().values() if benchmarks else ():
        # A hook of a plugin that raises (or adds an option every benchmark has) must break its own preparation
        # alone: tried on a parser of its own first, then added.
        trial = argparse.ArgumentParser(prog=f"trainbench prepare {bench.name}", parents=[parent], add_help=False)
        try:
            bench.add_prepare_arguments(trial)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 - SystemExit too: argparse exits on a clash of options
            p.broken_hooks[bench.name] = _hook_failure(bench.name, "add_prepare_arguments", e)
            continue
        own = benches.add_parser(
            bench.name,
            parents=[parent],
            help=str(bench.description),
            description=f"trainbench prepare {bench.name}: {bench.description}.",
            epilog=bench.prepare_examples if isinstance(bench.prepare_examples, str) else None,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        bench.add_prepare_arguments(own)
        p.prepare_options[bench.name] = {o for action in own._actions for o in action.option_strings}

    run = sub.add_parser(
        "run",
        help="train a benchmark to its target and write MLPerf logs",
        description="Train a benchmark to its quality target; write the MLPerf log, "
        "metrics and config into a new results folder, then check the log's compliance.",
        epilog=EXAMPLES_RUN,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("benchmark", help="benchmark name (see `trainbench list`)")
    run.add_argument("--preset", default="tiny", help="starting config (default: tiny)")
    run.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="FILE.yaml",
        help="YAML file of overrides (nested or dotted keys); may repeat, applied in order",
    )
    run.add_argument("--nproc", type=int, help="processes on this node (GPUs or CPU ranks); >1 uses torchrun")
    run.add_argument("--nexp", type=int, default=1, help="experiments to run, seeds seed..seed+K-1 (default 1)")
    run.add_argument(
        "--ruleset", help="mlperf-logging ruleset the log follows (default: the benchmark's newest; output.ruleset)"
    )
    run.add_argument("--help-config", action="store_true", help="print every config key with its value and exit")
    run.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")

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
    bench.add_argument("--config", action="append", default=[], metavar="FILE.yaml", help="YAML overrides; may repeat")
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
    bench.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")

    subm = sub.add_parser(
        "submit",
        help="write an sbatch script for a system and submit it to Slurm",
        description="Write the sbatch script for BENCH on a system (systems/NAME.yaml), check the request "
        "against the cluster (sinfo), and submit it. The results folder holds the script, config and logs.",
        epilog=EXAMPLES_SUBMIT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subm.add_argument("benchmark", nargs="?", help="benchmark name (see `trainbench list`)")
    subm.add_argument(
        "--system", required=True, help="system name (systems/NAME.yaml or built in) or a YAML path; ? lists them"
    )
    subm.add_argument(
        "--preset", help="starting config (default: the benchmark's MLPerf shape: large, llama31-8b, gpt3-175b, "
        "llama2-70b, gpt-oss-20b, flux1-schnell)"
    )  # fmt: skip
    subm.add_argument("--config", action="append", default=[], metavar="FILE.yaml", help="YAML overrides; may repeat")
    subm.add_argument("--nodes", type=int, help="nodes (default: the system's)")
    subm.add_argument("--time", help="time limit HH:MM:SS (default: the system's)")
    subm.add_argument("--nexp", type=int, default=1, help="experiments: a job array of K runs (default 1)")
    subm.add_argument("--array-parallel", type=int, metavar="N",
                      help="runs of the --nexp job array that may run at once (default: the system file's "
                      "array_parallel, 1: one after another, so no run shares the network or storage it "
                      "measures)")  # fmt: skip
    subm.add_argument(
        "--chain",
        type=int,
        default=1,
        metavar="K",
        help="submit K jobs of one name (--dependency=singleton), each continuing the run from the last one's "
        "checkpoint until it ends: a run longer than the partition's time limit (default 1, at most 100)",
    )
    subm.add_argument(
        "--ruleset", help="mlperf-logging ruleset the log follows (default: the benchmark's newest; output.ruleset)"
    )
    subm.add_argument("--dry-run", action="store_true", help="write and print the script; do not submit")
    subm.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")

    resub = sub.add_parser(
        "resubmit",
        help="submit a results folder's Slurm job again: its unfinished runs continue from their checkpoints",
        description="Submit the job script of a results folder written by `trainbench submit` again, for the runs "
        "that have not ended (no result_<i>.txt): after a crash, a lost node or a cancel, each continues from its "
        "last checkpoint (output.checkpoint_every_steps) to the losses of an uninterrupted run. Refused while a "
        "job of the folder is still queued or running.",
        epilog="example:\n  trainbench resubmit results/20261123T101500Z-bert-large-dgxh100_8x8 --time 00:30:00",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    resub.add_argument("folder", metavar="RESULTS_DIR")
    resub.add_argument("--time", help="time limit HH:MM:SS (default: the one the script was written with)")

    rep = sub.add_parser(
        "report",
        help="report on a results folder (two: compare them; a folder of many: an index; or export them)",
        description="Score the runs of a results folder (time to train, samples, throughput, energy, "
        "compliance, the MLPerf olympic mean) and write report.md and a self-contained report.html with "
        "a headline card and plots into it. Given two folders, write an HTML page that compares them (their "
        "cards, the figures with B/A, their curves overlaid, what differs in their configs and machines). Given a "
        "folder of many run and bench folders, write each one's report and index.html linking them. With "
        "--export, write the runs' metrics, configs and results for TensorBoard or MLflow instead.",
        epilog="examples:\n  trainbench report results/20261123T101500Z-bert-tiny\n"
        "  trainbench report results/A results/B --out a_vs_b.html\n  trainbench report results/\n"
        "  trainbench report results/ --export tensorboard tb/      (then: tensorboard --logdir tb/)\n"
        "  trainbench report results/ --export mlflow mlruns/",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rep.add_argument("folders", nargs="+", metavar="RESULTS_DIR",
                     help="one results folder, two to compare, or a folder of many to index")  # fmt: skip
    rep.add_argument("--out", metavar="FILE", help="where to write a comparison's page (default: "
                     "compare_<A>_vs_<B>.html in the working folder)")  # fmt: skip
    rep.add_argument("--allow-different", action="store_true",
                     help="compare two folders of different benchmarks (refused without it)")  # fmt: skip
    rep.add_argument("--export", nargs=2, metavar=("TOOL", "DIR"),
                     help="write every run of the folders for TOOL (tensorboard: event files under DIR; mlflow: DIR "
                     "as MLflow's file store, or a tracking URI such as sqlite:///mlflow.db) instead of the "
                     "reports; a run already in DIR is passed by")  # fmt: skip

    pkg = sub.add_parser(
        "package",
        help="lay a results folder out as an MLPerf submission package and run the package checker",
        description="Copy the MLPerf logs into <org>/results/<system>/<benchmark>/, write "
        "<org>/systems/<system>.json from what the runs recorded of their nodes (a field nothing recorded stays "
        "empty and is named) and <org>/benchmarks/<benchmark>/implementations/trainbench-<version>/ (trainbench's "
        "source and the runs' resolved config), then run mlperf-logging's package checker on it.",
    )
    pkg.add_argument("folder", metavar="RESULTS_DIR")
    pkg.add_argument("--org", required=True, help="submitting organisation (a folder name)")
    pkg.add_argument("--system", required=True, help="system name (a folder name)")
    pkg.add_argument("--out", default="submission", help="where to write the package (default ./submission)")
    pkg.add_argument("--ruleset", help="ruleset of the package checker (default: the one the runs followed)")
    pkg.add_argument(
        "--system-desc",
        metavar="FILE.json",
        help="the system description's fields (systems/<system>.json) to use over what the runs recorded",
    )

    conv = sub.add_parser(
        "convert",
        help="convert a reference checkpoint to trainbench's format",
        description="Convert MLPerf's TensorFlow BERT checkpoint (needs TensorFlow: `pip install -e '.[tf]'` in "
        "trainbench's clone) into a state dict for model.init_checkpoint. HF safetensors weights need no conversion.",
    )
    conv.add_argument("benchmark", help="benchmark name (bert)")
    conv.add_argument("--tf-checkpoint", required=True, help="checkpoint prefix, e.g. model.ckpt-28252")
    conv.add_argument("--out", required=True, help="output .pt file")

    check = sub.add_parser(
        "check",
        help="run mlperf-logging's compliance checker on finished runs",
        description="Check MLPerf logs with mlperf-logging's compliance checker.",
    )
    check.add_argument("path", help="a results folder (checks every result_*.txt) or one log file")
    check.add_argument("--ruleset", help="compliance ruleset (default: the one the runs followed)")
    return p


def _hook_failure(name: str, hook: str, e: BaseException) -> str:
    """One sentence for a benchmark's hook that raised, naming where the benchmark comes from."""
    from trainbench.benchmarks import ORIGINS, plugin_failure

    return (f"benchmark {name} ({ORIGINS.get(name, 'registered in this process')}) is left out of `trainbench "
            f"prepare`: its {hook} failed: {plugin_failure(e)}")  # fmt: skip


def _registry() -> dict:
    from trainbench.benchmarks import registry

    return registry()


def cmd_list(_args) -> int:
    from trainbench.console import console

    rows = [[b.name, b.mlperf_name, ", ".join(b.presets), b.description] for b in _registry().values()]
    _print_table("trainbench benchmarks", ["benchmark", "MLPerf name", "presets", "description"], rows)
    rulesets = "; ".join(f"{b.name} {', '.join(b.rulesets)}" for b in _registry().values())
    console.print(f"mlperf-logging rulesets, the default first (--ruleset): {rulesets}", markup=False)
    from trainbench.benchmarks import BUILT_IN, ENTRY_POINTS, ORIGINS, PLUGIN_ERRORS

    origins = "; ".join(f"{name} ({origin})" for name, origin in ORIGINS.items() if origin != BUILT_IN)
    console.print(f"not built in (installed packages declare them as {ENTRY_POINTS} entry points): {origins or 'none'}",
                  markup=False)  # fmt: skip
    for error in PLUGIN_ERRORS:
        console.print(error, style="yellow", markup=False)
    return 0


def cmd_prepare(args) -> int:
    from trainbench.benchmarks import get_benchmark

    return get_benchmark(args.benchmark).prepare(args)


def _overrides(args) -> dict[str, str]:
    """The key=value overrides of `run` or `bench`, with what --nproc and --ruleset set."""
    from trainbench.config import parse_key_values

    overrides = parse_key_values(args.overrides)
    if args.nproc is not None:
        overrides["distributed.nproc"] = str(args.nproc)
    if args.ruleset is not None:
        overrides["output.ruleset"] = args.ruleset
    return overrides


def cmd_run(args) -> int:
    from trainbench.config import apply_overrides, describe
    from trainbench.console import console
    from trainbench.launch.local import run_experiments
    from trainbench.measure.layout import planned
    from trainbench.resolve import build_config

    overrides = _overrides(args)
    if args.help_config:
        _, cfg = build_config(args.benchmark, args.preset, args.config, {})
        console.print(f"config keys of {args.benchmark} --preset {args.preset}:\n{describe(cfg)}", markup=False)
        return 0
    bench, cfg = build_config(args.benchmark, args.preset, args.config, overrides)
    given = apply_overrides(bench.config(args.preset), overrides)  # the dotted keys the command line sets
    run_dir, records = run_experiments(bench, cfg, args.nexp, given, plan=planned)
    ok = all(r.outcome and r.outcome["status"] == "success" and r.compliance and r.compliance.ok for r in records)
    finished = [r.outcome for r in records if r.outcome]
    if finished:
        times = ", ".join(f"{o['time_to_train_min']:.3f}" for o in finished)
        console.print(f"time to train (minutes): {times}")
    console.print(f"results: {run_dir}  (summary: {run_dir / 'summary.json'})")
    return 0 if ok else 1


def cmd_bench(args) -> int:
    from trainbench.benchmarks import get_benchmark
    from trainbench.console import console
    from trainbench.measure.bench import run_bench
    from trainbench.report import bench_report
    from trainbench.resolve import build_config

    overrides = _overrides(args)
    system = None
    if args.system == "?":
        return _list_systems()
    if args.system is not None:
        if args.nproc is not None:
            raise UserError("--nproc and --system both say how many ranks: the system's file says it for --system")
        system, cfg, bench = _on_system(args.benchmark, args.preset, args.config, overrides, args.system)
    else:
        preset = args.preset or get_benchmark(args.benchmark).full_preset
        bench, cfg = build_config(args.benchmark, preset, args.config, overrides)
    command = ["trainbench", *sys.argv[1:]]
    run_dir, raws, layers, depths, peers = run_bench(
        bench, cfg, args.steps, args.warmup, args.blocks, args.compare, args.profile_steps, system, command,
        args.memory_snapshot)  # fmt: skip
    result = bench_report.summarise(bench, cfg, raws, layers, depths, peers)
    bench_report.save(run_dir, result)
    console.print(bench_summary(result), markup=False)
    console.print(f"results: {run_dir}  ({run_dir / 'bench.json'})")
    return 0


def bench_summary(r: dict) -> str:
    """bench.json in a few lines."""
    how = r["figures"] + (f" from {', '.join(map(str, r['blocks_measured']))} of {r['blocks']} blocks"
                          if r["blocks_measured"] else "")  # fmt: skip
    lines = [f"{r['benchmark']}/{r['preset']} on {r['ranks']} x {r['device']} ({how}; {r['kind']}):",
             f"  {r['tokens_per_s']:,.0f} tokens/s ({r['tokens_per_s_per_rank']:,.0f} per rank), "
             f"{r['samples_per_s']:,.2f} samples/s, {r['step_seconds']:.3f} s a step of "
             f"{r['samples_per_step']:,.0f} samples"
             + (f" in {r['global_batch_size']} packed rows" if r["samples_per_step"] != r["global_batch_size"]
                else "")]  # fmt: skip
    extra = []
    if r["mfu"] is not None:
        extra.append(f"MFU {r['mfu']:.1%}")
    if r["peak_memory_gib"] is not None:
        extra.append(f"peak memory {r['peak_memory_gib']:.1f} GiB")
    if r["energy_joules_per_token"] is not None:
        extra.append(f"{r['energy_joules_per_token'] * 1e3:.2f} mJ per token")
    for name, g in (r.get("gpus") or {}).items():
        extra.append(f"{name}: {g['power_w']:.0f} W, SM {g['sm_clock_mhz']:.0f} MHz (medians), throttled by "
                     f"{', '.join(g['throttle_reasons']) or 'nothing'}")  # fmt: skip
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
    if r.get("profile"):
        from trainbench.report.bench_report import split_line

        lines.append("  " + split_line(r["profile"]))
    p = r["projection"]
    if p:
        lines.append(f"  projected time to train ({r['figures']}, ruleset {r['ruleset']}): {p['minutes']:.1f} min "
                     f"({p['samples_to_target']:,.0f} samples to target, {p['evals']} evals)")  # fmt: skip
    return "\n".join(lines)


def _on_system(benchmark: str, preset: str | None, configs: list[str], overrides: dict, name: str,
               nodes: int | None = None, time: str | None = None, array_parallel: int | None = None):  # fmt: skip
    """(system, config, benchmark) of a job on system ``name``: the system's device, nodes and ranks, and the
    micro-batch its layout fits."""
    import dataclasses

    from trainbench.benchmarks import get_benchmark
    from trainbench.launch.systems import load_system
    from trainbench.resolve import build_config

    system = load_system(name)
    changes = {k: v for k, v in (("nodes", nodes), ("time", time), ("array_parallel", array_parallel)) if v is not None}
    if changes:
        system = dataclasses.replace(system, **changes)
        system.validate()
    overrides.setdefault("device", system.device)
    bench, cfg = build_config(benchmark, preset or get_benchmark(benchmark).full_preset, configs, overrides, system)
    return system, cfg, bench


def cmd_submit(args) -> int:
    from trainbench.config import parse_key_values
    from trainbench.console import console
    from trainbench.launch.slurm import submit
    from trainbench.measure.layout import planned

    if args.system == "?":
        return _list_systems()
    if args.benchmark is None:
        raise UserError("name the benchmark to submit: trainbench submit BENCH --system NAME (see `trainbench list`)")
    overrides = parse_key_values(args.overrides)
    if args.ruleset is not None:
        overrides["output.ruleset"] = args.ruleset
    system, cfg, bench = _on_system(args.benchmark, args.preset, args.config, overrides, args.system, args.nodes,
                                    args.time, args.array_parallel)  # fmt: skip
    command = ["trainbench", *(sys.argv[1:] if sys.argv[1:2] == ["submit"] else ["submit", args.benchmark])]
    run_dir, script, job_id = submit(
        bench, cfg, system, args.nexp, args.dry_run, command, chain=args.chain, plan=planned
    )
    layout = system.naming(cfg.data.global_batch_size, cfg.data.micro_batch_size)
    if args.dry_run:
        console.print(script, markup=False, highlight=False)
        console.print(
            f"dry run: {layout} on {system.name}; script written to {run_dir / 'submit.sbatch'}, not submitted"
        )
    else:
        console.print(
            f"submitted job {job_id}: {bench.name}/{cfg.preset}, {layout} on {system.name}, "
            f"{args.nexp} run(s); results: {run_dir}"
        )
    return 0


def _list_systems() -> int:
    """`submit --system ?`: the known system files, and whether this cluster (sinfo) can run each."""
    import shutil

    from trainbench.launch.slurm import check_cluster
    from trainbench.launch.systems import known_systems, load_system

    here = shutil.which("sinfo") is not None
    rows = []
    for name, path in known_systems().items():
        try:
            system = load_system(str(path))
        except UserError as exc:
            rows.append([name, "-", "-", f"unreadable: {exc}", *(["-"] if here else [])])
            continue
        layout = f"{system.nodes} x {system.gpus_per_node or system.ranks_per_node} {system.device}"
        row = [name, layout, system.partition or "(default)", system.description or str(path)]
        if here:
            try:
                row.append(f"yes ({check_cluster(system)})")
            except UserError as exc:
                row.append(f"no: {str(exc).removeprefix('the cluster cannot run this job: ')}")
        rows.append(row)
    head = ["system", "nodes x ranks", "partition", "description", *(["fits this cluster"] if here else [])]
    _print_table("systems (./systems/*.yaml, then built in)", head, rows)
    return 0


def cmd_resubmit(args) -> int:
    from trainbench.console import console
    from trainbench.launch.slurm import resubmit

    runs, job_id = resubmit(Path(args.folder), args.time)
    console.print(
        f"submitted job {job_id}: run(s) {', '.join(map(str, runs))} of {args.folder} continue from their last "
        "checkpoints"
    )
    return 0


def _print_table(title: str, head: list[str], rows: list[list[str]]) -> None:
    from rich.table import Table
    from rich.text import Text

    from trainbench.console import console

    # Cells are data (a plugin's description, a results folder's values): shown as text, never read as markup.
    table = Table(title=Text(str(title)))
    for h in head:
        table.add_column(Text(str(h)))
    for row in rows:
        table.add_row(*(Text(str(cell)) for cell in row))
    console.print(table)


def cmd_report(args) -> int:
    from trainbench.console import console
    from trainbench.report import bench_report, index
    from trainbench.report.render import score_table, write_report

    folders = [Path(f) for f in args.folders]
    for folder in folders:
        if not folder.is_dir():
            raise UserError(f"results folder {folder} does not exist")
    if args.export:
        return _export(args.export, folders)
    if len(folders) > 2:
        raise UserError("give one results folder to report on, two to compare, or a folder of many to index "
                        "(or --export them)")  # fmt: skip
    if args.out and len(folders) == 1:
        raise UserError("--out names a comparison's page: give two folders to compare with it")
    if len(folders) == 2:
        from trainbench.report import compare

        page, head, rows = compare.write(folders[0], folders[1], Path(args.out) if args.out else None,
                                         args.allow_different)  # fmt: skip
        measured = bench_report.is_bench(folders[0])
        _print_table("comparison" + (" of throughput measurements" if measured else ""), head, rows)
        console.print(f"comparison: {page}")
        return 0
    folder = folders[0]
    if not index.is_results(folder) and index.results_under(folder):
        page, rows = index.write(folder)
        _print_table(f"{len(rows)} folders under {folder}", ["folder", "benchmark", "date", "status", "figure"],
                     [[r.folder.relative_to(folder).as_posix(), *_index_cells(r)] for r in rows])  # fmt: skip
        console.print(f"index: {page}  (and each folder's report.html)")
        return 0
    if bench_report.is_bench(folder):
        md, page, result = bench_report.write(folder)
        _print_table(bench_report.heading(result), ["figure", "value"], bench_report.rows(result))
        console.print(f"hardware: {bench_report.hardware_line(result)}", markup=False)
        console.print(f"report: {page}  (and {md.name})")
        return 0
    md, page, score, headline = write_report(folder)
    _print_table(str(folder), *score_table(score))
    console.print(f"{headline.figure} — {headline.what}", markup=False)
    for label, text in headline.lines:
        console.print(f"  {label}: {text}", markup=False)
    console.print(f"report: {page}  (and {md.name})")
    return 0


def _index_cells(row) -> list[str]:
    h = row.headline
    if h is None:
        return ["", "", f"cannot be reported: {row.error}", ""]
    return [f"{h.benchmark}/{h.preset}", h.date, h.status, h.figure]


def _export(how: list[str], folders: list[Path]) -> int:
    from trainbench.console import console
    from trainbench.report import index
    from trainbench.report.export import export

    tool, dest = how
    pairs = []
    for folder in folders:
        if index.is_results(folder):
            pairs.append((folder, folder.resolve().name))
            continue
        under = index.results_under(folder)
        if not under:
            raise UserError(f"{folder} holds no runs and no run or bench folders; give the folder `trainbench run` or "
                            "`bench` printed, or the results folder above them")  # fmt: skip
        pairs += [(f, f.relative_to(folder).as_posix()) for f in under]
    done = export(tool, dest, pairs)
    unfinished = f", {len(done.unfinished)} not finished (left for a later export)" if done.unfinished else ""
    console.print(f"{tool}: {len(done.written)} run(s) written to {dest}, {len(done.skipped)} already there"
                  f"{unfinished}", markup=False)  # fmt: skip
    for failed in done.failed:
        console.print(f"warning: not exported: {failed}", markup=False)
    if tool == "tensorboard" and done.written:
        console.print(f"view them: tensorboard --logdir {dest}", markup=False)
    return 1 if done.failed else 0


def cmd_package(args) -> int:
    from trainbench.console import console
    from trainbench.report.bench_report import refuse
    from trainbench.report.package import check_package, empty_fields, make_package
    from trainbench.report.scoring import folder_benchmark
    from trainbench.runfiles import finished_logs

    refuse(Path(args.folder), "package")
    logs = finished_logs(Path(args.folder))
    if args.ruleset is not None and logs:
        _check_ruleset_for(logs[0], args.ruleset)
    package = make_package(Path(args.folder), Path(args.out), args.org, args.system, args.system_desc)
    root = package.root
    _, ruleset = folder_benchmark(Path(args.folder), logs)
    ruleset = args.ruleset or ruleset
    checked = check_package(root, ruleset, package.scaled_down)
    (root / "package_checker.log").write_text(checked.output)
    console.print(f"package: {root}")
    if package.required_runs is not None:
        short = package.runs < package.required_runs
        console.print(f"  runs: {package.runs} finished, of the {package.required_runs} a {package.benchmark} "
                      f"submission needs{' (run it with --nexp ' + str(package.required_runs) + ')' if short else ''}",
                      style="yellow" if short else None)  # fmt: skip
    for note in package.notes:
        console.print(f"  {note}", markup=False, style="yellow" if note.startswith("the runs") else None)
    console.print(f"  implementation: {package.implementation} (trainbench's source and the runs' config)",
                  markup=False)  # fmt: skip
    desc_path = root / "systems" / f"{args.system}.json"
    empty = empty_fields(json.loads(desc_path.read_text()))
    if empty:
        console.print(f"  {desc_path.name}: {len(empty)} field(s) nothing recorded, empty: {', '.join(empty)}; fill "
                      "them in a copy and pass it as --system-desc", style="yellow", markup=False)  # fmt: skip
    for line in checked.passed:
        console.print(f"  passed: {line}", style="green", markup=False)
    for line in checked.warnings:
        console.print(f"  warning: {line}", style="yellow", markup=False)
    for line in checked.beyond_scale:
        console.print(f"  failed, as a scaled-down preset must: {line} (its samples to converge are measured against "
                      f"the full {package.benchmark} model's reference convergence points)", markup=False)  # fmt: skip
    for line in checked.errors:
        console.print(f"  error: {line}", style="red", markup=False)
    if checked.crashed:
        console.print("  error: the package checker gave no verdict: it stopped with an error, or printed no result "
                      "line (see its log)", style="red")  # fmt: skip
    if not checked.ok:
        verdict = f"{len(checked.errors) + checked.crashed} error(s)"
    elif checked.beyond_scale:
        verdict = "SUCCESS except the RCP check a scaled-down preset cannot pass"
    else:
        verdict = "no errors"
    verdict += f", {len(checked.warnings)} warning(s)" if checked.warnings else ""
    console.print(f"mlperf-logging package checker (ruleset {ruleset}): {verdict}; log: {root / 'package_checker.log'}")
    return 0 if checked.ok else 1


def cmd_convert(args) -> int:
    from trainbench.benchmarks import get_benchmark

    return get_benchmark(args.benchmark).convert(args)


def cmd_check(args) -> int:
    from trainbench.console import console
    from trainbench.mlperf import check_compliance
    from trainbench.report.scoring import folder_config
    from trainbench.runfiles import CONFIG, finished_logs, partial_logs

    path = Path(args.path)
    if path.is_dir():
        from trainbench.report.bench_report import refuse

        refuse(path, "check")
        logs = finished_logs(path)
        for p in partial_logs(path):
            console.print(f"{p.name}: run did not finish (no run_stop); not checked", style="yellow")
        if not logs:
            raise UserError(f"{path} holds no finished MLPerf log (result_*.txt)")
        config = path / CONFIG
        waived = frozenset()
        if config.exists():
            bench, cfg = folder_config(config)
            waived = bench.waived_checks(cfg)
        ruleset = args.ruleset or (bench.ruleset_of(cfg) if config.exists() else None)
    elif path.is_file():
        logs = [path]
        ruleset = args.ruleset
        waived = frozenset()
    else:
        raise UserError(f"{path} does not exist")
    if args.ruleset is not None:
        _check_ruleset_for(logs[0], args.ruleset)
    if ruleset is None:
        ruleset = _ruleset_from_log(logs[0])
    from trainbench.benchmarks import is_own
    from trainbench.mlperf import submission_benchmark
    from trainbench.report.scoring import log_events

    failures = 0
    for log in logs:
        own = is_own(submission_benchmark(log_events(log)))
        result = check_compliance(log, ruleset, waived=waived, own=own)
        failures += not result.ok
        console.print(f"{log}: {result.reason()} (ruleset {ruleset})", style="green" if result.ok else "red")
    return 1 if failures else 0


def _check_ruleset_for(log: Path, ruleset: str) -> None:
    """``--ruleset`` must be one mlperf-logging has and, for a benchmark trainbench knows, one it follows."""
    from trainbench.benchmarks import by_mlperf_name
    from trainbench.mlperf import require_installed, submission_benchmark
    from trainbench.report.scoring import log_events

    bench = by_mlperf_name(submission_benchmark(log_events(log)) or "")
    if bench is not None:
        bench.check_ruleset(ruleset, "--ruleset")
    else:
        require_installed(ruleset, "--ruleset")


def _ruleset_from_log(log: Path) -> str:
    from trainbench.benchmarks import ruleset_of
    from trainbench.mlperf import submission_benchmark
    from trainbench.report.scoring import log_events

    return ruleset_of(submission_benchmark(log_events(log)), log, "pass --ruleset")


COMMANDS = {
    "list": cmd_list,
    "prepare": cmd_prepare,
    "run": cmd_run,
    "submit": cmd_submit,
    "resubmit": cmd_resubmit,
    "report": cmd_report,
    "package": cmd_package,
    "bench": cmd_bench,
    "convert": cmd_convert,
    "check": cmd_check,
}


def _not_this_benchmarks(parser: argparse.ArgumentParser, benchmark: str, stray: list[str]) -> str:
    """One sentence for arguments ``prepare BENCHMARK`` does not take, naming the benchmarks whose option it is."""
    option = next((a.split("=", 1)[0] for a in stray if a.startswith("-")), None)
    if option is None:
        return f"trainbench prepare {benchmark} takes no argument {stray[0]!r} (its options: --help)"
    owners = [name for name, options in parser.prepare_options.items() if option in options]
    whose = f"an option of `prepare {' / '.join(owners)}`, not" if owners else "not an option"
    return f"{option} is {whose} of `trainbench prepare {benchmark}` (`--help` after it lists its options)"


def main(argv: list[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    # Help, or the usage of a bare `trainbench`, is printed without importing the benchmarks (and torch, seconds).
    help_only = not words or (("-h" in words or "--help" in words) and words[:1] != ["prepare"])
    parser = _parser(benchmarks=not help_only)
    if parser.broken_hooks:
        from rich.markup import escape

        from trainbench.console import console

        wanted = words[1] if words[:1] == ["prepare"] and len(words) > 1 else None
        if wanted in parser.broken_hooks:
            console.print(f"[red]error:[/red] {escape(parser.broken_hooks[wanted])}")
            return 2
        for sentence in parser.broken_hooks.values():
            console.print(f"warning: {sentence}", style="yellow", markup=False)
    # key=value overrides may come before or after options; argparse leaves the later ones unparsed.
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if args.command not in ("run", "submit", "bench") or "=" not in a or a.startswith("-")]
    if stray and args.command == "prepare":
        from rich.markup import escape

        from trainbench.console import console

        console.print(f"[red]error:[/red] {escape(_not_this_benchmarks(parser, args.benchmark, stray))}")
        return 2
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    try:
        return COMMANDS[args.command](args)
    except Preempted as exc:
        from trainbench.console import console

        console.print(f"{exc}; continue with the same command plus resume=true")
        return Preempted.exit_code
    except UserError as exc:
        from rich.markup import escape

        from trainbench.console import console

        console.print(f"[red]error:[/red] {escape(str(exc))}")
        return 2
    except KeyboardInterrupt:
        from trainbench.console import console

        console.print("interrupted (Ctrl-C)")
        return 130
    except OSError as exc:  # the machine refused: a full disk, a read-only or missing folder, a path that is a file
        from rich.markup import escape

        from trainbench.console import console

        where = f": {exc.filename}" if exc.filename else ""
        console.print(f"[red]error:[/red] {escape((exc.strerror or str(exc)) + where)}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
