"""System files: one YAML per machine (nodes, GPUs, CPUs and NUMA layout, partition, container, env).

They replace per-system shell configs such as ``config_DGXH100_1x8x48x1.sh``. A system is found by
name in ``./systems/`` and then among the ones shipped with trainbench, or given as a path.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml

from trainbench.config import has_control_character, is_plain_name, read_yaml_file
from trainbench.errors import ConfigError, UserError

RUNTIMES = ("pyxis", "apptainer", "podman")
IMAGE_PYTHON = "/opt/trainbench/venv/bin/python"  # where the project's Containerfile installs trainbench


@dataclass
class Container:
    """How each rank's process starts inside a container: ``runtime`` pyxis (srun --container-image, an enroot
    squashfs or a registry image), apptainer (``apptainer exec`` of a SIF) or podman (``podman run``; podman-hpc
    takes the same flags, ``runtime_command: podman-hpc``). ``mounts`` are ``HOST:CONTAINER`` pairs; the run's
    folder and the config's data and weights paths are added at the paths they have on the host."""

    runtime: str = "pyxis"
    image: str = ""
    mounts: list[str] = field(default_factory=list)
    python: str = IMAGE_PYTHON
    runtime_command: str | None = None  # the runtime's executable, where it is not the runtime's name


@dataclass
class System:
    name: str
    description: str = ""
    nodes: int = 1
    gpus_per_node: int = 0  # 0: a CPU system, tasks_per_node ranks per node
    tasks_per_node: int | None = None  # default: gpus_per_node
    cpus_per_node: int | None = None  # logical CPUs a node has (nproc); checked on the node
    numa: list[str] = field(default_factory=list)  # CPU list per NUMA node, e.g. ["0-55,112-167", "56-111,168-223"]
    gpu_numa: list[int] = field(default_factory=list)  # NUMA node of each GPU (by local rank)
    partition: str | None = None
    account: str | None = None
    time: str = "01:00:00"
    exclusive: bool = False
    gres: str | None = None  # default gpu:<gpus_per_node> when the system has GPUs
    mpi: str = "pmi2"
    cpu_bind: str | None = "none"  # srun --cpu-bind (ranks pin themselves from the NUMA map); null: leave it out
    container: Container | None = None
    env: dict[str, str] = field(default_factory=dict)
    device: str = "cuda"
    # More #SBATCH options, each one long option: ["--qos=high", "--constraint=h100", "--reservation=mlperf"]
    sbatch_options: list[str] = field(default_factory=list)
    array_parallel: int = 1  # runs of a --nexp job array that may run at once (--array=0-9%1: one after another)
    # A command that drops the page cache, run on every node (outside any container) before each run, e.g.
    # "sudo /usr/local/sbin/drop_caches"; without one a rank running as root drops it itself.
    cache_clear_command: str | None = None
    path: str = ""

    @property
    def ranks_per_node(self) -> int:
        return self.tasks_per_node or self.gpus_per_node or 1

    @property
    def srun_gres(self) -> str | None:
        if self.gres:
            return self.gres
        return f"gpu:{self.gpus_per_node}" if self.gpus_per_node else None

    def cpu_map(self) -> list[str]:
        """CPU list of each local rank: a GPU's NUMA node's CPUs, split evenly among the GPUs on that node."""
        if not self.numa:
            return []
        ranks = self.ranks_per_node
        owner = self.gpu_numa or [r * len(self.numa) // ranks for r in range(ranks)]
        out = []
        for rank in range(ranks):
            node = owner[rank]
            peers = [r for r in range(ranks) if owner[r] == node]
            k, n = peers.index(rank), len(peers)
            mine: list[int] = []
            for part in str(self.numa[node]).split(","):  # each range (cores, their hyperthreads) split evenly
                cpus = sorted(parse_cpus(part))
                mine += cpus[k * len(cpus) // n : (k + 1) * len(cpus) // n]
            out.append(format_cpus(mine))
        return out

    def validate(self) -> None:
        where = f"system {self.name} ({self.path})"
        for name, value in _strings(dataclasses.asdict(self)):
            if has_control_character(value):
                raise ConfigError(f"{where}: {name} holds a control character ({value!r}); it would reach the job "
                                  "script, where a line break starts a command")  # fmt: skip
        for i, option in enumerate(self.sbatch_options):
            _check_sbatch_option(where, i, option, self.exclusive)
        if self.array_parallel < 1:
            raise ConfigError(f"{where}: array_parallel must be at least 1 (runs of a job array at once), got "
                              f"{self.array_parallel}")  # fmt: skip
        if self.cache_clear_command is not None and not self.cache_clear_command.strip():
            raise ConfigError(f"{where}: cache_clear_command is empty; give the command, or leave the key out")
        if self.nodes < 1 or self.ranks_per_node < 1:
            raise ConfigError(f"{where}: nodes and GPUs/tasks per node must be at least 1")
        if not re.fullmatch(r"(\d+-)?\d{1,3}:\d\d:\d\d", self.time):
            raise ConfigError(f"{where}: time must be HH:MM:SS or D-HH:MM:SS, got {self.time!r}")
        if self.mpi not in ("pmi2", "pmix", "none"):
            raise ConfigError(f"{where}: mpi must be pmi2, pmix or none, got {self.mpi!r}")
        if self.device not in ("cuda", "cpu"):
            raise ConfigError(f"{where}: device must be cuda or cpu, got {self.device!r}")
        if self.container is not None:
            c = self.container
            if c.runtime not in RUNTIMES:
                raise ConfigError(f"{where}: container.runtime must be one of {', '.join(RUNTIMES)}, got {c.runtime!r}")
            if not c.image:
                raise ConfigError(f"{where}: container.image is empty (an image name, or a .sqsh/.sif file)")
            for m in c.mounts:
                host, sep, inside = m.partition(":")
                if not sep or not host.startswith("/") or not inside.startswith("/"):
                    raise ConfigError(f"{where}: container mount {m!r} is not HOST:CONTAINER with absolute paths")
        if self.gpu_numa and (len(self.gpu_numa) != self.ranks_per_node or max(self.gpu_numa) >= len(self.numa)):
            raise ConfigError(f"{where}: gpu_numa needs one NUMA index (< {len(self.numa)}) per GPU")
        for i, cpus in enumerate(self.numa):
            try:
                found = parse_cpus(cpus)
            except ValueError:
                raise ConfigError(f"{where}: numa[{i}] = {cpus!r} is not a CPU list like 0-55,112-167") from None
            if self.cpus_per_node is not None and max(found) >= self.cpus_per_node:
                raise ConfigError(
                    f"{where}: numa[{i}] names CPU {max(found)} but cpus_per_node is {self.cpus_per_node}"
                )

    def naming(self, global_batch: int, micro_batch: int) -> str:
        """NVIDIA's NODESxGPUSxBATCHxACCUMULATION name of this layout, e.g. 1x8x48x2."""
        world = self.nodes * self.ranks_per_node
        per_rank, rest = divmod(global_batch, world)
        if rest or per_rank % micro_batch:
            raise ConfigError(
                f"global batch {global_batch} does not split over {world} ranks ({self.nodes} nodes x "
                f"{self.ranks_per_node}) in micro-batches of {micro_batch}; change data.global_batch_size, "
                "data.micro_batch_size or --nodes"
            )
        return f"{self.nodes}x{self.ranks_per_node}x{micro_batch}x{per_rank // micro_batch}"


# What an sbatch option of the system file may be: one long option, its value of characters no shell or #SBATCH
# parser reads as anything but text.
SBATCH_OPTION = re.compile(r"--[a-z][a-z0-9-]*(=[A-Za-z0-9_.,:@%+=/\[\]-]+)?")
# The options trainbench writes itself, with the system file's key that sets each; and those sbatch takes only on
# its command line.
OWN_SBATCH_OPTIONS = {"--job-name": "name", "--nodes": "nodes", "--ntasks-per-node": "tasks_per_node",
                      "--ntasks": "tasks_per_node", "--time": "time", "--output": "the results folder",
                      "--error": "the results folder", "--requeue": "the job script", "--signal": "the job script",
                      "--gpus-per-node": "gpus_per_node", "--partition": "partition", "--account": "account",
                      "--exclusive": "exclusive", "--array": "array_parallel and --nexp",
                      "--dependency": "--chain", "--wrap": "the job script", "--parsable": "submit",
                      "--wait": "submit"}  # fmt: skip


def _check_sbatch_option(where: str, i: int, option, exclusive: bool) -> None:
    """One of the system file's ``sbatch_options``: a string that is one long option, which trainbench does not
    write itself; else one sentence naming it."""
    name = f"sbatch_options[{i}]"
    if not isinstance(option, str):
        raise ConfigError(f"{where}: {name} should be a string such as --qos=high, got {option!r}")
    if not SBATCH_OPTION.fullmatch(option):
        raise ConfigError(f"{where}: {name} {option!r} is not one long sbatch option (--name or --name=value, the "
                          "value of letters, digits and _.,:@%+=/[]-): a space, a line break, '#', a quote or a "
                          "shell character cannot go into a #SBATCH line")  # fmt: skip
    flag = option.partition("=")[0]
    if flag in OWN_SBATCH_OPTIONS:
        raise ConfigError(f"{where}: {name} sets {flag}, which trainbench writes from {OWN_SBATCH_OPTIONS[flag]}; "
                          "set it there")  # fmt: skip
    if flag in ("--mem", "--mem-per-cpu", "--mem-per-gpu") and exclusive:
        raise ConfigError(f"{where}: {name} sets {flag}, but an exclusive job asks for all of each node's memory "
                          "(--mem=0); leave it out, or set exclusive: false")  # fmt: skip


_KINDS = {
    "nodes": int,
    "gpus_per_node": int,
    "tasks_per_node": int,
    "cpus_per_node": int,
    "numa": list,
    "gpu_numa": list,
    "container": dict,
    "env": dict,
    "exclusive": bool,
    "time": str,
    "sbatch_options": list,
    "array_parallel": int,
    "cache_clear_command": str,
}


def format_cpus(cpus) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    cpus = sorted(cpus)
    runs, start = [], None
    for i, c in enumerate(cpus):
        start = c if start is None else start
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            runs.append(f"{start}-{c}" if c != start else f"{c}")
            start = None
    return ",".join(runs)


def parse_cpus(text: str) -> set[int]:
    """ "0-2,5" -> {0, 1, 2, 5}."""
    cpus: set[int] = set()
    for part in str(text).split(","):
        lo, _, hi = part.strip().partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def node_numa_cpus(sysfs: Path = Path("/sys/devices/system")) -> list[set[int]]:
    """This node's CPUs by NUMA node (one set of every CPU where sysfs lists no NUMA node)."""
    found = []
    for node in sorted((sysfs / "node").glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            found.append(parse_cpus((node / "cpulist").read_text().strip()))
        except (OSError, ValueError):
            continue
    return [cpus for cpus in found if cpus] or [set(range(os.cpu_count() or 1))]


def core_of(cpu: int, sysfs: Path = Path("/sys/devices/system")) -> frozenset[int]:
    """The logical CPUs that share ``cpu``'s core (its hyperthreads and itself)."""
    try:
        return frozenset(parse_cpus((sysfs / f"cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()))
    except (OSError, ValueError):
        return frozenset({cpu})


def allocation_shares(allowed: set[int], ranks: int, sysfs: Path = Path("/sys/devices/system")) -> list[set[int]]:
    """Each of ``ranks`` local ranks' share of the CPUs ``allowed`` (the job's allocation on this node, as the task's
    affinity shows it): the ranks spread over the NUMA nodes that hold allocated CPUs, in order, and the whole cores
    of each NUMA node (a core with its hyperthreads) split evenly among the ranks on it. An empty share where there
    are fewer cores than ranks on a NUMA node."""
    numa = [cpus & allowed for cpus in node_numa_cpus(sysfs)]
    numa = [cpus for cpus in numa if cpus] or [set(allowed)]
    owner = [r * len(numa) // ranks for r in range(ranks)]
    shares: list[set[int]] = []
    for rank in range(ranks):
        cpus = numa[owner[rank]]
        cores = list(dict.fromkeys(core_of(c, sysfs) & cpus for c in sorted(cpus)))
        peers = [r for r in range(ranks) if owner[r] == owner[rank]]
        k, n = peers.index(rank), len(peers)
        shares.append(set().union(*cores[k * len(cores) // n : (k + 1) * len(cores) // n]))
    return shares


def _builtin_dir():
    return resources.files("trainbench") / "systems"


def known_systems() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for folder in (Path(str(_builtin_dir())), Path("systems")):
        if folder.is_dir():
            for path in sorted(folder.glob("*.yaml")):
                found[path.stem] = path
    return found


def load_system(name_or_path: str) -> System:
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") and path.is_file()):
        known = known_systems()
        if name_or_path not in known:
            raise UserError(f"unknown system '{name_or_path}'; known systems: {', '.join(known) or '(none)'}")
        path = known[name_or_path]
    data = read_yaml_file(path, "system file")
    if not isinstance(data, dict):
        raise ConfigError(f"system file {path} must hold a mapping of keys to values, not {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(System)} | set(LEGACY_CONTAINER_KEYS)
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"system file {path}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(sorted(names))}")
    for f in dataclasses.fields(System):
        value, want = data.get(f.name), _KINDS.get(f.name)
        if (
            value is not None
            and want is not None
            and not (isinstance(value, want) and not (want is int and isinstance(value, bool)))
        ):
            raise ConfigError(f"system file {path}: {f.name} should be {want.__name__}, got {value!r}")
    data.setdefault("name", path.stem)
    # The name becomes a folder under output.results_dir and part of the job's name: '../x' would leave the folder.
    if not is_plain_name(data["name"]):
        raise ConfigError(f"system file {path}: name {data['name']!r} must be a plain name of letters, digits, '_', "
                          "'-' and '.' that starts with a letter, digit or '_' (set name: in the file, or rename "
                          "the file)")  # fmt: skip
    data["container"] = _container(path, data)
    data["env"] = {str(k): str(v) for k, v in (data.get("env") or {}).items()}
    data["path"] = str(path)
    system = System(**data)
    system.validate()
    return system


# The short form for pyxis, as NVIDIA's and other vendors' configs spell it: container_image and container_mounts.
LEGACY_CONTAINER_KEYS = {"container_image": "image", "container_mounts": "mounts"}


def _container(path: Path, data: dict) -> Container | None:
    """The ``container:`` section (or the pyxis short form) as a :class:`Container`; None for none."""
    section = data.get("container")
    legacy = {new: v for old, new in LEGACY_CONTAINER_KEYS.items() if (v := data.pop(old, None)) is not None}
    if section is not None and legacy:
        raise ConfigError(f"system file {path}: give the container either as a container: section or as "
                          "container_image/container_mounts, not both")  # fmt: skip
    if legacy:
        section = {"runtime": "pyxis", **legacy}
    if section is None:
        return None
    keys = {f.name: f for f in dataclasses.fields(Container)}
    unknown = sorted(set(section) - set(keys))
    if unknown:
        raise ConfigError(f"system file {path}: unknown container key(s) {', '.join(unknown)}; valid: "
                          f"{', '.join(keys)}")  # fmt: skip
    if not isinstance(section.get("mounts", []), list):
        raise ConfigError(f"system file {path}: container.mounts should be a list of HOST:CONTAINER paths")
    for key in ("runtime", "image", "python", "runtime_command"):
        if section.get(key) is not None and not isinstance(section[key], str):
            raise ConfigError(f"system file {path}: container.{key} should be a string, got {section[key]!r}")
    return Container(**{**section, "mounts": [str(m) for m in section.get("mounts", [])]})


def save_system(system: System, path: Path) -> None:
    """The system as a system file (``load_system`` reads it back the same)."""
    data = {k: v for k, v in dataclasses.asdict(system).items() if k != "path"}
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def _strings(value, name: str = ""):
    """Every string inside a system's fields, with where it is (env.KEY, container_mounts[1], ...)."""
    if isinstance(value, str):
        yield name, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k, f"{name}.{k}".lstrip("."))
            yield from _strings(v, f"{name}.{k}".lstrip("."))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _strings(v, f"{name}[{i}]")
