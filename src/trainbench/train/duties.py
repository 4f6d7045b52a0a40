"""What a run does beside training, each a small object the loop calls at fixed points: stop signals, garbage
collection, metrics.jsonl and throughput, telemetry, the profiler window."""

from __future__ import annotations

import gc
import json
import os
import signal
import threading
import time
from pathlib import Path

import torch

from trainbench.config import OutputConfig
from trainbench.console import RunConsole
from trainbench.distributed import DistInfo, all_reduce_sum
from trainbench.node import CacheClear, drop_page_cache, write_node_record
from trainbench.runfiles import METRICS
from trainbench.telemetry import Sampler
from trainbench.train.profiling import StepProfiler


class StopSignal:
    """SIGUSR1 (Slurm's warning before the time limit), SIGTERM or SIGINT (Ctrl-C): finish the step, checkpoint at
    the next log point, stop. A second Ctrl-C stops at once (KeyboardInterrupt), without a checkpoint."""

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)

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
        if signum == signal.SIGINT:
            # The next Ctrl-C is Python's own again. Written with os.write: a handler must not take locks.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            os.write(2, b"\nstopping at the next log point with a checkpoint; Ctrl-C again stops at once\n")

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


class GcPolicy:
    """``perf.gc_every_steps`` N > 0: what set-up made is frozen and automatic collection is off; every rank collects
    the young generations at the same step every N steps, and everything after each eval (automatic collections
    stalled 4-GPU runs for ~1.4 s every ~30 steps). 0: Python's automatic collection, untouched."""

    def __init__(self, every_steps: int):
        self.every = every_steps
        if self.every > 0:
            gc.collect()
            gc.freeze()  # what set-up made (model, compiled graphs, data index) is never scanned again
            gc.disable()

    def after_step(self, step: int) -> None:
        if self.every > 0 and step % self.every == 0:
            gc.collect(1)

    def after_eval(self) -> None:
        if self.every > 0:
            gc.collect()  # what training made and kept long enough to reach the oldest generation

    def restore(self) -> None:
        if self.every > 0:
            gc.unfreeze()
            gc.enable()


class Metrics:
    """metrics.jsonl (rank 0 only) and the training throughput between log points, evals excluded."""

    def __init__(self, run_dir: Path, index: int, enabled: bool, step: int, samples: int):
        self.index = index
        self.file = open(run_dir / METRICS, "a") if enabled else None
        self.last_time, self.last_samples, self.last_step = time.perf_counter(), samples, step
        self.timed_seconds, self.timed_samples = 0.0, 0

    def record(self, step: int, samples: int, row: dict) -> None:
        if self.file is not None:
            stamp = {"run": self.index, "step": step, "samples": samples, "time_ms": int(time.time() * 1000)}
            self.file.write(json.dumps(stamp | row) + "\n")
            self.file.flush()

    def interval(self, step: int, samples: int) -> tuple[int, float]:
        """(steps, samples/s) since the last log point, which this one becomes."""
        now = time.perf_counter()
        steps, rate = step - self.last_step, (samples - self.last_samples) / (now - self.last_time)
        self.timed_seconds += now - self.last_time
        self.timed_samples += samples - self.last_samples
        self.last_time, self.last_samples, self.last_step = now, samples, step
        return steps, rate

    def pause_ended(self) -> None:
        """An eval's time is not training time."""
        self.last_time = time.perf_counter()

    @property
    def samples_per_s(self) -> float | None:
        return self.timed_samples / self.timed_seconds if self.timed_seconds else None

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def start_telemetry(o: OutputConfig, run_dir: Path, index: int, info: DistInfo, out: RunConsole) -> Sampler | None:
    """The node's telemetry sampler, started by local rank 0 of each node (None when off): it samples the GPUs of the
    node's ranks, one a rank, or on a CPU run the CPU. A GPU list in the environment that names a GPU the node lacks
    stops the run here, before training."""
    if o.telemetry_hz <= 0 or info.local_rank != 0:
        return None
    gpus_used = info.local_world_size if info.device.type == "cuda" else 0
    sampler = Sampler(run_dir, o.telemetry_hz, gpus_used=gpus_used).start()
    out.say(f"run {index}: {sampler.note}")
    return sampler


def prepare_nodes(run_dir: Path, info: DistInfo) -> CacheClear:
    """Before a run, on each node (its local rank 0): drop the page cache where the process may, and record what the
    node is (``node_<host>.json``: CPUs, memory, GPUs, topology). Every rank takes part in two all-reduces (the
    failures, the nodes), so every rank learns whether every node dropped its cache; the record's failure never
    stops a run."""
    mine = None
    if info.local_rank == 0:
        mine = drop_page_cache()
        try:
            write_node_record(run_dir)
        except OSError:
            pass  # a full disk or a read-only folder stops the run later, where the run's own files are written
    failed = torch.tensor([0.0 if mine is None or mine.dropped else 1.0], device=info.device)
    nodes = torch.tensor([1.0 if info.local_rank == 0 else 0.0], device=info.device)
    failed, nodes = int(all_reduce_sum(failed, info).item()), int(all_reduce_sum(nodes, info).item())
    if mine is None or failed == 0 or nodes == 1:
        return mine or CacheClear(failed == 0, "")
    here = mine.how if not mine.dropped else "it was dropped on this node"
    return CacheClear(False, f"on {failed} of {nodes} nodes ({here})")


def start_profiler(o: OutputConfig, run_dir: Path, index: int, info: DistInfo) -> StepProfiler | None:
    return StepProfiler(run_dir, index, o.profile_start_step, o.profile_steps, info.device, info.rank) if o.profile \
        else None  # fmt: skip


def finish_profiler(profiler: StepProfiler | None, o: OutputConfig, index: int, info: DistInfo,
                    out: RunConsole) -> None:  # fmt: skip
    if profiler is None:
        return
    profiler.finish()  # a run that ended inside the window still gets its files
    if profiler.outputs:
        others = f" (ranks 1-{info.world_size - 1}: profile_{index}_rank<r>_*)" if info.world_size > 1 else ""
        out.say(f"run {index}: profile of steps {o.profile_start_step}-{profiler.stop_step - 1}: "
                f"{', '.join(p.name for p in profiler.outputs)}{others}")  # fmt: skip
