"""What the perf scripts share for timing GPU work (imported by them; not a measurement of its own)."""

from __future__ import annotations

import torch


def cuda_ms(fn) -> float:
    """Milliseconds of GPU time between CUDA events recorded before and after ``fn()``, once its work is done."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)
