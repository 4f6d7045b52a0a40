"""The single place that speaks mlperf-logging: writing and reading MLPerf log lines, and its compliance checker."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from mlperf_logging.mllog import constants
from mlperf_logging.mllog import mllog as mllog_impl

from trainbench.errors import ConfigError

__all__ = ["constants", "MLPerfLog", "read_log", "ComplianceResult", "check_compliance"]

PREFIX = ":::MLLOG"


class _RaisingFileHandler(logging.FileHandler):
    """A file handler whose write errors (a full disk) reach the caller instead of being printed and dropped."""

    def handleError(self, record: logging.LogRecord) -> None:
        raise  # noqa: PLE0704 - called by emit() inside its except block: re-raise what failed


class MLPerfLog:
    """An MLPerf log written to one file through ``mllog_impl.MLLogger``.

    Each run gets its own logger (not mllog's global one), so several runs in one process never write
    into each other's files. With ``path=None`` (ranks other than 0) every call is a no-op.
    """

    _count = 0

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path is not None else None
        self._logger: mllog_impl.MLLogger | None = None
        self._handler: logging.Handler | None = None
        if self.path is not None:
            MLPerfLog._count += 1
            py_logger = logging.getLogger(f"trainbench.mllog.{MLPerfLog._count}")
            py_logger.propagate = False
            py_logger.setLevel(logging.INFO)
            self._handler = _RaisingFileHandler(self.path)
            self._handler.setFormatter(logging.Formatter("%(message)s"))
            py_logger.addHandler(self._handler)
            # stack offset 2: the call site recorded in the metadata is the caller of our wrapper.
            self._logger = mllog_impl.MLLogger(logger=py_logger, default_stack_offset=2)

    def event(self, key: str, value: Any = None, metadata: dict | None = None, time_ms: int | None = None) -> None:
        if self._logger is not None:
            self._logger.event(key=key, value=value, metadata=metadata, time_ms=time_ms)

    def start(self, key: str, value: Any = None, metadata: dict | None = None, time_ms: int | None = None) -> None:
        if self._logger is not None:
            self._logger.start(key=key, value=value, metadata=metadata, time_ms=time_ms)

    def end(self, key: str, value: Any = None, metadata: dict | None = None, time_ms: int | None = None) -> None:
        if self._logger is not None:
            self._logger.end(key=key, value=value, metadata=metadata, time_ms=time_ms)

    def close(self) -> None:
        if self._handler is not None:
            self._handler.close()
            logging.getLogger(self._logger.logger.name).removeHandler(self._handler)
            self._handler = None
            self._logger = None


def read_log(path: str | Path, errors: str = "strict") -> list[dict]:
    """The events of an MLPerf log, in order: each ``:::MLLOG`` line's JSON (key, value, time_ms, metadata, ...).
    A line that is not JSON is skipped, as mlperf-logging's own reader skips it."""
    events = []
    for line in Path(path).read_text(errors=errors).splitlines():
        if PREFIX in line:
            try:
                events.append(json.loads(line.split(PREFIX, 1)[1]))
            except json.JSONDecodeError:
                continue
    return events


def run_window(events: list[dict]) -> tuple[int, int] | None:
    """(run_start, run_stop) times in ms, as mlperf-logging's result summarizer reads them (the first of each);
    None if either is missing."""
    start = next((e["time_ms"] for e in events if e["key"] == constants.RUN_START), None)
    stop = next((e["time_ms"] for e in events if e["key"] == constants.RUN_STOP), None)
    return None if start is None or stop is None else (start, stop)


def submission_benchmark(events: list[dict]) -> str | None:
    """The log's ``submission_benchmark`` value (the MLPerf benchmark name), if it has one."""
    return next((e["value"] for e in events if e["key"] == constants.SUBMISSION_BENCHMARK), None)


@dataclass(frozen=True)
class ComplianceResult:
    passed: bool
    ruleset: str
    output: str
    # Checks a scaled-down config cannot pass because the closed rules fix them to the full benchmark's values
    # (e.g. sequence length 8192): a log failing only these counts as compliant, and says so.
    waived: frozenset[str] = frozenset()
    # What the checker does not look at but the log must hold to be a record of one run (see log_problems).
    problems: tuple[str, ...] = ()
    # A benchmark of one's own: checked by the rules common to every benchmark, not an MLPerf benchmark's own.
    own: bool = False

    def _messages(self) -> list[str]:
        """First line of each message of the checker (it separates messages with a line of dashes)."""
        heads, block = [], []
        for line in self.output.splitlines() + ["-" * 30]:
            text = line.strip()
            if text.startswith(("INFO", "** Logging")) or text == "ERROR - FAILED":
                continue
            if len(text) >= 10 and set(text) == {"-"}:
                head = next((b for b in block if b), None)
                if head:
                    heads.append(head.removeprefix("WARNING - ").removeprefix("ERROR - ").strip())
                block = []
            else:
                block.append(text)
        return heads

    def failed_checks(self) -> set[str]:
        """Keys whose value check failed."""
        return {h.split("'")[1] for h in self._messages() if h.startswith("CHECK for '") and " failed" in h}

    def other_errors(self) -> list[str]:
        """Every other complaint: a missing or repeated key, an unmet at-least-one check, a parse error."""
        return [h for h in self._messages() if not (h.startswith("CHECK for '") and " failed" in h)]

    @property
    def ok(self) -> bool:
        """Passed with no warning, or failed only the waived checks; and the log is consistent."""
        if self.problems:
            return False
        if self.passed:
            return True
        failed = self.failed_checks()
        return bool(failed) and failed <= self.waived and not self.other_errors()

    def reason(self) -> str:
        """The lines that explain a failure: the checker's, then the log's own problems (or 'SUCCESS')."""
        if self.ok:
            kind = " (not an MLPerf benchmark: mlperf-logging's common rules and trainbench's log checks)"
            if self.passed:
                return "SUCCESS" + (kind if self.own else "")
            return (
                f"SUCCESS except the full-size checks of a scaled-down run ({', '.join(sorted(self.failed_checks()))})"
            )
        # What made it fail first: the checker's messages but the waived checks' (which it may print first), then
        # the log's own problems; the waived ones only named after them.
        waived = sorted(self.failed_checks() & self.waived)
        lines = [h for h in self._messages() if not any(h.startswith(f"CHECK for '{key}'") for key in waived)]
        text = "; ".join([*lines, *self.problems][:6]) or self.output.strip()[-500:]
        if waived:
            text += f" (and the waived full-size checks of a scaled-down run: {', '.join(waived)})"
        return text


def log_problems(events: list[dict]) -> list[str]:
    """What makes a log no record of one run, beyond what mlperf-logging's checker looks at: times that go back,
    events after run_stop, evals outside run_start..run_stop."""
    problems = []
    times = [e.get("time_ms") for e in events]
    back = next((i for i in range(1, len(times)) if (times[i] or 0) < (times[i - 1] or 0)), None)
    if back is not None:
        problems.append(f"event {back + 1} ('{events[back]['key']}') is earlier than the one before it: the log is out "
                        "of time order")  # fmt: skip
    keys = [e.get("key") for e in events]
    if constants.RUN_STOP in keys and keys.index(constants.RUN_STOP) < len(keys) - 1:
        after = keys[keys.index(constants.RUN_STOP) + 1]
        problems.append(f"'{after}' comes after run_stop: nothing may follow the end of the run")
    if constants.RUN_START in keys:
        early = [
            k for k in keys[: keys.index(constants.RUN_START)] if k in (constants.EVAL_ACCURACY, constants.BLOCK_START)
        ]
        if early:
            problems.append(f"'{early[0]}' comes before run_start")
    return problems


def _checker_dir(usage: str, ruleset: str) -> Path:
    from importlib import resources

    return Path(str(resources.files("mlperf_logging") / "compliance_checker" / f"{usage}_{ruleset}"))


def ruleset_version(ruleset: str) -> tuple[int, ...]:
    return tuple(int(part) for part in ruleset.split(".") if part.isdigit())


def installed_rulesets(usage: str = "training") -> list[str]:
    """The rulesets the installed mlperf-logging's compliance checker has for ``usage``, oldest first."""
    from importlib import resources

    root = Path(str(resources.files("mlperf_logging") / "compliance_checker"))
    found = [p.name.removeprefix(f"{usage}_") for p in root.glob(f"{usage}_*") if p.is_dir()]
    return sorted((r for r in found if re.fullmatch(r"\d+\.\d+\.\d+", r)), key=ruleset_version)


def require_installed(ruleset: str, where: str, then: str = "", usage: str = "training") -> None:
    """One sentence where ``ruleset`` is not one of the installed mlperf-logging's (``where``: the option named;
    ``then``: what to add, e.g. which rulesets would do)."""
    have = installed_rulesets(usage)
    if ruleset not in have:
        raise ConfigError(f"{where}={ruleset} is not a ruleset of the installed mlperf-logging (it has "
                          f"{', '.join(have[-6:])} and older){then}")  # fmt: skip


# The keys of what a run ran in and how it was laid out: every log must hold each once from ruleset 6.1.0 (optional
# in 6.0.0, unknown before); a run under an older ruleset does not write them.
DISCLOSURE_SINCE = "6.0.0"
DISCLOSURE_KEYS = (
    constants.LOWEST_NUMERICAL_PRECISION_IN_LINEAR,
    constants.LOWEST_NUMERICAL_PRECISION_IN_ATTN,
    constants.LOWEST_NUMERICAL_PRECISION_IN_COMM,
    constants.TENSOR_PARALLELISM,
    constants.PIPELINE_PARALLELISM,
    constants.CONTEXT_PARALLELISM,
    constants.EXPERT_PARALLELISM,
    constants.MICRO_BATCH_SIZE,
    constants.CONFIG_FILENAME,
)


def logs_disclosure(ruleset: str) -> bool:
    return ruleset_version(ruleset) >= ruleset_version(DISCLOSURE_SINCE)


def round_benchmarks(ruleset: str, usage: str = "training") -> set[str]:
    """The benchmarks of the MLPerf round of ``ruleset`` (mlperf-logging's benchmark_meta; a checker may still carry
    the rules of a benchmark its round dropped, as 5.1.0 does BERT's)."""
    from mlperf_logging.benchmark_meta import get_allowed_benchmarks

    try:
        return set(get_allowed_benchmarks(usage, ruleset))
    except (ValueError, KeyError):
        return known_mlperf_benchmarks(ruleset, usage)


def known_mlperf_benchmarks(ruleset: str, usage: str = "training") -> set[str]:
    """The benchmarks mlperf-logging's checker has rules for in ``ruleset`` (its closed_<name>.yaml files)."""
    folder = _checker_dir(usage, ruleset)
    if not folder.is_dir():
        return set()
    return {p.stem.removeprefix("closed_") for p in folder.glob("closed_*.yaml")} - {"common"}


def common_rules(tmp: Path, ruleset: str, usage: str = "training") -> Path:
    """mlperf-logging's rules common to every benchmark of ``ruleset`` (its common.yaml and the division's
    <division>_common.yaml), for a benchmark of one's own: written to ``tmp`` from the checker's own files with one
    rule changed in each, the one on ``submission_benchmark``, which there admits only MLPerf's names and then loads
    that benchmark's rules; here any name is admitted and nothing more is loaded. Returns the common file."""
    source = _checker_dir(usage, ruleset)
    for name in ("common", "closed_common", "open_common"):
        path = source / f"{name}.yaml"
        if not path.is_file():
            continue
        rules = yaml.safe_load(path.read_text()) or []
        for rule in rules:
            key = rule.get("KEY") if isinstance(rule, dict) else None
            if not key:
                continue
            if key.get("NAME") == constants.SUBMISSION_BENCHMARK:
                key["CHECK"] = " v['value'] != '' "
                key.pop("POST", None)
            elif isinstance(key.get("POST"), str):  # the division's file: the one written here
                key["POST"] = key["POST"].replace(f"'{usage}_{ruleset}/", f"'{tmp}/")
        (tmp / f"{name}.yaml").write_text(yaml.safe_dump(rules, sort_keys=False))
    return tmp / "common.yaml"


def check_compliance(
    log_path: str | Path,
    ruleset: str,
    usage: str = "training",
    waived: frozenset[str] = frozenset(),
    own: bool = False,
) -> ComplianceResult:
    """Run ``python -m mlperf_logging.compliance_checker`` on a log, as a user would by hand; ``own``: the log of a
    benchmark of one's own, checked by the rules every benchmark has (:func:`common_rules`)."""
    with tempfile.TemporaryDirectory() as tmp:
        config = ["--config", str(common_rules(Path(tmp), ruleset, usage))] if own else []
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "mlperf_logging.compliance_checker",
                "--usage",
                usage,
                "--ruleset",
                ruleset,
                *config,
                "--log_output",
                str(Path(tmp) / "checker.log"),
                str(log_path),
            ],
            capture_output=True,
            text=True,
        )
    output = proc.stdout + proc.stderr
    # Any warning fails: the checker still says SUCCESS with, for example, two run_stops.
    warned = any(line.startswith(("WARNING", "ERROR")) for line in output.splitlines())
    passed = proc.returncode == 0 and "SUCCESS" in output and not warned
    events = read_log(log_path, errors="replace") if Path(log_path).is_file() else []
    return ComplianceResult(passed, ruleset, output, waived, tuple(log_problems(events)), own)


