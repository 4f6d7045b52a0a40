"""The MLPerf record of one run: every MLPerf event the loop writes, in one object.

Header (init, submission and hyperparameter keys), run_start, the blocks between evals, the evals and run_stop.
Only rank 0 writes (``path`` None elsewhere). A resumed run appends to its log: no header and no run_start again,
but an event saying it was resumed and from where; time to train keeps counting from the original run_start.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from trainbench.config import OutputConfig, RunConfig
from trainbench.mlperf import MLPerfLog, constants
from trainbench.version import provenance

# Logged (a point in time) when a run continues from a checkpoint; value: how many times it was resumed.
RESUMED_KEY = "trainbench_resumed"


def platform_name(device: torch.device, world_size: int) -> str:
    if device.type == "cuda":
        return f"{world_size}x{torch.cuda.get_device_name(device).replace(' ', '_')}"
    return f"{world_size}xCPU_{os.cpu_count()}cores"


OWN_BENCHMARK_KEY = "trainbench_own_benchmark"
# Which trainbench wrote the log (keys the checker ignores): its version, and its commit where it ran from a checkout.
VERSION_KEY = "trainbench_version"
COMMIT_KEY = "trainbench_commit"


class MLPerfRecord:
    def __init__(self, path: Path | None, fresh: bool):
        self.path = path
        self.log = MLPerfLog(path)  # appends when resuming
        self.fresh = fresh
        # The log's header is written once: not again on resume.
        self._header = self.log if fresh else MLPerfLog(None)

    def header(self, mlperf_name: str, o: OutputConfig, platform: str, mlperf: bool = True,
               cache_cleared: bool = False) -> None:  # fmt: skip
        """cache_clear (whether the page cache was dropped before the run: :func:`trainbench.node.drop_page_cache`),
        init_start, the submission keys and the trainbench that wrote the log; a benchmark of one's own says so in
        its log (keys the checker ignores)."""
        h = self._header
        h.event(constants.CACHE_CLEAR, cache_cleared)
        h.start(constants.INIT_START)
        made_by = provenance()
        h.event(VERSION_KEY, made_by["version"])
        if "commit" in made_by:
            h.event(COMMIT_KEY, made_by["commit"])
        h.event(constants.SUBMISSION_BENCHMARK, mlperf_name)
        if not mlperf:
            h.event(OWN_BENCHMARK_KEY, "not an MLPerf benchmark: checked by mlperf-logging's common rules")
        h.event(constants.SUBMISSION_ORG, o.submission_org)
        h.event(constants.SUBMISSION_DIVISION, o.division)
        h.event(constants.SUBMISSION_STATUS, o.status)
        h.event(constants.SUBMISSION_PLATFORM, o.submission_platform or platform)

    def hyperparameters(self, cfg: RunConfig, accumulation: int, train_samples: int, eval_samples: int,
                        benchmark_keys: dict[str, Any], disclosure: dict[str, Any]) -> None:  # fmt: skip
        """The run's sizes and the benchmark's own keys, all from the config and the data; under a ruleset that
        has them (6.x), what the run ran in and how it was laid out (``disclosure``, read off the placed model)."""
        h = self._header
        h.event(constants.SEED, cfg.seed)
        h.event(constants.GLOBAL_BATCH_SIZE, cfg.data.global_batch_size)
        h.event(constants.GRADIENT_ACCUMULATION_STEPS, accumulation)
        h.event(constants.TRAIN_SAMPLES, train_samples)
        h.event(constants.EVAL_SAMPLES, eval_samples)
        for key, value in benchmark_keys.items():
            h.event(key, value)
        for key, value in disclosure.items():
            h.event(key, value)

    def run_start(self) -> int:
        """init_stop and run_start; returns run_start's time (ms)."""
        self.log.end(constants.INIT_STOP)
        start_ms = int(time.time() * 1000)
        self.log.start(constants.RUN_START, time_ms=start_ms)
        return start_ms

    def resumed(self, times: int, step: int, samples: int) -> None:
        self.log.event(RESUMED_KEY, times, metadata={"step": step, "samples": samples})

    def block_start(self, first_sample: int, count: int) -> None:
        self.log.start(constants.BLOCK_START, metadata={"first_epoch_num": first_sample, "epoch_count": count})

    def block_stop(self, first_sample: int) -> None:
        self.log.end(constants.BLOCK_STOP, metadata={"first_epoch_num": first_sample})

    def eval_start(self, meta: dict[str, Any]) -> None:
        self.log.start(constants.EVAL_START, metadata=meta)

    def eval_result(self, metric: float, meta: dict[str, Any]) -> None:
        self.log.event(constants.EVAL_ACCURACY, metric, metadata=meta)
        self.log.end(constants.EVAL_STOP, metadata=meta)

    def finish(self, status: str, time_ms: int, final: Path) -> None:
        """run_stop, atomically: the log with run_stop appended is written beside ``final``, synced, renamed to
        ``final``, and only then is the unfinished log removed. A kill at any point leaves either the unfinished log
        (no run_stop: resume continues it) or the whole finished one, never a finished log without its end or an
        unfinished log with one."""
        self.log.close()
        if self.path is None:
            return
        tmp = final.with_name(final.name + ".tmp")
        shutil.copyfile(self.path, tmp)
        end = MLPerfLog(tmp)
        end.end(constants.RUN_STOP, metadata={"status": status}, time_ms=time_ms)
        end.close()
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        self.path.unlink()

    def close(self) -> None:
        """Leave the log unfinished (no run_stop): the run stopped before it ended."""
        self.log.close()
