"""Machine telemetry during a run: GPU power, energy, temperatures, clocks, utilisation, memory, throttling.

One background thread per node (started by local rank 0) samples the NVIDIA GPUs that the node's ranks use
(:func:`select_gpus`), and no other, through NVML (`nvidia-ml-py`) at ``rate_hz`` (default 1 Hz, MLPerf Power's
minimum) and appends one row per GPU per sample to ``telemetry_<host>_gpu<i>.csv`` in the run folder, ``i`` being
NVML's index of the GPU. Times are Unix milliseconds, the clock of the MLPerf log, so rows line up with
``run_start``/``run_stop``. Without NVML (no NVIDIA driver, no GPU), and on a CPU run, it samples CPU utilisation
and memory with psutil into ``telemetry_<host>_cpu.csv`` and says that GPU telemetry is absent. A failing sensor is
recorded as empty and never stops a run; what does is a GPU list in the environment that names a GPU the node
lacks, at the start.
"""

from __future__ import annotations

import contextlib
import csv
import os
import platform
import re
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from trainbench.errors import UserError

GPU_FIELDS = (
    "time_ms",
    "gpu",
    "power_w",
    "energy_j",  # the GPU's own energy counter since driver load (Volta and newer), if it has one
    "gpu_temp_c",
    "mem_temp_c",
    "sm_clock_mhz",
    "mem_clock_mhz",
    "gpu_util_pct",
    "mem_util_pct",
    "mem_used_mib",
    "throttle_reasons",
)
CPU_FIELDS = ("time_ms", "cpu_util_pct", "mem_used_mib", "mem_total_mib")


def _now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class NvmlDevice:
    """One GPU as NVML lists it: its index (NVML's order, the PCI bus order), its UUID (``GPU-...``), its minor number
    (the N of /dev/nvidiaN, Slurm's id for it; None where NVML does not give it) and the UUIDs of its MIG devices
    (``MIG-...``; none where MIG is off)."""

    index: int
    uuid: str
    minor: int | None = None
    mig_uuids: tuple[str, ...] = ()


# Where the GPUs a process may use are listed, first match wins. Slurm's lists come first: with per-task GPU binding
# a rank's CUDA_VISIBLE_DEVICES holds its own GPU alone (and under cgroup device confinement it is renumbered from 0),
# while the step's list holds every GPU of the node's ranks, by ids that do not depend on the confinement.
GPU_LISTS = ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES")


def gpu_list_source(env: Mapping[str, str]) -> str | None:
    """The variable of ``env`` that says which GPUs the ranks may use (:data:`GPU_LISTS`), or None where none is set:
    then every GPU NVML lists. An empty CUDA_VISIBLE_DEVICES counts (it hides every GPU); an empty Slurm list does
    not."""
    for var in GPU_LISTS:
        if var in env and (var == "CUDA_VISIBLE_DEVICES" or env[var].strip()):
            return var
    return None


def select_gpus(env: Mapping[str, str], devices: list[NvmlDevice], used: int) -> list[NvmlDevice]:
    """The GPUs that the ``used`` ranks of this node run on, among NVML's ``devices``, in the ranks' order: each rank
    takes the visible device of its local rank (``torch.cuda.set_device``), so the first ``used`` of the visible
    list, a GPU listed twice (two MIG devices of one GPU) once. The visible list is Slurm's (SLURM_STEP_GPUS, else
    SLURM_JOB_GPUS), else CUDA_VISIBLE_DEVICES, else every device. A listed GPU that this host lacks raises
    :class:`UserError`, which names the variable, the entry and what the host has."""
    var = gpu_list_source(env)
    if var is None:
        visible = list(devices)
    elif var == "CUDA_VISIBLE_DEVICES":
        visible = _cuda_visible(env[var], devices)
    else:
        visible = _slurm_gpus(var, env[var], devices)
    chosen = []
    for device in visible[:used]:
        if device not in chosen:
            chosen.append(device)
    return chosen