@dataclass(frozen=True)
class ReferenceConvergence:
    """Samples to reach the target at one global batch by mlperf-logging's reference convergence points (RCPs)."""

    global_batch_size: int
    mean_samples: float
    """Olympic mean of the reference runs (fastest and slowest dropped), as the RCP checker takes it."""
    between: tuple[int, int] | None = None
    """The two reference batches it is interpolated between (linearly in the batch, as the checker does); None
    where a reference point exists at this batch."""


def reference_means(benchmark: str, ruleset: str) -> dict[int, float] | None:
    """The reference convergence points mlperf-logging ships for ``benchmark`` and ``ruleset``: each global batch's
    mean samples to converge (the olympic mean of its runs); None where it has no file for them."""
    from importlib import resources

    path = resources.files("mlperf_logging") / "rcp_checker" / f"training_{ruleset}" / f"rcps_{benchmark}.json"
    if not path.is_file():
        return None
    means = {}
    for entry in json.loads(path.read_text()).values():
        runs = sorted(entry.get("samples to converge") or entry["Epochs to converge"])  # both hold samples
        means[int(entry["BS"])] = sum(runs[1:-1]) / (len(runs) - 2)
    return means


def reference_convergence(benchmark: str, ruleset: str, global_batch_size: int) -> ReferenceConvergence | None:
    """Samples to target at ``global_batch_size`` from the RCP file that mlperf-logging ships for ``benchmark`` and
    ``ruleset`` (:func:`reference_means`); None where it has no file, or the batch lies outside its reference
    batches."""
    means = reference_means(benchmark, ruleset)
    if means is None:
        return None
    if global_batch_size in means:
        return ReferenceConvergence(global_batch_size, means[global_batch_size])
    below = [b for b in means if b < global_batch_size]
    above = [b for b in means if b > global_batch_size]
    if not below or not above:
        return None
    low, high = max(below), min(above)
    share = (global_batch_size - low) / (high - low)
    mean = means[low] + share * (means[high] - means[low])
    return ReferenceConvergence(global_batch_size, mean, (low, high))
