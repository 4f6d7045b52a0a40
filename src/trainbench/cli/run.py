"""`trainbench run` (on this node), `submit` and `resubmit` (a Slurm job on a system), and what `bench` shares with
them: the overrides, the config of a system's job, the list of systems."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainbench.cli.common import add_config_arguments, print_table
from trainbench.errors import UserError

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


def add_run_parser(sub) -> None:
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
    add_config_arguments(run, "YAML file of overrides (nested or dotted keys); may repeat, applied in order")
    run.add_argument("--nproc", type=int, help="processes on this node (GPUs or CPU ranks); >1 uses torchrun")
    run.add_argument("--nexp", type=int, default=1, help="experiments to run, seeds seed..seed+K-1 (default 1)")
    run.add_argument(
        "--ruleset", help="mlperf-logging ruleset the log follows (default: the benchmark's newest; output.ruleset)"
    )
    run.add_argument("--help-config", action="store_true", help="print every config key with its value and exit")


def add_submit_parser(sub) -> None:
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
    add_config_arguments(subm)
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


def add_resubmit_parser(sub) -> None:
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


def run_overrides(args) -> dict[str, str]:
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
    from trainbench.measure.plan import planned
    from trainbench.resolve import build_config

    overrides = run_overrides(args)
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


def on_system(benchmark: str, preset: str | None, configs: list[str], overrides: dict, name: str,
               nodes: int | None = None, time: str | None = None, array_parallel: int | None = None,
               defaults: dict | None = None):  # fmt: skip
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
    bench, cfg = build_config(benchmark, preset or get_benchmark(benchmark).full_preset, configs, overrides, system,
                              defaults)  # fmt: skip
    return system, cfg, bench


def cmd_submit(args) -> int:
    from trainbench.config import parse_key_values
    from trainbench.console import console
    from trainbench.launch.slurm import submit
    from trainbench.measure.plan import planned

    if args.system == "?":
        return list_systems()
    if args.benchmark is None:
        raise UserError("name the benchmark to submit: trainbench submit BENCH --system NAME (see `trainbench list`)")
    overrides = parse_key_values(args.overrides)
    if args.ruleset is not None:
        overrides["output.ruleset"] = args.ruleset
    system, cfg, bench = on_system(args.benchmark, args.preset, args.config, overrides, args.system, args.nodes,
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


def list_systems() -> int:
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
    print_table("systems (./systems/*.yaml, then built in)", head, rows)
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
