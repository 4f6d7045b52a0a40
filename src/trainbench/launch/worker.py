"""Entry point of each torchrun process: ``python -m trainbench.launch.worker RUN_DIR INDEX``."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from pathlib import Path

from rich.markup import escape

from trainbench.console import console
from trainbench.distributed import init_distributed, leave, resolve_device, shutdown
from trainbench.errors import Preempted, UserError
from trainbench.launch.local import RUN_LOCKED, check_or_record_inputs
from trainbench.launch.systems import allocation_shares, format_cpus, parse_cpus
from trainbench.resolve import allocator_settings, experiment_config, load_run_config
from trainbench.runfiles import CONFIG, RANKS_LOCK, FolderLock, RunFiles, rank_error
from trainbench.train.duties import StopSignal
from trainbench.train.loop import train


def main(argv: list[str] | None = None) -> int:
    """``RUN_DIR INDEX [--resume]``: one rank of run INDEX (torchrun's or Slurm's environment)."""
    StopSignal.install_early()
    argv = sys.argv[1:] if argv is None else argv
    run_dir, index, resume = Path(argv[0]), int(argv[1]), "--resume" in argv[2:]
    if RUN_LOCKED in os.environ:
        # Beside the launcher's lock, held by this rank until its process ends (the kernel drops it, however it
        # ends): the folder stays in use while any rank of the run lives, even where the launcher is gone.
        FolderLock(run_dir, "", RANKS_LOCK).share()
    bench, saved = load_run_config(run_dir / CONFIG)
    allocator_settings(bench)  # a rank that srun started: before its first CUDA allocation
    cfg = experiment_config(saved, index)
    lock = None
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    if rank == "0" and RUN_LOCKED not in os.environ:  # started by srun: no launcher holds the run's lock
        job = os.environ.get("SLURM_JOB_ID")
        try:
            lock = FolderLock.of_run(run_dir, index, f"run {index}" + (f" of Slurm job {job}" if job else "")).acquire()
            check_or_record_inputs(bench, saved, run_dir, index)
        except UserError as exc:  # before any collective: srun's --kill-on-bad-exit ends the other ranks
            console.print(f"[red]error:[/red] {escape(str(exc))}")
            return 1
    info = init_distributed(resolve_device(cfg.device), cfg.distributed.backend, cfg.distributed.timeout_s)
    ended = False
    try:
        pinned = bind_cpus(info)
        if pinned and info.is_main:
            console.print(f"rank 0: {pinned}", markup=False)
        train(cfg, bench, run_dir, index, info, resume=resume)
        ended = True
    except Preempted as exc:
        if info.is_main:
            console.print(str(exc))
            # The job script requeues on this marker: srun's own exit code is not reliable here, since
            # --kill-on-bad-exit may stop the other ranks (after the checkpoint) before they exit with 3.
            RunFiles(run_dir, index).preempted_marker.touch()
        return Preempted.exit_code
    except UserError as exc:
        say_error(exc, info, run_dir, f"run{index}")
        return 1
    finally:
        shutdown(drain=ended)
        if lock is not None:
            lock.release()
    return 0


def say_error(exc: UserError, info, run_dir: Path, what: str) -> None:
    """Rank 0 prints the sentence; another rank leaves it in the run folder for its launcher to name."""
    if info.is_main:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
    else:
        with contextlib.suppress(OSError):  # the exit code still says it failed
            rank_error(run_dir, what, info.rank).write_text(str(exc) + "\n")


def bind_cpus(info, env=None) -> str | None:
    """Pin this rank to its CPUs on its node, within the job's allocation there (the CPUs this task may use, which
    Slurm confines to what it allocated the job), and return how (None: not pinned):

    - where Slurm bound the task itself (srun --cpu-bind, SLURM_CPU_BIND_TYPE other than none), its binding stands;
    - with the system file's NUMA map (TRAINBENCH_CPU_MAP, "0-13;14-27;..."): this local rank's CPUs of it, less the
      ones the allocation does not hold (a job that shares its nodes); a CPU the node lacks, or a share the
      allocation holds none of, is one readable sentence;
    - else, under Slurm with several ranks on the node: this local rank's share of the allocation, NUMA node by NUMA
      node and whole cores (:func:`allocation_shares`)."""
    env = os.environ if env is None else env
    allowed = os.sched_getaffinity(0)
    bound = env.get("SLURM_CPU_BIND_TYPE", "").replace("verbose", "").strip(",: ")
    if bound and bound not in ("none", "no"):
        return f"CPUs {format_cpus(allowed)}, as Slurm bound the task ({bound})"
    layout = env.get("TRAINBENCH_CPU_MAP")
    if layout:
        ranges = layout.split(";")
        if info.local_rank >= len(ranges):
            raise UserError(f"the system's CPU map has {len(ranges)} entries but this is local rank {info.local_rank}")
        cpus = parse_cpus(ranges[info.local_rank])
        absent = sorted(c for c in cpus if c >= (os.cpu_count() or 0))
        usable = cpus & allowed
        if absent or not usable:
            have = f"this node has {os.cpu_count()} CPUs" if absent else "the job's allocation holds none of them"
            raise UserError(
                f"local rank {info.local_rank} on {socket.gethostname()} should run on CPUs {ranges[info.local_rank]} "
                f"but {have} (this task may use {len(allowed)} CPUs: {format_cpus(allowed)}); fix cpus_per_node / "
                "numa in the system file"
            )
        os.sched_setaffinity(0, usable)
        part = "" if usable == cpus else f", the part of the system file's {ranges[info.local_rank]} allocated"
        return f"CPUs {format_cpus(usable)} (the system file's NUMA map{part})"
    ranks = info.local_world_size
    if "SLURM_JOB_ID" not in env or ranks < 2:
        return None
    share = allocation_shares(allowed, ranks)[info.local_rank]
    if not share:
        return f"not pinned: the job's allocation on this node ({format_cpus(allowed)}) has fewer cores than ranks"
    os.sched_setaffinity(0, share)
    return f"CPUs {format_cpus(share)} (its share of the job's allocation {format_cpus(allowed)})"


if __name__ == "__main__":
    leave(main())  # never through Python's finalization: see leave()