def _cuda_visible(value: str, devices: list[NvmlDevice]) -> list[NvmlDevice]:
    """CUDA_VISIBLE_DEVICES as CUDA reads it: comma-separated integer indices, GPU UUIDs or MIG device UUIDs (any
    unique prefix of one), whitespace around each allowed; a negative index or an empty entry ends the list. CUDA's
    indices are taken as NVML's: both are the PCI bus order under CUDA_DEVICE_ORDER=PCI_BUS_ID, and CUDA's default
    order (fastest first) is that order too on a node of identical GPUs. A MIG device stands for its GPU: NVML's
    power and energy are the physical GPU's. An entry that is none of these is refused (CUDA would end the list
    there, silently)."""
    where = f"CUDA_VISIBLE_DEVICES={value}"
    visible = []
    for raw in value.split(","):
        entry = raw.strip()
        if not entry:
            break
        if re.fullmatch(r"-?[0-9]+", entry):
            index = int(entry)
            if index < 0:
                break
            if index >= len(devices):
                raise UserError(f"{where} names GPU {index}, but this host has {_count(devices)}")
            visible.append(devices[index])
        elif entry.startswith(("GPU-", "MIG-")):
            matches = [d for d in devices if any(u.startswith(entry) for u in (d.uuid, *d.mig_uuids))]
            if not matches:
                raise UserError(f"{where} names {entry}, which matches none of this host's {_count(devices)}: "
                                f"{', '.join(_short(d.uuid) for d in devices)}")  # fmt: skip
            if len(matches) > 1:
                raise UserError(f"{where} names {entry}, which matches {len(matches)} of this host's "
                                f"{_count(devices)} ({', '.join(d.uuid for d in matches)}); give enough of the UUID "
                                "to tell them apart")  # fmt: skip
            visible.append(matches[0])
        else:
            raise UserError(f"{where} names {entry!r}, which is neither a GPU index nor a GPU or MIG UUID; this host "
                            f"has {_count(devices)}")  # fmt: skip
    return visible


def _slurm_gpus(var: str, value: str, devices: list[NvmlDevice]) -> list[NvmlDevice]:
    """Slurm's list of a job's or step's GPUs on this node: comma-separated ids (``a-b`` ranges too), each a GPU's
    minor number (/dev/nvidiaN) whatever the job's device confinement; NVML's index stands in for a GPU whose minor
    number NVML does not give."""
    by_id = {d.index if d.minor is None else d.minor: d for d in devices}
    ids = _id_list(sorted(by_id))
    visible = []
    for raw in value.split(","):
        entry = raw.strip()
        bounds = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", entry)
        if bounds is None:
            raise UserError(f"{var}={value} names GPU {entry!r}, which is not a GPU id (a number); this host's "
                            f"{_count(devices)} have the ids {ids}")  # fmt: skip
        for gpu in range(int(bounds[1]), int(bounds[2] or bounds[1]) + 1):
            if gpu not in by_id:
                raise UserError(f"{var}={value} names GPU {gpu}, but this host's {_count(devices)} have the ids {ids} "
                                "(their /dev/nvidiaN numbers)")  # fmt: skip
            visible.append(by_id[gpu])
    return visible


def _count(devices: list[NvmlDevice]) -> str:
    """'4 GPUs (0-3)': how many GPUs NVML lists, and their indices."""
    if not devices:
        return "no GPU"
    return f"{len(devices)} GPU{'s' if len(devices) > 1 else ''} ({_id_list([d.index for d in devices])})"


def _id_list(ids: list[int]) -> str:
    """'0-3' for a run of ids, else '0, 2, 5'."""
    if len(ids) > 2 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    return ", ".join(map(str, ids))


def _short(uuid: str) -> str:
    """A UUID's first group (``GPU-1234abcd``): enough to tell a host's GPUs apart."""
    return "-".join(uuid.split("-")[:2])


def _text(value) -> str:
    return value if isinstance(value, str) else value.decode()


def nvml_devices(nv) -> list[NvmlDevice]:
    """Every GPU that NVML (the ``pynvml`` module ``nv``, initialised) lists, in its index order."""
    devices = []
    for index in range(nv.nvmlDeviceGetCount()):
        handle = nv.nvmlDeviceGetHandleByIndex(index)
        migs = []
        for i in range(_try(nv.nvmlDeviceGetMaxMigDeviceCount, handle) or 0):
            mig = _try(nv.nvmlDeviceGetMigDeviceHandleByIndex, handle, i)  # fails for a slot with no MIG device
            uuid = None if mig is None else _try(nv.nvmlDeviceGetUUID, mig)
            if uuid is not None:
                migs.append(_text(uuid))
        minor = _try(nv.nvmlDeviceGetMinorNumber, handle)
        devices.append(NvmlDevice(index, _text(nv.nvmlDeviceGetUUID(handle)), minor, tuple(migs)))
    return devices


