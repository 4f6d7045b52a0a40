"""Local launcher: one process in-process, or N processes through torchrun; K experiments in one folder."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainbench.benchmarks.base import Benchmark
from trainbench.config import RunConfig, leaves, save_config
from trainbench.console import RunConsole, console
from trainbench.distributed import THREADS_WHY, available_slots, cpu_threads, init_distributed, resolve_device, shutdown
from trainbench.errors import ConfigError, DataError, Preempted, UserError
from trainbench.mlperf import ComplianceResult, check_compliance, constants, read_log
from trainbench.resolve import PATH_KEYS, absolute_paths, allocator_settings, experiment_config, load_run_config
from trainbench.runfiles import (
    CONFIG,
    CONSOLE,
    INPUTS,
    LOCK,
    RANKS_LOCK,
    SUMMARY,
    FolderLock,
    RunFiles,
    other_ranks_error,
    read_json,
)
from trainbench.version import describe, provenance


def refuse_used_run_dir(run_dir: Path) -> None:
    """A new run writes its config, logs and summary into ``output.run_dir``: where that folder holds anything (an
    earlier run, finished or not), the run would overwrite it, so it is refused. An empty folder is taken (one made
    for the run beforehand), as is one holding only the lock files a run that stopped before writing left."""
    if not run_dir.is_dir():
        return
    held = sorted(p.name for p in run_dir.iterdir() if not p.name.startswith(LOCK))
    if held:
        what = f"a run (its {CONFIG})" if CONFIG in held else f"{len(held)} file(s), {', '.join(held[:3])}"
        raise UserError(f"output.run_dir={run_dir} already holds {what}, which a new run would overwrite; continue "
                        "that run with resume=true, or give a new or empty folder for a new run")  # fmt: skip


def new_run_dir(results_dir: str, benchmark: str, preset: str) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    base = Path(results_dir) / f"{stamp}-{benchmark}-{preset}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    path.mkdir(parents=True)
    return path


@dataclass
class RunRecord:
    index: int
    outcome: dict | None  # run_<i>.json of a run that ended (its log has run_stop), else None
    compliance: ComplianceResult | None
    stopped: str | None = None  # why a run that did not end stopped, as its run_<i>.json says


def preflight(bench: Benchmark, cfg: RunConfig) -> str:
    """Fail before creating anything for what can be checked up front; returns the device kind."""
    allocator_settings(bench)
    device = preflight_device(cfg)
    bench.check_data(cfg)
    return device


def preflight_device(cfg: RunConfig) -> str:
    """The device kind the config asks for, where this machine has enough of it for distributed.nproc processes."""
    device = resolve_device(cfg.device)
    slots = available_slots(device)
    nproc = cfg.distributed.nproc
    if nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, got {nproc}")
    if nproc > slots:
        what = "GPUs" if device == "cuda" else "CPU cores"
        raise ConfigError(
            f"--nproc {nproc} asks for {nproc} processes but this machine has {slots} {what} (device={device}); "
            f"use --nproc {slots} or fewer"
        )
    return device


def resume_run_dir(bench: Benchmark, cfg: RunConfig) -> Path:
    """The folder resume=true continues: output.run_dir, else the newest of this benchmark and preset."""
    if cfg.output.run_dir:
        run_dir = Path(cfg.output.run_dir)
        if not run_dir.is_dir():
            raise UserError(f"resume=true but {run_dir} does not exist, so there is no run to resume; check "
                            "output.run_dir, or start a new run without resume=true")  # fmt: skip
        if not (run_dir / CONFIG).exists():
            raise UserError(f"resume=true but {run_dir} holds no run to resume (it has no {CONFIG}); check "
                            "output.run_dir, or start a new run without resume=true")  # fmt: skip
        return run_dir
    root = Path(cfg.output.results_dir)
    candidates = sorted(root.glob(f"*-{bench.name}-{cfg.preset}*/{CONFIG}")) if root.is_dir() else []
    if not candidates:
        raise UserError(
            f"resume=true but {root} holds no {bench.name}/{cfg.preset} run folder; "
            "give output.run_dir=FOLDER or start without resume=true"
        )
    return candidates[-1].parent


# Set for the ranks of a run whose launcher holds the run's lock; a rank 0 started otherwise (srun) takes it.
RUN_LOCKED = "TRAINBENCH_RUN_LOCKED"

# What resume=true takes from the command line; every other key is the run's own, from its config.yaml.
RESUME_KEYS = ("resume", "output.run_dir", "output.results_dir", "output.progress")


# perf.plan=auto's planner (measure/plan.planned), passed in by the caller above the launcher: (benchmark, config,
# say, here=True) -> the config with its layout chosen and the lines saying why.
Planner = Callable[..., tuple[RunConfig, list[str]]]


def run_experiments(bench: Benchmark, cfg: RunConfig, nexp: int = 1, given: list[str] | None = None, *,
                    plan: Planner) -> tuple[Path, list[RunRecord]]:  # fmt: skip
    """Run ``nexp`` experiments into one results folder. ``given``: the keys set on the command line (resume=true
    refuses any that would change the run's saved settings); ``plan``: perf.plan=auto's planner."""
    if nexp < 1:
        raise ConfigError(f"--nexp must be at least 1, got {nexp}")
    with contextlib.ExitStack() as locks:
        cfg = _resumed(bench, cfg, given or [], locks) if cfg.resume else _fresh(cfg)
        device = _checked(bench, cfg, nexp)
        cfg, lines = plan(bench, cfg, console.print)  # before any folder: a layout that cannot fit stops here
        run_dir = _claim_folder(bench, cfg, locks)
        out = _open_folder(bench, cfg, run_dir, lines)
        return run_dir, _run_each(bench, cfg, nexp, run_dir, device, out)


def _resumed(bench: Benchmark, cfg: RunConfig, given: list[str], locks: contextlib.ExitStack) -> RunConfig:
    """resume=true: the run folder to continue, locked while this process runs it, and the settings the run started
    with (its config.yaml); a key given on the command line that would change them is refused."""
    run_dir = resume_run_dir(bench, cfg)  # a run folder (its config.yaml), else nothing is made
    locks.enter_context(FolderLock(run_dir, "resume=true"))  # one process at a time continues a run folder
    _, saved = load_run_config(run_dir / CONFIG)
    _refuse_changes_on_resume(saved, cfg, given, run_dir)
    return dataclasses.replace(saved, resume=True, output=dataclasses.replace(saved.output, run_dir=str(run_dir)))


def _fresh(cfg: RunConfig) -> RunConfig:
    """A new run: its paths absolute (it may be resumed, or its job started, from another directory), and a folder
    it names refused where it holds anything."""
    cfg = absolute_paths(cfg)
    if cfg.output.run_dir:
        refuse_used_run_dir(Path(cfg.output.run_dir))
    return cfg


def _checked(bench: Benchmark, cfg: RunConfig, nexp: int) -> str:
    """What can be checked before any folder is made (the device, the data; a resumed run's inputs and checkpoints
    against its start); returns the device kind."""
    try:
        device = preflight(bench, cfg)
        if cfg.resume:
            check_resume(bench, cfg, Path(cfg.output.run_dir), range(nexp))
    except DataError as exc:
        if cfg.resume:
            raise DataError(f"resuming {cfg.output.run_dir} with the settings in its {CONFIG}: {exc}") from None
        raise
    return device


def _claim_folder(bench: Benchmark, cfg: RunConfig, locks: contextlib.ExitStack) -> Path:
    """The results folder: the one named (made where missing) or a new one; a new run locks it here (a resumed one
    holds its lock already)."""
    if cfg.output.run_dir:
        run_dir = Path(cfg.output.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
    else:
        run_dir = new_run_dir(cfg.output.results_dir, bench.name, cfg.preset)
    if not cfg.resume:
        locks.enter_context(FolderLock(run_dir, "a run"))
    return run_dir


def _open_folder(bench: Benchmark, cfg: RunConfig, run_dir: Path, plan: list[str]) -> RunConsole:
    """The folder's config.yaml, its console (the plan's lines first) and the inputs' identity (recorded at a run's
    start, checked on resume); returns the console."""
    save_config(cfg, run_dir / CONFIG, f"resolved config, written by {describe()}")
    out = RunConsole(run_dir / CONSOLE)
    for line in plan:
        out.say(line)
    if not cfg.resume or not (run_dir / INPUTS).exists():
        if cfg.resume:
            out.say(f"{run_dir} has no {INPUTS} (made by an earlier version): its data and weights are recorded now, "
                    "not checked against the run's start")  # fmt: skip
        _write_inputs(bench, cfg, run_dir)
    out.say(f"results folder: {run_dir}")
    return out


def _run_each(bench: Benchmark, cfg: RunConfig, nexp: int, run_dir: Path, device: str,
              out: RunConsole) -> list[RunRecord]:  # fmt: skip
    """Each experiment in turn (a resumed one that finished is skipped), its outcome said and checked, and the
    folder's summary written, also where one stops."""
    records: list[RunRecord] = []
    try:
        for index in range(nexp):
            _run_one(bench, cfg, run_dir, index, device, out)
            records.append(_collect(bench, run_dir, index, cfg))
            _report(out, records[-1])
    except BaseException:
        # The run that stopped is in the summary too, as not finished; a summary that cannot be written (a full
        # disk) must not hide why the run stopped.
        with contextlib.suppress(Exception):
            records.append(_collect(bench, run_dir, len(records), cfg, check=False))
            write_summary(bench, cfg, run_dir, records)
        raise
    write_summary(bench, cfg, run_dir, records)
    return records


