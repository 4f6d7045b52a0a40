"""The headline of a results folder: what a reader looks for first, in one card at the top of its report, in the
index of many folders and side by side in a comparison. For runs: the time to train of one run, or the MLPerf score
and its spread over several (`trainbench run --nexp N`), the compliance verdict, the hardware as the runs recorded
it and the trainbench that ran them. For a throughput measurement (`trainbench bench`): its throughput, never a time
to train."""

from __future__ import annotations

import math
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainbench.report.page import esc, md_text
from trainbench.report.scoring import Score, read_outcome
from trainbench.runfiles import CONFIG


@dataclass(frozen=True)
class Headline:
    benchmark: str
    preset: str
    figure: str
    """The one figure: a time to train, a score, a throughput; or what stands in its place."""
    what: str
    """What the figure is."""
    lines: list[tuple[str, str]] = field(default_factory=list)
    """(label, text) under the figure: spread, compliance, hardware, trainbench."""
    compliant: bool | None = None
    date: str = ""
    status: str = ""
    """A few words for the index: how many runs ended how; or the kind of measurement."""
    hardware: str = ""
    version: str = ""


def read_config(folder: Path) -> tuple[str, dict[str, Any]]:
    """config.yaml's text and its mapping ({} where it is none: a damaged or crafted file is shown, not used)."""
    import yaml

    path = Path(folder) / CONFIG
    text = path.read_text(errors="replace") if path.exists() else ""
    try:
        value = yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError, ValueError):
        value = None
    return text, value if isinstance(value, dict) else {}


def config_value(config: dict[str, Any], dotted: str, kind: type) -> Any:
    """The value at ``dotted`` in a loaded config where it is of ``kind``, else None."""
    value: Any = config
    for key in dotted.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return value if isinstance(value, kind) and not isinstance(value, bool) else None


def minutes(value: float | None) -> str:
    return "-" if value is None else f"{value:,.3f} min"


def when(ms: float | None) -> str:
    """A log's Unix ms as a UTC date and time; "" where there is none (or it is no date)."""
    try:
        return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(ms / 1000)) if ms is not None else ""
    except (OverflowError, OSError, ValueError):
        return ""


def _folder_time(folder: Path) -> str:
    """The time in a results folder's name (``20261128T173614Z-...``, as `run` and `bench` name them)."""
    match = re.match(r"(\d{4})(\d\d)(\d\d)T(\d\d)(\d\d)\d\dZ", Path(folder).name)
    return f"{match[1]}-{match[2]}-{match[3]} {match[4]}:{match[5]} UTC" if match else ""


def version_of(record: dict[str, Any]) -> str | None:
    """The trainbench that wrote a run's record: its ``system.trainbench`` (or a ``trainbench`` of its own), a version
    or {version, commit}; None where the record has none."""
    system = record.get("system") if isinstance(record.get("system"), dict) else {}
    for value in (system.get("trainbench"), record.get("trainbench")):
        if isinstance(value, str):
            return value
        if isinstance(value, dict) and isinstance(value.get("version"), str):
            commit = value.get("commit")
            return value["version"] + (f" ({commit[:12]})" if isinstance(commit, str) and commit else "")
    return None


def versions(records: list[dict[str, Any]]) -> str:
    found = sorted({v for r in records if (v := version_of(r))})
    if not found:
        return "not recorded (made before trainbench recorded its version)"
    return "trainbench " + found[0] if len(found) == 1 else "the runs differ: " + ", ".join(found)


def _text(system: dict[str, Any], key: str) -> str | None:
    value = system.get(key)
    return value if isinstance(value, str) and value.strip() else None