def sampled_note(chosen: list[NvmlDevice], count: int, env: Mapping[str, str], used: int) -> str:
    """What the sampler records and why those GPUs: the console's line at the start of a run."""
    source = gpu_list_source(env)
    names = ", ".join(f"{d.index} ({_short(d.uuid)})" for d in chosen)
    ranks = f"{used} rank{'s' if used > 1 else ''} on this node"
    if source is None:
        why = f"taken in NVML's order for {ranks} (none of {', '.join(GPU_LISTS)} is set)"
    else:
        why = f"chosen by {source}={env[source]} for {ranks}"
    note = f"GPU telemetry through NVML: GPU{'s' if len(chosen) > 1 else ''} {names} of this host's {count}, {why}"
    for d in chosen:
        if d.mig_uuids:
            note += f"; GPU {d.index} is shared by its MIG devices: its power and energy are the whole GPU's"
    return note


class Sampler:
    """Background sampler; ``start()``, then ``stop()`` (idempotent). ``note`` says what is recorded.

    ``gpus_used`` is how many GPUs this node's ranks run on (one per rank; 0 for a CPU run, which records CPU and
    memory): those GPUs are found in ``env`` (:func:`select_gpus`) and sampled, and no other, so that power drawn by
    other work on the host does not count as the run's."""

    def __init__(self, run_dir: Path, rate_hz: float = 1.0, host: str | None = None, *, gpus_used: int,
                 env: Mapping[str, str] | None = None):  # fmt: skip
        if not 0 < rate_hz <= 100:
            raise ValueError(f"telemetry rate must be in (0, 100] Hz, got {rate_hz}")
        self.run_dir = Path(run_dir)
        self.period = 1.0 / rate_hz
        self.host = host or socket.gethostname().split(".")[0]
        self.gpus_used = gpus_used
        self.env = os.environ if env is None else env
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml = None
        self._handles: list = []  # (NVML index, handle) of each GPU sampled
        self._files: list = []
        self._writers: list = []
        self.note = ""
        self.samples = 0

    # -- set-up ------------------------------------------------------------------------------------------
    def _open_gpu(self) -> bool:
        """Open the GPUs the ranks use; False (and a note why) where there are none to sample. A GPU list that names
        a GPU this host lacks raises UserError: the run stops before training, in one sentence."""
        if self.gpus_used == 0:
            self.note = "GPU telemetry off (a CPU run); recording CPU and memory"
            return False
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as exc:  # no driver, no library
            self.note = f"GPU telemetry absent ({type(exc).__name__}: {exc}); recording CPU and memory"
            return False
        try:
            devices = nvml_devices(pynvml)
            chosen = select_gpus(self.env, devices, self.gpus_used)
            self._handles = [(d.index, pynvml.nvmlDeviceGetHandleByIndex(d.index)) for d in chosen]
        except Exception as exc:
            _try(pynvml.nvmlShutdown)
            if isinstance(exc, UserError):
                raise
            self.note = f"GPU telemetry absent ({type(exc).__name__}: {exc}); recording CPU and memory"
            return False
        if not chosen:
            _try(pynvml.nvmlShutdown)
            source = gpu_list_source(self.env)
            why = "NVML sees no GPU" if not devices else f"{source}={self.env[source]} leaves no GPU visible"
            self.note = f"GPU telemetry absent ({why}); recording CPU and memory"
            return False
        self._nvml = pynvml
        for d in chosen:
            self._add_writer(self.run_dir / f"telemetry_{self.host}_gpu{d.index}.csv", GPU_FIELDS)
        self.note = sampled_note(chosen, len(devices), self.env, self.gpus_used)
        return True

    def _add_writer(self, path: Path, fields) -> None:
        new = not path.exists()
        f = open(path, "a", newline="")
        writer = csv.writer(f)
        if new:
            writer.writerow(fields)
        self._files.append(f)
        self._writers.append(writer)

    def start(self) -> Sampler:
        if not self._open_gpu():
            self._add_writer(self.run_dir / f"telemetry_{self.host}_cpu.csv", CPU_FIELDS)
        self._sample()  # one row at once: a run shorter than the period still has one
        self._thread = threading.Thread(target=self._loop, name="telemetry", daemon=True)
        self._thread.start()
        return self

    # -- sampling ------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        next_time = time.monotonic() + self.period
        while not self._stop.wait(max(0.0, next_time - time.monotonic())):
            self._sample()
            next_time += self.period
            if next_time < time.monotonic():  # fell behind (a long stall): do not burst to catch up
                next_time = time.monotonic() + self.period

    def _sample(self) -> None:
        stamp = _now_ms()
        try:
            if self._nvml is not None:
                for writer, (index, handle) in zip(self._writers, self._handles, strict=True):
                    writer.writerow(self._gpu_row(stamp, index, handle))
            else:
                self._writers[0].writerow(self._cpu_row(stamp))
            for f in self._files:
                f.flush()
            self.samples += 1
        except Exception as exc:  # never let telemetry stop training
            self.note += f"; a sample failed ({type(exc).__name__}: {exc})"

    def _gpu_row(self, stamp: int, index: int, h) -> list:
        nv = self._nvml

        def read(fn, *args, scale=None):
            try:
                value = fn(h, *args)
            except Exception:
                return ""
            return value if scale is None else round(value * scale, 3)

        util = _try(lambda: nv.nvmlDeviceGetUtilizationRates(h))
        memory = _try(lambda: nv.nvmlDeviceGetMemoryInfo(h))
        return [
            stamp,
            index,
            read(nv.nvmlDeviceGetPowerUsage, scale=1e-3),  # mW -> W
            read(nv.nvmlDeviceGetTotalEnergyConsumption, scale=1e-3),  # mJ -> J
            read(nv.nvmlDeviceGetTemperature, nv.NVML_TEMPERATURE_GPU),
            _memory_temperature(nv, h),
            read(nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_SM),
            read(nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_MEM),
            "" if util is None else util.gpu,
            "" if util is None else util.memory,
            "" if memory is None else round(memory.used / 2**20, 1),
            read(nv.nvmlDeviceGetCurrentClocksThrottleReasons),
        ]

    def _cpu_row(self, stamp: int) -> list:
        import psutil

        memory = psutil.virtual_memory()
        return [stamp, psutil.cpu_percent(interval=None), round(memory.used / 2**20, 1), round(memory.total / 2**20)]

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None
            self._sample()  # a last row at the end: the window is covered on both sides
        for f in self._files:
            f.close()
        self._files, self._writers = [], []
        if self._nvml is not None:
            _try(self._nvml.nvmlShutdown)
            self._nvml = None


