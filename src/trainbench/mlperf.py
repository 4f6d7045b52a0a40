"""The single place that speaks mlperf-logging: writing MLPerf logs and running its compliance checker."""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlperf_logging.mllog import constants
from mlperf_logging.mllog import mllog as mllog_impl

__all__ = ["constants", "MLPerfLog", "ComplianceResult", "check_compliance"]


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
            self._handler = logging.FileHandler(self.path)
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


@dataclass(frozen=True)
class ComplianceResult:
    passed: bool
    ruleset: str
    output: str

    def reason(self) -> str:
        """The checker's lines that explain a failure (or 'SUCCESS')."""
        if self.passed:
            return "SUCCESS"
        lines = [ln for ln in self.output.splitlines() if ln.startswith(("ERROR", "WARNING")) and "FAILED" not in ln]
        return "; ".join(lines[:5]) or self.output.strip()[-500:]


def check_compliance(log_path: str | Path, ruleset: str, usage: str = "training") -> ComplianceResult:
    """Run ``python -m mlperf_logging.compliance_checker`` on a log, as a user would by hand."""
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "mlperf_logging.compliance_checker",
                "--usage",
                usage,
                "--ruleset",
                ruleset,
                "--log_output",
                str(Path(tmp) / "checker.log"),
                str(log_path),
            ],
            capture_output=True,
            text=True,
        )
    output = proc.stdout + proc.stderr
    passed = proc.returncode == 0 and "SUCCESS" in output
    return ComplianceResult(passed, ruleset, output)
