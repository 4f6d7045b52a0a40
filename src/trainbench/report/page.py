"""What every HTML page of the reports shares: one stylesheet, tables, embedded images. The pages are whole in one
file (no script, no font or style fetched from anywhere), and every text taken from a results folder goes through
``esc``."""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Iterable

STYLE = """body{font-family:sans-serif;margin:2em 3%;color:#222}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #bbb;padding:3px 8px;font-size:13px;
text-align:left;vertical-align:top}th{background:#eee}img{max-width:100%;display:block;margin:1em 0}
pre{background:#f6f6f6;padding:1em;font-size:12px;overflow-x:auto}
.cards{display:flex;flex-wrap:wrap;gap:1em}
.card{border:1px solid #c8cfdb;border-radius:8px;background:#f5f8fc;padding:.8em 1.2em;margin:.5em 0;
min-width:22em;flex:1}
.card .what{font-size:.9em;color:#555}.card .figure{font-size:2em;font-weight:bold;margin:.1em 0}
.card dl{display:grid;grid-template-columns:max-content auto;gap:.2em 1em;margin:.6em 0 0}
.card dt{color:#555}.card dd{margin:0}
.pass{color:#17692b}.fail{color:#b3261e}.differs td{background:#fff4d6}
.muted{color:#666;font-size:.9em}"""


def esc(text) -> str:
    return html.escape(str(text))


def document(title: str, body: str) -> str:
    """A whole page: ``title`` is escaped here, ``body`` is HTML built with :func:`esc`."""
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
            f"<style>{STYLE}</style></head><body>\n{body}\n</body></html>\n")  # fmt: skip


def table(head: Iterable[str], rows: Iterable[Iterable[str]], classes: Iterable[str] | None = None) -> str:
    """A table of text cells (escaped); ``classes`` gives each row's class, where one is given."""
    classes = list(classes) if classes is not None else None
    body = "".join(
        (f'<tr class="{esc(classes[n])}">' if classes and classes[n] else "<tr>")
        + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>"
        for n, row in enumerate(rows)
    )  # fmt: skip
    return f"<table><tr>{''.join(f'<th>{esc(h)}</th>' for h in head)}</tr>{body}</table>"


def image(title: str, png: bytes) -> str:
    """A titled PNG, embedded."""
    data = base64.b64encode(png).decode()
    return f'<h2>{esc(title)}</h2><img alt="{esc(title)}" src="data:image/png;base64,{data}">'


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
