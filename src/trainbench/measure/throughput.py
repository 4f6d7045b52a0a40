"""A throughput measurement (`trainbench bench`): the run's own model, placement, optimizer, step and eval on rows
made in memory, timed after a warm-up. Never a time-to-train result: no MLPerf log is written."""

from __future__ import annotations

import dataclasses
import re
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from trainbench.benchmarks.base import Benchmark
from trainbench.config import RunConfig
from trainbench.console import RunConsole
from trainbench.data.prefetch import pinned, prefetch
from trainbench.distributed import DistInfo, all_reduce_sum
from trainbench.errors import UserError
from trainbench.families.decoder.moe import MoE
from trainbench.runfiles import CONSOLE
from trainbench.telemetry import machine, window_summary
from trainbench.train.duties import start_telemetry
from trainbench.train.evaluate import evaluate
from trainbench.train.loop import announce
from trainbench.train.record import MLPerfRecord
from trainbench.train.setup import build_run
from trainbench.train.step import StepTotals, train_step


def memory_account(device: torch.device, run_dir: Path, when: str, top: int = 30) -> str:
    """torch.cuda.memory's snapshot now (``memory_<when>.pickle``, for pytorch.org/memory_viz) and the bytes held,
    grouped by the innermost frame of trainbench's code that allocated them (``memory_<when>.txt``); returns where
    the account is, for a message."""
    snap = torch.cuda.memory._snapshot(device)
    pickle_path = run_dir / f"memory_{when}.pickle"
    torch.cuda.memory._dump_snapshot(str(pickle_path))
    groups: dict[str, int] = {}
    for segment in snap.get("segments", []):
        for block in segment.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            frames = block.get("frames") or []
            ours = [f for f in frames if "trainbench" in f.get("filename", "")][:4] or frames[:1]
            backward = any("autograd" in f.get("filename", "") and "backward" in f.get("name", "") for f in frames)
            where = " < ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in ours) or "(no stack)"
            where = ("backward: " if backward else "") + where
            groups[where] = groups.get(where, 0) + block["size"]
    total = sum(groups.values())
    lines = [f"{total / 2**30:.2f} GiB allocated ({when}), by the code that allocated it:"]
    largest = sorted(groups.items(), key=lambda kv: -kv[1])[:top]
    lines += [f"{size / 2**30:9.3f} GiB  {where}" for where, size in largest]
    text_path = run_dir / f"memory_{when}.txt"
    text_path.write_text("\n".join(lines) + "\n")
    return f"; the account is in {text_path}"


def allocator_retries(device: torch.device) -> int | None:
    """How many times so far this process's caching allocator found neither a cached block nor new GPU memory for an
    allocation, freed every cached block (waiting on the GPU) and tried again; None off CUDA. Each retry stalls the
    step: a count that grows in the timed steps is memory pressure slowing them."""
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0)) if device.type == "cuda" else None


def _sync(info: DistInfo) -> None:
    if info.device.type == "cuda":
        torch.cuda.synchronize(info.device)
    if info.world_size > 1:
        torch.distributed.barrier()