def _try(fn, *args):
    """``fn(*args)``, or None where it raises (a query the GPU or driver does not support)."""
    try:
        return fn(*args)
    except Exception:
        return None


def _memory_temperature(nv, handle):
    """HBM temperature where NVML exposes it (a field value), else empty."""
    field_id = getattr(nv, "NVML_FI_DEV_MEMORY_TEMP", None)
    if field_id is None:
        return ""
    values = _try(lambda: nv.nvmlDeviceGetFieldValues(handle, [field_id]))
    if not values or getattr(values[0], "nvmlReturn", 1) != 0:
        return ""
    value = values[0].value
    return getattr(value, "uiVal", getattr(value, "ullVal", ""))


# -- energy ------------------------------------------------------------------------------------------------


@dataclass
class Energy:
    joules: float
    method: str  # "counter" (the GPU's energy counter) or "power" (integrated power samples)


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def integrate_power(times_ms: list[float], watts: list[float], start_ms: float, stop_ms: float) -> float:
    """Energy in joules over [start_ms, stop_ms] from power samples: the trapezoid rule, with the power
    at the window's edges interpolated linearly (held constant beyond the first and last samples)."""
    points = sorted(zip(times_ms, watts, strict=True))
    if not points or stop_ms <= start_ms:
        return 0.0

    def power_at(t: float) -> float:
        if t <= points[0][0]:
            return points[0][1]
        if t >= points[-1][0]:
            return points[-1][1]
        for (t0, p0), (t1, p1) in zip(points, points[1:], strict=False):
            if t0 <= t <= t1:
                return p0 if t1 == t0 else p0 + (p1 - p0) * (t - t0) / (t1 - t0)
        return points[-1][1]

    inside = [(t, p) for t, p in points if start_ms < t < stop_ms]
    trace = [(start_ms, power_at(start_ms)), *inside, (stop_ms, power_at(stop_ms))]
    return sum((t1 - t0) / 1000 * (p0 + p1) / 2 for (t0, p0), (t1, p1) in zip(trace, trace[1:], strict=False))


def gpu_energy(path: Path, start_ms: float, stop_ms: float) -> Energy | None:
    """One GPU's energy between run_start and run_stop, from its telemetry file (:func:`rows_energy`)."""
    return rows_energy(read_csv(path), start_ms, stop_ms)