def _run_one(bench: Benchmark, cfg: RunConfig, run_dir: Path, index: int, device: str, out: RunConsole) -> None:
    """Experiment ``index`` under its own lock, in this process or under torchrun; nothing where it finished."""
    if cfg.resume and RunFiles(run_dir, index).finished:
        out.say(f"run {index}: finished already")
        return
    if cfg.resume and not _has_checkpoint(run_dir, index):
        out.say(f"run {index}: no checkpoint to resume from; it starts again from its beginning")
    with FolderLock.of_run(run_dir, index, f"run {index}"):
        if cfg.distributed.nproc == 1:
            _run_in_process(bench, experiment_config(cfg, index), run_dir, index, device)
        else:
            _run_torchrun(cfg, run_dir, index)


def _has_checkpoint(run_dir: Path, index: int) -> bool:
    from trainbench.train import checkpoint

    return checkpoint.find_checkpoint(run_dir, index) is not None


def _flat_config(cfg: RunConfig) -> dict[str, Any]:
    """The config's settings that define a run (not how it is resumed), by dotted key."""
    return {k: getattr(leaf.owner, leaf.field.name) for k, leaf in leaves(cfg).items()
            if k not in RESUME_KEYS and k != "resume"}  # fmt: skip


def check_or_record_inputs(bench: Benchmark, cfg: RunConfig, run_dir: Path, index: int) -> None:
    """For a rank 0 that Slurm started (no launcher checked for it): check run ``index`` against what the folder
    recorded when it started, or record that where this is the start."""
    if (run_dir / INPUTS).exists():
        check_resume(bench, cfg, run_dir, [index])
    else:
        _write_inputs(bench, cfg, run_dir)