def measure(cfg: RunConfig, bench: Benchmark, run_dir: Path, info: DistInfo, steps: int, warmup: int,
            profile_steps: int = 0, snapshot: bool = False) -> dict[str, Any]:  # fmt: skip
    """``warmup`` optimizer steps, then ``steps`` timed ones, then (on a GPU) ``profile_steps`` profiled ones, then one
    eval batch timed (after one untimed); every rank's figures summed. Returns rank 0's record of it (the same dict
    on every rank, but for ``profile``, which is rank 0's)."""
    out = RunConsole(run_dir / CONSOLE, enabled=info.is_main)
    cuda = info.device.type == "cuda"
    one_gpu = cuda and info.world_size == 1
    copy_rate = _device_copy_rate() if one_gpu else None  # (before the model: 2 GiB for a moment)
    family_rates = bench.family.one_gpu_rates(cfg, info.device) if one_gpu else None
    run = build_run(cfg, bench, info, None, synthetic=True)
    announce(out, cfg, bench, run, 0, info)
    node = _forecast(cfg, bench, info, out) if cuda and info.world_size > 1 and info.is_main else None
    autocast = torch.autocast(info.device.type, dtype=torch.bfloat16, enabled=run.bf16)
    sampler = start_telemetry(cfg.output, run_dir, 0, info, out)
    timed = _steps_or_why_not(cfg, bench, run, info, autocast, steps, warmup, profile_steps, run_dir, out, snapshot)
    peak = torch.cuda.max_memory_allocated(info.device) / 2**30 if cuda else None
    held = torch.cuda.max_memory_reserved(info.device) / 2**30 if cuda else None
    eval_seconds_per_row, router = _eval_seconds_per_row(bench, run, info, autocast)
    if one_gpu and timed.seconds > 0:  # kept for a forecast of this shape on several GPUs (measure/forecast.py)
        _keep_step(cfg, bench, run, info, timed.seconds / steps, copy_rate, router, out, family_rates)
    if sampler is not None:
        sampler.stop()
    seconds, start_ms, stop_ms = timed.seconds, timed.start_ms, timed.stop_ms
    result = {
        "steps": steps,
        "warmup": warmup,
        "seconds": seconds,
        "samples_per_step": timed.samples / steps,
        "samples_per_s": timed.samples / seconds,
        "tokens_per_s": timed.samples * bench.family.tokens_per_sample(cfg) / seconds,
        "mean_loss": timed.loss,
        "peak_memory_gib": peak,
        # rank 0's peak held by the caching allocator (allocated, and cached for reuse) over the timed steps
        "peak_reserved_gib": held,
        "allocator_retries": timed.allocator_retries,
        # what the GPU has (or perf.gpu_memory_gib stands in for): where an extrapolated peak would not fit
        "gpu_memory_gib": (cfg.perf.gpu_memory_gib or _gpu_gib(info.device)) if cuda else None,
        "eval_seconds_per_sample": eval_seconds_per_row / info.world_size,  # each rank its own rows, side by side
        "eval_samples": run.data.eval_samples,
        "notes": run.placed.notes + bench.family.model_notes(cfg, info.device, run.bf16),
        "profile": timed.profile,
        "router": router,
        "device": torch.cuda.get_device_name(info.device) if cuda else "cpu",
    }
    if node is not None:
        result["forecast"] = _against(node, seconds / steps, out)
    if info.is_main:
        result.update(_node_window(cfg, run_dir, info, start_ms, stop_ms))
    return result


def _node_window(cfg: RunConfig, run_dir: Path, info: DistInfo, start_ms: float, stop_ms: float) -> dict[str, Any]:
    """What rank 0 ran on (the report's hardware line) and this node's GPUs over the timed steps: median power and SM
    clock, throttle reasons, energy."""
    found: dict[str, Any] = {"system": machine(cfg.output.gpu_links and info.device.type == "cuda")}
    found["gpus"] = window_summary(run_dir, start_ms, stop_ms)
    energy = node_energy(found["gpus"], info.local_world_size)
    if energy is not None:
        found["energy_joules"] = energy
    return found


def _device_copy_rate() -> float | None:
    """The GPU's own memory copy rate (measure/probe.device_copy_rate), which a forecast on several GPUs charges
    FSDP2's copies at; None where 2 GiB are not free for it."""
    from trainbench.measure.probe import device_copy_rate

    try:
        return device_copy_rate()
    except torch.OutOfMemoryError:
        return None
    finally:
        torch.cuda.empty_cache()


def _keep_step(cfg: RunConfig, bench: Benchmark, run, info: DistInfo, step_s: float, copy_rate: float | None,
               router: dict | None, out: RunConsole, family_rates: dict[str, float] | None = None) -> None:  # fmt: skip
    """This one GPU's step at ``cfg``'s shape kept for a forecast on several GPUs (measure/forecast.py); a cache that
    cannot be written is said, and the measurement stands."""
    from trainbench.measure import forecast

    one = forecast.measured(cfg, bench, run.placed.module, step_s, torch.cuda.get_device_name(info.device), copy_rate,
                            router["loads"] if router else None, family_rates)  # fmt: skip
    try:
        forecast.save(cfg, one)
    except OSError as exc:
        out.say(f"  this step was not kept for a forecast on several GPUs ({exc})", style="yellow")


def _against(node: dict[str, Any], measured_s: float, out: RunConsole) -> dict[str, Any]:
    """The forecast ``node``, after the timed steps: how far their ``measured_s`` a step fell from it, said."""
    if "step_s" in node:
        out.say(f"  measured {measured_s:.3f} s a step: its rate {node['step_s'] / measured_s - 1:+.1%} against the "
                "forecast's")  # fmt: skip
    return node


def _forecast(cfg: RunConfig, bench: Benchmark, info: DistInfo, out: RunConsole) -> dict[str, Any]:
    """Rank 0's forecast of this step on the node's ranks from one GPU's (measure/forecast.py), said before the timed
    steps."""
    from trainbench.measure import forecast

    node = forecast.forecast(bench, cfg, info.world_size, torch.cuda.get_device_name(info.device))
    out.say("  " + forecast.line(node))
    return node


def node_energy(gpus: dict[str, dict], ranks_here: int) -> float | None:
    """The energy (J) of this node's ranks' GPUs over the timed steps (``gpus``: telemetry.window_summary's), each of
    them, or None: a sum that left one out would be too small for the tokens every rank trained."""
    energies = [g["energy_j"] for g in gpus.values()]
    if len(energies) != ranks_here or None in energies:
        return None
    return sum(energies)