def rows_energy(rows: list[dict], start_ms: float, stop_ms: float) -> Energy | None:
    """One GPU's energy over [start_ms, stop_ms] from its telemetry rows: from its energy counter when both ends are
    covered by samples that have it (interpolated to the exact times), else from its power samples."""
    rows = [r for r in rows if r.get("time_ms")]
    if not rows:
        return None
    counter = [(float(r["time_ms"]), float(r["energy_j"])) for r in rows if r.get("energy_j") not in (None, "")]
    if len(counter) >= 2 and counter[0][0] <= start_ms and counter[-1][0] >= stop_ms:
        times = [t for t, _ in counter]
        values = [e for _, e in counter]

        def at(t):
            for (t0, e0), (t1, e1) in zip(counter, counter[1:], strict=False):
                if t0 <= t <= t1:
                    return e0 if t1 == t0 else e0 + (e1 - e0) * (t - t0) / (t1 - t0)
            return values[-1] if t >= times[-1] else values[0]

        return Energy(at(stop_ms) - at(start_ms), "counter")
    power = [(float(r["time_ms"]), float(r["power_w"])) for r in rows if r.get("power_w") not in (None, "")]
    if not power:
        return None
    return Energy(integrate_power([t for t, _ in power], [p for _, p in power], start_ms, stop_ms), "power")


def run_energy(run_dir: Path, start_ms: float, stop_ms: float) -> dict | None:
    """Energy to train of every GPU telemetry file in the run folder, and the total."""
    per_gpu = {}
    for path in sorted(Path(run_dir).glob("telemetry_*_gpu*.csv")):
        energy = gpu_energy(path, start_ms, stop_ms)
        if energy is not None:
            per_gpu[path.stem.removeprefix("telemetry_")] = {"joules": round(energy.joules, 3), "method": energy.method}
    if not per_gpu:
        return None
    total = sum(e["joules"] for e in per_gpu.values())
    return {"total_joules": round(total, 3), "total_kwh": total / 3.6e6, "per_gpu": per_gpu}


# -- what the machine is -----------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory_gb() -> str:
    try:
        kb = int(
            next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal")).split()[1]
        )
        return f"{kb / 2**20:.0f} GB"
    except (OSError, StopIteration, ValueError):
        return "unknown"


def gpus() -> tuple[int, str, str, str]:
    """(count, model, memory, ids) of this machine's NVIDIA GPUs, the ids each GPU by the first group of its UUID in
    NVML's order (``GPU-1234abcd, GPU-...``: what tells two machines of one name and kind apart, a fleet's hosts
    often all called the same); (0, "", "", "") without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        if n == 0:
            return 0, "", "", ""
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(h)
        memory = pynvml.nvmlDeviceGetMemoryInfo(h).total / 2**30
        ids = ", ".join(_short(d.uuid) for d in nvml_devices(pynvml))
        pynvml.nvmlShutdown()
        return n, name if isinstance(name, str) else name.decode(), f"{memory:.0f} GB", ids
    except Exception:
        return 0, "", "", ""


def active_nvlinks(nv, handle) -> int | None:
    """How many of a GPU's NVLinks are up, through NVML (the ``pynvml`` module ``nv``, initialised): 0 for a GPU with
    none (PCIe alone; NVML refuses the query), None where this NVML cannot be asked."""
    state = getattr(nv, "nvmlDeviceGetNvLinkState", None)
    if state is None:
        return None
    up = 0
    for link in range(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)):
        if _try(state, handle, link) == getattr(nv, "NVML_FEATURE_ENABLED", 1):
            up += 1
    return up


def gpu_links() -> str | None:
    """How this host's GPUs reach each other, by their active NVLinks (``18 active NVLinks on each of 2 GPUs``, or
    ``no active NVLink (PCIe between GPUs)``): two machines of one kind whose pairs scale differently may differ here.
    None with fewer than 2 GPUs or without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            counts = [active_nvlinks(pynvml, pynvml.nvmlDeviceGetHandleByIndex(i))
                      for i in range(pynvml.nvmlDeviceGetCount())]  # fmt: skip
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None
    if len(counts) < 2 or None in counts:
        return None
    if len(set(counts)) > 1:
        return f"active NVLinks by GPU: {', '.join(str(c) for c in counts)}"
    if counts[0] == 0:
        return f"no active NVLink on its {len(counts)} GPUs (PCIe between GPUs)"
    return f"{counts[0]} active NVLinks on each of {len(counts)} GPUs"


