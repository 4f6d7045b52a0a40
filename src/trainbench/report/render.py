"""A results folder as a report: report.md and a self-contained report.html (plots embedded), PNGs in plots/."""

from __future__ import annotations

import base64
import csv
import html
import json
import math
import re
from pathlib import Path

from trainbench.errors import UserError
from trainbench.report.scoring import NUMBER, Score, fields_problem, read_job, read_outcome, read_summary, score_folder
from trainbench.runfiles import CONFIG, METRICS, read_json

# The fields of a metrics.jsonl row the plots read, and their kinds (an eval row adds the benchmark's metric).
METRIC_FIELDS = {"run": int, "step": int, "samples": NUMBER, "loss": NUMBER, "samples_per_s": NUMBER,
                 "time_ms": NUMBER}  # fmt: skip


def _metrics(run_dir: Path, metric_name: str | None = None) -> list[dict]:
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


def _telemetry(run_dir: Path) -> dict[str, list[dict]]:
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


def make_plots(run_dir: Path, target: float | None, metric_name: str) -> list[tuple[str, Path]]:
    """PNG plots into run_dir/plots; returns (title, path) pairs for those that have data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = run_dir / "plots"
    folder.mkdir(exist_ok=True)
    rows = _metrics(run_dir, metric_name)
    runs = sorted({r.get("run") or 0 for r in rows})
    plots = []

    def save(fig, name, title):
        fig.tight_layout()
        path = folder / name
        fig.savefig(path, dpi=90)
        plt.close(fig)
        plots.append((title, path))

    def per_run(key):
        for run in runs:
            pts = [(r["samples"], r[key]) for r in rows if (r.get("run") or 0) == run
                   and r.get(key) is not None and r.get("samples") is not None]  # fmt: skip
            if pts:
                yield run, pts

    evals = list(per_run(metric_name))
    if evals:
        fig, ax = plt.subplots(figsize=(7, 3.6))
        for run, pts in evals:
            ax.plot(*zip(*pts, strict=True), marker="o", label=f"run {run}")
        if target is not None:
            ax.axhline(target, color="red", linestyle="--", label=f"target {target}")
        ax.set(xlabel="samples", ylabel=metric_name, title=f"{metric_name} vs samples")
        ax.legend(fontsize=7)
        save(fig, "eval.png", f"{metric_name} vs samples")
    losses = list(per_run("loss"))
    if losses:
        fig, ax = plt.subplots(figsize=(7, 3.6))
        for run, pts in losses:
            ax.plot(*zip(*pts, strict=True), label=f"run {run}", linewidth=1)
        ax.set(xlabel="samples", ylabel="training loss", title="loss vs samples")
        ax.legend(fontsize=7)
        save(fig, "loss.png", "loss vs samples")
    rates = [r for r in rows if r.get("samples_per_s") is not None and r.get("time_ms") is not None]
    if rates:
        fig, ax = plt.subplots(figsize=(7, 3.6))
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
    telemetry = _telemetry(run_dir)
    gpu = {k: v for k, v in telemetry.items() if "_gpu" in k}
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
    cpu = {k: v for k, v in telemetry.items() if k.endswith("_cpu")}
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


def _fmt(value, digits=3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def score_table(score: Score) -> tuple[list[str], list[list[str]]]:
    head = [
        "run",
        "status",
        "compliance",
        "time to train (min)",
        "samples",
        "samples/s",
        "final metric",
        "energy (kWh)",
        "in the score",
    ]
    body = []
    for r in score.runs:
        energy = None if not r.energy else r.energy["total_kwh"]
        body.append([
            str(r.index), r.status, "pass" if r.compliant else f"fail: {r.compliance_reason[:80]}",
            _fmt(r.time_to_train_min), _fmt(r.samples), _fmt(r.train_samples_per_s, 1), _fmt(r.final_metric, 4),
            _fmt(energy, 6), _in_score(score, r),
        ])  # fmt: skip
    return head, body


def _in_score(score: Score, run) -> str:
    """Whether the olympic mean averages this run, or why it drops it."""
    if not score.valid:
        return "-"
    if run.index in score.counted:
        return "averaged"
    if not run.counts:
        return "dropped: does not count"
    fastest = min(r.time_to_train_min for r in score.runs if r.index in score.counted)
    return "dropped: fastest" if run.time_to_train_min <= fastest else "dropped: slowest"


def notes(score: Score, benchmark: str | None) -> list[str]:
    """What a reader comparing machines needs beside the table."""
    from trainbench.benchmarks import is_own

    out = []
    if is_own(benchmark):
        out.append(f"{benchmark} is not an MLPerf benchmark: its logs are checked by mlperf-logging's rules common to "
                   "every benchmark and trainbench's own log checks, and no MLPerf reference convergence applies; its "
                   "times compare with its own runs only.")  # fmt: skip
    if score.runs and all(r.energy is None for r in score.runs):
        out.append("Energy is empty: it needs GPU telemetry during the run (NVIDIA GPUs with NVML, "
                   "output.telemetry_hz > 0); a CPU run records power only where the CPU reports it.")  # fmt: skip
    if score.required_runs and len(score.runs) < score.required_runs:
        out.append(f"MLPerf asks for {score.required_runs} runs of {benchmark or 'this benchmark'}; this folder has "
                   f"{len(score.runs)} (trainbench run --nexp {score.required_runs}).")  # fmt: skip
    return out


def system_line(run_dir: Path, job: dict) -> str:
    """The machine the runs ran on, from the first outcome file that records it, and the system file if any."""
    outcomes = (read_outcome(p) for p in sorted(run_dir.glob("run_*.json")))
    found = next((o["system"] for o in outcomes if o.get("system")), {})
    parts = [job["system"]] if job.get("system") else []
    parts += [f"{k} {v}" for k, v in found.items() if k not in ("host", "executable")]
    return "; ".join(parts) or "not recorded (runs made before trainbench recorded the machine)"


def preflight_lines(run_dir: Path) -> list[str]:
    """What each job's preflight measured (launch/preflight.py): its nodes and the all-reduce's bus bandwidth."""
    out = []
    for path in sorted(run_dir.glob("preflight_*.json")):
        p = read_json(path)
        a = p.get("allreduce") if isinstance(p.get("allreduce"), dict) else {}
        try:
            nodes = ", ".join(map(str, p["nodes"]))
            out.append(f"Preflight of run {int(p['index'])}: {len(p['nodes'])} node(s) ({nodes}), "
                       f"{int(p['ranks'])} ranks on {p['device']}; all-reduce of {int(a['bytes']) >> 20} MiB: bus "
                       f"bandwidth {float(a['bus_gb_per_s']):.2f} GB/s ({p.get('time', '')}).")  # fmt: skip
        except (KeyError, TypeError, ValueError):
            out.append(f"Preflight record {path.name} is not what the preflight writes; left out.")
    return out


def write_report(run_dir: Path) -> tuple[Path, Path, Score]:
    """report.md and report.html in the results folder; returns their paths and the score."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"results folder {run_dir} does not exist")
    score = score_folder(run_dir)
    config = (run_dir / CONFIG).read_text(errors="replace") if (run_dir / CONFIG).exists() else f"(no {CONFIG})"
    job = read_job(run_dir)
    summary = read_summary(run_dir)
    target = _target(config)
    metric = next((r.get("metric_name") for r in summary.get("runs", []) if r.get("metric_name")), "eval metric")
    plots = make_plots(run_dir, target, metric)
    head, body = score_table(score)
    score_line = (
        f"**Score: {score.score_min:.3f} minutes** ({score.reason})" if score.score_min is not None
        else f"**No valid score**: {score.reason}"
    )  # fmt: skip
    if score.ruleset:
        score_line += f". Logs checked under mlperf-logging's ruleset {score.ruleset}."
    system = system_line(run_dir, job)
    title = f"{summary.get('benchmark', 'benchmark')}/{summary.get('preset', '')} — {run_dir.name}"

    layout = f", layout {job['layout']}" if "layout" in job else ""
    extra = notes(score, summary.get("mlperf_benchmark")) + preflight_lines(run_dir)
    explanation = summary.get("metric_explanation") or _metric_explanation(summary.get("benchmark"))
    if explanation:
        extra.append(explanation)
    md = [f"# {md_text(title)}", "", md_text(score_line, keep_bold=True), "", f"System: {md_text(system + layout)}",
          ""]  # fmt: skip
    md += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    md += ["| " + " | ".join(md_text(c) for c in row) + " |" for row in body]
    md += ["", *(md_text(n) for n in extra)]
    fence = md_fence(config)
    md += [
        "",
        *(f"![{md_text(t)}](plots/{p.name})" for t, p in plots),
        "",
        "## Config",
        "",
        f"{fence}yaml",
        config.rstrip(),
        fence,
        "",
    ]
    md_path = run_dir / "report.md"
    md_path.write_text("\n".join(md))

    def img(path: Path) -> str:
        return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()

    esc = html.escape
    rows_html = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in body)
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>
<style>body{{font-family:sans-serif;margin:2em 3%;color:#222}}
table{{border-collapse:collapse}}td,th{{border:1px solid #bbb;padding:3px 8px;font-size:13px}}
th{{background:#eee}}img{{max-width:100%;display:block;margin:1em 0}}
pre{{background:#f6f6f6;padding:1em;font-size:12px}}
.score{{font-size:1.3em}}</style></head><body>
<h1>{esc(title)}</h1>
<p class="score">{esc(score_line.replace("**", ""))}</p>
<p>System: {esc(system + layout)}</p>
<table><tr>{"".join(f"<th>{esc(h)}</th>" for h in head)}</tr>{rows_html}</table>
{"".join(f"<p>{esc(n)}</p>" for n in extra)}
{"".join(f'<h2>{esc(t)}</h2><img alt="{esc(t)}" src="{img(p)}">' for t, p in plots)}
<h2>Config</h2><pre>{esc(config)}</pre>
</body></html>
"""
    html_path = run_dir / "report.html"
    html_path.write_text(page)
    return md_path, html_path, score


def md_text(text: str, keep_bold: bool = False) -> str:
    """Text from a results folder as Markdown that shows it as it is: HTML, links, images and code spans written
    into a field are shown, never rendered (a crafted folder would otherwise put its HTML into the report), and a
    '|' or a line break cannot cut a table row."""
    out = html.escape(" ".join(str(text).split()), quote=False)
    for c in "\\`[]|":
        out = out.replace(c, "\\" + c)
    if not keep_bold:
        out = out.replace("*", "\\*")
    return out


def md_fence(text: str) -> str:
    """A code fence longer than any run of backticks in ``text``, so the text cannot close it."""
    return "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", text)), default=0))


def _target(config_text: str) -> float | None:
    import yaml

    try:
        return float(yaml.safe_load(config_text)["eval"]["target"])
    except Exception:
        return None


def compare(a: Path, b: Path) -> tuple[list[str], list[list[str]]]:
    """Side by side: score, mean throughput, mean energy per run, and the ratio B/A."""
    sa, sb = score_folder(a), score_folder(b)

    def mean(values):
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    def energy(score):
        return mean([r.energy["total_kwh"] for r in score.runs if r.energy])

    rows = []
    for name, va, vb in [
        ("score (min)", sa.score_min, sb.score_min),
        ("mean time to train (min)", mean([r.time_to_train_min for r in sa.runs]),
         mean([r.time_to_train_min for r in sb.runs])),
        ("mean samples/s", mean([r.train_samples_per_s for r in sa.runs]),
         mean([r.train_samples_per_s for r in sb.runs])),
        ("mean energy per run (kWh)", energy(sa), energy(sb)),
        ("runs (counted)", len(sa.counted), len(sb.counted)),
    ]:  # fmt: skip
        ratio = vb / va if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va else None
        rows.append([name, _fmt(va, 4), _fmt(vb, 4), _fmt(ratio, 3)])
    return ["", f"A: {Path(a).name}", f"B: {Path(b).name}", "B/A"], rows


def _metric_explanation(benchmark: str | None) -> str:
    """What the metric of a folder written before summary.json kept it is, from the registered benchmark."""
    from trainbench.benchmarks import registry

    bench = registry().get(benchmark or "")
    return bench.metric_explanation if bench is not None else ""
