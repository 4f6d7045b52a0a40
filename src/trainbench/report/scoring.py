"""Scores from a results folder: per-run time to train, samples, throughput, energy; the MLPerf score.

The score follows MLPerf's rule as mlperf-logging's result summarizer computes it: a run counts when its
log passes the compliance checker (which includes reaching the target); the fastest and the slowest run
are dropped and the rest averaged. A run that did not count is dropped as the slowest, so one may
fail; two or more make the result invalid. A test checks our number against the summarizer's own code.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainbench.benchmarks import is_own, ruleset_of
from trainbench.errors import UserError
from trainbench.mlperf import check_compliance, constants, read_log, run_window, submission_benchmark
from trainbench.runfiles import SUMMARY, RunFiles, run_indices
from trainbench.telemetry import run_energy

# -- reading a results folder: every value the reports use, of the type they use it as -------------------------------
# A results folder is input like any other (copied, edited, crafted): a field of the wrong type is one sentence naming
# the file and the field, never a TypeError in the middle of a report.

NUMBER = (int, float)


@dataclass(frozen=True)
class ListOf:
    """A JSON list whose every item is of ``item``'s kind."""

    item: Any


def _kind_name(kind: Any) -> str:
    if isinstance(kind, ListOf):
        return f"a list of {_kind_name(kind.item)}"
    if isinstance(kind, dict):
        return "an object"
    if kind == NUMBER:
        return "a number"
    return {str: "a string", int: "a whole number", dict: "an object", list: "a list"}.get(kind, str(kind))


def _problem(value: Any, kind: Any, where: str) -> str | None:
    """Where ``value`` is not of ``kind`` (a type, a tuple of types, :class:`ListOf`, or a dict of field kinds for a
    nested object), the dotted field and what it should be; None where it is."""
    if isinstance(kind, ListOf):
        if not isinstance(value, list):
            return f"{where} should be {_kind_name(kind)}"
        return next((p for i, v in enumerate(value) if (p := _problem(v, kind.item, f"{where}[{i}]"))), None)
    if isinstance(kind, dict):
        if not isinstance(value, dict):
            return f"{where} should be an object"
        return fields_problem(value, kind, where + ".")
    types = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        return f"{where} should be {_kind_name(kind)}, not {json.dumps(value)[:40]}"
    return None


def fields_problem(record: dict, fields: dict[str, Any], prefix: str = "") -> str | None:
    """The first field of ``record`` named in ``fields`` that is present, not null, and of another kind."""
    for name, kind in fields.items():
        value = record.get(name)
        if value is not None:
            problem = _problem(value, kind, prefix + name)
            if problem:
                return problem
    return None


