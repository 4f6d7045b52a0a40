"""The plots of the reports: a results folder's curves against samples, its throughput and its telemetry (PNGs in
plots/), and two folders' curves overlaid for `report A B`. An eval is a point: nothing was measured between two
evals, so no line joins them."""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from trainbench.errors import UserError
from trainbench.report.scoring import NUMBER, fields_problem
from trainbench.runfiles import METRICS

# The fields of a metrics.jsonl row the plots read, and their kinds (an eval row adds the benchmark's metric).
METRIC_FIELDS = {"run": int, "step": int, "samples": NUMBER, "loss": NUMBER, "samples_per_s": NUMBER,
                 "time_ms": NUMBER}  # fmt: skip
SIZE = (7, 3.6)  # inches, at DPI: 630 x 324 pixels
DPI = 90


def metrics(run_dir: Path, metric_name: str | None = None) -> list[dict]:
    """metrics.jsonl's rows; a resumed run logs the steps after its checkpoint again, and its later row wins. A
    line cut short (a killed run) is skipped; a row whose fields are of other kinds is one sentence naming it."""
    path = run_dir / METRICS
    fields = METRIC_FIELDS | ({metric_name: NUMBER} if metric_name else {})
    rows: dict[tuple, dict] = {}
    for n, line in enumerate(path.read_text(errors="replace").splitlines() if path.exists() else [], 1):
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(row, dict):
            problem = fields_problem(row, fields)
            if problem:
                raise UserError(f"{path}, line {n}: {problem}; restore the file from the run, or remove it")
            rows[(row.get("run"), row.get("step"), "loss" in row)] = row
    return list(rows.values())


def telemetry(run_dir: Path) -> dict[str, list[dict]]:
    """Each telemetry CSV's rows; one that is not CSV text is one sentence naming it."""
    out = {}
    for path in sorted(run_dir.glob("telemetry_*.csv")):
        try:
            with open(path, newline="", errors="replace") as f:
                out[path.stem.removeprefix("telemetry_")] = list(csv.DictReader(f))
        except csv.Error as exc:
            raise UserError(f"{path} is not a telemetry CSV trainbench wrote ({exc}); remove or restore it") from None
    return out


def _float(value) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _series(rows: list[dict], key: str, t0: float) -> list[tuple[float, float]]:
    """(seconds since t0, value) of the rows that have both as finite numbers."""
    pts = [(_float(r.get("time_ms")), _float(r.get(key))) for r in rows]
    return [((t - t0) / 1000, v) for t, v in pts if t is not None and v is not None]


def per_run(rows: list[dict], key: str) -> Iterator[tuple[int, list[tuple[float, float]]]]:
    """(run, [(samples, value)]) of every run with rows that hold ``key``."""
    for run in sorted({r.get("run") or 0 for r in rows}):
        pts = [(r["samples"], r[key]) for r in rows if (r.get("run") or 0) == run
               and r.get(key) is not None and r.get("samples") is not None]  # fmt: skip
        if pts:
            yield run, pts


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    plt = _pyplot()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    plt.close(fig)
    return buffer.getvalue()


def _evals(ax, pts, **style) -> None:
    """Evals as points only: the metric is known at each eval, not between two."""
    ax.plot(*zip(*pts, strict=True), marker="o", linestyle="none", markersize=5, **style)