def hardware(systems: list[dict[str, Any]], nodes: int | None, ranks_per_node: int | None,
             system_name: str | None) -> str:  # fmt: skip
    """The machine of the runs as they recorded it: nodes and ranks, GPU and CPU model and count, memory; where the
    runs' records differ, each."""
    scale = []
    if system_name:
        scale.append(f"system {system_name}")
    if nodes:
        ranks = f" x {ranks_per_node} rank{'s' if ranks_per_node != 1 else ''}" if ranks_per_node else ""
        scale.append(f"{nodes} node{'s' if nodes != 1 else ''}{ranks}")
    seen: list[str] = []
    for system in systems:
        parts = []
        gpus, cpu, memory = _text(system, "gpus"), _text(system, "cpu"), _text(system, "memory")
        if gpus:
            parts.append("no GPU" if gpus == "none" else f"GPUs {gpus}")
        if cpu:
            parts.append(f"CPU {cpu}")
        if memory:
            parts.append(f"memory {memory}")
        text = ", ".join(parts)
        if text and text not in seen:
            seen.append(text)
    if not seen:
        machine = "machine not recorded (runs made before trainbench recorded it)"
    elif len(seen) == 1:
        machine = ("each node: " if nodes and nodes > 1 else "") + seen[0]
    else:
        machine = "the runs' records differ: " + " | ".join(seen)
    return "; ".join([*scale, machine])


def _spread(times: list[float]) -> str:
    """Fastest to slowest, and the standard deviation (with Bessel's correction) over their mean."""
    if len(times) < 2:
        return minutes(times[0]) if times else "-"
    mean = sum(times) / len(times)
    sd = math.sqrt(sum((t - mean) ** 2 for t in times) / (len(times) - 1))
    return f"{min(times):,.3f} to {max(times):,.3f} min (standard deviation {sd:,.3f} min, {sd / mean:.1%})"


def _statuses(score: Score) -> str:
    counts = Counter(r.status for r in score.runs)
    n = len(score.runs)
    return f"{n} run{'s' if n != 1 else ''}: " + ", ".join(f"{c} {s}" for s, c in sorted(counts.items()))


def _compliance(score: Score, own: bool) -> tuple[str, bool]:
    rules = f"ruleset {score.ruleset}" if score.ruleset else "no ruleset"
    if own:
        rules += "; not an MLPerf benchmark: the rules common to every benchmark"
    failed = [r for r in score.runs if not r.compliant]
    n = len(score.runs)
    if not failed:
        logs = "the log passes" if n == 1 else f"all {n} logs pass"
        return f"{logs} mlperf-logging's compliance checker ({rules})", True
    first = failed[0]
    return (f"{len(failed)} of {n} logs fail mlperf-logging's compliance checker ({rules}); run {first.index}: "
            f"{' '.join(first.compliance_reason.split())[:200]}", False)  # fmt: skip


def for_runs(folder: Path, score: Score, summary: dict[str, Any], job: dict[str, Any]) -> Headline:
    """The headline of a folder of runs, from its score and its records."""
    from trainbench.benchmarks import is_own
    from trainbench.runfiles import RunFiles

    _, config = read_config(folder)
    benchmark = summary.get("benchmark") or summary.get("mlperf_benchmark") or config_value(config, "benchmark", str)
    benchmark = benchmark or "benchmark"
    preset = summary.get("preset") or config_value(config, "preset", str) or ""
    own = is_own(summary.get("mlperf_benchmark") or benchmark)
    records = [read_outcome(RunFiles(folder, r.index).outcome) for r in score.runs]
    systems = [r["system"] for r in records if isinstance(r.get("system"), dict)]
    machine = hardware(systems, config_value(config, "distributed.nodes", int),
                       config_value(config, "distributed.nproc", int), job.get("system"))  # fmt: skip
    version = versions(records)
    verdict, compliant = _compliance(score, own)
    counting = [r for r in score.runs if r.counts]
    times = [r.time_to_train_min for r in counting]
    needs = (f"{score.required_runs} runs of {summary.get('mlperf_benchmark') or benchmark}" if score.required_runs
             else "at least 3 runs")  # fmt: skip
    ruleset = f" under ruleset {score.ruleset}" if score.ruleset and score.required_runs else ""
    lines: list[tuple[str, str]] = []
    if score.valid:
        figure = minutes(score.score_min)
        what = f"MLPerf score: {score.reason.split('; ')[0]}"
        counted = [r.time_to_train_min for r in score.runs if r.index in score.counted]
        lines.append(("spread", f"the runs averaged: {_spread(counted)}; every run that counts: {_spread(times)}"))
        if score.required_runs and len(score.runs) < score.required_runs:
            lines.append(("not yet a result", f"MLPerf asks for {needs}{ruleset}; this folder has "
                                              f"{len(score.runs)}"))  # fmt: skip
    elif len(score.runs) == 1 and counting:
        figure = minutes(times[0])
        what = "time to train (one run)"
        lines.append(("score", f"a score needs {needs}{ruleset}, the olympic mean of their times (the fastest and the "
                               f"slowest dropped): trainbench run --nexp {score.required_runs or 3}"))  # fmt: skip
    elif counting:
        figure = minutes(times[0]) if len(times) == 1 else f"{min(times):,.3f} to {max(times):,.3f} min"
        what = (f"time to train of the {len(counting)} of {len(score.runs)} runs that count; no MLPerf score: "
                f"{score.reason}")  # fmt: skip
        lines.append(("score", f"a score needs {needs}{ruleset}"))
    else:
        figure = "no time to train"
        what = f"no run counts: {score.reason}" if len(score.runs) > 1 else _why_not(score)
    lines += [("compliance", verdict), ("hardware", machine), ("trainbench", version)]
    starts = [r.start_ms for r in score.runs if r.start_ms is not None]
    return Headline(benchmark, preset, figure, what, lines, compliant, when(min(starts)) if starts else
                    _folder_time(folder), _statuses(score), machine, version)  # fmt: skip


