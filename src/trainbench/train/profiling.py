"""A short torch.profiler window in a run: the top kernels by GPU time as CSV, a Chrome trace, and where each
step's GPU time went.

``profile=true`` records steps ``profile_start_step`` .. ``profile_start_step + profile_steps - 1`` on every rank.
Rank 0 writes ``profile_<i>_kernels.csv`` (operators and kernels by self device time, or CPU time on a CPU run),
``profile_<i>_trace.json`` (open it in chrome://tracing or ui.perfetto.dev) and, on a GPU,
``profile_<i>_timeline.json`` (:func:`timeline`); rank r > 0 writes the same files named
``profile_<i>_rank<r>_*``, so a rank that makes the others wait shows up in its own files.
"""

from __future__ import annotations

import bisect
import csv
import json
import re
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

# GPU activity in a Chrome trace that occupies the device: kernels, copies and memsets.
_GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


class StepProfiler:
    def __init__(self, run_dir: Path, index: int, start_step: int, steps: int, device: torch.device, rank: int = 0):
        self.run_dir, self.index = Path(run_dir), index
        self.prefix = f"profile_{index}_" if rank == 0 else f"profile_{index}_rank{rank}_"
        self.start_step, self.stop_step = start_step, start_step + steps
        self.cuda = device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._prof = profile(activities=activities, record_shapes=False)
        self._active = False
        self._steps_recorded = 0
        self.outputs: list[Path] = []

    def before_step(self, step: int) -> None:
        """Call with the number of the step about to run (0-based)."""
        if step == self.start_step and not self._active:
            if self.cuda:
                torch.cuda.synchronize()  # the window holds this step's GPU work and nothing earlier
            self._prof.__enter__()
            self._active = True

    def after_step(self, step_done: int) -> None:
        """Call with the count of steps finished."""
        if self._active:
            self._steps_recorded = step_done - self.start_step
            if step_done >= self.stop_step:
                self.finish()

    def finish(self) -> None:
        if not self._active:
            return
        if self.cuda:
            torch.cuda.synchronize()
        self._prof.__exit__(None, None, None)
        self._active = False
        trace = self.run_dir / f"{self.prefix}trace.json"
        self._prof.export_chrome_trace(str(trace))
        table = self.run_dir / f"{self.prefix}kernels.csv"
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
        if self.cuda and self._steps_recorded > 0:
            summary = self.run_dir / f"{self.prefix}timeline.json"
            with open(trace) as f:
                summary.write_text(json.dumps(timeline(json.load(f), self._steps_recorded), indent=1) + "\n")
            self.outputs.append(summary)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the union ``a`` outside the union ``b`` (both sorted, disjoint)."""
    covered, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            covered += min(end, b[k][1]) - max(start, b[k][0])
            k += 1
    return _length(a) - covered


def timeline(trace: dict, steps: int) -> dict:
    """Where a profiled window's GPU time went, per step in ms, from a Chrome trace of one rank.

    ``window``: first GPU activity to last. ``busy``: some kernel, copy or memset runs. ``compute``: some
    non-communication activity runs (``compute_kernels`` sums those kernels' own times, counting twice what
    ran concurrently). ``comm``: a collective (NCCL) kernel runs; ``comm_exposed``: a collective runs and
    nothing else does, which is the all-reduce not hidden behind backward, and the time this rank waited
    inside a collective for a slower one. ``idle``: nothing runs, which is the GPU waiting for the host.
    """
    gpu, comm = [], []
    compute_sum = 0.0
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") not in _GPU_CATEGORIES:
            continue
        span = (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
        if "nccl" in e.get("name", "").lower():
            comm.append(span)
        else:
            gpu.append(span)
            if e["cat"] == "kernel":
                compute_sum += span[1] - span[0]
    if not gpu and not comm:
        raise ValueError("the trace has no GPU activity")
    busy, compute, comm_u = _union(gpu + comm), _union(gpu), _union(comm)
    window = busy[-1][1] - busy[0][0]
    per_step = 1e-3 / steps  # trace times are in microseconds
    return {
        "steps": steps,
        "window_ms": window * per_step,
        "busy_ms": _length(busy) * per_step,
        "compute_ms": _length(compute) * per_step,
        "compute_kernels_ms": compute_sum * per_step,
        "comm_ms": _length(comm_u) * per_step,
        "comm_exposed_ms": _minus(comm_u, compute) * per_step,
        "idle_ms": (window - _length(busy)) * per_step,
        "comm_kernels": len(comm),
    }


KERNEL_KINDS = (  # first match wins: (kind, substrings of the lower-cased kernel name)
    ("nccl", ("nccl",)),
    ("compiled elementwise", ("triton_",)),  # Inductor's kernels, named after the ops they fuse
    ("attention", ("flash", "fmha", "attn", "attention", "sdpa", "cudnn")),
    ("fp8 gemm", ("e4m3", "f8f8", "fp8", "qgmma", "_qq", "_qr", "_rq")),  # cuBLAS's nvjet: q = e4m3, r = e5m2
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "wgmma", "sm90")),
    ("optimizer", ("adam", "lamb", "multi_tensor", "foreach", "norm_kernel")),  # (lambdas, layer norms: see below)
    ("copy", ("memcpy", "memset", "copy")),
    ("other", ("",)),
)


# trainbench's Triton kernels (families/fp8, families/decoder's fp8_output and glu_kernel; optim/adamw) are named so
OWN_KERNEL_PREFIX = "tb_"
OWN_KERNEL_KINDS = {"tb_adamw": "optimizer"}  # those counted with a kind of their own; the rest are "own kernels"


def kernel_kind(name: str) -> str:
    """The kind of a GPU kernel by its name: FP8 or bf16 GEMM, attention, compiled elementwise work, ..., or one of
    trainbench's own Triton kernels (``tb_...``; the optimizer's update counts as optimizer)."""
    low = name.lower()
    if low.startswith(OWN_KERNEL_PREFIX):
        return next((kind for own, kind in OWN_KERNEL_KINDS.items() if low.startswith(own)), "own kernels")
    # torch's elementwise kernels carry their functor's "{lambda()#1}" and its normalisation layers' are
    # "..._norm_kernel": neither is LAMB nor the gradients' norm.
    low = re.sub(r"lambda|(layer|rms|group|batch)_norm", "~", low)
    return next(kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys))


def kernels_by_kind(trace: dict, steps: int, top: int = 40) -> dict:
    """GPU time a step by kind of kernel and the ``top`` longest kernels (ms a step, calls a step), from a Chrome
    trace of ``steps`` steps."""
    per_name: dict[str, list[float]] = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") in _GPU_CATEGORIES:
            entry = per_name.setdefault(e.get("name", "?"), [0.0, 0])
            entry[0] += float(e.get("dur", 0)) / 1e3 / steps
            entry[1] += 1
    kinds: dict[str, float] = {}
    for name, (ms, _) in per_name.items():
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + ms
    longest = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "by_kind_ms": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
        "kernels": [
            {"name": n[:160], "kind": kernel_kind(n), "ms": ms, "calls": c / steps} for n, (ms, c) in longest
        ],  # fmt: skip
    }


# Where a kernel's launch sat on the host: CPU ranges that name a part of the step (operators, autograd functions'
# forwards and backwards, torch.profiler.record_function ranges), and the launches themselves.
_CPU_RANGES = ("cpu_op", "user_annotation", "python_function")
_LAUNCHES = ("cuda_runtime", "cuda_driver")
OPTIMIZER_PART = ("optimizer", r"^Optimizer\.step#")  # torch's range around every optimizer's step


def kernels_by_part(trace: dict, steps: int, parts: tuple[tuple[str, str], ...] = ()) -> dict[str, float]:
    """GPU time a step (ms) by part of the step, from a Chrome trace recorded with CPU and CUDA activity: a kernel (or
    copy) counts to the first of ``parts`` (a name and a regular expression), then ``optimizer``, whose expression
    matches a CPU range open on the launching thread when it was launched; a collective to ``communication``;
    the rest to ``model``. Parts with no time are left out."""
    patterns = [(name, re.compile(pattern)) for name, pattern in (*parts, OPTIMIZER_PART)]
    launches: dict[object, tuple[object, object, float]] = {}
    spans: dict[tuple[object, object], dict[int, list[tuple[float, float]]]] = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X":
            continue
        if e.get("cat") in _LAUNCHES:
            correlation = (e.get("args") or {}).get("correlation")
            if correlation is not None:
                launches[correlation] = (e.get("pid"), e.get("tid"), float(e["ts"]))
        elif e.get("cat") in _CPU_RANGES:
            index = next((i for i, (_, p) in enumerate(patterns) if p.search(e.get("name", ""))), None)
            if index is not None:
                start = float(e["ts"])
                spans.setdefault((e.get("pid"), e.get("tid")), {}).setdefault(index, []).append(
                    (start, start + float(e.get("dur", 0)))
                )
    merged = {thread: {i: _union(v) for i, v in sorted(by_part.items())} for thread, by_part in spans.items()}

    def part_at(pid, tid, ts: float) -> str:
        for index, intervals in merged.get((pid, tid), {}).items():
            k = bisect.bisect_right(intervals, (ts, float("inf"))) - 1
            if k >= 0 and intervals[k][0] <= ts <= intervals[k][1]:
                return patterns[index][0]
        return "model"

    out: dict[str, float] = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") not in _GPU_CATEGORIES:
            continue
        if "nccl" in e.get("name", "").lower():
            part = "communication"
        else:
            launch = launches.get((e.get("args") or {}).get("correlation"))
            part = part_at(*launch) if launch else "model"
        out[part] = out.get(part, 0.0) + float(e.get("dur", 0)) / 1e3 / steps
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


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