def _write_inputs(bench: Benchmark, cfg: RunConfig, run_dir: Path) -> None:
    value = {"config": _flat_config(cfg), "inputs": bench.inputs_identity(cfg)}
    tmp = run_dir / f"{INPUTS}.{os.getpid()}.tmp"  # a job array's tasks may write it at once
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    tmp.replace(run_dir / INPUTS)


def check_resume(bench: Benchmark, cfg: RunConfig, run_dir: Path, indices) -> None:
    """Refuse to continue runs ``indices`` of ``run_dir`` where the config, data or weights are not those the runs
    started with, or a checkpoint is damaged or could run code: each is one sentence naming what changed."""
    recorded = read_json(run_dir / INPUTS)
    if recorded:
        started = recorded.get("config") if isinstance(recorded.get("config"), dict) else {}
        for key, value in _flat_config(cfg).items():
            if key in started and started[key] != value:
                raise ConfigError(
                    f"{run_dir / CONFIG} says {key}={value!r}, but the run started with {started[key]!r} (what its "
                    f"log declares); restore {key} there, or start a new run"
                )
        before = recorded.get("inputs") if isinstance(recorded.get("inputs"), dict) else {}
        now = bench.inputs_identity(cfg)
        for name, old in before.items():
            if now.get(name) != old:
                change = bench.describe_input_change(name, old, now.get(name))
                raise DataError(
                    f"the {name} changed since the run started ({change}); resuming would train on other inputs "
                    "than its log and checkpoint: restore them, or start a new run"
                )
    for index in indices:
        files = RunFiles(run_dir, index)
        if files.finished:
            continue
        _check_declared(bench, experiment_config(cfg, index), files.partial_log)
        from trainbench.train import checkpoint

        ckpt = checkpoint.find_checkpoint(run_dir, index)
        if ckpt is not None:
            checkpoint.verify(ckpt, cfg.distributed.world_size)


