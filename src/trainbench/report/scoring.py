"""Scores from a results folder: per-run time to train, samples, throughput, energy; the MLPerf score.

The score follows MLPerf's rule as mlperf-logging's result summarizer computes it: a run counts when its
log passes the compliance checker (which includes reaching the target); the fastest and the slowest run
are dropped and the rest averaged. A run that did not count is dropped as the slowest, so one may
fail; two or more make the result invalid. A test checks our number against the summarizer's own code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from trainbench.mlperf import check_compliance
from trainbench.telemetry import run_energy

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


def log_events(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        if ":::MLLOG" in line:
            try:
                out.append(json.loads(line.split(":::MLLOG", 1)[1]))
            except json.JSONDecodeError:
                continue
    return out


def run_window(events: list[dict]) -> tuple[int, int] | None:
    """(run_start, run_stop) times in ms, as the summarizer reads them (the first of each); None if either
    is missing."""
    start = next((e["time_ms"] for e in events if e["key"] == "run_start"), None)
    stop = next((e["time_ms"] for e in events if e["key"] == "run_stop"), None)
    return None if start is None or stop is None else (start, stop)


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
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    ruleset = ruleset or summary.get("ruleset") or "5.0.0"
    indices = sorted(
        {int(p.name.split("_")[1].split(".")[0]) for p in run_dir.glob("result_*.txt*")}
        | {int(p.stem.split("_")[1]) for p in run_dir.glob("run_*.json")}
    )
    runs = []
    for i in indices:
        log = run_dir / f"result_{i}.txt"
        outcome_path = run_dir / f"run_{i}.json"
        outcome = json.loads(outcome_path.read_text()) if outcome_path.exists() else {}
        if not log.exists():
            runs.append(RunScore(i, f"result_{i}.txt.partial", "unfinished", False, "no run_stop (the run did not "
                                 "finish)", None, None, None, None, None))  # fmt: skip
            continue
        events = log_events(log)
        check = check_compliance(log, ruleset, waived=frozenset(summary.get("waived_checks", [])))
        window = run_window(events)
        ttt = None if window is None else (window[1] - window[0]) / 60_000
        energy = outcome.get("energy")
        if energy is None and window is not None:
            energy = run_energy(run_dir, *window)
        runs.append(
            RunScore(
                index=i,
                log=log.name,
                status=outcome.get("status", "unknown"),
                compliant=check.ok,
                compliance_reason=check.reason(),
                time_to_train_min=ttt,
                samples=outcome.get("samples"),
                train_samples_per_s=outcome.get("train_samples_per_s"),
                final_metric=outcome.get("final_metric"),
                energy=energy,
            )
        )
    benchmark = summary.get("mlperf_benchmark", "bert")
    required = get_result_file_counts("training").get(benchmark)
    score, valid, reason, counted = score_runs([r.time_to_train_min if r.counts else None for r in runs])
    if valid and required and len(runs) < required:
        reason += f"; MLPerf asks for {required} runs of {benchmark}, this folder has {len(runs)}"
    return Score(runs, score, valid, reason, required, counted)