def make_plots(run_dir: Path, target: float | None, metric_name: str) -> list[tuple[str, Path]]:
    """PNG plots into run_dir/plots; returns (title, path) pairs for those that have data."""
    plt = _pyplot()
    folder = run_dir / "plots"
    folder.mkdir(exist_ok=True)
    rows = metrics(run_dir, metric_name)
    runs = sorted({r.get("run") or 0 for r in rows})
    plots = []

    def save(fig, name, title):
        path = folder / name
        path.write_bytes(_png(fig))
        plots.append((title, path))

    evals = list(per_run(rows, metric_name))
    if evals:
        fig, ax = plt.subplots(figsize=SIZE)
        for run, pts in evals:
            _evals(ax, pts, label=f"run {run}")
        if target is not None:
            ax.axhline(target, color="red", linestyle="--", linewidth=1, label=f"target {target}")
        ax.set(xlabel="samples trained", ylabel=metric_name, title=f"{metric_name} at each eval (one point an eval)")
        ax.set_xlim(left=0)
        ax.legend(fontsize=7)
        save(fig, "eval.png", f"{metric_name} vs samples, one point an eval")
    losses = list(per_run(rows, "loss"))
    if losses:
        fig, ax = plt.subplots(figsize=SIZE)
        for run, pts in losses:
            ax.plot(*zip(*pts, strict=True), label=f"run {run}", linewidth=1)
        ax.set(xlabel="samples trained", ylabel="training loss", title="training loss vs samples")
        ax.set_xlim(left=0)
        ax.legend(fontsize=7)
        save(fig, "loss.png", "training loss vs samples")
    rates = [r for r in rows if r.get("samples_per_s") is not None and r.get("time_ms") is not None]
    if rates:
        fig, ax = plt.subplots(figsize=SIZE)
        for run in runs:
            pts = [r for r in rates if (r.get("run") or 0) == run]
            if pts:
                t0 = pts[0]["time_ms"]
                ax.plot(
                    [(r["time_ms"] - t0) / 1000 for r in pts], [r["samples_per_s"] for r in pts], label=f"run {run}"
                )
        ax.set(xlabel="seconds since the run's first record", ylabel="samples/s", title="throughput over time")
        ax.legend(fontsize=7)
        save(fig, "throughput.png", "samples/s over time")
    measured = telemetry(run_dir)
    gpu = {k: v for k, v in measured.items() if "_gpu" in k}
    if gpu:
        fields = [("power_w", "power (W)"), ("gpu_temp_c", "GPU temperature (C)"), ("sm_clock_mhz", "SM clock (MHz)")]
        fig, axes = plt.subplots(len(fields), 1, figsize=(7, 2.4 * len(fields)), sharex=True)
        t0 = min((t for series in gpu.values() for r in series if (t := _float(r.get("time_ms"))) is not None),
                 default=0.0)  # fmt: skip
        for (key, label), ax in zip(fields, axes, strict=True):
            for name, series in gpu.items():
                pts = _series(series, key, t0)
                if pts:
                    ax.plot(*zip(*pts, strict=True), label=name, linewidth=1)
            ax.set_ylabel(label)
        axes[-1].set_xlabel("seconds")
        axes[0].legend(fontsize=6, ncol=4)
        save(fig, "gpu.png", "per-GPU power, temperature and SM clock")
    cpu = {k: v for k, v in measured.items() if k.endswith("_cpu")}
    if cpu and not gpu:
        fig, ax = plt.subplots(figsize=(7, 3))
        for name, series in cpu.items():
            t0 = next((t for r in series if (t := _float(r.get("time_ms"))) is not None), 0.0)
            pts = _series(series, "cpu_util_pct", t0)
            if pts:
                ax.plot(*zip(*pts, strict=True), label=name)
        ax.set(xlabel="seconds", ylabel="CPU utilisation (%)", title="CPU utilisation (no GPU telemetry)")
        ax.legend(fontsize=7)
        save(fig, "cpu.png", "CPU utilisation (no GPU telemetry: a CPU run, or no NVML)")
    return plots


@dataclass(frozen=True)
class Curves:
    """One folder's side of an overlay: its label, its metrics rows, the metric's name and its target."""

    label: str
    rows: list[dict]
    metric_name: str
    target: float | None


COLOURS = ("tab:blue", "tab:orange")


def overlay(sides: list[Curves]) -> list[tuple[str, bytes]]:
    """The folders' eval metric (points) and training loss (lines) against samples on shared axes, one colour a
    folder; (title, PNG) pairs of those with data."""
    plt = _pyplot()
    out = []
    metrics_named = sorted({s.metric_name for s in sides})
    evals = [(s, colour, list(per_run(s.rows, s.metric_name))) for s, colour in zip(sides, COLOURS, strict=False)]
    if any(pts for _, _, pts in evals):
        fig, ax = plt.subplots(figsize=SIZE)
        for side, colour, runs in evals:
            for n, (_, pts) in enumerate(runs):
                _evals(ax, pts, color=colour, label=side.label if n == 0 else None)
        for side, colour, _ in evals:
            if side.target is not None:
                ax.axhline(side.target, color=colour, linestyle="--", linewidth=1, label=f"target of {side.label}")
        name = " / ".join(metrics_named)
        ax.set(xlabel="samples trained", ylabel=name, title=f"{name} at each eval (one point an eval)")
        ax.set_xlim(left=0)
        ax.legend(fontsize=7)
        out.append((f"{name} vs samples, both folders", _png(fig)))
    losses = [(s, colour, list(per_run(s.rows, "loss"))) for s, colour in zip(sides, COLOURS, strict=False)]
    if any(pts for _, _, pts in losses):
        fig, ax = plt.subplots(figsize=SIZE)
        for side, colour, runs in losses:
            for n, (_, pts) in enumerate(runs):
                ax.plot(*zip(*pts, strict=True), color=colour, linewidth=1, label=side.label if n == 0 else None)
        ax.set(xlabel="samples trained", ylabel="training loss", title="training loss vs samples")
        ax.set_xlim(left=0)
        ax.legend(fontsize=7)
        out.append(("training loss vs samples, both folders", _png(fig)))
    return out