def _check_declared(bench: Benchmark, cfg: RunConfig, log: Path) -> None:
    """The config against what the run's unfinished log declares (seed, batch, the benchmark's hyperparameters)."""
    if not log.exists():
        return
    try:
        declared = {e["key"]: e.get("value") for e in read_log(log, errors="replace") if "key" in e}
    except (OSError, ValueError, TypeError):
        return  # a log too damaged to read: the checker says so when the run ends
    expected = {constants.SEED: cfg.seed, constants.GLOBAL_BATCH_SIZE: cfg.data.global_batch_size}
    expected |= bench.hyperparameters(cfg)
    for key, value in expected.items():
        if key in declared and not _same(declared[key], value):
            raise ConfigError(
                f"{log.name} declares {key}={declared[key]!r} but {log.parent / CONFIG} gives {value!r}; the config "
                "was changed since the run started: restore it, or start a new run"
            )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    return a == b


def _refuse_changes_on_resume(saved: RunConfig, given_cfg: RunConfig, given: list[str], run_dir: Path) -> None:
    table, ours = leaves(saved), leaves(given_cfg)
    for key in given:
        if key in RESUME_KEYS:
            continue
        value = getattr(ours[key].owner, ours[key].field.name)
        saved_value = getattr(table[key].owner, table[key].field.name)
        if key in PATH_KEYS and value and saved_value:  # saved absolute; given as typed, relative or not
            same = os.path.realpath(Path(value).expanduser()) == os.path.realpath(saved_value)
        else:
            same = value == saved_value
        if not same:
            raise ConfigError(
                f"resume=true continues {run_dir} with the settings in its {CONFIG}, so {key}={value} cannot apply; "
                f"drop it (resume takes only {', '.join(RESUME_KEYS)}), or start a new run"
            )


def _run_in_process(bench: Benchmark, cfg: RunConfig, run_dir: Path, index: int, device: str) -> None:
    import torch.distributed as dist

    from trainbench.train.loop import train

    had_group = dist.is_available() and dist.is_initialized()
    info = init_distributed(device, cfg.distributed.backend, cfg.distributed.timeout_s)
    try:
        train(cfg, bench, run_dir, index, info, resume=cfg.resume)
    finally:
        if not had_group:  # a group the run made for itself (FSDP2 over one rank) ends with it
            shutdown()


def torchrun_worker(nproc: int, *worker_args: str, module: str = "trainbench.launch.worker"
                    ) -> tuple[list[str], dict[str, str]]:  # fmt: skip
    """The command and environment that start ``nproc`` ranks of ``python -m MODULE WORKER_ARGS`` (a training run's
    ranks: launch/worker.py) on this node under torchrun, the cores shared out among them."""
    env = dict(os.environ)
    # Chosen here for every rank at once (torchrun would set 1 where OMP_NUM_THREADS is unset), and said why.
    threads, why = cpu_threads(nproc, env)
    env |= {"OMP_NUM_THREADS": str(threads), THREADS_WHY: why}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc-per-node={nproc}",
           "-m", module, *worker_args]  # fmt: skip
    return cmd, env