def read_record(path: Path, fields: dict[str, Any], whole: bool = False, required: tuple[str, ...] = ()) -> dict:
    """A JSON object from a results folder with the ``fields`` the caller reads checked for their kind; a field of
    another kind is one sentence naming the file and the field. A missing file is {}; so is one that is not a JSON
    object (a write cut short), unless ``whole``, where it is one sentence too."""
    path = Path(path)
    try:
        value = json.loads(path.read_text(errors="replace"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as exc:
        if whole:
            raise UserError(f"{path} is not a JSON object ({type(exc).__name__}); restore it from the run, or remove "
                            "it") from None  # fmt: skip
        return {}
    if not isinstance(value, dict):
        if whole:
            raise UserError(f"{path} should hold one JSON object, not {type(value).__name__}; restore it from the run, "
                            "or remove it")  # fmt: skip
        return {}
    missing = [name for name in required if name not in value]
    problem = f"field {missing[0]} is missing" if missing else fields_problem(value, fields)
    if problem:
        raise UserError(f"{path}: {problem}; restore the file from the run, or remove it")
    return value


SUMMARY_FIELDS = {"mlperf_benchmark": str, "ruleset": str, "waived_checks": ListOf(str), "benchmark": str,
                  "preset": str, "metric_explanation": str, "runs": ListOf({"metric_name": str})}  # fmt: skip
OUTCOME_FIELDS = {"energy": {"total_kwh": NUMBER}, "samples": int, "train_samples_per_s": NUMBER, "system": dict}
JOB_FIELDS = {"system": str, "layout": str}


def read_summary(run_dir: Path) -> dict:
    return read_record(Path(run_dir) / SUMMARY, SUMMARY_FIELDS)


def metric_name(summary: dict) -> str:
    """The eval metric's name the summary's runs give (the first that names one; a null list of runs names none),
    else "eval metric"."""
    return next((r["metric_name"] for r in summary.get("runs") or [] if r.get("metric_name")), "eval metric")


def read_outcome(path: Path) -> dict:
    """A run_<i>.json, its energy whole where it has one (the report adds its total_kwh)."""
    outcome = read_record(path, OUTCOME_FIELDS)
    if outcome.get("energy") is not None and not isinstance(outcome["energy"].get("total_kwh"), NUMBER):
        raise UserError(f"{path}: field energy.total_kwh is missing; restore the file from the run, or remove it")
    return outcome


def read_job(run_dir: Path) -> dict:
    return read_record(Path(run_dir) / "job.json", JOB_FIELDS, whole=True)


def _event_problem(event: Any) -> str | None:
    """What of an MLPerf event the reports read is missing or of another kind; None where nothing is."""
    if not isinstance(event, dict):
        return "is not a JSON object"
    if not isinstance(event.get("key"), str):
        return "has no key"
    key, problem = event["key"], fields_problem(event, {"time_ms": NUMBER, "metadata": dict})
    if problem is None and key in (constants.RUN_START, constants.RUN_STOP) and event.get("time_ms") is None:
        problem = "lacks time_ms"
    if problem is None and key == constants.RUN_STOP:
        problem = fields_problem(event.get("metadata") or {}, {"status": str}, "metadata.")
    if problem is None and key == constants.EVAL_ACCURACY:
        problem = _problem(event.get("value"), NUMBER, "value") or fields_problem(
            event.get("metadata") or {}, {"samples_count": int, "epoch_num": NUMBER}, "metadata.")  # fmt: skip
    if problem is None and key == constants.SUBMISSION_BENCHMARK:
        problem = _problem(event.get("value"), str, "value")
    return problem


def log_events(log: Path) -> list[dict]:
    """The events of an MLPerf log, each with the fields the reports read of the kinds they read them as; else one
    sentence naming the log and the event."""
    events = read_log(log, errors="replace")
    for n, event in enumerate(events, 1):
        problem = _event_problem(event)
        if problem:
            key = f" ({event['key']})" if isinstance(event, dict) and isinstance(event.get("key"), str) else ""
            raise UserError(f"{log}: MLPerf event {n}{key[:60]} {problem}; it is not a log trainbench wrote (run the "
                            "benchmark again)")  # fmt: skip
    return events


def energy_of(run_dir: Path, window: tuple[float, float]) -> dict | None:
    """The runs' energy from the GPU telemetry files, or one sentence where one is not what telemetry writes."""
    try:
        return run_energy(run_dir, *window)
    except (ValueError, TypeError, KeyError, csv.Error, UnicodeDecodeError) as exc:
        raise UserError(f"the GPU telemetry files of {run_dir} (telemetry_*_gpu*.csv) are not what trainbench "
                        f"writes ({type(exc).__name__}: {exc}); remove or restore them") from None  # fmt: skip


# Where a folder's summary.json is gone, the ruleset comes from its logs' submission_benchmark.
NO_SUMMARY = "no summary.json beside it says which compliance ruleset applies"
MAX_DROPPED = 1  # MLPerf: one non-converged run may be dropped (unet3d allows 4; none here)


@dataclass
class RunScore:
    index: int
    log: str
    status: str  # success, aborted, unfinished
    compliant: bool
    compliance_reason: str
    time_to_train_min: float | None
    samples: int | None
    train_samples_per_s: float | None
    final_metric: float | None
    energy: dict | None
    start_ms: float | None = None  # the log's run_start (Unix ms)

    @property
    def counts(self) -> bool:
        return self.compliant and self.time_to_train_min is not None


@dataclass
class Score:
    runs: list[RunScore]
    score_min: float | None
    valid: bool
    reason: str
    required_runs: int | None = None
    counted: list[int] = field(default_factory=list)  # run indices averaged
    ruleset: str | None = None  # the mlperf-logging ruleset the logs were checked under


def score_runs(times: list[float | None], max_dropped: int = MAX_DROPPED) -> tuple[float | None, bool, str, list[int]]:
    """Olympic score of run times in minutes (None: the run does not count). Returns (score, valid, reason,
    indices averaged)."""
    n = len(times)
    failed = sum(t is None for t in times)
    if failed > max_dropped:
        return None, False, f"{failed} of {n} runs did not count; at most {max_dropped} may be dropped", []
    order = sorted((t, i) for i, t in enumerate(times) if t is not None)
    # Drop the fastest max_dropped and the slowest (max_dropped - failed): failed runs are the slowest.
    kept = order[max_dropped : len(order) - (max_dropped - failed)]
    if not kept:
        return None, False, f"{n} run(s): too few for an olympic mean (at least {2 * max_dropped + 1})", []
    score = sum(t for t, _ in kept) / len(kept)
    note = f"mean of {len(kept)} of {n} runs (fastest and slowest dropped"
    note += f", {failed} non-counting run dropped as the slowest)" if failed else ")"
    return score, True, note, [i for _, i in kept]


def score_folder(run_dir: Path, ruleset: str | None = None) -> Score:
    """Every run of a results folder, checked and scored."""
    from mlperf_logging.benchmark_meta import get_result_file_counts

    run_dir = Path(run_dir)
    summary = read_summary(run_dir)
    runs, benchmark = [], summary.get("mlperf_benchmark")
    indices = run_indices(run_dir)
    if not indices:
        raise UserError(f"{run_dir} holds no runs (no result_<i>.txt, result_<i>.txt.partial or run_<i>.json); "
                        "give the folder `trainbench run` printed")  # fmt: skip
    one_benchmark(run_dir, [RunFiles(run_dir, i).log for i in indices if RunFiles(run_dir, i).log.exists()])
    for i in indices:
        files = RunFiles(run_dir, i)
        outcome = read_outcome(files.outcome)
        if not files.log.exists():
            runs.append(RunScore(i, files.partial_log.name, "unfinished", False, "no run_stop (the run did not "
                                 "finish)", None, None, None, None, None))  # fmt: skip
            continue
        events = log_events(files.log)
        benchmark = benchmark or submission_benchmark(events)
        if ruleset is None:
            ruleset = summary.get("ruleset") or ruleset_of(benchmark, files.log, NO_SUMMARY)
        check = check_compliance(files.log, ruleset, waived=frozenset(summary.get("waived_checks") or []),
                                 own=is_own(benchmark))  # fmt: skip
        window = run_window(events)
        ttt = None if window is None else (window[1] - window[0]) / 60_000
        energy = outcome.get("energy")
        if energy is None and window is not None:
            energy = energy_of(run_dir, window)
        # The log is the record: status, time to train, the final metric and the samples come from it;
        # run_<i>.json adds only what the log does not hold (throughput, energy).
        stop = next((e for e in events if e["key"] == constants.RUN_STOP), {})
        evals = [e for e in events if e["key"] == constants.EVAL_ACCURACY]
        meta = (evals[-1].get("metadata") or {}) if evals else {}
        runs.append(
            RunScore(
                index=i,
                log=files.log.name,
                status=(stop.get("metadata") or {}).get("status", "unknown"),
                compliant=check.ok,
                compliance_reason=check.reason(),
                time_to_train_min=ttt,
                samples=meta.get("samples_count", meta.get("epoch_num", outcome.get("samples"))),
                train_samples_per_s=outcome.get("train_samples_per_s"),
                final_metric=evals[-1]["value"] if evals else None,
                energy=energy,
                start_ms=None if window is None else window[0],
            )
        )
    required = get_result_file_counts("training").get(benchmark) if benchmark else None
    score, valid, reason, counted = score_runs([r.time_to_train_min if r.counts else None for r in runs])
    if valid and required and len(runs) < required:
        reason += f"; MLPerf asks for {required} runs of {benchmark}, this folder has {len(runs)}"
    return Score(runs, score, valid, reason, required, counted, ruleset)


def one_benchmark(run_dir: Path, logs: list[Path]) -> str | None:
    """The one MLPerf benchmark every finished log of ``run_dir`` (and its summary.json) names; a folder whose logs
    name several is refused in one sentence naming them (it would be scored, or packaged, as one)."""
    named: dict[str, list[str]] = {}
    for log in logs:
        name = submission_benchmark(log_events(log))
        if name:  # a log naming none is broken, not another benchmark's: the checker says so
            named.setdefault(name, []).append(log.name)
    expected = read_summary(run_dir).get("mlperf_benchmark")
    if expected:
        named.setdefault(expected, []).append(SUMMARY)
    if len(named) > 1:
        parts = "; ".join(f"{', '.join(files)}: {name}" for name, files in sorted(named.items()))
        raise UserError(f"{run_dir} mixes benchmarks ({parts}); a results folder holds the runs of one benchmark: "
                        "move the others to a folder of their own")  # fmt: skip
    return next(iter(named), None)


def folder_benchmark(run_dir: Path, logs: list[Path]) -> tuple[str, str]:
    """(MLPerf benchmark name, compliance ruleset) of a results folder: from its summary.json, else from its first
    log's ``submission_benchmark`` through the benchmark registry."""
    summary = read_summary(run_dir)
    one_benchmark(run_dir, logs)
    name = summary.get("mlperf_benchmark") or submission_benchmark(log_events(logs[0]))
    return name, summary.get("ruleset") or ruleset_of(name, logs[0], NO_SUMMARY)


def folder_config(path: Path):
    """(benchmark, config) of a results folder's config.yaml, for `check` and `package`; one sentence where it is not
    a config trainbench saved (:func:`trainbench.launch.local.load_run_config` says which)."""
    from trainbench.resolve import load_run_config

    return load_run_config(path)