def _steps_or_why_not(cfg, bench, run, info, autocast, steps, warmup, profile_steps, run_dir, out, snapshot) -> Timed:
    """The timed steps (with every allocation recorded where ``snapshot``), or one sentence where they do not fit."""
    if snapshot and info.device.type == "cuda":
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    snapshot = snapshot and info.device.type == "cuda" and info.is_main
    try:
        timed = _timed_steps(cfg, bench, run, info, autocast, steps, warmup, profile_steps, run_dir, out)
    except torch.OutOfMemoryError as exc:
        raise UserError(_does_not_fit(cfg, bench, info, exc, memory_account(info.device, run_dir, "oom")
                                      if snapshot else "")) from None  # fmt: skip
    if snapshot:
        memory_account(info.device, run_dir, "peak")
    return timed


def _gpu_gib(device: torch.device) -> float:
    """The GPU's whole memory, GiB."""
    return torch.cuda.get_device_properties(device).total_memory / 2**30


def _does_not_fit(cfg: RunConfig, bench: Benchmark, info: DistInfo, exc: torch.OutOfMemoryError,
                  account: str) -> str:  # fmt: skip
    """The sentence for a measurement out of GPU memory: the allocation that failed (from torch's message), the peak
    this rank held before it (what is held once the error unwound says little), and what would make it fit."""
    gib = _gpu_gib(info.device)
    peak = torch.cuda.max_memory_allocated(info.device) / 2**30
    asked = re.search(r"Tried to allocate ([0-9.]+ [KMGT]?i?B)", str(exc))
    failed = f"an allocation of {asked.group(1)} failed" if asked else "an allocation failed"
    layers = bench.family.depth(cfg)
    at = f" at {layers} blocks" if layers else ""
    ways = ["measure fewer blocks (--blocks)"] if layers and layers > 2 else []
    micro = cfg.data.micro_batch_size
    ways += [f"a smaller micro-batch (data.micro_batch_size={micro // 2})"] if micro > 1 else []
    ways += ["recompute or offload more (perf.*)", "use more GPUs (--nproc)"]
    rank = f" on rank {info.rank}" if info.world_size > 1 else ""
    return (
        f"{bench.name}/{cfg.preset} does not fit in this GPU's {gib:.0f} GiB{at} ({failed} with {peak:.1f} GiB "
        f"at its peak{rank}{account}); {', '.join(ways[:-1])} or {ways[-1]}"
    )


@dataclasses.dataclass
class Timed:
    seconds: float  # of the timed steps
    start_ms: float  # their start and stop, ms since the epoch (the telemetry's clock)
    stop_ms: float
    samples: int  # samples the timed steps trained on (a packed row holds several)
    loss: float  # the mean loss of every step
    profile: dict | None  # rank 0's profiled steps: where a step's GPU time went
    allocator_retries: int | None  # every rank's caching allocator's retries in the timed steps (None off CUDA)


def _timed_steps(cfg, bench, run, info, autocast, steps: int, warmup: int, profile_steps: int, run_dir: Path,
                 out) -> Timed:  # fmt: skip
    totals = StepTotals(info.device)
    source = pinned(run.data.train, info.device) if info.device.type == "cuda" else run.data.train
    batches = prefetch(source, cfg.data.prefetch)
    run.placed.model.train()
    profile_steps = profile_steps if info.device.type == "cuda" else 0
    samples, profile, retries = 0, None, None

    def one(i: int, step_batches) -> None:
        train_step(bench, run.placed, run.optimizer, step_batches, bench.lr_at(cfg, i), info, autocast, totals)

    try:
        it = iter(batches)
        for i in range(warmup + steps):
            if i == warmup:
                _sync(info)
                if info.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(info.device)
                retries = allocator_retries(info.device)
                start, start_ms = time.perf_counter(), time.time() * 1000
            step_batches = next(it)
            one(i, step_batches)
            if i >= warmup:
                samples += step_batches.samples
            out.say(f"  step {i + 1} of {warmup + steps}{' (warm-up)' if i < warmup else ''}")
        _sync(info)
        seconds, stop_ms = time.perf_counter() - start, time.time() * 1000
        if retries is not None:
            retries = int(all_reduce_sum(torch.tensor([allocator_retries(info.device) - retries],
                                                      device=info.device), info).item())  # fmt: skip
        if profile_steps:
            out.say(f"  profiling {profile_steps} more steps")
            profile = _profiled(lambda k: one(warmup + steps + k, next(it)), profile_steps, run_dir, info,
                                bench.family.depth(cfg), bench.family.step_parts, out.say)  # fmt: skip
    finally:
        batches.close()
    loss = float(all_reduce_sum(totals.loss_sum.clone(), info)) / (warmup + steps + profile_steps)
    return Timed(seconds, start_ms, stop_ms, samples, loss, profile, retries)