def _run_torchrun(cfg: RunConfig, run_dir: Path, index: int) -> None:
    cmd, env = torchrun_worker(cfg.distributed.nproc, str(run_dir), str(index), *(["--resume"] if cfg.resume else []))
    env[RUN_LOCKED] = "1"  # this process holds the run's lock for its ranks
    files = RunFiles(run_dir, index)
    files.preempted_marker.unlink(missing_ok=True)
    for stale in run_dir.glob(f"error_run{index}_rank*.txt"):  # from an attempt before this resume
        stale.unlink()
    FolderLock(run_dir, "", RANKS_LOCK).describe(f"the {cfg.distributed.nproc} ranks of run {index}, started")
    # torchrun in a session of its own (its ranks are in sessions of theirs): a stop signal reaches the ranks from
    # this process alone, once each, as a rank that Slurm signals gets it.
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    with RankSignals(proc) as ranks:
        code = ranks.wait()
    if files.preempted_marker.exists():
        files.preempted_marker.unlink()
        raise Preempted(f"run {index}: stopped by a signal; checkpoint saved in {run_dir}")
    if code != 0 and files.finished:
        # Rank 0 wrote run_stop after the run's last collective, so the result is whole; a rank that crashed on
        # its way out (a thread of its own at interpreter exit) does not undo it.
        RunConsole(run_dir / CONSOLE).say(
            f"run {index}: torchrun exited with code {code} after the run had ended (its log holds run_stop): a "
            "rank crashed on its way out; the result stands",
            style="yellow",
        )
        return
    if code != 0:
        outcome = read_json(files.outcome) or None
        why = f": {outcome['reason']}" if outcome and outcome.get("status") == "interrupted" else ""
        said = other_ranks_error(run_dir, f"run{index}")
        why += f"; {said}" if said else ""
        raise UserError(
            f"run {index} failed under torchrun (exit code {code}){why}; see the messages above and "
            f"{run_dir / CONSOLE}; resume=true continues it from its last checkpoint"
        )


class RankSignals:
    """While torchrun's ranks run, SIGTERM, SIGINT and SIGUSR1 sent to this process go on to each rank (SIGHUP, a
    closed terminal, as SIGTERM), which finishes its step, checkpoints at its next log point and stops, as it does
    for a signal sent to it; a second SIGINT stops the ranks at once. torchrun's own forwarding is not used: it
    passes on SIGTERM and SIGINT but not SIGUSR1, kills the ranks 30 s after (mid-checkpoint on a large model), and
    exits before them on a second signal. A rank is sent a signal only once its handlers are in place (/proc's SigCgt):
    during its imports the signal would end it without a checkpoint.

    :meth:`wait` returns torchrun's exit code once torchrun and every rank it started have ended: this process
    (which holds the folder's lock) never ends before its ranks."""

    FORWARDED = {signal.SIGTERM: signal.SIGTERM, signal.SIGINT: signal.SIGINT, signal.SIGUSR1: signal.SIGUSR1,
                 signal.SIGHUP: signal.SIGTERM}  # fmt: skip

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.sent: list[signal.Signals] = []  # every stop signal received, in order
        self.delivered: dict[Any, int] = {}  # rank (psutil.Process) -> how many of ``sent`` it was sent
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> RankSignals:
        for sig in self.FORWARDED:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        self.sent.append(self.FORWARDED[signal.Signals(signum)])  # delivered by wait()'s loop, within 0.2 s

    def wait(self) -> int:
        import psutil

        while True:
            try:
                code = self.proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                self._deliver()
        # torchrun reaps the ranks it started before it exits; one killed itself leaves them running: wait them out.
        while alive := [rank for rank in self.delivered if rank.is_running()]:
            psutil.wait_procs(alive, timeout=0.2)
            self._deliver()
        return code

    def _deliver(self) -> None:
        import psutil

        with contextlib.suppress(psutil.Error):
            for rank in psutil.Process(self.proc.pid).children():
                self.delivered.setdefault(rank, 0)
        for rank, count in self.delivered.items():
            while count < len(self.sent) and _handles(rank.pid, self.sent[count]):
                with contextlib.suppress(psutil.Error):
                    rank.send_signal(self.sent[count])  # psutil checks the pid is still this rank's
                count += 1
            self.delivered[rank] = count


def run_to_end(cmd: list[str], env: dict[str, str] | None = None, what: str = "the measurement") -> int:
    """``cmd`` (a process with no checkpoint to save: a throughput measurement under torchrun, a layout probe) in a
    session of its own, to its end: its exit code. SIGTERM, SIGINT or SIGHUP sent to this process goes on to it as
    SIGTERM (torchrun passes it to its ranks and kills them 30 s after), and once it and every process it started
    have ended, :class:`UserError` says ``what`` was stopped. Without this, a signal that reaches this process alone
    (``timeout``, ``kill``) ends it and leaves its child, and the child's ranks, holding the GPUs."""
    import psutil

    received: list[int] = []
    main = threading.current_thread() is threading.main_thread()  # where Python lets a handler be set
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP) if main}  # fmt: skip
    started: set[Any] = set()  # every process the child started, seen while it ran
    try:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        sent = 0
        while True:
            with contextlib.suppress(psutil.Error):
                started.update(psutil.Process(proc.pid).children(recursive=True))
            if sent < len(received):
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                sent = len(received)
            try:
                code = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                continue
        if received:  # what the child left running (killed before it reaped its own) goes too
            alive = [p for p in started if p.is_running()]
            for p in alive:
                with contextlib.suppress(psutil.Error):
                    p.terminate()
            for p in psutil.wait_procs(alive, timeout=10)[1]:
                with contextlib.suppress(psutil.Error):
                    p.kill()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        raise UserError(f"{what} was stopped by {signal.Signals(received[0]).name} (exit code {code}); every process "
                        "it started has ended")  # fmt: skip
    return code


