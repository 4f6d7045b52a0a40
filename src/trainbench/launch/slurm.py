"""`trainbench submit`: an sbatch script per results folder, checked against the cluster, then submitted.

The script starts one process per GPU (or per CPU rank) with ``srun``; each reads its rank from
``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NTASKS`` and meets the others at the first node's address.
Every value that reaches the script is shell-quoted, so names, paths and overrides with spaces, quotes,
``$()`` or ``;`` are data, never code.

K experiments (``--nexp``) are one job array: one submission, each array task is requeued on its own after a
preemption, and ``SLURM_ARRAY_TASK_ID`` is the run index (``result_<i>.txt``). The array is throttled to the system
file's ``array_parallel`` runs at once (``%1`` by default): runs side by side would share the network and storage
they measure. An exclusive job asks for each node's whole memory too (``--mem=0``); the system file's
``sbatch_options`` add any other #SBATCH option (a QOS, a constraint, a reservation).

Preemption: ``--signal=USR1@120`` makes every rank checkpoint and exit with code 3 two minutes before the
time limit; the script then requeues the job (``--requeue``), and the requeued job resumes from the
checkpoint. ``scancel`` leaves ``slurm_<i>.json`` saying CANCELLED in the results folder.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

from trainbench.benchmarks.base import Benchmark
from trainbench.config import RunConfig, has_control_character, save_config
from trainbench.errors import UserError
from trainbench.launch.local import Planner, new_run_dir
from trainbench.launch.systems import System, load_system, save_system
from trainbench.node import SITE_CACHE_CLEAR_ENV
from trainbench.resolve import absolute_paths, load_run_config, path_values
from trainbench.runfiles import CONFIG, FolderLock, RunFiles
from trainbench.version import describe

q = shlex.quote
SCRIPT = "submit.sbatch"
SYSTEM = "system.yaml"  # the system the folder's job was written for, as it was then


def _job_name(bench: str, preset: str, system: str) -> str:
    # Slurm shows job names in squeue; keep them to characters every tool prints as they are.
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", f"tb-{bench}-{preset}-{system}")[:64]


def render_script(system: System, cfg: RunConfig, run_dir: Path, nexp: int, command: list[str], python: str,
                  chain: int = 1) -> str:  # fmt: skip
    """The sbatch script: #SBATCH lines, environment, srun of every rank, requeue and bookkeeping. With ``chain``
    > 1 the job is one of a chain of that name: it starts when the previous one has ended, continues the run from
    its checkpoint, and on the time-limit warning leaves the rest to the next one instead of requeueing itself, when
    a next one is queued; with none (the chain's last, or a resubmitted job) it requeues itself. A requeue Slurm
    refuses leaves the state STOPPED and a line saying how to continue."""
    job = _job_parts(system, cfg, run_dir, command, python, "slurm-%A_%a.out" if nexp > 1 else "slurm-%j.out",
                     requeue=True)  # fmt: skip
    sb, box = job.sbatch, job.box
    if nexp > 1:  # throttled: runs at once would share (and measure) one network and one file system
        sb.append(f"--array=0-{nexp - 1}%{system.array_parallel}")
    if chain > 1:
        sb.append("--dependency=singleton")
    lines = [
        *job.head(sb),
        "INDEX=${SLURM_ARRAY_TASK_ID:-0}",
        *job.environment,
        "state() {  # the job's state, for whoever reads the results folder (written whole, then renamed)",
        '  printf \'{"job_id": "%s", "index": %s, "state": "%s", "exit_code": %s}\\n\' '
        '"$SLURM_JOB_ID" "$INDEX" "$1" "$2" > "$RUN_DIR/.slurm_$INDEX.json.$$" && '
        'mv -f "$RUN_DIR/.slurm_$INDEX.json.$$" "$RUN_DIR/slurm_$INDEX.json"',
        "}",
        "on_term() {  # scancel or the time limit (the ranks checkpoint and stop too): record which",
        '  s=$(scontrol show job "$SLURM_JOB_ID" -o 2>/dev/null | grep -o "JobState=[A-Z_]*" | cut -d= -f2)',
        '  case "$s" in CANCELLED|TIMEOUT|PREEMPTED|NODE_FAIL) ;; *)  # RUNNING/COMPLETING: ask the nodes, the clock',
        '    if sinfo -h -N -n "$SLURM_JOB_NODELIST" -o %T 2>/dev/null | grep -qiE "down|fail"; then s=NODE_FAIL; '
        '    elif [ "$(date +%s)" -ge "$(( ${SLURM_JOB_END_TIME:-9999999999} - 10 ))" ]; then s=TIMEOUT; '
        "else s=CANCELLED; fi ;; esac  # NODE_FAIL: Slurm requeues the job (--requeue) and it resumes",
        '  state "$s" null',
        "  STOPPED=1",
        "}",
        "STOPPED=0",
        "trap on_term TERM",
        # result_<i>.txt exists once run i has ended (runfiles.RunFiles.log)
        'if [ -e "$RUN_DIR/result_$INDEX.txt" ]; then  # an earlier job (of a chain, or a requeue) ended the run',
        '  echo "run $INDEX has ended: nothing left for job $SLURM_JOB_ID"',
        "  exit 0",
        "fi",
        'rm -f "$RUN_DIR/preempted_$INDEX"',
        "state RUNNING null",
        *box.start_lines,
        "# preflight: on every node the container starts, sees the data and this folder, the GPUs are there, and an",
        "# all-reduce over the job's ranks measures the bus bandwidth (preflight_$INDEX.json); else no run starts",
        'rm -rf "$RUN_DIR/preflight" && mkdir -p "$RUN_DIR/preflight"',
        job.each_rank('trainbench.launch.preflight "$RUN_DIR" "$INDEX"') + "; prc=$?",
        "bad=0",
        'for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do',
        '  why=$(cat "$RUN_DIR/preflight/$node".*.failed 2>/dev/null | head -n 1)',
        '  if [ -n "$why" ]; then echo "preflight failed on node $node: $why"; bad=1',
        '  elif ! ls "$RUN_DIR/preflight/$node".*.ok >/dev/null 2>&1; then',
        '    echo "preflight failed on node $node: it never reported (the container did not start there, or the '
        'results folder is not visible in it; srun exit code $prc)"; bad=1',
        "  fi",
        "done",
        'if [ "$bad" = 0 ] && [ "$prc" != 0 ]; then echo "preflight failed: the all-reduce step exited with $prc"; '
        "bad=1; fi",
        'if [ "$bad" = 1 ]; then state PREFLIGHT_FAILED "$prc"; exit 1; fi',
        *job.cache_clear_lines,
        job.each_rank('trainbench.launch.worker "$RUN_DIR" "$INDEX" --resume') + " &",
        "wait $!; rc=$?",
        "while kill -0 $! 2>/dev/null; do wait $!; rc=$?; done  # a trapped signal interrupts the first wait",
        'if [ "$STOPPED" = 1 ]; then exit "$rc"; fi',
        'if [ -e "$RUN_DIR/preempted_$INDEX" ]; then  # the ranks checkpointed on USR1: go again',
        '  rm -f "$RUN_DIR/preempted_$INDEX"',
        *(
            [  # the next job of the chain resumes from the checkpoint, if one is queued: else this one goes again
                '  if squeue -h -n "$SLURM_JOB_NAME" -o %i 2>/dev/null | grep -qvx "$SLURM_JOB_ID"; then',
                '    state CONTINUES "$rc"; exit 0',
                "  fi",
            ]
            if chain > 1
            else []
        ),
        '  state REQUEUED "$rc"',
        '  if ! scontrol requeue "$SLURM_JOB_ID"; then',
        '    state STOPPED "$rc"',
        '    echo "run $INDEX stopped with a checkpoint and no job follows: trainbench resubmit $RUN_DIR continues it"',
        "  fi",
        "  exit 0",
        "fi",
        box.finish + ' -m trainbench.launch.slurm finish "$RUN_DIR" "$INDEX" "$rc"',
        "exit $?  # the run's exit code, or 0 where its log holds run_stop",
    ]
    return job.script(lines, sb)


@dataclasses.dataclass
class JobParts:
    """What every job script of a system has: its #SBATCH options, the srun of one process per rank, the
    environment and the container (the run's script and the throughput measurement's build on these)."""

    sbatch: list[str]
    srun: list[str]
    env: dict[str, str]
    box: ContainerParts
    run_dir: Path
    python: str
    recorded: str  # the command that wrote the script, on one line
    layout: str
    cache_clear_command: str | None = None

    def head(self, sb: list[str]) -> list[str]:
        return [
            "#!/bin/bash",
            *(f"#SBATCH {q(opt)}" for opt in sb),
            f"# written by: {self.recorded}",
            f"# layout {self.layout} (nodes x ranks per node x micro-batch x accumulation)",
            "set -uo pipefail",
            f"RUN_DIR={q(str(self.run_dir))}",
            f"PYTHON={q(self.python)}",
        ]

    @property
    def environment(self) -> list[str]:
        return [
            'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))",
            *(f"export {k}={q(v)}" for k, v in self.env.items() if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)),
        ]

    @property
    def cache_clear_lines(self) -> list[str]:
        """The system file's cache_clear_command on every node, outside any container; its exit code goes to the
        ranks, whose MLPerf log says whether the page cache was dropped (without one, a rank running as root drops
        it itself)."""
        if not self.cache_clear_command:
            return []
        return [
            "# the page cache, dropped on every node before the run (the system file's cache_clear_command)",
            'srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 bash -c '
            f"{q(self.cache_clear_command)}; export {SITE_CACHE_CLEAR_ENV}=$?",
        ]

    def each_rank(self, module_args: str) -> str:
        """The srun line starting ``python -m <module_args>`` on every rank (in the container, if any)."""
        return " ".join([*map(q, self.srun), *self.box.srun_flags, self.box.command]) + f" -m {module_args}"

    def script(self, lines: list[str], sb: list[str]) -> str:
        script = "\n".join(lines) + "\n"
        # The last guard: every value above is quoted, but no quoting keeps a line break from ending a line.
        checked = [str(self.run_dir), self.python, *sb, *self.srun, *self.env.values(), *self.env, *self.box.prefix]
        for value in [*checked, self.cache_clear_command or ""]:
            if has_control_character(value):
                raise UserError(f"{value!r} holds a control character; it cannot go into a job script")
        return script


def _job_parts(system: System, cfg: RunConfig, run_dir: Path, command: list[str], python: str, output: str,
               requeue: bool = False) -> JobParts:  # fmt: skip
    ranks = system.ranks_per_node
    sb = [
        f"--job-name={_job_name(cfg.benchmark, cfg.preset, system.name)}",
        f"--nodes={system.nodes}",
        f"--ntasks-per-node={ranks}",
        f"--time={system.time}",
        f"--output={run_dir}/{output}",
        *(["--requeue", "--signal=USR1@120"] if requeue else []),
    ]
    if system.gpus_per_node:
        sb.append(f"--gpus-per-node={system.gpus_per_node}")
    if system.partition:
        sb.append(f"--partition={system.partition}")
    if system.account:
        sb.append(f"--account={system.account}")
    if system.exclusive:
        sb += ["--exclusive", "--mem=0"]  # the whole node, its memory too (--exclusive alone leaves the default)
    sb += system.sbatch_options
    srun = ["srun", f"--mpi={system.mpi}", f"--ntasks-per-node={ranks}", "--kill-on-bad-exit=1"]
    if system.cpu_bind:
        srun.append(f"--cpu-bind={system.cpu_bind}")
    if system.srun_gres:
        srun.append(f"--gres={system.srun_gres}")  # repeated on srun: some Slurm versions drop it otherwise
    env = dict(system.env)
    box = container_parts(system, mounts_for(system, cfg, run_dir), env)
    if system.numa:
        env["TRAINBENCH_CPU_MAP"] = ";".join(system.cpu_map())
    recorded = "".join(" " if has_control_character(c) else c for c in " ".join(q(a) for a in command))
    layout = system.naming(cfg.data.global_batch_size, cfg.data.micro_batch_size)
    return JobParts(sb, srun, env, box, run_dir, python, recorded, layout, system.cache_clear_command)


def render_bench_script(system: System, cfg: RunConfig, run_dir: Path, command: list[str], python: str,
                        rank: str) -> str:  # fmt: skip
    """The sbatch script of a throughput measurement (`trainbench bench --system`): every rank runs ``python -m
    RANK`` (the measurement's module and arguments), which measures the depth that bench_request.json names; no
    requeue (a measurement that is stopped is measured again)."""
    job = _job_parts(system, cfg, run_dir, command, python, "slurm-bench-%j.out")
    lines = [
        *job.head(job.sbatch),
        *job.environment,
        *job.box.start_lines,
        job.each_rank(rank),
    ]
    return job.script(lines, job.sbatch)


# -- containers -------------------------------------------------------------------------------------------

# Passed into a podman container by name (podman's --env takes a trailing * for every variable so named): what a rank
# reads of Slurm's and the job script's environment.
PODMAN_ENV = ("SLURM_*", "SLURMD_NODENAME", "MASTER_ADDR", "MASTER_PORT", "TRAINBENCH_*", "CUDA_VISIBLE_DEVICES")


@dataclasses.dataclass
class ContainerParts:
    """What the job script adds for a container: lines that start it once per node, srun flags (kept unquoted where
    they expand $SLURM_JOB_ID), the command prefix of each rank (a runtime and the image's python), and how the
    closing bookkeeping step runs."""

    start_lines: list[str]
    srun_flags: list[str]
    prefix: list[str]
    finish: str

    @property
    def command(self) -> str:
        """The start of each rank's command, as shell text."""
        return " ".join(map(q, self.prefix)) if self.prefix else '"$PYTHON"'


def mounts_for(system: System, cfg: RunConfig, run_dir: Path) -> list[str]:
    """The system's mounts, then the run's folder and the config's data and weights at the paths they have here:
    the ranks read and write the same paths inside as outside."""
    if system.container is None:
        return []
    mounts = list(system.container.mounts)
    covered = [m.split(":")[1] for m in mounts]
    paths = [str(run_dir)] + [str(v) for k, v in path_values(cfg).items() if k != "output.run_dir"]
    for path in paths:
        if any(path == c or path.startswith(c.rstrip("/") + "/") for c in covered):
            continue
        if "," in path or ":" in path:
            raise UserError(f"{path} holds a comma or a colon, which a container mount cannot take; move it or mount "
                            "a folder above it in the system file's container.mounts")  # fmt: skip
        mounts.append(f"{path}:{path}")
        covered.append(path)
    return mounts


def container_parts(system: System, mounts: list[str], env: dict[str, str]) -> ContainerParts:
    c = system.container
    if c is None:
        return ContainerParts([], [], [], '"$PYTHON"')
    gpus = system.gpus_per_node > 0
    if c.runtime == "pyxis":
        name = "--container-name=trainbench_${SLURM_JOB_ID}"  # expanded by the shell: one container per job
        start = [
            "# pyxis: the first step imports the image once on every node; later steps reuse it by name",
            " ".join(["srun", "--ntasks-per-node=1", q(f"--container-image={c.image}"), name, "true"])
            + ' || { state PREFLIGHT_FAILED $?; echo "preflight failed: the container image did not start on every '
            'node"; exit 1; }',
        ]
        flags = [name, q(f"--container-mounts={','.join(mounts)}")] if mounts else [name]
        finish = " ".join(["srun", "--nodes=1", "--ntasks=1", *flags, q(c.python)])
        return ContainerParts(start, flags, [c.python], finish)
    if c.runtime == "apptainer":
        prefix = [c.runtime_command or "apptainer", "exec", *(["--nv"] if gpus else [])]
        for m in mounts:
            prefix += ["--bind", m]
        prefix += [c.image, c.python]
    else:  # podman (podman-hpc: runtime_command)
        prefix = [c.runtime_command or "podman", "run", "--rm", "--network=host", "--uts=host", "--ipc=host"]
        for m in mounts:
            prefix += ["-v", m]
        for name in (*PODMAN_ENV, *env):
            prefix.append(f"--env={name}")
        if gpus:
            prefix.append("--device=nvidia.com/gpu=all")
        prefix += [c.image, c.python]
    finish = " ".join(["srun", "--nodes=1", "--ntasks=1", *map(q, prefix)])
    return ContainerParts([], [], prefix, finish)


# -- what the cluster can do ------------------------------------------------------------------------------


def _run(cmd: list[str]) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise UserError(
            f"`{cmd[0]}` was not found: Slurm's client tools must be on PATH to submit "
            "(use --dry-run to only write the script)"
        ) from None
    if proc.returncode != 0:
        said = "; ".join(line.strip() for line in (proc.stderr or proc.stdout).splitlines() if line.strip())
        raise UserError(f"`{' '.join(cmd)}` failed: {said[:300]}")  # one line, however many the tool printed
    return proc.stdout


def _minutes(limit: str) -> float:
    """Slurm time (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM:SS; 'infinite') -> minutes."""
    if limit in ("infinite", "UNLIMITED"):
        return float("inf")
    days, _, rest = limit.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        parts += [0] * (3 - len(parts))
        h, m, s = parts
    elif len(parts) == 3:
        h, m, s = parts
    elif len(parts) == 2:
        h, m, s = 0, parts[0], parts[1]
    else:
        h, m, s = 0, parts[0], 0
    return int(days or 0) * 1440 + h * 60 + m + s / 60


def check_cluster(system: System) -> str:
    """Partition, nodes, CPUs, GPUs and time limit against the request; returns the partition used."""
    partitions = {}
    for line in _run(["sinfo", "-h", "-o", "%P|%a|%l|%D|%c|%G"]).splitlines():
        name, avail, limit, nodes, cpus, gres = line.split("|")
        default = name.endswith("*")
        name = name.rstrip("*")
        entry = partitions.setdefault(name, {"avail": avail, "limit": limit, "nodes": 0, "cpus": 0, "gpus": 0})
        entry["default"] = entry.get("default") or default
        entry["nodes"] += int(nodes)
        entry["cpus"] = max(entry["cpus"], int(cpus.rstrip("+")))
        gpus = [int(m) for m in re.findall(r"gpu(?::[^:(,]+)?:(\d+)", gres)]
        entry["gpus"] = max([entry["gpus"], *gpus])
    if not partitions:
        raise UserError("sinfo lists no partitions: is this a Slurm login node?")
    name = system.partition or next((n for n, e in partitions.items() if e.get("default")), None)
    if name not in partitions:
        raise UserError(f"partition '{name}' does not exist on this cluster; partitions: {', '.join(partitions)}")
    p = partitions[name]
    problems = []
    if p["avail"] != "up":
        problems.append(f"partition {name} is {p['avail']}")
    if system.nodes > p["nodes"]:
        problems.append(f"{system.nodes} nodes were asked for but partition {name} has {p['nodes']}")
    if system.gpus_per_node > p["gpus"]:
        problems.append(f"{system.gpus_per_node} GPUs per node were asked for but nodes of {name} have {p['gpus']}")
    if system.gpus_per_node == 0 and system.ranks_per_node > p["cpus"]:
        problems.append(f"{system.ranks_per_node} CPU ranks per node but nodes of {name} have {p['cpus']} CPUs")
    if system.cpus_per_node and system.cpus_per_node > p["cpus"]:
        problems.append(
            f"the system file says {system.cpus_per_node} CPUs per node but nodes of {name} have {p['cpus']}"
        )
    if _minutes(system.time) > _minutes(p["limit"]):
        problems.append(f"time {system.time} exceeds partition {name}'s limit {p['limit']}")
    if problems:
        raise UserError("the cluster cannot run this job: " + "; ".join(problems))
    return name


def check_mpi(system: System) -> None:
    """The system's ``srun --mpi`` plugin is one this cluster's srun offers (``srun --mpi=list``): a job asking for
    pmix where only pmi2 is built fails at its first srun, after waiting in the queue."""
    if system.mpi in ("none", ""):
        return
    try:
        proc = subprocess.run(["srun", "--mpi=list"], capture_output=True, text=True, timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return  # no srun here to ask: sinfo's check has already said what it could
    listed = proc.stdout + proc.stderr
    offered = sorted({w.strip() for w in re.findall(r"^\s+(\S+)\s*$", listed, re.MULTILINE)})
    if proc.returncode != 0 or not offered:
        return
    if not any(name == system.mpi or name.startswith(f"{system.mpi}_") for name in offered):
        raise UserError(
            f"system {system.name} asks for srun --mpi={system.mpi} but this cluster's srun offers "
            f"{', '.join(offered)} (srun --mpi=list); set mpi: in the system file to one of them"
        )


def check_container(system: System) -> None:
    """A container image that is a file (an enroot squashfs, an Apptainer SIF) exists where submit runs."""
    image = system.container.image if system.container else None
    if image and (image.startswith(("/", "./", "~")) or image.endswith((".sqsh", ".sif"))):
        if not Path(image).expanduser().is_file():
            how = "build it with containers/image.sh (docs/containers.md)"
            raise UserError(f"container image {image} (system {system.name}) does not exist; {how}")


# -- submit -----------------------------------------------------------------------------------------------


def submit(
    bench: Benchmark,
    cfg: RunConfig,
    system: System,
    nexp: int,
    dry_run: bool,
    command: list[str],
    chain: int = 1,
    *,
    plan: Planner,
) -> tuple[Path, str, str | None]:
    """Write the results folder's config.yaml and submit.sbatch; submit it (``chain`` times, as a chain of jobs of
    one name) unless ``dry_run``. ``plan``: perf.plan=auto's planner, from the cached probe of the system's GPU.

    Returns (run folder, script text, the first job's id or None)."""
    if nexp < 1:
        raise UserError(f"--nexp must be at least 1, got {nexp}")
    if not 1 <= chain <= MAX_CHAIN:
        raise UserError(f"--chain must be from 1 to {MAX_CHAIN} jobs, got {chain}")
    if chain > 1 and nexp > 1:
        raise UserError("--chain continues one run across jobs: use it with --nexp 1 (submit each experiment apart)")
    layout = system.naming(cfg.data.global_batch_size, cfg.data.micro_batch_size)
    check_container(system)
    if not dry_run:  # a dry run may be written anywhere: the cluster and its data need not be here
        check_cluster(system)
        check_mpi(system)
        bench.check_data(cfg)
    from trainbench.console import console

    try:
        cfg, lines = plan(bench, cfg, console.print, here=False)  # from the cached probe of the system's GPU
    except UserError as exc:
        if not dry_run:
            raise
        lines = [f"dry run, layout not planned: {exc}"]
    for line in lines:
        console.print(line, markup=False)
    run_dir = new_run_dir(cfg.output.results_dir, bench.name, f"{cfg.preset}-{system.name}").resolve()
    cfg = absolute_paths(cfg)  # the job starts in another directory: data and base weights saved absolute
    cfg = dataclasses.replace(
        cfg,
        device=system.device,
        resume=True,
        distributed=dataclasses.replace(cfg.distributed, nproc=system.ranks_per_node, nodes=system.nodes),
        output=dataclasses.replace(cfg.output, run_dir=str(run_dir), progress=False),
    )
    bench.validate(cfg)  # again, at the job's world size (nodes x ranks per node)
    save_config(cfg, run_dir / CONFIG, f"resolved config, written by {describe()}")
    python = system.container.python if system.container else sys.executable
    script = render_script(system, cfg, run_dir, nexp, command, python, chain)
    path = run_dir / SCRIPT
    path.write_text(script)
    save_system(system, run_dir / SYSTEM)
    job = {"system": system.name, "layout": layout, "nexp": nexp, "chain": chain, "script": path.name, "job_id": None}
    write_job(run_dir, job)
    if not dry_run:
        ids: list[str] = []
        for k in range(chain):  # each job recorded as soon as Slurm has it: resubmit must know every one
            try:
                ids.append(_run(["sbatch", "--parsable", str(path)]).strip().split(";")[0])
            except UserError as e:
                if not ids:
                    raise
                raise UserError(f"sbatch refused job {k + 1} of the chain of {chain} ({e}); jobs {', '.join(ids)} "
                                f"are queued and recorded in {run_dir / 'job.json'}: let them run, then `trainbench "
                                f"resubmit {run_dir}` continues the run (or scancel them)") from None  # fmt: skip
            finally:
                if ids:
                    write_job(run_dir, job | {"job_id": ids[0], "job_ids": ids})
        job["job_id"], job["job_ids"] = ids[0], ids
    return run_dir, script, job["job_id"]


def bench_job(system: System, cfg: RunConfig, run_dir: Path, command: list[str], say, rank: str) -> None:
    """One depth of a throughput measurement as a Slurm job (``trainbench bench --system``; ``rank``: the module and
    arguments each rank runs): the script written to bench.sbatch, submitted with ``sbatch --wait``; returns when the
    job has ended. Ctrl-C, SIGTERM or SIGHUP (a closed terminal, `kill`, `timeout`) cancels the job: it would
    otherwise hold its nodes' GPUs to its time limit."""
    python = system.container.python if system.container else sys.executable
    path = run_dir / "bench.sbatch"
    path.write_text(render_bench_script(system, cfg, run_dir, command, python, rank))
    try:
        proc = subprocess.Popen(["sbatch", "--wait", "--parsable", str(path)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip
    except FileNotFoundError:
        raise UserError("`sbatch` was not found: Slurm's client tools must be on PATH to measure on a system") from None
    job_id = None
    stops = {sig: signal.signal(sig, signal.default_int_handler) for sig in (signal.SIGTERM, signal.SIGHUP)
             if threading.current_thread() is threading.main_thread()}  # fmt: skip
    try:
        job_id = proc.stdout.readline().strip().split(";")[0] or None  # --parsable prints the id at submission
        if job_id:
            say(f"submitted job {job_id}; waiting for it to end (its output: {run_dir}/slurm-bench-{job_id}.out)")
        _, err = proc.communicate()
    except KeyboardInterrupt:
        if job_id:
            subprocess.run(["scancel", job_id], capture_output=True)
            say(f"job {job_id} cancelled")
        raise
    finally:
        for sig, handler in stops.items():
            signal.signal(sig, handler)
    if job_id is None:
        said = "; ".join(line.strip() for line in err.splitlines() if line.strip())
        raise UserError(f"sbatch refused the measurement's job: {said[:300]}")


# The most jobs one `submit --chain` queues: a chain of a week at a two-hour limit, and a typo's million refused.
MAX_CHAIN = 100


def write_job(run_dir: Path, job: dict) -> None:
    """``job.json`` whole or as it was: written beside, then renamed over it."""
    tmp = run_dir / "job.json.tmp"
    tmp.write_text(json.dumps(job, indent=2) + "\n")
    os.replace(tmp, run_dir / "job.json")


def read_job(run_dir: Path) -> dict:
    """``job.json`` of a results folder, checked: one sentence for a file that is not what submit writes."""
    path = run_dir / "job.json"
    try:
        job = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        why = str(e)[:120]
        raise UserError(f"{path}: not readable as JSON ({why}); it is written by `trainbench submit`") from None
    ids = job.get("job_ids") if isinstance(job, dict) else None
    if (not isinstance(job, dict) or not isinstance(job.get("nexp", 1), int) or isinstance(job.get("nexp", 1), bool)
            or not 1 <= job.get("nexp", 1) <= 10_000 or not isinstance(job.get("system", ""), str)
            or not (ids is None or isinstance(ids, list) and all(isinstance(i, (str, int)) for i in ids))
            or not isinstance(job.get("job_id"), (str, int, type(None)))):  # fmt: skip
        raise UserError(f"{path}: not the job record `trainbench submit` writes (nexp, system, job_id, job_ids)")
    return job


def _job_states(ids: list[str]) -> dict[str, str]:
    """Slurm's state of each of these jobs (array tasks included) still in the queue; {} once all have left."""
    # Not `squeue -j`: it fails on a job Slurm has already forgotten.
    states = {}
    for line in _run(["squeue", "-h", "-o", "%F|%i|%T"]).splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[0] in ids:
            states[parts[1]] = parts[2]
    return states


def resubmit(run_dir: Path, time_limit: str | None = None) -> tuple[list[int], str]:
    """Submit a results folder's job script again, for its runs that have not ended (no ``result_<i>.txt``): each
    continues from its last checkpoint (the script's ranks start with ``--resume``), or starts again where it never
    saved one. Refused while a job of the folder is still queued or running, or when every run has ended.

    Returns (the run indexes resubmitted, the new job's id)."""
    run_dir = Path(run_dir).resolve()
    path, job_file = run_dir / SCRIPT, run_dir / "job.json"
    if not (path.is_file() and job_file.is_file()):
        raise UserError(f"{run_dir} is not a results folder written by `trainbench submit` (no {SCRIPT} or job.json)")
    with FolderLock(run_dir, "trainbench resubmit"):  # two resubmits at once: the second waits for nothing, it stops
        return _resubmit(run_dir, path, time_limit)


def _resubmit(run_dir: Path, path: Path, time_limit: str | None) -> tuple[list[int], str]:
    job = read_job(run_dir)
    nexp = int(job.get("nexp", 1))
    left = [i for i in range(nexp) if not (run_dir / f"result_{i}.txt").exists()]
    if not left:
        raise UserError(f"every run in {run_dir} has ended (result_*.txt): nothing to resubmit")
    ids = [str(i) for i in job.get("job_ids") or [job.get("job_id")] if i]
    queued = _job_states(ids)
    if queued:
        job_id, state = next(iter(queued.items()))
        raise UserError(f"job {job_id} of {run_dir} is still {state}: wait for it or scancel it before resubmitting")
    system = load_system(str(run_dir / SYSTEM)) if (run_dir / SYSTEM).is_file() else load_system(job["system"])
    if time_limit is not None:
        system = dataclasses.replace(system, time=time_limit)
        system.validate()
    bench, cfg = load_run_config(run_dir / CONFIG)
    check_cluster(system)
    check_mpi(system)
    bench.check_data(cfg)
    command = ["sbatch", "--parsable"]
    if nexp > 1:
        # only the runs that have not ended, as many at once as the system allows
        command.append("--array=" + ",".join(str(i) for i in left) + f"%{system.array_parallel}")
    if time_limit is not None:
        command.append(f"--time={time_limit}")
    job_id = _run([*command, str(path)]).strip().split(";")[0]
    for i in left:  # until the job starts: no FAILED or CANCELLED of the last attempt left looking current
        write_state(run_dir, i, {"job_id": job_id, "index": i, "state": "PENDING", "exit_code": None})
    job["job_ids"] = [*ids, job_id]
    job["job_id"] = job_id
    write_job(run_dir, job)
    return left, job_id


def finish(run_dir: Path, index: int, rc: int) -> int:
    """After a run's srun: its compliance check, the folder's summary, and the job state; returns the job's exit
    code."""
    from trainbench.launch.local import _collect, write_summary

    bench, cfg = load_run_config(run_dir / CONFIG)
    nexp = json.loads((run_dir / "job.json").read_text()).get("nexp", 1) if (run_dir / "job.json").exists() else 1
    records = [_collect(bench, run_dir, i, cfg) for i in range(nexp)]
    write_summary(bench, cfg, run_dir, records)
    # A log that holds run_stop is a whole result, even if a rank crashed on its way out after it.
    state = "COMPLETED" if rc == 0 or RunFiles(run_dir, index).finished else "FAILED"
    write_state(
        run_dir, index, {"index": index, "state": state, "exit_code": rc, "job_id": os.environ.get("SLURM_JOB_ID")}
    )
    return 0 if state == "COMPLETED" else rc


def write_state(run_dir: Path, index: int, state: dict) -> None:
    """``slurm_<index>.json``, written whole beside it and renamed over it: a reader never sees it half written."""
    path = run_dir / f"slurm_{index}.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(state) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 4 and argv[0] == "finish":
        return finish(Path(argv[1]), int(argv[2]), int(argv[3]))
    print("usage: python -m trainbench.launch.slurm finish RUN_DIR INDEX EXIT_CODE", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
