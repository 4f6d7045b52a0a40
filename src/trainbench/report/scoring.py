"""Scores from a results folder: per-run time to train, samples, throughput, energy; the MLPerf score.

The score follows MLPerf's rule as mlperf-logging's result summarizer computes it: a run counts when its
log passes the compliance checker (which includes reaching the target); the fastest and the slowest run
are dropped and the rest averaged. A run that did not count is dropped as the slowest, so one may
fail; two or more make the result invalid. A test checks our number against the summarizer's own code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from trainbench.benchmarks import is_own, ruleset_of
from trainbench.errors import UserError
from trainbench.mlperf import check_compliance, constants, read_log, run_window, submission_benchmark
from trainbench.runfiles import SUMMARY, RunFiles, read_json, run_indices
from trainbench.telemetry import run_energy

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
    summary = read_json(run_dir / SUMMARY)
    runs, benchmark = [], summary.get("mlperf_benchmark")
    indices = run_indices(run_dir)
    if not indices:
        raise UserError(f"{run_dir} holds no runs (no result_<i>.txt, result_<i>.txt.partial or run_<i>.json); "
                        "give the folder `trainbench run` printed")  # fmt: skip
    one_benchmark(run_dir, [RunFiles(run_dir, i).log for i in indices if RunFiles(run_dir, i).log.exists()])
    for i in indices:
        files = RunFiles(run_dir, i)
        outcome = read_json(files.outcome)
        if not files.log.exists():
            runs.append(RunScore(i, files.partial_log.name, "unfinished", False, "no run_stop (the run did not "
                                 "finish)", None, None, None, None, None))  # fmt: skip
            continue
        events = read_log(files.log, errors="replace")
        benchmark = benchmark or submission_benchmark(events)
        if ruleset is None:
            ruleset = summary.get("ruleset") or ruleset_of(benchmark, files.log, NO_SUMMARY)
        check = check_compliance(files.log, ruleset, waived=frozenset(summary.get("waived_checks", [])),
                                 own=is_own(benchmark))  # fmt: skip
        window = run_window(events)
        ttt = None if window is None else (window[1] - window[0]) / 60_000
        energy = outcome.get("energy")
        if energy is None and window is not None:
            energy = run_energy(run_dir, *window)
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
        name = submission_benchmark(read_log(log, errors="replace"))
        if name:  # a log naming none is broken, not another benchmark's: the checker says so
            named.setdefault(name, []).append(log.name)
    expected = read_json(run_dir / SUMMARY).get("mlperf_benchmark")
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
    summary = read_json(run_dir / SUMMARY)
    one_benchmark(run_dir, logs)
    name = summary.get("mlperf_benchmark") or submission_benchmark(read_log(logs[0], errors="replace"))
    return name, summary.get("ruleset") or ruleset_of(name, logs[0], NO_SUMMARY)