def _handles(pid: int, sig: signal.Signals) -> bool:
    """Whether process ``pid`` has its stop handlers in place (:class:`StopSignal` installs them together) and one
    for ``sig``, read from Linux's /proc (elsewhere assumed). SIGTERM tells: Python catches SIGINT from its start,
    where it raises KeyboardInterrupt."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False  # ended
    except OSError:
        return True
    caught = next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), None)
    if caught is None:
        return True
    mask = int(caught, 16)
    return all(mask >> (s - 1) & 1 for s in (signal.SIGTERM, sig))


def _collect(
    bench: Benchmark, run_dir: Path, index: int, cfg: RunConfig | None = None, check: bool = True
) -> RunRecord:
    files = RunFiles(run_dir, index)
    outcome = read_json(files.outcome) or None
    if not files.log.exists():  # no run_stop: the run did not end, whatever run_<i>.json says
        stopped = outcome.get("reason") if outcome else None
        return RunRecord(index, None, None, stopped or "no run_stop in its log and no run_<i>.json saying why")
    waived = bench.waived_checks(cfg) if cfg is not None else frozenset()
    ruleset = bench.ruleset_of(cfg)
    compliance = check_compliance(files.log, ruleset, waived=waived, own=not bench.mlperf) if check else None
    return RunRecord(index, outcome, compliance)


def _report(out: RunConsole, record: RunRecord) -> None:
    o = record.outcome
    if o is None:
        out.say(f"run {record.index}: did not finish: {record.stopped}", style="red")
        return
    verdict = record.compliance.reason() if record.compliance else "no log"
    style = "green" if o["status"] == "success" else "yellow"
    metric = "-" if o["final_metric"] is None else f"{o['final_metric']:.4f}"
    rate = "" if o["train_samples_per_s"] is None else f", {o['train_samples_per_s']:,.1f} samples/s"
    memory = "" if o["peak_memory_gib"] is None else f", peak memory {o['peak_memory_gib']:.2f} GiB"
    out.say(
        f"run {record.index}: {o['status']} — time to train {o['time_to_train_min']:.3f} min "
        f"({o['time_to_train_min'] * 60:.1f} s), {o['samples']:,} samples{rate}{memory}, {o['metric_name']} {metric}; "
        f"compliance (ruleset {record.compliance.ruleset if record.compliance else '-'}): {verdict}",
        style=style,
    )


def write_summary(bench: Benchmark, cfg: RunConfig, run_dir: Path, records: list[RunRecord]) -> Path:
    summary = {
        "benchmark": bench.name,
        "mlperf_benchmark": bench.mlperf_name,
        "is_mlperf_benchmark": bench.mlperf,
        "preset": cfg.preset,
        "metric_explanation": bench.metric_explanation,
        "ruleset": bench.ruleset_of(cfg),
        "waived_checks": sorted(bench.waived_checks(cfg)),
        "trainbench": provenance(),  # what wrote this summary; each run records what ran it
        "runs": [
            {
                "index": r.index,
                "result": RunFiles(run_dir, r.index).log.name,
                "finished": r.outcome is not None,
                **(r.outcome or {"stopped": r.stopped}),
                "compliance": None
                if r.compliance is None
                else {"passed": r.compliance.ok, "reason": r.compliance.reason()},
            }
            for r in records
        ],
    }
    path = run_dir / SUMMARY
    tmp = path.with_name(f"{SUMMARY}.{os.getpid()}.tmp")  # several Slurm array tasks may write it
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    tmp.replace(path)
    return path