def driver_version() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        pynvml.nvmlShutdown()
        return version if isinstance(version, str) else version.decode()
    except Exception:
        return ""


def machine(links: bool = False) -> dict[str, str]:
    """What a run ran on, for its outcome file and the report: CPU, memory, GPUs (their ids and, with ``links``,
    ``output.gpu_links``, how they are linked) and driver, torch, Python, and the trainbench that ran it."""
    import torch

    from trainbench.version import provenance

    count, gpu, gpu_memory, ids = gpus()
    return {
        "host": socket.gethostname(),
        "cpu": f"{cpu_model()} ({os.cpu_count()} logical cores)",
        "memory": memory_gb(),
        "gpus": f"{count} x {gpu} ({gpu_memory})" if count else "none",
        **({"gpu_ids": ids} if ids else {}),  # which GPUs: machines of one name differ
        **({"gpu_links": said} if links and (said := gpu_links()) else {}),  # and how they reach each other
        "driver": driver_version() or "-",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "trainbench": provenance(),  # {version, commit}, as the run files record it
        "executable": sys.executable,  # which installation ran: a container's image, a venv
    }


# -- a measured window ---------------------------------------------------------------------------------------


def throttle_names(mask: int) -> list[str]:
    """The names of the clock event (throttle) reasons set in NVML's bit mask, by nvidia-ml-py's own constants
    (``nvmlClocksThrottleReasonSwPowerCap`` is 0x4: "SwPowerCap"); bits it does not name as ``0x...``."""
    import pynvml

    prefix = "nvmlClocksThrottleReason"
    named = {
        value: name.removeprefix(prefix)
        for name, value in sorted(vars(pynvml).items())
        if name.startswith(prefix) and name.removeprefix(prefix) not in ("All", "None", "UserDefinedClocks")
    }
    names = [named[bit] for bit in sorted(named) if mask & bit]
    rest = mask & ~sum(named)
    return names + ([hex(rest)] if rest else [])


def window_summary(run_dir: Path, start_ms: float, stop_ms: float, busy_pct: float = 50) -> dict[str, dict]:
    """Each sampled GPU's telemetry over [start_ms, stop_ms]: the median power and SM clock of its busy samples
    (utilisation >= ``busy_pct``; None where none was, as in a window shorter than the sampling's period), the
    throttle reasons seen in any sample, and its energy over the window. Every GPU sampled has its entry, busy or not:
    the window's energy is that of all of them (a GPU left out would leave its energy out of the run's)."""
    out = {}
    for path in sorted(Path(run_dir).glob("telemetry_*_gpu*.csv")):
        every_row = read_csv(path)  # the energy interpolates from the samples on either side of the window
        rows = [r for r in every_row if r.get("time_ms") and start_ms <= float(r["time_ms"]) <= stop_ms]
        busy = [r for r in rows if r["gpu_util_pct"] and float(r["gpu_util_pct"]) >= busy_pct]
        masks = {int(r["throttle_reasons"]) for r in rows if r["throttle_reasons"] not in ("", None)}
        energy = rows_energy(every_row, start_ms, stop_ms)
        out[path.stem.removeprefix("telemetry_")] = {
            "busy_samples": len(busy),
            "power_w": statistics.median(float(r["power_w"]) for r in busy) if busy else None,
            "sm_clock_mhz": statistics.median(float(r["sm_clock_mhz"]) for r in busy) if busy else None,
            "throttle_reasons": sorted({name for m in masks for name in throttle_names(m)}),
            "energy_j": None if energy is None else round(energy.joules, 3),
        }
    return out


@contextlib.contextmanager
def measured_window(folder: Path | None = None, rate_hz: float = 10.0, gpus_used: int = 1) -> Iterator[dict]:
    """Sample the first ``gpus_used`` GPUs this process sees (:class:`Sampler`; one: the ``cuda:0`` of a process on one
    GPU) into ``folder`` (a temporary one, removed after, where none is given) while the block runs; the dict it
    yields is filled, on leaving, with :func:`window_summary` of the block's time (GPU name -> power, SM clock,
    throttle reasons, energy)."""
    with contextlib.ExitStack() as stack:
        if folder is None:
            folder = stack.enter_context(tempfile.TemporaryDirectory())
        sampler = Sampler(Path(folder), rate_hz, gpus_used=gpus_used).start()
        start = _now_ms()
        summary: dict = {}
        try:
            yield summary
        finally:
            stop = _now_ms()
            sampler.stop()
            summary.update(window_summary(Path(folder), start, stop))
