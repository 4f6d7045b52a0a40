"""A short torch.profiler window in a run: the top kernels by GPU time as CSV, and a Chrome trace.

``profile=true`` records steps ``profile_start_step`` .. ``profile_start_step + profile_steps - 1`` on rank 0
and writes ``profile_<i>_kernels.csv`` (operators and kernels by self device time, or CPU time on a CPU
run) and ``profile_<i>_trace.json`` (open it in chrome://tracing or ui.perfetto.dev).
"""

from __future__ import annotations

import csv
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


class StepProfiler:
    def __init__(self, run_dir: Path, index: int, start_step: int, steps: int, device: torch.device):
        self.run_dir, self.index = Path(run_dir), index
        self.start_step, self.stop_step = start_step, start_step + steps
        self.cuda = device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._prof = profile(activities=activities, record_shapes=False)
        self._active = False
        self.outputs: list[Path] = []

    def before_step(self, step: int) -> None:
        """Call with the number of the step about to run (0-based)."""
        if step == self.start_step and not self._active:
            self._prof.__enter__()
            self._active = True

    def after_step(self, step_done: int) -> None:
        """Call with the count of steps finished."""
        if self._active and step_done >= self.stop_step:
            self.finish()

    def finish(self) -> None:
        if not self._active:
            return
        if self.cuda:
            torch.cuda.synchronize()
        self._prof.__exit__(None, None, None)
        self._active = False
        trace = self.run_dir / f"profile_{self.index}_trace.json"
        self._prof.export_chrome_trace(str(trace))
        table = self.run_dir / f"profile_{self.index}_kernels.csv"
        events = self._prof.key_averages()
        device_key = "self_device_time_total"

        def device_time(e):
            return getattr(e, device_key, 0) or getattr(e, "self_cuda_time_total", 0) or 0

        ranked = sorted(events, key=lambda e: (device_time(e), e.self_cpu_time_total), reverse=True)
        with open(table, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["name", "calls", "self_device_time_us", "self_cpu_time_us", "cpu_time_total_us"])
            for e in ranked[:50]:
                writer.writerow([e.key, e.count, round(device_time(e), 1), round(e.self_cpu_time_total, 1),
                                 round(e.cpu_time_total, 1)])  # fmt: skip
        self.outputs = [table, trace]


def bf16_matmul_peak_tflops(n: int = 8192, reps: int = 30) -> float:
    """Measured bf16 matmul throughput of this GPU (n^3 GEMMs): the denominator of the MFU we report."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e12
