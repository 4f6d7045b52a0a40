"""`trainbench report A B`: two results folders side by side as a self-contained HTML page, with the terminal table
beside it. Two folders of runs: both headline cards, the table of scores and rates with B/A, their curves against
samples overlaid, and what differs between their configs and their machines. Two throughput measurements: their
figures with B/A, and the same diffs. Two different benchmarks are refused unless asked for."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from trainbench.errors import UserError
from trainbench.report import bench_report
from trainbench.report.headline import Headline, card_html, for_bench, for_runs, read_config
from trainbench.report.page import document, esc, image, table
from trainbench.report.scoring import log_events, metric_name, read_job, read_outcome, read_summary, score_folder
from trainbench.runfiles import RunFiles, run_indices

# What names the folder and the run rather than the machine: left out of the system diff.
NOT_THE_MACHINE = ("executable",)


def benchmark_of(folder: Path) -> tuple[str, str]:
    """(benchmark, preset) a folder's runs or measurement ran: bench.json's, else summary.json's, else config.yaml's,
    else the first finished log's submission_benchmark."""
    from trainbench.mlperf import submission_benchmark
    from trainbench.report.headline import config_value

    if bench_report.is_bench(folder):
        result = bench_report.read(folder)
        return result["benchmark"], result["preset"]
    summary, (_, config) = read_summary(folder), read_config(folder)
    name = summary.get("benchmark") or config_value(config, "benchmark", str)
    if not name:
        logs = [RunFiles(folder, i).log for i in run_indices(folder) if RunFiles(folder, i).log.exists()]
        name = submission_benchmark(log_events(logs[0])) if logs else None
    return name or "an unknown benchmark", summary.get("preset") or config_value(config, "preset", str) or "?"


def refuse_different(a: Path, b: Path) -> None:
    """One sentence where ``a`` and ``b`` hold two different benchmarks."""
    (name_a, preset_a), (name_b, preset_b) = benchmark_of(a), benchmark_of(b)
    if name_a != name_b:
        raise UserError(f"{a} holds {name_a}/{preset_a} and {b} holds {name_b}/{preset_b}: two different benchmarks "
                        "train different models to different targets, so their times and rates do not compare; give "
                        "--allow-different to put them side by side anyway")  # fmt: skip


def flatten(value: Any, prefix: str = "") -> dict[str, str]:
    """A loaded config as dotted keys and their values as text."""
    if isinstance(value, dict) and value:
        out: dict[str, str] = {}
        for key, inner in value.items():
            out |= flatten(inner, f"{prefix}.{key}" if prefix else str(key))
        return out
    return {prefix: value if isinstance(value, str) else json.dumps(value, default=str)} if prefix else {}


