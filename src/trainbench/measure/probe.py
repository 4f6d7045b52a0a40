"""The probe behind ``perf.plan=auto``: two blocks of the run's model, built and placed by the run's own code
(``build_run``) at the run's width and sequence length, one micro-batch a step, on this GPU; it measures what
layout.BlockProbe holds (a block's saved bytes, its forward and backward time, the weights, the working set) and the
pinned copy rates to and from the host, with the GPU idle and while a training step runs. Run in a process of its own
(``python -m trainbench.measure.plan CONFIG OUT``), so the launcher never holds a CUDA context; its answer is cached
per GPU model, software versions and shape."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# What a probe measures: a cached probe of an older format is measured again (2: copy rates while a step runs; 3: the
# optimizer state of the measured block's own parameters, and that of the parameters outside the blocks; 4: the GPU's
# own memory copy rate; 5: the steps it times queued back to back, as a run's, with none of the GPU's idle moments
# between steps that each waiting for the step before gave it; 6: perf.probe_blocks blocks, and the key holds the hold
# and the blocks whatever their values).
PROBE_FORMAT = 6


# What a probe's figures depend on beyond the software (:func:`probe_key`), and so what a command must be given to
# cache the probe a run looks for (:func:`shape_keys`): the model's keys but these, and these of the other sections
# (by their names in the key; the blocks as many as the probe builds, :func:`probe_blocks`).
MODEL_NOT_SHAPING = ("num_layers", "base_weights")
SHAPING = {"seq": ("data", "seq_length"), "micro": ("data", "micro_batch_size"), "compile": ("perf", "compile"),
           "sustained_s": ("perf", "probe_sustained_s"), "blocks": ("perf", "probe_blocks")}  # fmt: skip


def probe_blocks(cfg) -> int:
    """The blocks the probe builds: ``perf.probe_blocks``, no more than the model has, and at least 2 (block 1 is
    measured: its input comes from block 0, so it requires grad as every later one does)."""
    return max(2, min(cfg.perf.probe_blocks, cfg.model.num_layers))


def cache_dir() -> Path:
    root = os.environ.get("TRAINBENCH_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "trainbench"
    )
    return Path(root) / "probe"


def probe_key(cfg) -> str:
    """What the probe's figures depend on: the model's shape and precision, the sequence, the micro-batch, compile,
    the software (torch, trainbench), the seconds of steps before it times them (``perf.probe_sustained_s``) and the
    blocks it builds (:func:`probe_blocks`); the GPU model is added where the probe runs."""
    import trainbench

    m = {k: v for k, v in dataclasses.asdict(cfg.model).items() if k not in MODEL_NOT_SHAPING}
    shape = {"format": PROBE_FORMAT, "benchmark": cfg.benchmark, "model": m, "torch": torch.__version__,
             "trainbench": trainbench.__version__}  # fmt: skip
    shape |= {name: getattr(getattr(cfg, section), key) for name, (section, key) in SHAPING.items()}
    shape["blocks"] = probe_blocks(cfg)
    return hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:16]


def shape_keys(cfg, preset) -> list[str]:
    """``key=value`` for each key that :func:`probe_key` holds and ``cfg`` sets away from its ``preset`` (and
    ``perf.plan=auto`` where the preset plans by hand): what a ``trainbench bench`` must be given to probe and cache
    what a run of ``cfg`` looks for."""

    def said(value) -> str:
        if isinstance(value, bool):
            return str(value).lower()
        return ",".join(str(v) for v in value) if isinstance(value, (list, tuple)) else str(value)

    pairs = [(f"model.{f.name}", getattr(cfg.model, f.name), getattr(preset.model, f.name))
             for f in dataclasses.fields(cfg.model) if f.name not in MODEL_NOT_SHAPING]  # fmt: skip
    pairs += [(f"{section}.{key}", getattr(getattr(cfg, section), key), getattr(getattr(preset, section), key))
              for section, key in SHAPING.values()]  # fmt: skip
    plan = [] if preset.perf.plan == "auto" else ["perf.plan=auto"]
    return plan + [f"{key}={said(value)}" for key, value, default in pairs if value != default]


def cached(cfg, gpu_name: str | None = None) -> dict[str, Any] | None:
    """The newest cached probe of this shape (on ``gpu_name`` where given)."""
    found = []
    for path in cache_dir().glob(f"{probe_key(cfg)}-*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if gpu_name is None or data.get("gpu_name") == gpu_name:
            found.append((path.stat().st_mtime, data))
    return max(found, key=lambda f: f[0])[1] if found else None


def save(cfg, data: dict[str, Any]) -> Path:
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    name = "".join(c if c.isalnum() else "_" for c in data["gpu_name"])
    path = folder / f"{probe_key(cfg)}-{name}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def probe_config(cfg):
    """The run's config cut to the probe's blocks, one micro-batch a step, nothing recomputed or offloaded."""
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, num_layers=probe_blocks(cfg)),
        data=dataclasses.replace(cfg.data, global_batch_size=cfg.data.micro_batch_size),
        perf=dataclasses.replace(
            cfg.perf,
            activation_checkpointing=False,
            recompute_blocks=0,
            offload_blocks=0,
            offload_recomputed_inputs=False,
            plan="manual",
            cuda_graphs=False,
        ),  # fmt: skip
        distributed=dataclasses.replace(cfg.distributed, nproc=1, nodes=1),
        device="cuda",
    )


def _state_bytes(optimizer: torch.optim.Optimizer, params) -> int:
    """The bytes of the optimizer's state tensors for ``params``."""
    return sum(t.numel() * t.element_size() for p in params for t in optimizer.state.get(p, {}).values()
               if isinstance(t, torch.Tensor))  # fmt: skip


