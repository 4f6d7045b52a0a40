"""`trainbench report results/`: a folder of many run and bench folders as one index page (index.html), each folder
a row (benchmark, date, status, time to train or throughput, hardware) linked to its own report, which is written
beside it. A folder that cannot be reported is listed with the sentence that says why, and the others still are."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from trainbench.errors import UserError
from trainbench.report import bench_report
from trainbench.report.headline import Headline
from trainbench.report.page import document, esc
from trainbench.runfiles import run_indices

DEPTH = 4  # how deep under the given folder run and bench folders are looked for
INDEX = "index.html"


def is_results(folder: Path) -> bool:
    """A folder of runs (run files) or of a measurement (bench.json)."""
    return bench_report.is_bench(folder) or bool(run_indices(folder))


def results_under(root: Path) -> list[Path]:
    """Every run and bench folder under ``root`` (not ``root`` itself), at most DEPTH folders down; links are not
    followed and hidden folders are passed by, and nothing is looked for inside a results folder."""
    found = []
    for here, folders, _ in os.walk(root):
        depth = len(Path(here).relative_to(root).parts)
        keep = []
        for name in sorted(folders):
            path = Path(here) / name
            if name.startswith(".") or path.is_symlink():
                continue
            if is_results(path):
                found.append(path)
            elif depth + 1 < DEPTH:
                keep.append(name)
        folders[:] = keep
    return found


@dataclass(frozen=True)
class Row:
    folder: Path
    headline: Headline | None
    report: Path | None
    error: str = ""


def report_one(folder: Path) -> Row:
    """The folder's report written, and its headline; a folder that cannot be reported, the sentence why."""
    from trainbench.report.headline import for_bench
    from trainbench.report.render import write_report

    try:
        if bench_report.is_bench(folder):
            _, page, result = bench_report.write(folder)
            return Row(folder, for_bench(folder, result), page)
        _, page, _, headline = write_report(folder)
        return Row(folder, headline, page)
    except UserError as exc:
        return Row(folder, None, None, str(exc))


def write(root: Path) -> tuple[Path, list[Row]]:
    """index.html in ``root`` and the report of every results folder under it."""
    root = Path(root)
    folders = results_under(root)
    if not folders:
        raise UserError(f"{root} holds no runs and no run or bench folders (none up to {DEPTH} folders down); give "
                        "the folder `trainbench run` or `bench` printed, or the results folder above them")  # fmt: skip
    rows = sorted((report_one(f) for f in folders),
                  key=lambda r: (r.headline.date if r.headline else "", str(r.folder)), reverse=True)  # fmt: skip
    body = "".join(_row(root, r) for r in rows)
    failed = sum(1 for r in rows if r.error)
    title = f"index of {root.resolve().name or root}/"
    page = document(title, f"<h1>{esc(title)}</h1>\n<p>{len(rows)} folders ({failed} could not be reported), newest "
                           "first; each name links to the folder's report.</p>\n<table><tr><th>folder</th>"
                           "<th>benchmark</th><th>date</th><th>status</th><th>time to train / throughput</th>"
                           f"<th>compliance</th><th>hardware</th><th>trainbench</th></tr>{body}</table>")  # fmt: skip
    path = root / INDEX
    path.write_text(page)
    return path, rows


def _row(root: Path, row: Row) -> str:
    name = row.folder.relative_to(root).as_posix()
    if row.headline is None:
        return (f"<tr><td>{esc(name)}</td><td></td><td></td><td class=\"fail\">cannot be reported: {esc(row.error)}"
                "</td><td></td><td></td><td></td><td></td></tr>")  # fmt: skip
    h = row.headline
    link = f'<a href="{esc(quote(row.report.relative_to(root).as_posix()))}">{esc(name)}</a>'
    verdict = next((text for label, text in h.lines if label == "compliance"), "")
    cls = "" if h.compliant is None else f' class="{"pass" if h.compliant else "fail"}"'
    figure = f'<b>{esc(h.figure)}</b><br><span class="muted">{esc(h.what)}</span>'
    return (f"<tr><td>{link}</td><td>{esc(h.benchmark)}/{esc(h.preset)}</td><td>{esc(h.date)}</td>"
            f"<td>{esc(h.status)}</td><td>{figure}</td><td{cls}>{esc(verdict)}</td><td>{esc(h.hardware)}</td>"
            f"<td>{esc(h.version)}</td></tr>")  # fmt: skip
