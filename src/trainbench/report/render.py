"""A results folder as a report: report.md and a self-contained report.html (plots embedded), PNGs in plots/. The
headline card comes first (report/headline.py), then the runs' table, the plots and the config."""

from __future__ import annotations

from pathlib import Path

from trainbench.errors import UserError
from trainbench.report.headline import Headline, card_html, card_md, for_runs, read_config
from trainbench.report.page import document, esc, image, md_fence, md_text, table
from trainbench.report.plots import make_plots
from trainbench.report.scoring import Score, metric_name, read_job, read_outcome, read_summary, score_folder
from trainbench.runfiles import CONFIG, read_json

__all__ = ["compare", "md_fence", "md_text", "write_report"]


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


def machine_part(key: str, value) -> str:
    """One field of a run's machine record as the report shows it: the trainbench that ran as its version (commit)."""
    if key == "trainbench" and isinstance(value, dict):
        from trainbench.version import describe

        return describe(value)
    return f"{key} {value}"


def system_line(run_dir: Path, job: dict) -> str:
    """The machine the runs ran on, from the first outcome file that records it, and the system file if any."""
    outcomes = (read_outcome(p) for p in sorted(run_dir.glob("run_*.json")))
    found = next((o["system"] for o in outcomes if o.get("system")), {})
    parts = [job["system"]] if job.get("system") else []
    parts += [machine_part(k, v) for k, v in found.items() if k not in ("host", "executable")]
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


def write_report(run_dir: Path) -> tuple[Path, Path, Score, Headline]:
    """report.md and report.html in the results folder; returns their paths, the score and the headline."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"results folder {run_dir} does not exist")
    score = score_folder(run_dir)
    config, _ = read_config(run_dir)
    config = config or f"(no {CONFIG})"
    job = read_job(run_dir)
    summary = read_summary(run_dir)
    headline = for_runs(run_dir, score, summary, job)
    target = target_of(config)
    metric = metric_name(summary)
    plots = make_plots(run_dir, target, metric)
    head, body = score_table(score)
    system = system_line(run_dir, job)
    title = f"{summary.get('benchmark', 'benchmark')}/{summary.get('preset', '')} — {run_dir.name}"

    layout = f", layout {job['layout']}" if "layout" in job else ""
    extra = notes(score, summary.get("mlperf_benchmark")) + preflight_lines(run_dir)
    if score.ruleset:
        extra.append(f"Logs checked under mlperf-logging's ruleset {score.ruleset}.")
    explanation = summary.get("metric_explanation") or _metric_explanation(summary.get("benchmark"))
    if explanation:
        extra.append(explanation)
    md = [f"# {md_text(title)}", "", *card_md(headline), f"System: {md_text(system + layout)}", ""]
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
    page = document(title, f"<h1>{esc(title)}</h1>\n{card_html(headline)}\n<p>System: {esc(system + layout)}</p>\n"
                           f"{table(head, body)}\n{''.join(f'<p>{esc(n)}</p>' for n in extra)}\n"
                           f"{''.join(image(t, p.read_bytes()) for t, p in plots)}\n"
                           f"<h2>Config</h2><pre>{esc(config)}</pre>")  # fmt: skip
    html_path = run_dir / "report.html"
    html_path.write_text(page)
    return md_path, html_path, score, headline


def target_of(config_text: str) -> float | None:
    import yaml

    try:
        return float(yaml.safe_load(config_text)["eval"]["target"])
    except Exception:
        return None


def compare(a: Path, b: Path) -> tuple[list[str], list[list[str]]]:
    """Side by side: score, mean throughput, mean energy per run, and the ratio B/A."""
    return compare_scores(score_folder(a), score_folder(b), Path(a).name, Path(b).name)


def compare_scores(sa: Score, sb: Score, name_a: str, name_b: str) -> tuple[list[str], list[list[str]]]:
    """:func:`compare` of two folders' scores."""

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
    return ["", f"A: {name_a}", f"B: {name_b}", "B/A"], rows


def _metric_explanation(benchmark: str | None) -> str:
    """What the metric of a folder written before summary.json kept it is, from the registered benchmark."""
    from trainbench.benchmarks import registry

    bench = registry().get(benchmark or "")
    return bench.metric_explanation if bench is not None else ""