def diff(a: dict[str, str], b: dict[str, str]) -> list[list[str]]:
    """[key, A's, B's] of every key whose value differs, or that one side lacks ("-")."""
    return [[k, a.get(k, "-"), b.get(k, "-")] for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def machine_of(folder: Path) -> dict[str, str]:
    """What a folder recorded of the machine it ran on: the system file, the layout, nodes and ranks, and what run 0
    (or the measurement's rank 0) recorded: CPU, memory, GPUs and driver, torch, Python, trainbench."""
    from trainbench.report.headline import config_value

    out: dict[str, str] = {}
    if bench_report.is_bench(folder):
        result = bench_report.read(folder)
        out |= {"ranks": str(result["ranks"]), "device": result["device"]}
        if isinstance(result.get("nodes"), int):
            out["nodes"] = str(result["nodes"])
        system = result.get("system") if isinstance(result.get("system"), dict) else {}
    else:
        job = read_job(folder)
        out |= {k: job[k] for k in ("system", "layout") if k in job}
        _, config = read_config(folder)
        for key in ("distributed.nodes", "distributed.nproc"):
            value = config_value(config, key, int)
            if value is not None:
                out[key.split(".")[1]] = str(value)
        outcomes = (read_outcome(RunFiles(folder, i).outcome) for i in run_indices(folder))
        system = next((o["system"] for o in outcomes if o.get("system")), {})
    out |= {k: v if isinstance(v, str) else json.dumps(v, default=str) for k, v in system.items()
            if k not in NOT_THE_MACHINE}  # fmt: skip
    return out


def other_gpus(machine_a: dict[str, str], machine_b: dict[str, str]) -> str | None:
    """One sentence where two folders' machines (:func:`machine_of`) recorded different GPUs (their UUIDs:
    ``system.gpu_ids``; their links, ``system.gpu_links``, named too where both recorded them and they differ), whose
    ratio then holds the machines' own difference as well (two machines of 2 H200 ran one flux1 measurement 15 %
    apart, docs/notes/node.md); None where they ran on the same GPUs or either did not record them."""
    ids = [machine_a.get("gpu_ids"), machine_b.get("gpu_ids")]
    if None in ids or ids[0] == ids[1]:
        return None
    links = [machine_a.get("gpu_links"), machine_b.get("gpu_links")]
    differ = None not in links and links[0] != links[1]
    linked = f", linked differently ({links[0]} against {links[1]})" if differ else ""
    return (
        f"A and B ran on different GPUs ({ids[0]} against {ids[1]}){linked}: B/A includes the difference between "
        "the machines, which can be as large as what is compared; measure both on one machine for a ratio of the code"
    )


def default_out(a: Path, b: Path) -> Path:
    """compare_<A>_vs_<B>.html in the working folder, the names cut to plain characters."""

    def plain(name: str) -> str:
        return re.sub(r"[^A-Za-z0-9._-]", "_", name)[:80] or "folder"

    return Path(f"compare_{plain(Path(a).resolve().name)}_vs_{plain(Path(b).resolve().name)}.html")


def write(a: Path, b: Path, out: Path | None = None,
          allow_different: bool = False) -> tuple[Path, list[str], list[list[str]], str | None]:  # fmt: skip
    """The comparison page of ``a`` and ``b`` at ``out``; returns its path, the table of figures with B/A, and the
    sentence that they ran on different GPUs (:func:`other_gpus`) or None."""
    a, b = Path(a), Path(b)
    measured = [bench_report.is_bench(a), bench_report.is_bench(b)]
    if measured[0] != measured[1]:
        raise UserError("compare a throughput measurement (trainbench bench) with another one, and runs with runs: "
                        f"{(a, b)[measured.index(True)]} is a measurement, the other a run")  # fmt: skip
    if not allow_different:
        refuse_different(a, b)
    name_a, name_b = f"A: {a.name}", f"B: {b.name}"
    if measured[0]:
        head, rows = bench_report.compare(a, b)
        cards = [for_bench(a, bench_report.read(a)), for_bench(b, bench_report.read(b))]
        plots: list[tuple[str, bytes]] = []
    else:
        head, rows, cards, plots = _runs(a, b)
    (_, config_a), (_, config_b) = read_config(a), read_config(b)
    config_diff = diff(flatten(config_a), flatten(config_b))
    machine_a, machine_b = machine_of(a), machine_of(b)
    keys = list(dict.fromkeys([*machine_a, *machine_b]))
    machine_rows = [[k, machine_a.get(k, "-"), machine_b.get(k, "-")] for k in keys]
    differs = ["differs" if ra != rb else "" for _, ra, rb in machine_rows]
    title = f"{a.name} vs {b.name}"
    same = len(set(flatten(config_a)) | set(flatten(config_b))) - len(config_diff)
    config_part = (table(["key", name_a, name_b], config_diff) + f'<p class="muted">{same} other keys are the same.</p>'
                   if config_diff else f"<p>The two configs are the same ({same} keys).</p>")  # fmt: skip
    other = other_gpus(machine_a, machine_b)
    warning = f"<p><b>{esc(other)}</b></p>\n" if other else ""
    body = (f"<h1>{esc(title)}</h1>\n<p>A: {esc(a)}<br>B: {esc(b)}</p>\n"
            f'<div class="cards">{card_html(cards[0], name_a)}{card_html(cards[1], name_b)}</div>\n'
            f"<h2>Side by side</h2>{table(head, rows)}\n{''.join(image(t, png) for t, png in plots)}\n"
            f"{warning}<h2>Config: what differs</h2>{config_part}\n"
            f"<h2>System: what each recorded</h2>{table(['', name_a, name_b], machine_rows, differs)}"
            f'<p class="muted">Rows that differ are marked.</p>')  # fmt: skip
    out = Path(out) if out is not None else default_out(a, b)
    if out.is_dir():
        raise UserError(f"--out {out} is a folder: give the comparison's file name (e.g. {out / default_out(a, b)})")
    try:
        out.write_text(document(title, body))
    except OSError as exc:
        raise UserError(f"cannot write the comparison to {out}: {exc.strerror or exc}") from None
    return out, head, rows, other


def _runs(a: Path, b: Path) -> tuple[list[str], list[list[str]], list[Headline], list[tuple[str, bytes]]]:
    """Two folders of runs: the table with B/A, their cards, their curves overlaid."""
    from trainbench.report.plots import Curves, metrics, overlay
    from trainbench.report.render import compare_scores, target_of

    sides, cards, scores = [], [], []
    for folder, label in ((a, "A"), (b, "B")):
        score, summary = score_folder(folder), read_summary(folder)
        scores.append(score)
        cards.append(for_runs(folder, score, summary, read_job(folder)))
        metric = metric_name(summary)
        text, _ = read_config(folder)
        sides.append(Curves(f"{label}: {folder.name}", metrics(folder, metric), metric, target_of(text)))
    head, rows = compare_scores(scores[0], scores[1], a.name, b.name)
    return head, rows, cards, overlay(sides)
