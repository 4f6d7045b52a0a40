"""A results folder as an MLPerf submission package, laid out so mlperf-logging's package checker can run on it:
<org>/results/<system>/<benchmark>/result_*.txt, <org>/systems/<system>.json (built from what the runs recorded of
their nodes) and <org>/benchmarks/<benchmark>/implementations/trainbench-<version>/ (the source of trainbench and the
runs' resolved config)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from trainbench import __version__
from trainbench.config import is_plain_name
from trainbench.errors import UserError
from trainbench.report.scoring import folder_benchmark, folder_config, read_job
from trainbench.runfiles import CONFIG, RunFiles, finished_logs, read_json
from trainbench.version import PACKAGE_DIR, checkout_root, describe, provenance

STATUS_NAMES = {
    "onprem": "Available on-premise",
    "cloud": "Available cloud",
    "preview": "Preview",
    "research": "Research, Development, or Internal (RDI)",
}


def _agreed(values, what: str, notes: list[str]) -> str:
    """The one value the nodes recorded (as text), "" where none did; where they differ, each of them, and a note."""
    found = list(dict.fromkeys(str(v) for v in values if v not in (None, "")))
    if len(found) > 1:
        notes.append(f"the runs' nodes differ in {what}: {'; '.join(found)}")
    return " / ".join(found)


def _gpu_memory(gpu: dict) -> str | None:
    return f"{gpu['memory_mib'] / 1024:.0f} GB" if isinstance(gpu.get("memory_mib"), (int, float)) else None


def _links(node: dict) -> str | None:
    """The GPUs' interconnect as ``nvidia-smi topo -m`` shows it: NVLink (with its NV<n> bond) or PCIe."""
    text = (node.get("gpu_topology") or {}).get("text")
    if not text:
        return None
    bonds = sorted(set(re.findall(r"\bNV(\d+)\b", text)), key=int)
    return f"NVLink (NV{'/NV'.join(bonds)} between GPUs)" if bonds else "PCIe"


def _networking(node: dict) -> str | None:
    """The node's RDMA ports (InfiniBand, RoCE) that are up, by rate, and its other physical interfaces that are up."""
    ports: dict[tuple, list[str]] = {}
    for p in node.get("infiniband") or []:
        if "ACTIVE" in str(p.get("state", "")).upper():
            ports.setdefault((p.get("rate"), p.get("link_layer")), []).append(f"{p.get('device')}/{p.get('port')}")
    parts = [f"{len(names)} x {rate or '?'} {layer or 'RDMA'} ({', '.join(names)})"
             for (rate, layer), names in ports.items()]  # fmt: skip
    for nic in node.get("network") or []:
        if nic.get("device") and nic.get("state") == "up":
            speed = f", {nic['speed_mbps'] / 1000:g} Gb/s" if nic.get("speed_mbps") else ""
            parts.append(f"{nic.get('name')} ({nic.get('driver') or 'Ethernet'}{speed})")
    return "; ".join(parts) or None


def _software(node: dict) -> str | None:
    sw = node.get("software") or {}
    parts = [("Python", sw.get("python")), ("CUDA", sw.get("cuda_toolkit")), ("NVIDIA driver", node.get("driver"))]
    return ", ".join(f"{name} {v}" for name, v in parts if v) or None


def _framework(node: dict) -> str | None:
    sw = node.get("software") or {}
    made_by = sw.get("trainbench")
    if not isinstance(made_by, dict):
        return None
    return f"{describe(made_by)}, PyTorch {sw['torch']}" if sw.get("torch") else describe(made_by)