def _optimizer_bytes(run, block: torch.nn.Module, persistent: int, blocks: int) -> tuple[int, int]:
    """The gradients and optimizer state of ``block``'s trained parameters (its own state tensors, and one more copy
    of the parameters for their gradients during a step), and of all else: ``persistent``, what the first step left
    allocated beyond the weights (the whole optimizer state, and any buffer kept across steps), less the share of the
    probe's ``blocks`` blocks, plus the gradients of the trained parameters outside the blocks (a trained embedding
    and output layer)."""

    def trained(params) -> int:
        return sum(p.numel() * p.element_size() for p in params if p.requires_grad)

    everything = list(run.placed.module.parameters())
    ours = _state_bytes(run.optimizer, block.parameters()) + trained(block.parameters())
    return ours, max(0, persistent + trained(everything) - blocks * ours)


def _storages(module: torch.nn.Module) -> int:
    seen = {}
    for t in [*module.parameters(), *module.buffers()]:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def link_rates(gib: int = 1, reps: int = 3, gpus: int = 1) -> tuple[float, float]:
    """Pinned copy rates (bytes/s) of one GPU, GPU to host and host to GPU: the median of ``reps`` copies of ``gib``
    GiB after one untimed. With ``gpus`` above 1, that many GPUs of this host copy the same way at once, as the ranks
    of a node offloading in step do (their forwards send out together, their backwards fetch back together), and
    each round counts its slowest GPU."""
    n = gib << 30
    devices = [torch.device("cuda", i) for i in range(gpus)] if gpus > 1 else [torch.device("cuda")]
    buffers = [(torch.empty(n, dtype=torch.uint8, device=d), torch.empty(n, dtype=torch.uint8, pin_memory=True))
               for d in devices]  # fmt: skip
    rates = []
    for way in (0, 1):
        rounds = []
        for _ in range(reps + 1):
            marks = []
            for device, (gpu, host) in zip(devices, buffers, strict=True):
                src, dst = (gpu, host) if way == 0 else (host, gpu)
                with torch.cuda.device(device):
                    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    dst.copy_(src, non_blocking=True)
                    stop.record()
                marks.append((start, stop))
            for _, stop in marks:
                stop.synchronize()
            rounds.append(min(n / (start.elapsed_time(stop) / 1e3) for start, stop in marks))
        rates.append(sorted(rounds[1:])[reps // 2])
    return rates[0], rates[1]


def device_copy_rate(gib: int = 1, reps: int = 3) -> float:
    """The GPU's own memory copy rate (bytes copied a second; each byte read once and written once): the median of
    ``reps`` copies of ``gib`` GiB from one buffer of this GPU to another, after one untimed."""
    n = gib << 30
    src, dst = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
    rates = []
    for _ in range(reps + 1):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        stop.record()
        stop.synchronize()
        rates.append(n / (start.elapsed_time(stop) / 1e3))
    return sorted(rates[1:])[reps // 2]


def busy_link_rates(step, step_s: float, to_host: float, to_gpu: float) -> tuple[float, float]:
    """Pinned copy rates (bytes/s) while the GPU computes, as an offloaded step's copies run: one copy each way on a
    side stream of its own, both queued just before a training step (``step()``), each of as many bytes as half the
    step (``step_s``) carries at the idle rates ``to_host`` and ``to_gpu``, so that it ends inside the step unless the
    compute slows it; timed by events on its own stream."""
    device = torch.device("cuda", torch.cuda.current_device())
    sizes = [max(64 << 20, min(2 << 30, int(0.5 * step_s * rate))) for rate in (to_host, to_gpu)]
    pairs = [(torch.empty(sizes[0], dtype=torch.uint8, device=device), torch.empty(sizes[0], dtype=torch.uint8,
                                                                                   pin_memory=True)),
             (torch.empty(sizes[1], dtype=torch.uint8, pin_memory=True), torch.empty(sizes[1], dtype=torch.uint8,
                                                                                     device=device))]  # fmt: skip
    torch.cuda.synchronize(device)
    marks = []
    for src, dst in pairs:
        stream = torch.cuda.Stream(device)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            stop.record(stream)
        marks.append((start, stop))
    step()
    torch.cuda.synchronize(device)
    return tuple(n / (start.elapsed_time(stop) / 1e3) for n, (start, stop) in zip(sizes, marks, strict=True))


class _BlockMarks:
    """CUDA events and memory counts around one block: its forward (pre- and post-hooks) and its backward (the
    gradient reaching its output, then its input). The hooks run outside ``torch.compile``: a compiled block
    (``Module.compile``) would otherwise trace them into its graph, where the events are never recorded and the
    memory counts are constants of the trace."""

    def __init__(self, block: torch.nn.Module, device: torch.device):
        self.device, self.events, self.kept, self.input_bytes = device, {}, 0, 0
        self.hooks = [block.register_forward_pre_hook(torch.compiler.disable(self._before)),
                      block.register_forward_hook(torch.compiler.disable(self._after))]  # fmt: skip

    def _event(self, name: str) -> None:
        self.events[name] = torch.cuda.Event(enable_timing=True)
        self.events[name].record()

    def _before(self, module, args) -> None:
        self.input_bytes = args[0].numel() * args[0].element_size()
        self._alloc = torch.cuda.memory_allocated(self.device)
        if args[0].requires_grad:
            args[0].register_hook(lambda g: self._event("backward_end"))
        self._event("forward_start")

    def _after(self, module, args, output) -> None:
        self._event("forward_end")
        self.kept = torch.cuda.memory_allocated(self.device) - self._alloc  # what its forward left: saved + output
        output.register_hook(lambda g: self._event("backward_start"))

    def taken(self) -> dict[str, Callable[[], float]]:
        """The block's forward and backward of the step just queued, as callables of no argument giving seconds
        (read once the step has run): its events, kept apart from the next step's."""
        events = dict(self.events)

        def seconds(a: str, b: str):
            return lambda: events[a].elapsed_time(events[b]) / 1e3

        return {"forward_s": seconds("forward_start", "forward_end"),
                "backward_s": seconds("backward_start", "backward_end")}  # fmt: skip

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


def _stepper(run, bench, pcfg, info):
    """One training step of the probe's model a call (the i-th's learning rate)."""
    from trainbench.train.step import StepTotals, train_step

    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=run.bf16)
    steps = iter(run.data.train)
    run.placed.model.train()

    def step(i: int) -> None:
        train_step(bench, run.placed, run.optimizer, next(steps), bench.lr_at(pcfg, i), info, autocast,
                   StepTotals(info.device))  # fmt: skip

    return step


def _mark() -> torch.cuda.Event:
    """A CUDA event recorded now on the current stream, for timing."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _timed_steps(step, device: torch.device, marks: _BlockMarks, sustained_s: float = 0.0,
                 streamed: bool = True) -> dict[str, Any]:  # fmt: skip
    """Two steps (compile, settle), then steps for ``sustained_s`` seconds (``perf.probe_sustained_s``: the GPU
    brought to the clock its power cap holds through a run), then three measured; the fastest measured one's times
    and memory, the SM clock and power the steps ran at (:func:`busiest_gpu`), and the steps run in all.

    ``streamed``: after the first two, each step is queued while the one before still runs (one step ahead at most),
    as a run's micro-batches follow each other, so that the GPU never idles between them; a step's time is the GPU's
    from the end of the one before to its own end (CUDA events). Else each step starts after the one before has
    ended, the GPU idle for the moment its first kernels take to be queued."""
    from trainbench.telemetry import measured_window

    timed, i = [], 0
    with measured_window(rate_hz=20.0) as seen:
        for _ in range(2):
            torch.cuda.synchronize(device)
            step(i)
            i += 1
        torch.cuda.synchronize(device)
        until, ahead = time.perf_counter() + sustained_s, None
        while time.perf_counter() < until:
            step(i)
            i += 1
            if not streamed:
                torch.cuda.synchronize(device)
                continue
            ended = _mark()
            if ahead is not None:  # (the queue never runs more than a step ahead of the GPU)
                ahead.synchronize()
            ahead = ended
        start = _mark()
        for _ in range(3):
            if not streamed:
                torch.cuda.synchronize(device)
                start = _mark()
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            step(i)
            i += 1
            end = _mark()
            timed.append({"start": start, "end": end, "peak": torch.cuda.max_memory_allocated(device) - base,
                          "base": base, "blocks": marks.taken()})  # fmt: skip
            start = end
        torch.cuda.synchronize(device)
    times = [{"step_s": t["start"].elapsed_time(t["end"]) / 1e3, "peak": t["peak"], "base": t["base"],
              **{key: seconds() for key, seconds in t["blocks"].items()}} for t in timed]  # fmt: skip
    return min(times, key=lambda x: x["step_s"]) | busiest_gpu(seen) | {"steps": i}


def _machine(device: torch.device) -> dict[str, Any]:
    """The GPU (its name, compute capability, total and free memory before the probe) and the host memory free."""
    from trainbench.families.planner import host_available_bytes

    free, total = torch.cuda.mem_get_info(device)
    return {"gpu_name": torch.cuda.get_device_name(device), "gpu_total_bytes": total, "gpu_free_bytes": free,
            "capability": list(torch.cuda.get_device_capability(device)),
            "host_available_bytes": host_available_bytes()}  # fmt: skip


def measure(cfg, bench, streamed: bool = True) -> dict[str, Any]:
    """The probe on this process's GPU (see the module's docstring); ``streamed``: its steps queued back to back
    (:func:`_timed_steps`)."""
    from trainbench.distributed import DistInfo
    from trainbench.train.setup import build_run

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    machine = _machine(device)
    (to_host, to_gpu), device_copy = link_rates(), device_copy_rate()
    pcfg = probe_config(cfg)
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=device)
    run = build_run(pcfg, bench, info, None, synthetic=True)
    blocks, block = pcfg.model.num_layers, run.placed.module.model.layers[1]
    weights, block_weights = torch.cuda.memory_allocated(device), _storages(block)
    marks = _BlockMarks(block, device)
    step = _stepper(run, bench, pcfg, info)
    try:
        last = _timed_steps(step, device, marks, sustained := float(cfg.perf.probe_sustained_s), streamed)
    finally:
        marks.remove()
    to_host_busy, to_gpu_busy = busy_link_rates(lambda: step(last["steps"]), last["step_s"], to_host, to_gpu)
    block_optimizer, other_optimizer = _optimizer_bytes(run, block, last["base"] - weights, blocks)
    return machine | {
        "kept_bytes": marks.kept,
        "input_bytes": marks.input_bytes,
        "block_weight_bytes": block_weights,
        "other_weight_bytes": weights - blocks * block_weights,
        "optimizer_bytes_per_block": block_optimizer,
        "other_optimizer_bytes": other_optimizer,
        "working_bytes": max(0, last["peak"] - blocks * marks.kept),
        "forward_s": last["forward_s"],
        "backward_s": last["backward_s"],
        "head_s": max(0.0, last["step_s"] - blocks * (last["forward_s"] + last["backward_s"])),
        "to_host_bytes_s": to_host,
        "to_gpu_bytes_s": to_gpu,
        "to_host_busy_bytes_s": to_host_busy,
        "to_gpu_busy_bytes_s": to_gpu_busy,
        "device_copy_bytes_s": device_copy,
        "seq": cfg.data.seq_length,
        "micro_batch": cfg.data.micro_batch_size,
        "torch": torch.__version__,
        **{key: last[key] for key in ("sm_clock_mhz", "power_w")},
        **({"sustained_s": sustained, "sustained_steps": last["steps"] - 5} if sustained else {}),
        "streamed": streamed,
        "blocks": blocks,
    }


def busiest_gpu(summary: dict[str, dict]) -> dict[str, Any]:
    """The median SM clock (MHz) and power (W) of the GPU the probe's timed steps kept busiest, from
    telemetry.measured_window's summary; None for each where no sample found it busy (no NVML, or steps too short
    for a sample)."""
    busy = [g for g in summary.values() if g["busy_samples"]]
    if not busy:
        return {"sm_clock_mhz": None, "power_w": None}
    busiest = max(busy, key=lambda g: g["busy_samples"])
    return {"sm_clock_mhz": busiest["sm_clock_mhz"], "power_w": busiest["power_w"]}
