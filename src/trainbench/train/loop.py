"""The one training loop: every benchmark, every scale (1 CPU rank to many GPUs).

The benchmark supplies model, data, optimizer, loss and metric (``Benchmark``); this loop owns the
order of things MLPerf measures: init, run_start, train blocks between evals, eval, run_stop.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from trainbench.benchmarks.base import Benchmark
from trainbench.config import RunConfig
from trainbench.console import RunConsole, TrainProgress
from trainbench.data.prefetch import pinned, prefetch
from trainbench.errors import ConfigError, Preempted, TrainingDiverged
from trainbench.mlperf import MLPerfLog, constants
from trainbench.telemetry import Sampler, run_energy
from trainbench.train import checkpoint
from trainbench.train.distributed import DistInfo, ReduceSettings, all_reduce_sum, split_compiled_graph, wrap_ddp
from trainbench.train.profiling import StepProfiler

# Logged (a point in time) when a run continues from a checkpoint; value: how many times it was resumed.
RESUMED_KEY = "trainbench_resumed"


class StopSignal:
    """SIGUSR1 (Slurm's warning before the time limit) or SIGTERM: finish the step, checkpoint, stop."""

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

    early = False  # set by install_early(): a signal that came before training started

    @classmethod
    def install_early(cls) -> None:
        """Catch the stop signals from process start (a worker's imports and rendezvous take seconds), so a
        signal sent then is not fatal: the run stops at its first log step instead."""

        def handle(signum, frame):
            cls.early = True

        for sig in cls.SIGNALS:
            signal.signal(sig, handle)

    def __init__(self):
        self.caught = StopSignal.early
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.caught = True

    def any(self, info: DistInfo) -> bool:
        """Whether any rank caught a signal (all ranks must agree to checkpoint together)."""
        if info.world_size == 1:
            return self.caught
        flag = torch.tensor([float(self.caught)], device=info.device)
        return bool(all_reduce_sum(flag, info).item() > 0)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


@dataclass
class RunOutcome:
    index: int
    seed: int
    status: str  # "success" or "aborted"
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

    @property
    def time_to_train_min(self) -> float:
        return (self.run_stop_ms - self.run_start_ms) / 60_000

    def to_json(self) -> dict:
        return asdict(self) | {"time_to_train_min": self.time_to_train_min}


def result_paths(run_dir: Path, index: int) -> tuple[Path, Path]:
    """(in-progress, finished) names of run ``index``'s MLPerf log."""
    return run_dir / f"result_{index}.txt.partial", run_dir / f"result_{index}.txt"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def platform_name(device: torch.device, world_size: int) -> str:
    if device.type == "cuda":
        return f"{world_size}x{torch.cuda.get_device_name(device).replace(' ', '_')}"
    return f"{world_size}xCPU_{os.cpu_count()}cores"


def train(
    cfg: RunConfig, bench: Benchmark, run_dir: Path, index: int, info: DistInfo, resume: bool = False
) -> RunOutcome:
    """Train run ``index`` of ``run_dir`` to the target (or to max_samples) and write its MLPerf log.

    With ``resume`` and a checkpoint of run ``index`` in ``run_dir``, continue from it: same samples,
    same optimizer state, same RNG, appending to the run's MLPerf log. SIGUSR1 or SIGTERM saves a
    checkpoint and raises :class:`Preempted`, leaving the log unfinished (``.partial``).
    """
    is_main = info.is_main
    partial, final = result_paths(run_dir, index)
    out = RunConsole(run_dir / "console.log", enabled=is_main)
    ckpt = checkpoint.find_checkpoint(run_dir, index) if resume else None
    if ckpt is None and is_main:
        partial.unlink(missing_ok=True)  # a fresh start: nothing of an earlier attempt stays in the log
        (run_dir / "metrics.jsonl").touch()
    mll = MLPerfLog(partial if is_main else None)  # appends when resuming
    device = info.device
    use_bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")

    o = cfg.output
    # The log's header (init, submission and hyperparameter keys) is written once: not again on resume.
    header = mll if ckpt is None else MLPerfLog(None)
    header.event(constants.CACHE_CLEAR, True)
    header.start(constants.INIT_START)
    header.event(constants.SUBMISSION_BENCHMARK, bench.mlperf_name)
    header.event(constants.SUBMISSION_ORG, o.submission_org)
    header.event(constants.SUBMISSION_DIVISION, o.division)
    header.event(constants.SUBMISSION_STATUS, o.status)
    header.event(constants.SUBMISSION_PLATFORM, o.submission_platform or platform_name(device, info.world_size))

    seed_everything(cfg.seed)
    # raw_model: the parameters and the checkpoint; ddp: the gradient all-reduce; model: what is called.
    raw_model = bench.build_model(cfg)
    placed = bench.place(raw_model, cfg, info, use_bf16)
    ddp = None
    if cfg.optimizer.clip == "bucket" and info.world_size == 1:
        raise ConfigError("optimizer.clip=bucket clips before the all-reduce: it needs more than one rank")
    if placed is not None:  # the benchmark shards and compiles its model itself
        raw_model = placed
    else:
        raw_model = raw_model.to(device)
    if placed is None and info.world_size > 1:
        reduce = ReduceSettings(
            clip_norm=cfg.optimizer.max_grad_norm if cfg.optimizer.clip == "bucket" else None,
            bf16=cfg.distributed.grad_reduce_dtype == "bf16",
        )
        ddp = wrap_ddp(raw_model, info, cfg.distributed.bucket_cap_mb, reduce)
    model = ddp or raw_model
    graph_note = None
    if cfg.perf.compile and placed is None:
        # Under DDP, dynamo splits the graph at bucket boundaries (so each bucket's all-reduce overlaps backward)
        # unless told not to. Static shapes: one graph per shape (packed rows: one; length bins: one per bin).
        split = split_compiled_graph(cfg.distributed.overlap_compiled, info)
        torch._dynamo.config.optimize_ddp = split
        if ddp is not None:
            graph_note = (
                "the compiled graph split at the DDP buckets, each all-reduce overlapping backward"
                if split
                else "one compiled graph, the DDP buckets all-reduced after backward"
            )
        model = torch.compile(model, mode="reduce-overhead" if cfg.perf.cuda_graphs else None, dynamic=False)
    optimizer = bench.build_optimizer(cfg, raw_model)
    accumulation = bench.accumulation_steps(cfg)
    gbs = cfg.data.global_batch_size
    eval_every = cfg.eval.every_samples or bench.eval_every_samples(cfg)
    max_samples = cfg.schedule.max_samples or cfg.schedule.total_steps * gbs
    state = checkpoint.LoopState(next_eval=eval_every)
    if ckpt is not None:
        state = checkpoint.load(ckpt, raw_model, optimizer, info)
        state.resumed += 1
    # The data stream is in rows: step x GBS of them were consumed (a packed row holds several samples).
    data_rank, data_ranks = bench.data_rank(cfg, info)
    data = bench.build_data(cfg, data_rank, data_ranks, start_sample=state.step * gbs)

    header.event(constants.SEED, cfg.seed)
    header.event(constants.GLOBAL_BATCH_SIZE, gbs)
    header.event(constants.GRADIENT_ACCUMULATION_STEPS, accumulation)
    header.event(constants.TRAIN_SAMPLES, data.train_samples)
    header.event(constants.EVAL_SAMPLES, data.eval_samples)
    for key, value in bench.hyperparameters(cfg).items():
        header.event(key, value)
    sampler = None
    if o.telemetry_hz > 0 and info.local_rank == 0:
        sampler = Sampler(run_dir, o.telemetry_hz).start()
        out.say(f"run {index}: {sampler.note}")
    n_params = sum(p.numel() for p in raw_model.parameters())
    out.say(
        f"run {index}: {bench.name}/{cfg.preset}, seed {cfg.seed}, {n_params / 1e6:.2f}M parameters, "
        f"{info.world_size} x {device.type}, {'bf16' if use_bf16 else 'fp32'}, global batch {gbs} "
        f"({cfg.data.micro_batch_size} x {accumulation} accumulation x {info.world_size} ranks), "
        f"eval every {eval_every:,} samples, target {bench.metric_name} "
        f"{'>=' if bench.higher_is_better else '<='} {cfg.eval.target}"
    )
    if graph_note:
        out.say(f"run {index}: {graph_note} (distributed.overlap_compiled={cfg.distributed.overlap_compiled})")
    for note in bench.model_notes(cfg, device, use_bf16):
        out.say(f"run {index}: {note}")

    if ckpt is None:
        mll.end(constants.INIT_STOP)
        state.run_start_ms = int(time.time() * 1000)
        mll.start(constants.RUN_START, time_ms=state.run_start_ms)
    else:
        # MLPerf semantics: the log says the run was resumed, and from where; time to train keeps
        # counting from the original run_start, so the time lost to the interruption is included.
        mll.event(RESUMED_KEY, state.resumed, metadata={"step": state.step, "samples": state.samples})
        out.say(f"run {index}: resumed from {ckpt} at step {state.step:,} ({state.samples:,} samples)")
    run_start_ms = state.run_start_ms

    metrics = open(run_dir / "metrics.jsonl", "a") if is_main else None
    progress = TrainProgress(max_samples, bench.metric_name, enabled=is_main and o.progress)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16)
    step, samples, next_eval = state.step, state.samples, state.next_eval
    status, reason, metric = constants.ABORTED, f"max_samples={max_samples:,} reached before the target", None
    evals: list[tuple[int, float]] = [tuple(e) for e in state.evals]
    metric = evals[-1][1] if evals else None
    stop = StopSignal()
    preempted = False
    # Loss and finiteness stay on device between log points: reading them is a host sync.
    loss_sum = torch.zeros((), device=device)
    nonfinite = torch.zeros((), dtype=torch.bool, device=device)
    last_log_time, last_log_samples, last_log_step = time.perf_counter(), samples, step
    timed_seconds, timed_samples = 0.0, 0

    def record(row: dict) -> None:
        if metrics is not None:
            stamp = {"run": index, "step": step, "samples": samples, "time_ms": int(time.time() * 1000)}
            metrics.write(json.dumps(stamp | row) + "\n")
            metrics.flush()

    def check_finite() -> None:
        if bool(nonfinite):
            raise TrainingDiverged(
                f"the loss became NaN or infinite by step {step} ({samples:,} samples); lower optimizer.lr, "
                "raise schedule.warmup_steps or check the data"
            )

    if ckpt is None:
        mll.start(constants.BLOCK_START, metadata={"first_epoch_num": 0, "epoch_count": eval_every})
    model.train()

    profiler = None
    if o.profile:
        profiler = StepProfiler(run_dir, index, o.profile_start_step, o.profile_steps, device, info.rank)

    collect_every = cfg.perf.gc_every_steps
    if collect_every > 0:
        gc.collect()
        gc.freeze()  # what set-up made (model, compiled graphs, data index) is never scanned again
        gc.disable()

    def save_checkpoint() -> None:
        loop_state = checkpoint.LoopState(step, samples, next_eval, run_start_ms, evals, state.resumed)
        checkpoint.save(run_dir, index, raw_model, optimizer, loop_state, info)

    try:
        steps = pinned(data.train, device) if device.type == "cuda" else data.train
        for micro_batches in prefetch(steps, cfg.data.prefetch):
            if profiler is not None:
                profiler.before_step(step)
            lr = bench.lr_at(cfg, step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batches = [bench.to_device(mb, device) for mb in micro_batches]
            # Normalise by counts over the whole global batch (all micro-batches, all ranks), so the
            # gradient is that of the global-batch loss whatever the split; DDP then averages over
            # ranks, which the factor world_size undoes.
            weights = all_reduce_sum(sum(bench.loss_weights(b) for b in batches), info)
            for i, batch in enumerate(batches):
                sync = i == len(batches) - 1 or ddp is None
                if cfg.perf.cuda_graphs:
                    # A new step: the previous replay's outputs are used up.
                    torch.compiler.cudagraph_mark_step_begin()
                with contextlib.nullcontext() if sync else ddp.no_sync(), autocast:
                    loss = bench.loss(model, batch, weights) * info.world_size
                loss.backward()
                loss_sum += loss.detach() / info.world_size
                nonfinite |= ~torch.isfinite(loss.detach())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if profiler is not None:
                profiler.after_step(step)
            # A packed step carries its count of sequences; otherwise a step is one global batch.
            samples += getattr(micro_batches, "samples", gbs)

            if step % o.log_every_steps == 0 or samples >= next_eval:
                check_finite()
                mean_loss = float(all_reduce_sum(loss_sum.clone(), info)) / (step - last_log_step)
                now = time.perf_counter()
                rate = (samples - last_log_samples) / (now - last_log_time)
                timed_seconds += now - last_log_time
                timed_samples += samples - last_log_samples
                record({"loss": mean_loss, "lr": lr, "samples_per_s": rate})
                progress.update(samples, loss=mean_loss, rate=rate)
                loss_sum.zero_()
                last_log_time, last_log_samples, last_log_step = now, samples, step
                if stop.any(info):
                    save_checkpoint()
                    preempted = True
                    raise Preempted(f"run {index}: stopped by a signal at step {step:,}; checkpoint saved in {run_dir}")

            if samples >= next_eval or samples >= max_samples:
                mll.end(constants.BLOCK_STOP, metadata={"first_epoch_num": next_eval - eval_every})
                metric = evaluate(bench, model, data.eval, info, autocast, mll, samples)
                evals.append((samples, metric))
                record({bench.metric_name: metric})
                if collect_every > 0:
                    gc.collect()  # what training made and kept long enough to reach the oldest generation
                progress.update(samples, metric=metric)
                out.say(f"  eval at {samples:,} samples: {bench.metric_name} {metric:.4f}")
                model.train()
                if bench.reached(metric, cfg.eval.target):
                    status, reason = constants.SUCCESS, f"reached {bench.metric_name} {metric:.4f}"
                    break
                if samples >= max_samples:
                    break
                while next_eval <= samples:
                    next_eval += eval_every
                mll.start(constants.BLOCK_START, metadata={"first_epoch_num": samples, "epoch_count": eval_every})
                # The eval's time is not training time.
                last_log_time = time.perf_counter()
            if o.checkpoint_every_steps and step % o.checkpoint_every_steps == 0:
                save_checkpoint()
            if collect_every > 0 and step % collect_every == 0:
                gc.collect(1)
    except TrainingDiverged as exc:
        reason = str(exc)
        raise
    finally:
        if collect_every > 0:
            gc.unfreeze()
            gc.enable()
        progress.close()
        stop.restore()
        run_stop_ms = int(time.time() * 1000)
        if sampler is not None:
            sampler.stop()
        if profiler is not None:
            profiler.finish()  # a run that ended inside the window still gets its files
            if profiler.outputs:
                others = f" (ranks 1-{info.world_size - 1}: profile_{index}_rank<r>_*)" if info.world_size > 1 else ""
                out.say(f"run {index}: profile of steps {o.profile_start_step}-{profiler.stop_step - 1}: "
                        f"{', '.join(p.name for p in profiler.outputs)}{others}")  # fmt: skip
        if not preempted:  # a preempted run is not over: no run_stop, the log stays .partial
            mll.end(constants.RUN_STOP, metadata={"status": status}, time_ms=run_stop_ms)
        mll.close()
        if metrics is not None:
            metrics.close()
        outcome = RunOutcome(
            index=index,
            seed=cfg.seed,
            status=status,
            reason=reason,
            metric_name=bench.metric_name,
            target=cfg.eval.target,
            final_metric=metric,
            samples=samples,
            steps=step,
            run_start_ms=run_start_ms,
            run_stop_ms=run_stop_ms,
            evals=evals,
            train_samples_per_s=timed_samples / timed_seconds if timed_seconds else None,
            peak_memory_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
            energy=run_energy(run_dir, run_start_ms, run_stop_ms) if is_main and not preempted else None,
        )
        if is_main and not preempted:
            # Only a run that reached run_stop gets its final name (even if aborted); a crash leaves .partial.
            partial.replace(final)
            (run_dir / f"run_{index}.json").write_text(json.dumps(outcome.to_json(), indent=2) + "\n")
    return outcome


@torch.no_grad()
def evaluate(bench: Benchmark, model, batches, info: DistInfo, autocast, mll: MLPerfLog, samples: int) -> float:
    model.eval()
    meta = bench.eval_metadata(samples)
    mll.start(constants.EVAL_START, metadata=meta)
    sums = None
    for batch in batches:
        with autocast:
            part = bench.eval_sums(model, bench.to_device(batch, info.device))
        sums = part if sums is None else sums + part
    metric = bench.eval_metric(all_reduce_sum(sums, info))
    mll.event(constants.EVAL_ACCURACY, metric, metadata=meta)
    mll.end(constants.EVAL_STOP, metadata=meta)
    return metric
