"""The one training loop: every benchmark, every scale (1 CPU rank to many GPUs).

The benchmark supplies model and placement, data, optimizer, loss and metric (``Benchmark``); this loop owns the
order of things MLPerf measures: init, run_start, train blocks between evals, eval, run_stop. Its parts: building
the run (train/setup.py), the MLPerf record (train/record.py), the step (train/step.py), eval (train/evaluate.py)
and the side duties (train/duties.py: signals, GC, metrics, telemetry, profiler; checkpoints in train/checkpoint.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from trainbench.benchmarks.base import Benchmark
from trainbench.config import RunConfig
from trainbench.console import RunConsole, TrainProgress
from trainbench.data.prefetch import pinned, prefetch
from trainbench.distributed import DistInfo, all_reduce_sum
from trainbench.errors import Preempted, TrainingDiverged
from trainbench.mlperf import constants, logs_disclosure
from trainbench.runfiles import CONSOLE, METRICS, RunFiles
from trainbench.telemetry import machine, run_energy
from trainbench.train import checkpoint
from trainbench.train.duties import (
    GcPolicy,
    Metrics,
    StopSignal,
    finish_profiler,
    prepare_nodes,
    start_profiler,
    start_telemetry,
)
from trainbench.train.evaluate import evaluate
from trainbench.train.record import MLPerfRecord, platform_name
from trainbench.train.setup import RunSetup, build_run
from trainbench.train.step import StepTotals, train_step
from trainbench.version import provenance


@dataclass
class RunOutcome:
    index: int
    seed: int
    status: str  # "success" or "aborted" (MLPerf's: the run ended), or "interrupted" (it did not end: no run_stop)
    reason: str
    metric_name: str
    target: float
    final_metric: float | None
    samples: int
    steps: int
    run_start_ms: int
    run_stop_ms: int
    evals: list[tuple[int, float]] = field(default_factory=list)
    train_samples_per_s: float | None = None  # over the timed training steps, evals excluded
    peak_memory_gib: float | None = None  # CUDA only
    energy: dict | None = None  # energy to train from the telemetry (J, kWh, per GPU); None without GPU telemetry
    system: dict | None = None  # what it ran on (rank 0's machine): CPU, memory, GPUs, driver, torch, Python
    trainbench: dict = field(default_factory=provenance)  # the trainbench that ran it: version, commit

    @property
    def time_to_train_min(self) -> float:
        return (self.run_stop_ms - self.run_start_ms) / 60_000

    def to_json(self) -> dict:
        return asdict(self) | {"time_to_train_min": self.time_to_train_min}


def train(
    cfg: RunConfig, bench: Benchmark, run_dir: Path, index: int, info: DistInfo, resume: bool = False
) -> RunOutcome:
    """Train run ``index`` of ``run_dir`` to the target (or to max_samples) and write its MLPerf log.

    With ``resume`` and a checkpoint of run ``index`` in ``run_dir``, continue from it: same samples,
    same optimizer state, same RNG, appending to the run's MLPerf log. SIGUSR1, SIGTERM or SIGINT saves a
    checkpoint and raises :class:`Preempted`, leaving the log unfinished (``.partial``); so does any other stop
    before the run ends, without the checkpoint, and run_<i>.json says why.
    """
    files = RunFiles(run_dir, index)
    out = RunConsole(run_dir / CONSOLE, enabled=info.is_main)
    ckpt = checkpoint.find_checkpoint(run_dir, index) if resume else None
    if ckpt is None and info.is_main:
        files.partial_log.unlink(missing_ok=True)  # a fresh start: nothing of an earlier attempt stays in the log
        (run_dir / METRICS).touch()
    record = MLPerfRecord(files.partial_log if info.is_main else None, fresh=ckpt is None)
    cache = prepare_nodes(run_dir, info)  # before the data is first read
    out.say(f"run {index}: {cache.line}")
    record.header(bench.mlperf_name, cfg.output, platform_name(info.device, info.world_size), bench.mlperf,
                  cache.dropped)  # fmt: skip
    run = build_run(cfg, bench, info, ckpt)
    disclosure = run.disclosure if logs_disclosure(bench.ruleset_of(cfg)) else {}  # keys an older ruleset lacks
    record.hyperparameters(cfg, run.accumulation, run.data.train_samples, run.data.eval_samples,
                           bench.hyperparameters(cfg), disclosure)  # fmt: skip
    sampler = start_telemetry(cfg.output, run_dir, index, info, out)
    announce(out, cfg, bench, run, index, info)
    if ckpt is None:
        run.state.run_start_ms = record.run_start()
    else:
        # What the log holds past the checkpoint (an eval cut short, blocks of the steps to redo) goes: the resumed
        # run logs them again. MLPerf semantics: the log says the run was resumed, and from where; time to train
        # keeps counting from the original run_start, so the time lost to the interruption is included.
        if info.is_main and run.state.log_bytes and files.partial_log.stat().st_size > run.state.log_bytes:
            os.truncate(files.partial_log, run.state.log_bytes)
        record.resumed(run.state.resumed, run.state.step, run.state.samples)
        out.say(f"run {index}: resumed from {ckpt} at step {run.state.step:,} ({run.state.samples:,} samples)")
    return TrainLoop(cfg, bench, run, files, info, record, out, sampler).run()


def announce(out: RunConsole, cfg: RunConfig, bench: Benchmark, run: RunSetup, index: int, info: DistInfo) -> None:
    """The run's first console lines: what trains, where, at which batch, to which target."""
    n_params = sum(p.numel() for p in run.placed.module.parameters())
    gbs = cfg.data.global_batch_size
    out.say(
        f"run {index}: {bench.name}/{cfg.preset}, seed {cfg.seed}, {n_params / 1e6:.2f}M parameters, "
        f"{info.world_size} x {info.device.type}, {'bf16' if run.bf16 else 'fp32'}, global batch {gbs} "
        f"({cfg.data.micro_batch_size} x {run.accumulation} accumulation x {info.world_size} ranks), "
        f"eval every {run.eval_every:,} samples, target {bench.metric_name} "
        f"{'>=' if bench.higher_is_better else '<='} {cfg.eval.target}"
    )
    threads = [info.threads_note] if info.threads_note else []
    for note in threads + run.placed.notes + bench.family.model_notes(cfg, info.device, run.bf16):
        out.say(f"run {index}: {note}")