def system_description(org: str, system_name: str, run_dir: Path, division: str, status: str,
                       cfg=None) -> tuple[dict, list[str]]:  # fmt: skip
    """The system JSON from what the runs recorded of their compute nodes (``node_<host>.json``: CPUs, memory, GPUs,
    driver, topology, software) and of their layout (the resolved config: nodes, ranks per node), never from the
    machine that packages them; a field nothing recorded stays empty. Returns it and notes for the console."""
    from trainbench.node import read_node_records

    notes: list[str] = []
    nodes = read_node_records(run_dir)
    if nodes:
        notes.append(f"system description from the runs' records of {len(nodes)} node(s): "
                     f"{', '.join(str(n.get('host')) for n in nodes)}")  # fmt: skip
    else:
        notes.append("the runs recorded no node (node_<host>.json; runs made before trainbench recorded them): the "
                     "system description holds only what their config says")  # fmt: skip
    cpu = [n.get("cpu") or {} for n in nodes]
    gpus = [g for n in nodes for g in n.get("gpus") or []]
    on_gpus = cfg is not None and cfg.device != "cpu" and bool(gpus)

    def agreed(values, what: str) -> str:
        return _agreed(values, what, notes)

    if cfg is None:
        accelerators = model = ""
    else:
        accelerators = str(cfg.distributed.nproc) if on_gpus else "0"
        model = agreed((g.get("name") for g in gpus), "GPU model") if on_gpus else "none (CPU)"
    desc = {
        "submitter": org,
        "division": division,
        "status": STATUS_NAMES.get(status, status),
        "system_name": system_name,
        "number_of_nodes": str(cfg.distributed.nodes) if cfg is not None else "",
        "host_processors_per_node": agreed((c.get("sockets") for c in cpu), "CPU sockets"),
        "host_processor_model_name": agreed((c.get("model") for c in cpu), "CPU model"),
        "host_processor_core_count": agreed((c.get("cores_per_socket") for c in cpu), "cores per socket"),
        "host_processor_vcpu_count": agreed((c.get("logical_cpus") for c in cpu), "logical CPUs"),
        "host_processor_frequency": "",
        "host_processor_caches": "",
        "host_processor_interconnect": "",
        "host_memory_capacity": agreed(
            (f"{n['memory_bytes'] / 2**30:.0f} GB" for n in nodes if isinstance(n.get("memory_bytes"), int)), "memory"
        ),  # fmt: skip
        "host_storage_type": "",
        "host_storage_capacity": "",
        "host_networking": agreed(map(_networking, nodes), "networking"),
        "host_networking_topology": "",
        "host_memory_configuration": "",
        "accelerators_per_node": accelerators,
        "accelerator_model_name": model,
        "accelerator_host_interconnect": "",
        "accelerator_frequency": "",
        "accelerator_on-chip_memories": "",
        "accelerator_memory_configuration": "",
        "accelerator_memory_capacity": agreed(map(_gpu_memory, gpus), "GPU memory") if on_gpus else "",
        "accelerator_interconnect": agreed(map(_links, nodes), "GPU links") if on_gpus else "",
        "accelerator_interconnect_topology": "",
        "cooling": "",
        "hw_notes": "",
        "framework": agreed(map(_framework, nodes), "trainbench and PyTorch"),
        "other_software_stack": agreed(map(_software, nodes), "software"),
        "operating_system": agreed((n.get("os") for n in nodes), "operating system"),
        "sw_notes": "",
    }
    return desc, notes


STATUSES = ("Available on-premise", "Available cloud", "Research, Development, or Internal (RDI)", "Preview")


def read_system_desc(path: Path, required: list[str]) -> dict:
    """A system description the user wrote (JSON, an object of strings): every field the package checker requires,
    and a status it accepts; else one sentence naming what is wrong."""
    try:
        desc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"--system-desc {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"--system-desc {path} is not a JSON file ({exc})") from None
    if not isinstance(desc, dict):
        raise UserError(f"--system-desc {path} should hold one JSON object of fields, not {type(desc).__name__}")
    missing = [field for field in required if field not in desc]
    if missing:
        raise UserError(f"--system-desc {path} lacks {len(missing)} field(s) the package checker requires: "
                        f"{', '.join(missing)} (start from the systems/<system>.json that package writes)")  # fmt: skip
    if desc["status"] not in STATUSES:
        raise UserError(f"--system-desc {path}: status {desc['status']!r} should be one of {', '.join(STATUSES)}")
    return desc


def empty_fields(desc: dict) -> list[str]:
    """The system description's fields nothing filled (the package checker accepts them empty; a submission
    should not)."""
    return [field for field, value in desc.items() if value in ("", None)]