def _profiled(step, steps: int, run_dir: Path, info: DistInfo, blocks: int | None,
              parts: tuple[tuple[str, str], ...] = (), say=print) -> dict | None:  # fmt: skip
    """``steps`` steps under torch.profiler (after the timed ones, so the timing never pays for it). Rank 0 keeps the
    trace (``profile_<blocks>_trace.json``) and returns a step's split (compute, exposed communication, idle: see
    :func:`~trainbench.train.profiling.timeline`), its GPU time by kind of kernel and by part of the step (the
    family's ``step_parts``, the optimizer, communication, the model: :func:`~trainbench.train.profiling.
    kernels_by_part`, from the host ranges the kernels were launched in)."""
    import json

    from torch.profiler import ProfilerActivity, profile

    from trainbench.train.profiling import kernels_by_kind, kernels_by_part, timeline

    _sync(info)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=False) as prof:
        for k in range(steps):
            step(k)
        _sync(info)
        if info.is_main:  # then the events are read and written: more than 5 min for the whole 8B on 2 H200
            say("  profiled; reading the profiler's events and writing the trace (minutes on a whole large model: "
                "--profile-steps 0 skips it)")  # fmt: skip
    if not info.is_main:
        return None
    trace = run_dir / f"profile_{blocks if blocks is not None else 'model'}_trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())
    return {"steps": steps, "trace": trace.name, "split": timeline(events, steps),
            "by_part_ms": kernels_by_part(events, steps, parts)} | kernels_by_kind(events, steps)  # fmt: skip


EVAL_TIMINGS = 3  # the eval's timed passes, of which the median counts


def _eval_seconds_per_row(bench, run, info, autocast) -> tuple[float, dict | None]:
    """The eval's seconds per row of this rank: the median of :data:`EVAL_TIMINGS` timed passes over its eval batch
    after one untimed pass (which compiles), and where the model has a mixture of experts, how evenly its routers
    spread the untimed pass's tokens. One timed pass moved 2x between two runs of the same model on the same GPUs
    (the 8B over 2 H200: 0.184 and 0.084 s a sample), and with it the evals' share of the projected time."""
    record = MLPerfRecord(None, fresh=True)  # the eval's events go nowhere: no MLPerf log
    rows = sum(len(next(iter(b.values()))) for b in run.data.eval)
    with RouterLoads(run.placed.module) as loads:
        evaluate(bench, run.placed.model, run.data.eval, info, autocast, record, 0)
    _sync(info)
    seconds = []
    for _ in range(EVAL_TIMINGS):
        t = time.perf_counter()
        evaluate(bench, run.placed.model, run.data.eval, info, autocast, record, 0)
        _sync(info)
        seconds.append(time.perf_counter() - t)
    return statistics.median(seconds) / rows, loads.balance(info)


class RouterLoads:
    """Tokens routed to each expert of each mixture of experts in ``model`` while in the ``with`` block."""

    def __init__(self, model: torch.nn.Module):
        self.moes = [m for m in model.modules() if isinstance(m, MoE)]
        self.counts: list[torch.Tensor | int] = [0] * len(self.moes)

    def __enter__(self) -> RouterLoads:
        def count(i: int, moe: MoE):
            def hook(_module, _inputs, output) -> None:
                chosen = output[1].topk(moe.shape.top_k, dim=-1).indices.flatten()
                self.counts[i] = self.counts[i] + torch.bincount(chosen, minlength=moe.shape.experts)

            return hook

        self.hooks = [moe.register_forward_hook(count(i, moe)) for i, moe in enumerate(self.moes)]
        return self

    def __exit__(self, *exc) -> None:
        for hook in self.hooks:
            hook.remove()

    def balance(self, info: DistInfo) -> dict | None:
        """Each block's busiest and idlest expert against the mean (1: every expert got as many tokens), over the
        tokens of every rank; None without experts."""
        if not self.moes or any(isinstance(c, int) for c in self.counts):
            return None
        loads = all_reduce_sum(torch.stack(self.counts).double(), info)  # [blocks, experts]
        mean = loads.mean(dim=1)
        busiest, idlest = (loads.max(dim=1).values / mean).tolist(), (loads.min(dim=1).values / mean).tolist()
        return {"experts": loads.shape[1], "tokens_routed": int(loads[0].sum()), "busiest_over_mean": busiest,
                "idlest_over_mean": idlest, "worst_busiest_over_mean": max(busiest),
                "loads": [[int(n) for n in block] for block in loads.tolist()]}  # fmt: skip