class TrainLoop:
    """Steps, log points, evals and checkpoints from where ``run.state`` stands to the target or max_samples."""

    def __init__(self, cfg: RunConfig, bench: Benchmark, run: RunSetup, files: RunFiles, info: DistInfo,
                 record: MLPerfRecord, out: RunConsole, sampler) -> None:  # fmt: skip
        self.cfg, self.bench, self.run_, self.files, self.info = cfg, bench, run, files, info
        self.record, self.out, self.sampler = record, out, sampler
        self.state = run.state
        self.state.evals = [tuple(e) for e in self.state.evals]
        self.metric = self.state.evals[-1][1] if self.state.evals else None
        self.status = constants.ABORTED
        self.reason = f"max_samples={run.max_samples:,} reached before the target"
        self.ended = False  # reached the target, max_samples or a diverged loss: MLPerf's end of a run
        self.metrics = Metrics(files.run_dir, files.index, info.is_main, self.state.step, self.state.samples)
        self.progress = TrainProgress(run.max_samples, bench.metric_name, enabled=info.is_main and cfg.output.progress)
        self.autocast = torch.autocast(info.device.type, dtype=torch.bfloat16, enabled=run.bf16)
        self.stop = StopSignal()
        self.totals = StepTotals(info.device)
        self.system = machine(cfg.output.gpu_links and info.device.type == "cuda") if info.is_main else None

    def run(self) -> RunOutcome:
        if self.record.fresh:
            self.record.block_start(0, self.run_.first_eval)
        self.run_.placed.model.train()
        profiler = start_profiler(self.cfg.output, self.files.run_dir, self.files.index, self.info)
        gc_policy = GcPolicy(self.cfg.perf.gc_every_steps)
        try:
            self._steps(profiler, gc_policy)
            self.ended = True
        except TrainingDiverged as exc:  # MLPerf's aborted: the run ended without reaching the target
            self.ended, self.reason = True, str(exc)
            raise
        except Preempted as exc:
            self.status, self.reason = INTERRUPTED, str(exc)
            raise
        except BaseException as exc:  # a crash, a lost rank, a full disk, a second Ctrl-C: the run did not end
            self.status, self.reason = INTERRUPTED, interruption(exc)
            raise
        finally:
            gc_policy.restore()
            outcome = self._finish(profiler)
        return outcome

    def _steps(self, profiler, gc_policy: GcPolicy) -> None:
        s, run, info = self.state, self.run_, self.info
        if not self.record.fresh and s.step and (s.samples >= s.next_eval or s.samples >= run.max_samples):
            # A checkpoint saved where an eval was due (by an earlier version) resumes with that eval, so every
            # eval stays at the samples of an uninterrupted run.
            if self._eval_point(gc_policy):
                return
        steps = pinned(run.data.train, info.device) if info.device.type == "cuda" else run.data.train
        batches = prefetch(steps, self.cfg.data.prefetch)
        try:
            for step_batches in batches:
                if self._step(step_batches, profiler, gc_policy):
                    break
        finally:
            batches.close()  # ends and joins its thread before the run is finished and the process exits

    def _step(self, step_batches, profiler, gc_policy: GcPolicy) -> bool:
        """One training step and the duties due after it (log point, eval, checkpoint, stop signal); True when
        the run is over."""
        s, run, info = self.state, self.run_, self.info
        if profiler is not None:
            profiler.before_step(s.step)
        lr = self.bench.lr_at(self.cfg, s.step)
        train_step(self.bench, run.placed, run.optimizer, step_batches, lr, info, self.autocast, self.totals)
        s.step += 1
        if profiler is not None:
            profiler.after_step(s.step)
        s.samples += step_batches.samples
        log_point = s.step % self.cfg.output.log_every_steps == 0 or s.samples >= s.next_eval
        if log_point:
            self._log_point(lr)
        if s.samples >= s.next_eval or s.samples >= run.max_samples:
            if self._eval_point(gc_policy):
                return True
        every = self.cfg.output.checkpoint_every_steps
        saved = bool(every) and s.step % every == 0
        if saved:
            self._save_checkpoint()
        # A stop signal on any rank checkpoints here, after the eval due at this step (if one was): a resumed
        # run's evals fall at the same samples as an uninterrupted run's.
        if log_point and self.stop.any(self.info):
            if not saved:
                self._save_checkpoint()
            raise Preempted(f"run {self.files.index}: stopped by a signal at step {s.step:,}; checkpoint saved in "
                            f"{self.files.run_dir}")  # fmt: skip
        gc_policy.after_step(s.step)
        return False

    def _log_point(self, lr: float) -> None:
        """Loss and rate since the last log point into metrics.jsonl."""
        s = self.state
        if bool(self.totals.nonfinite):
            raise TrainingDiverged(
                f"the loss became NaN or infinite by step {s.step} ({s.samples:,} samples); lower optimizer.lr, "
                "raise schedule.warmup_steps or check the data"
            )
        steps, rate = self.metrics.interval(s.step, s.samples)
        mean_loss = float(all_reduce_sum(self.totals.loss_sum.clone(), self.info)) / steps
        self.metrics.record(s.step, s.samples, {"loss": mean_loss, "lr": lr, "samples_per_s": rate})
        self.progress.update(s.samples, loss=mean_loss, rate=rate)
        self.totals.loss_sum.zero_()

    def _eval_point(self, gc_policy: GcPolicy) -> bool:
        """Close the block, evaluate, and open the next block; True when the run is over."""
        s, run, bench = self.state, self.run_, self.bench
        self.record.block_stop(s.next_eval - run.eval_every if s.next_eval > run.first_eval else 0)
        self.metric = evaluate(bench, run.placed.model, run.data.eval, self.info, self.autocast, self.record,
                               s.samples)  # fmt: skip
        s.evals.append((s.samples, self.metric))
        self.metrics.record(s.step, s.samples, {bench.metric_name: self.metric})
        gc_policy.after_eval()
        self.progress.update(s.samples, metric=self.metric)
        self.out.say(f"  eval at {s.samples:,} samples: {bench.metric_name} {self.metric:.4f}")
        run.placed.model.train()
        if bench.reached(self.metric, self.cfg.eval.target):
            self.status, self.reason = constants.SUCCESS, f"reached {bench.metric_name} {self.metric:.4f}"
            return True
        if s.samples >= run.max_samples:
            return True
        while s.next_eval <= s.samples:
            s.next_eval += run.eval_every
        self.record.block_start(s.samples, run.eval_every)
        self.metrics.pause_ended()
        return False

    def _save_checkpoint(self) -> None:
        log = self.files.partial_log
        self.state.log_bytes = log.stat().st_size if self.info.is_main and log.exists() else 0
        if self.run_.placed.rearrange is not None:  # a checkpoint holds the placement's own order, whatever moved since
            self.run_.placed.rearrange(self.run_.optimizer, True)
        checkpoint.save(self.files.run_dir, self.files.index, self.run_.placed.module, self.run_.optimizer,
                        self.state, self.info)  # fmt: skip

    def _finish(self, profiler) -> RunOutcome:
        """For a run that ended: the outcome file, then run_stop and the log's final name, atomically. For one that
        did not: the log stays ``.partial`` (resume=true continues from the last checkpoint) and the outcome file
        says why it stopped."""
        self.progress.close()
        self.stop.restore()
        run_stop_ms = int(time.time() * 1000)
        if self.sampler is not None:
            self.sampler.stop()
        finish_profiler(profiler, self.cfg.output, self.files.index, self.info, self.out)
        self.metrics.close()
        outcome = self._outcome(run_stop_ms)
        if not self.ended:
            self.record.close()
            if self.info.is_main:
                with contextlib.suppress(OSError):  # best effort: the disk may be what failed
                    write_json_atomic(self.files.outcome, outcome.to_json())
            return outcome
        if self.info.is_main:
            write_json_atomic(self.files.outcome, outcome.to_json())
        try:
            self.record.finish(self.status, run_stop_ms, self.files.log)
        except BaseException as exc:  # the log is still unfinished: so is the run
            outcome.status, outcome.reason = INTERRUPTED, interruption(exc)
            with contextlib.suppress(OSError):
                write_json_atomic(self.files.outcome, outcome.to_json())
            raise
        return outcome

    def _outcome(self, run_stop_ms: int) -> RunOutcome:
        s, device = self.state, self.info.device
        return RunOutcome(
            index=self.files.index,
            seed=self.cfg.seed,
            status=self.status,
            reason=self.reason,
            metric_name=self.bench.metric_name,
            target=self.cfg.eval.target,
            final_metric=self.metric,
            samples=s.samples,
            steps=s.step,
            run_start_ms=s.run_start_ms,
            run_stop_ms=run_stop_ms,
            evals=s.evals,
            train_samples_per_s=self.metrics.samples_per_s,
            peak_memory_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
            system=self.system,
            energy=run_energy(self.files.run_dir, s.run_start_ms, run_stop_ms)
            if self.info.is_main and self.ended
            else None,
        )


INTERRUPTED = "interrupted"


def interruption(exc: BaseException) -> str:
    """What stopped a run that did not end, in one sentence for run_<i>.json."""
    how = "`trainbench resubmit` of this results folder" if "SLURM_JOB_ID" in os.environ else "resume=true"
    then = f"{how} continues from the last checkpoint, if one was saved"
    if isinstance(exc, KeyboardInterrupt):
        return f"interrupted by Ctrl-C; {then}"
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return f"stopped by {type(exc).__name__}: {first}; {then}"


def write_json_atomic(path: Path, value: dict) -> None:
    """``path`` is the whole JSON or what it was before: written beside it, then renamed over it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(tmp, path)
