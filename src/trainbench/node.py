"""What a compute node is, and what a run does to it before it starts.

Local rank 0 of each node of a run writes ``node_<host>.json`` into the run folder, beside the telemetry: the CPUs
(model, sockets, cores, threads), memory, GPUs, driver, operating system and software versions, and the node's
topology: ``nvidia-smi topo -m`` (how the GPUs and NICs are linked) and the network interfaces of
/sys/class/net and /sys/class/infiniband. A tool or file that is missing is recorded as missing, never a reason
to stop the run. ``trainbench package`` builds the submission's system description from these records, not from
the machine it runs on.

Before each run the page cache is dropped where the process may (:func:`drop_page_cache`: root writes 3 to
/proc/sys/vm/drop_caches after a sync), as MLPerf's reference scripts do, so a run does not read its data from
memory an earlier run left behind; the MLPerf log's ``cache_clear`` says whether it was.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from trainbench.version import provenance

DROP_CACHES = Path("/proc/sys/vm/drop_caches")
# "0" in the environment: leave the page cache as it is (a shared workstation, a test suite); the log says so.
NO_CACHE_CLEAR_ENV = "TRAINBENCH_CACHE_CLEAR"
# Set by a Slurm job script that ran the system file's cache_clear_command on every node: that command's exit code.
SITE_CACHE_CLEAR_ENV = "TRAINBENCH_CACHE_CLEAR_RC"
NOT_ROOT = "not root and no cache_clear_command in the system file"


@dataclass(frozen=True)
class CacheClear:
    """Whether this node's page cache was dropped before the run, and the console's words for it."""

    dropped: bool
    how: str

    @property
    def line(self) -> str:
        return f"page cache dropped ({self.how})" if self.dropped else f"page cache not dropped: {self.how}"


def drop_page_cache(path: Path | None = None, env: dict | None = None) -> CacheClear:
    """Drop this node's page cache (clean pages: written data is synced first) where the process may: a Slurm job's
    site command already ran (its exit code in the environment), or this process is root and the kernel's file
    takes the write. Never raises: what stopped it is in ``how``."""
    env = os.environ if env is None else env
    path = DROP_CACHES if path is None else path
    site = env.get(SITE_CACHE_CLEAR_ENV)
    if site is not None:
        if site.strip() == "0":
            return CacheClear(True, "by the system file's cache_clear_command, on every node")
        return CacheClear(False, f"the system file's cache_clear_command exited with {site.strip() or '?'}")
    if env.get(NO_CACHE_CLEAR_ENV, "").strip() == "0":
        return CacheClear(False, f"{NO_CACHE_CLEAR_ENV}=0 in the environment")
    if os.geteuid() != 0:
        return CacheClear(False, NOT_ROOT)
    try:
        os.sync()
        with open(path, "w") as f:
            f.write("3\n")
    except OSError as exc:
        return CacheClear(False, f"root, but {path} refused the write ({exc.strerror or exc})")
    return CacheClear(True, f"3 written to {path}")


# -- what the node is ---------------------------------------------------------------------------------------------


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def cpus() -> dict:
    """The CPU model, sockets, physical cores and logical CPUs, from sysfs (any architecture) and /proc/cpuinfo."""
    model = None
    for line in (_read(Path("/proc/cpuinfo")) or "").splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model Name", "cpu model") and value.strip():
            model = value.strip()
            break
    packages, cores, logical = set(), set(), 0
    for topo in sorted(Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology")):
        package, core = _read(topo / "physical_package_id"), _read(topo / "core_id")
        logical += 1
        if package is not None and core is not None:
            packages.add(package)
            cores.add((package, core))
    logical = logical or os.cpu_count() or 0
    return {
        "model": model or platform.processor() or None,
        "sockets": len(packages) or None,
        "cores_per_socket": len(cores) // len(packages) if packages else None,
        "logical_cpus": logical or None,
        "numa_nodes": len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) or None,
    }


def memory_bytes() -> int | None:
    for line in (_read(Path("/proc/meminfo")) or "").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return None


def nvidia_gpus() -> dict:
    """Each NVIDIA GPU's name and memory, the driver and its CUDA version, through NVML; ``gpus_missing`` says why
    there are none."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # no library, no driver, no GPU: the record says which
        return {"gpus": [], "driver": None, "cuda_driver": None, "gpus_missing": f"NVML: {exc}"}
    try:
        text = lambda v: v.decode() if isinstance(v, bytes) else str(v)  # noqa: E731
        found = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            found.append({"name": text(pynvml.nvmlDeviceGetName(h)),
                          "memory_mib": pynvml.nvmlDeviceGetMemoryInfo(h).total // 2**20})  # fmt: skip
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()
        return {"gpus": found, "driver": text(pynvml.nvmlSystemGetDriverVersion()),
                "cuda_driver": f"{cuda // 1000}.{cuda % 1000 // 10}", "gpus_missing": None}  # fmt: skip
    except Exception as exc:
        return {"gpus": [], "driver": None, "cuda_driver": None, "gpus_missing": f"NVML: {exc}"}
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def gpu_topology(timeout_s: float = 60) -> dict:
    """``nvidia-smi topo -m`` as it printed it (GPU-to-GPU and GPU-to-NIC links, CPU and NUMA affinity), or why not."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return {"text": None, "missing": "nvidia-smi not found on PATH"}
    try:
        proc = subprocess.run([tool, "topo", "-m"], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError) as exc:
        return {"text": None, "missing": f"nvidia-smi topo -m did not run: {exc}"}
    if proc.returncode != 0:
        said = (proc.stderr or proc.stdout).strip().splitlines()
        return {"text": None, "missing": f"nvidia-smi topo -m exited with {proc.returncode}: {said[0] if said else ''}"}
    return {"text": proc.stdout, "missing": None}


def network_interfaces(root: Path = Path("/sys/class/net")) -> list[dict]:
    """Each interface of /sys/class/net: whether it is a device (virtual ones, bridges, veth, lo, have none), its
    state, speed (Mb/s; None where the driver does not say), MTU and driver."""
    out = []
    for dev in sorted(root.glob("*")) if root.is_dir() else []:
        speed = _read(dev / "speed")
        driver = dev / "device" / "driver"
        out.append({
            "name": dev.name,
            "device": (dev / "device").exists(),
            "state": _read(dev / "operstate"),
            "speed_mbps": int(speed) if speed and speed.lstrip("-").isdigit() and int(speed) > 0 else None,
            "mtu": int(m) if (m := _read(dev / "mtu")) and m.isdigit() else None,
            "driver": driver.resolve().name if driver.exists() else None,
        })  # fmt: skip
    return out


def infiniband(root: Path = Path("/sys/class/infiniband")) -> list[dict]:
    """Each port of each RDMA device of /sys/class/infiniband: its state, rate and link layer (InfiniBand or
    Ethernet for RoCE), and the device's board and firmware."""
    out = []
    for dev in sorted(root.glob("*")) if root.is_dir() else []:
        for port in sorted((dev / "ports").glob("*")):
            out.append({
                "device": dev.name,
                "port": port.name,
                "state": _read(port / "state"),
                "rate": _read(port / "rate"),
                "link_layer": _read(port / "link_layer"),
                "board": _read(dev / "board_id"),
                "firmware": _read(dev / "fw_ver"),
            })  # fmt: skip
    return out


def operating_system() -> str:
    pretty = None
    for line in (_read(Path("/etc/os-release")) or "").splitlines():
        if line.startswith("PRETTY_NAME="):
            pretty = line.split("=", 1)[1].strip().strip('"')
    return f"{pretty or platform.system()}, kernel {platform.release()}"


def node_record() -> dict:
    """What this node is: host, CPUs, memory, GPUs, driver, OS, software and topology (see the module's text)."""
    import torch

    gpus = nvidia_gpus()
    return {
        "host": socket.gethostname(),
        "cpu": cpus(),
        "memory_bytes": memory_bytes(),
        **gpus,
        "os": operating_system(),
        "software": {
            "trainbench": provenance(),
            "torch": torch.__version__,
            "cuda_toolkit": torch.version.cuda,
            "python": platform.python_version(),
            "executable": sys.executable,
        },  # fmt: skip
        "gpu_topology": gpu_topology(),
        "network": network_interfaces(),
        "infiniband": infiniband(),
    }


NODE_RECORD = "node_{host}.json"


def write_node_record(run_dir: Path) -> Path:
    """This node's record in the run folder (written beside, then renamed: a reader never sees half of it)."""
    record = node_record()
    path = Path(run_dir) / NODE_RECORD.format(host=re.sub(r"[^A-Za-z0-9_.-]", "_", record["host"]))
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def read_node_records(run_dir: Path) -> list[dict]:
    """The node records of a run folder, by host name; one that is not whole JSON is left out."""
    found = []
    for path in sorted(Path(run_dir).glob(NODE_RECORD.format(host="*"))):
        try:
            value = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(value, dict):
            found.append(value)
    return found
