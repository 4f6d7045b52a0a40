"""A results folder as an MLPerf submission package: <org>/results/<system>/<benchmark>/result_*.txt and
<org>/systems/<system>.json, laid out so mlperf-logging's package checker can run on it."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from trainbench.config import is_plain_name
from trainbench.errors import UserError
from trainbench.report.scoring import folder_benchmark, folder_config, read_job
from trainbench.runfiles import CONFIG, RunFiles, finished_logs
from trainbench.telemetry import cpu_model, gpus, memory_gb


def system_description(org: str, system_name: str, run_dir: Path, division: str, status: str) -> dict:
    """The system JSON from the system file the job used (if any) and what this machine reports."""
    job = read_job(run_dir)
    nodes, per_node = 1, None
    if job.get("system"):
        from trainbench.launch.systems import load_system

        try:
            system = load_system(job["system"])
            nodes, per_node = system.nodes, system.gpus_per_node
        except UserError:
            pass
    gpu_count, gpu_name, gpu_memory = gpus()
    import torch

    return {
        "submitter": org,
        "division": division,
        "status": {
            "onprem": "Available on-premise",
            "cloud": "Available cloud",
            "preview": "Preview",
            "research": "Research, Development, or Internal (RDI)",
        }.get(status, status),  # fmt: skip
        "system_name": system_name,
        "number_of_nodes": str(nodes),
        "host_processors_per_node": "1",
        "host_processor_model_name": cpu_model(),
        "host_processor_core_count": str(os.cpu_count()),
        "host_processor_vcpu_count": str(os.cpu_count()),
        "host_processor_frequency": "",
        "host_processor_caches": "",
        "host_processor_interconnect": "",
        "host_memory_capacity": memory_gb(),
        "host_storage_type": "",
        "host_storage_capacity": "",
        "host_networking": "",
        "host_networking_topology": "",
        "host_memory_configuration": "",
        "accelerators_per_node": str(per_node if per_node is not None else gpu_count),
        "accelerator_model_name": gpu_name or "none (CPU)",
        "accelerator_host_interconnect": "",
        "accelerator_frequency": "",
        "accelerator_on-chip_memories": "",
        "accelerator_memory_configuration": "",
        "accelerator_memory_capacity": gpu_memory,
        "accelerator_interconnect": "",
        "accelerator_interconnect_topology": "",
        "cooling": "",
        "hw_notes": "",
        "framework": f"trainbench, PyTorch {torch.__version__}",
        "other_software_stack": f"Python {platform.python_version()}",
        "operating_system": platform.platform(),
        "sw_notes": "",
    }


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
    cfg = folder_config(run_dir / CONFIG)[1] if (run_dir / CONFIG).exists() else None
    division = cfg.output.division if cfg else "closed"
    status = cfg.output.status if cfg else "onprem"
    root = out / org
    if out.resolve() not in root.resolve().parents:
        raise UserError(f"--org {org!r} would write outside {out}")
    desc = system_description(org, system_name, run_dir, division, status)
    if system_desc is not None:  # checked before anything is written
        desc = read_system_desc(Path(system_desc), list(desc)) | {"submitter": org, "system_name": system_name}
    results = root / "results" / system_name / benchmark
    results.mkdir(parents=True, exist_ok=True)
    for i, log in enumerate(logs):
        shutil.copyfile(log, results / RunFiles(results, i).log.name)
    systems = root / "systems"
    systems.mkdir(parents=True, exist_ok=True)
    (systems / f"{system_name}.json").write_text(json.dumps(desc, indent=2) + "\n")
    from mlperf_logging.benchmark_meta import get_result_file_counts

    from trainbench.benchmarks import registry

    bench = registry().get(cfg.benchmark) if cfg else None
    return Package(root, benchmark, len(logs), get_result_file_counts("training").get(benchmark),
                   scaled_down=bool(bench and bench.scaled_down(cfg)))  # fmt: skip


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