def _why_not(score: Score) -> str:
    run = score.runs[0]
    if run.status == "success":
        return f"run {run.index} reached its target, but its log does not pass the compliance check"
    return f"run {run.index} {run.status}: {' '.join(run.compliance_reason.split())[:200]}"


def for_bench(folder: Path, result: dict[str, Any]) -> Headline:
    """The headline of a throughput measurement's folder (bench.json, read and checked)."""
    system = result.get("system") if isinstance(result.get("system"), dict) else {}
    nodes = result.get("nodes") if isinstance(result.get("nodes"), int) else None
    ranks = result["ranks"]
    per_node = ranks // nodes if nodes else ranks
    machine = f"{ranks} x {result['device']}; " + hardware([system] if system else [], nodes, per_node, None)
    rate = result.get("tokens_per_s")
    figure = f"{rate:,.0f} tokens/s" if isinstance(rate, (int, float)) else "-"
    samples = result.get("samples_per_s")
    lines = [("samples/s", f"{samples:,.2f}" if isinstance(samples, (int, float)) else "-")]
    projection = result.get("projection")
    from trainbench.report.projection import NONE_UNSAID

    why = result.get("projection_none") or NONE_UNSAID
    projected = (f"{projection['minutes']:,.1f} min (from the reference convergence points; a projection, not a "
                 "result)" if projection else f"none ({why})")  # fmt: skip
    lines.append(("projected time to train", projected))
    version = versions([result])
    lines += [("hardware", machine), ("trainbench", version)]
    return Headline(result["benchmark"], result["preset"], figure,
                    f"{result['kind']} ({result['figures']} figures)", lines, None, _folder_time(folder),
                    f"throughput measurement ({result['figures']})", machine, version)  # fmt: skip


def card_html(h: Headline, heading: str = "") -> str:
    """The card: the figure and what it is, then its lines; ``heading`` above them (a comparison names each side)."""
    rows = ""
    for label, text in h.lines:
        ok = h.compliant if label == "compliance" else None
        verdict = "" if ok is None else f' class="{"pass" if ok else "fail"}"'
        rows += f"<dt>{esc(label)}</dt><dd{verdict}>{esc(text)}</dd>"
    top = f"<div><b>{esc(heading)}</b></div>" if heading else ""
    return (f'<div class="card">{top}<div class="what">{esc(h.benchmark)}/{esc(h.preset)} · {esc(h.what)}</div>'
            f'<div class="figure">{esc(h.figure)}</div><dl>{rows}</dl></div>')  # fmt: skip


def card_md(h: Headline) -> list[str]:
    """The card in Markdown: the figure in bold, then a list of its lines (text escaped by md_text)."""
    return [f"**{md_text(h.figure)}** — {md_text(h.what)}", "",
            *(f"- {md_text(label)}: {md_text(text)}" for label, text in h.lines), ""]  # fmt: skip