@dataclass(frozen=True)
class Package:
    root: Path
    benchmark: str
    runs: int
    required_runs: int | None
    """How many runs MLPerf asks of the benchmark (None: not an MLPerf benchmark)."""
    scaled_down: bool
    """The runs' preset is not the full benchmark's (unknown counts as full size: nothing is excused)."""
    implementation: Path | None = None
    """benchmarks/<b>/implementations/trainbench-<version>/: the source and the runs' configs."""
    notes: tuple[str, ...] = ()
    """Where the system description came from, and what the console should say of the package's contents."""


def recorded_makers(run_dir: Path, logs: list[Path]) -> list[dict]:
    """The trainbench each finished run recorded (its run_<i>.json), one of each; none for runs made before runs
    recorded it."""
    found: list[dict] = []
    for log in logs:
        made_by = read_json(RunFiles(run_dir, int(log.name.split("_")[1].split(".")[0])).outcome).get("trainbench")
        if isinstance(made_by, dict) and made_by not in found:
            found.append(made_by)
    return found


def write_implementation(folder: Path, run_dir: Path, system_name: str, made_by: list[dict], cfg=None) -> list[str]:
    """``benchmarks/<b>/implementations/trainbench-<version>/``: the source of this trainbench (the package's .py
    files and package data, no caches; the checkout's pyproject.toml where it runs from one), and the runs' resolved
    config, system file and job script named for the system. Returns notes for the console: a version the runs
    did not record, or no record of one."""
    notes = []
    folder.mkdir(parents=True)
    shutil.copytree(PACKAGE_DIR, folder / "src" / "trainbench", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    root = checkout_root()
    if root is not None:
        shutil.copyfile(root / "pyproject.toml", folder / "pyproject.toml")
    for name, target in ((CONFIG, f"config_{system_name}.yaml"), ("system.yaml", f"system_{system_name}.yaml"),
                         ("submit.sbatch", f"submit_{system_name}.sbatch")):  # fmt: skip
        if (run_dir / name).is_file():
            shutil.copyfile(run_dir / name, folder / target)
    here = provenance()
    ran = ", ".join(describe(m) for m in made_by) or "not recorded (runs made before trainbench recorded it)"
    how = (f"`trainbench run {cfg.benchmark} --preset {cfg.preset} --config config_{system_name}.yaml --nexp 10`"
           if cfg is not None else "`trainbench run` with it as --config")  # fmt: skip
    (folder / "README.md").write_text("\n\n".join([
        f"# trainbench {here['version']}",
        f"`src/trainbench` is the source of {describe(here)}, which laid out this package; the runs were made by "
        f"{ran}.",
        f"`config_{system_name}.yaml` is the runs' resolved config (run i's seed is its seed + i). Where the runs "
        f"were submitted to Slurm, `system_{system_name}.yaml` is the system file and `submit_{system_name}.sbatch` "
        "the job script they ran with.",
        f"To run them again: `pip install .` here (or install trainbench {here['version']}), then {how}.",
    ]) + "\n")  # fmt: skip
    if not made_by:
        notes.append(f"the runs did not record which trainbench made them: {folder.name} holds {describe(here)}")
    elif any(any(m[k] != here.get(k) for k in m) for m in made_by):  # (a run recorded before the source has none)
        notes.append(f"the runs were made by {ran}, but {folder.name} holds the source of {describe(here)}, the "
                     "trainbench that packaged them: check out the runs' commit and package again")  # fmt: skip
    return notes


def make_package(run_dir: Path, out: Path, org: str, system_name: str, system_desc: str | None = None) -> Package:
    run_dir, out = Path(run_dir), Path(out)
    for name, value in (("--org", org), ("--system", system_name)):
        if not is_plain_name(value):
            raise UserError(f"{name} {value!r}: give a plain name of letters, digits, '_', '-' and '.' that starts "
                            "with a letter, digit or '_' (it becomes a folder name inside --out)")  # fmt: skip
    logs = finished_logs(run_dir)
    if not logs:
        raise UserError(f"{run_dir} holds no finished MLPerf log (result_*.txt)")
    benchmark, _ = folder_benchmark(run_dir, logs)
    read_job(run_dir)  # the job's record (a Slurm run's), refused in one sentence where it is of the wrong shape
    cfg = folder_config(run_dir / CONFIG)[1] if (run_dir / CONFIG).exists() else None
    division = cfg.output.division if cfg else "closed"
    status = cfg.output.status if cfg else "onprem"
    root = out / org
    if out.resolve() not in root.resolve().parents:
        raise UserError(f"--org {org!r} would write outside {out}")
    desc, notes = system_description(org, system_name, run_dir, division, status, cfg)
    if system_desc is not None:  # checked before anything is written
        desc = read_system_desc(Path(system_desc), list(desc)) | {"submitter": org, "system_name": system_name}
        notes = [f"system description from {system_desc}"]
    implementation = root / "benchmarks" / benchmark / "implementations" / f"trainbench-{__version__}"
    if implementation.exists():
        raise UserError(f"{implementation} exists already: package into an empty --out, or remove it")
    results = root / "results" / system_name / benchmark
    results.mkdir(parents=True, exist_ok=True)
    for i, log in enumerate(logs):
        shutil.copyfile(log, results / RunFiles(results, i).log.name)
    systems = root / "systems"
    systems.mkdir(parents=True, exist_ok=True)
    (systems / f"{system_name}.json").write_text(json.dumps(desc, indent=2) + "\n")
    notes += write_implementation(implementation, run_dir, system_name, recorded_makers(run_dir, logs), cfg)
    from mlperf_logging.benchmark_meta import get_result_file_counts

    from trainbench.benchmarks import registry

    bench = registry().get(cfg.benchmark) if cfg else None
    return Package(root, benchmark, len(logs), get_result_file_counts("training").get(benchmark),
                   scaled_down=bool(bench and bench.scaled_down(cfg)), implementation=implementation,
                   notes=tuple(notes))  # fmt: skip


@dataclass(frozen=True)
class PackageCheck:
    """What mlperf-logging's package checker said of a package."""

    output: str
    passed: list[str]
    warnings: list[str]
    errors: list[str]
    beyond_scale: list[str]
    """Errors a scaled-down preset cannot avoid (the RCP check compares its samples to converge with the full
    model's reference convergence points); kept apart from ``errors`` only for such a run."""
    crashed: bool
    """The checker gave no verdict: it exited non-zero, or its output lacks the line that ends every check it
    finishes (a folder it could not read, an argument it took for something else)."""

    @property
    def ok(self) -> bool:
        return not self.errors and not self.crashed


# The last line mlperf-logging's package checker logs on each of its two verdicts.
PASSED = "PACKAGE CHECKER FOUND NO ERRORS"
FAILED = "PACKAGE CHECKER FOUND ERRORS"


def check_package(root: Path, ruleset: str, scaled_down: bool) -> PackageCheck:
    """mlperf-logging's package checker on the package, its lines sorted into passed checks, warnings and errors.
    The verdict is read from what it printed, not its exit status alone: it exits 0 whatever it finds, and 0 after
    printing its usage too. It is given the package's absolute path after ``--``, so no folder name can reach it as
    an option."""
    with tempfile.TemporaryDirectory() as tmp:  # it writes a log file of its own, by default in the working folder
        proc = subprocess.run(
            [sys.executable, "-m", "mlperf_logging.package_checker", "--log_output",
             str(Path(tmp) / "package_checker.log"), "--", str(Path(root).resolve()), "training", ruleset],
            capture_output=True,
            text=True,
        )  # fmt: skip
    # Less its pointer to the log file, gone with the temporary folder.
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if not ln.startswith("** Detailed log output")]
    output = "\n".join(lines) + "\n"
    errors = [ln.removeprefix("ERROR - ").strip() for ln in lines if ln.startswith("ERROR")]
    beyond = [e for e in errors if e.startswith("RCP Test Failed")] if scaled_down else []
    verdict_passed = any(PASSED in ln for ln in lines)
    verdict_failed = any(FAILED in ln for ln in lines)
    if verdict_failed and not errors:  # it found errors it logged in no ERROR line: not a pass
        errors = ["the package checker found errors (see its log)"]
    return PackageCheck(
        output=output,
        passed=[ln.removeprefix("INFO - ").strip() for ln in lines if "checker passed" in ln or "Test Passed" in ln],
        warnings=[ln.removeprefix("WARNING - ").strip() for ln in lines if ln.startswith("WARNING")],
        errors=[e for e in errors if e not in beyond],
        beyond_scale=beyond,
        crashed=proc.returncode != 0 or not (verdict_passed or verdict_failed),
    )
