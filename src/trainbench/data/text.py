"""Raw text for BERT pretraining: reading the corpora, cutting them into chunks, and splitting documents
into sentences.

Three input kinds:

``wiki-xml``   A Wikipedia dump (``enwiki-*-pages-articles*.xml[.bz2]``), streamed: one document per
               article (namespace 0, redirects skipped). Markup is stripped with mwparserfromhell, the
               maintained wikitext parser (it understands templates, links, tables and tags; regex
               strippers leave template debris behind). Parsing runs in the workers, not the reader.
``results4``   The layout MLPerf's reference pipeline produces: one sentence per line, a blank line
               between documents, any number of files (a folder is read in sorted file order).
``wikitext``   WikiText-style text: `` = Title = `` lines start an article, ``= = Section = =`` lines are
               dropped, each other line is a paragraph that is split into sentences.

The reader runs in the parent process and only cuts the input into *chunks* of whole documents of about
``chunk_bytes`` of raw text. Chunk boundaries depend on the input and ``chunk_bytes`` alone, never on the
number of workers; that is what makes the output independent of ``--workers``.
"""

from __future__ import annotations

import bz2
import io
import re
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from trainbench.errors import DataError

FORMATS = ("wiki-xml", "results4", "wikitext")
# The documented source of the real corpus (any enwiki pages-articles dump works; MLPerf used 20200101).
WIKI_DUMP_URL = "https://dumps.wikimedia.org/enwiki/latest/enwiki-latest-pages-articles.xml.bz2"


@dataclass
class Chunk:
    index: int
    kind: str  # one of FORMATS: tells the worker how to turn each raw document into sentences
    documents: list[str]
    nbytes: int  # characters of raw text
    input_bytes: int = 0  # bytes of the input files this chunk moved through


def list_inputs(paths: list[str | Path]) -> list[Path]:
    """Expand folders (sorted, regular files only, hidden files skipped); every path must exist."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            inside = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
            if not inside:
                raise DataError(f"input folder {path} holds no files")
            files.extend(inside)
        elif path.is_file():
            files.append(path)
        else:
            raise DataError(f"input {path} does not exist")
    return files


def detect_format(files: list[Path]) -> str:
    """wiki-xml for .xml/.bz2 dumps, wikitext when any file's first lines carry ` = Title = ` headings (a folder
    may hold a README beside the text), else results4."""
    if any(f.suffix in (".bz2", ".xml") or ".xml" in f.name for f in files):
        return "wiki-xml"
    if any(_has_wikitext_titles(f) for f in files):
        return "wikitext"
    return "results4"


def _has_wikitext_titles(path: Path) -> bool:
    with open(path, encoding="utf-8", errors="replace") as f:
        head = [f.readline() for _ in range(50)]
    return any(_WIKITEXT_TITLE.fullmatch(line.strip()) for line in head)


def inputs_of_format(files: list[Path], kind: str) -> list[Path]:
    """The files a detected format applies to: a WikiText folder's README (no headings) is not part of it."""
    if kind == "wikitext":
        return [f for f in files if _has_wikitext_titles(f)]
    if kind == "wiki-xml":
        return [f for f in files if f.suffix in (".bz2", ".xml") or ".xml" in f.name]
    return files


@contextmanager
def _open_text(path: Path):
    """Text of a plain or .bz2 file, and the underlying binary file (whose tell() drives progress)."""
    with open(path, "rb") as raw:
        stream = bz2.BZ2File(raw) if path.suffix == ".bz2" else raw
        yield io.TextIOWrapper(stream, encoding="utf-8", errors="replace"), raw


# -- reading raw documents (parent process) ----------------------------------------------------------------
# Each reader yields (raw document, bytes of the file consumed so far).


def _blank_line_documents(path: Path, block_bytes: int = 1 << 23) -> Iterator[tuple[str, int]]:
    """Documents separated by blank lines (results4), read in large blocks."""
    tail = ""
    with _open_text(path) as (f, raw):
        while block := f.read(block_bytes):
            text = tail + block
            cut = text.rfind("\n\n")
            if cut < 0:
                tail = text
                continue
            position = raw.tell()
            for doc in text[:cut].split("\n\n"):
                yield doc, position
            tail = text[cut + 2 :]
        if tail:
            yield tail, raw.tell()


_WIKITEXT_TITLE = re.compile(r"= [^=].*[^=] =")


def _wikitext_documents(path: Path) -> Iterator[tuple[str, int]]:
    lines: list[str] = []
    with _open_text(path) as (f, raw):
        for line in f:
            if _WIKITEXT_TITLE.fullmatch(line.strip()):
                if "".join(lines).strip():
                    yield "".join(lines), raw.tell()
                lines = []
            else:
                lines.append(line)
        if "".join(lines).strip():
            yield "".join(lines), raw.tell()


def _wiki_xml_documents(path: Path) -> Iterator[tuple[str, int]]:
    """Raw wikitext of every article (namespace 0, not a redirect), streamed from the dump."""
    try:
        with open(path, "rb") as raw:
            stream = bz2.BZ2File(raw) if path.suffix == ".bz2" else raw
            context = ET.iterparse(stream, events=("end",))
            ns = redirect = text = None
            for _, elem in context:
                tag = elem.tag.rsplit("}", 1)[-1]
                if tag == "ns":
                    ns = elem.text
                elif tag == "redirect":
                    redirect = True
                elif tag == "text":
                    text = elem.text
                elif tag == "page":
                    if ns == "0" and not redirect and text:
                        yield text, raw.tell()
                    ns = redirect = text = None
                    elem.clear()
    except EOFError:
        raise DataError(f"{path} ends early: the bz2 stream is truncated (re-download the dump)") from None
    except OSError as exc:
        raise DataError(f"{path} is not a readable bz2 file ({exc})") from None
    except ET.ParseError as exc:
        raise DataError(f"{path} is not a well-formed Wikipedia XML dump ({exc})") from None


READERS: dict[str, Callable[[Path], Iterator[tuple[str, int]]]] = {
    "wiki-xml": _wiki_xml_documents,
    "results4": _blank_line_documents,
    "wikitext": _wikitext_documents,
}


def chunks(files: list[Path], kind: str, chunk_bytes: int) -> Iterator[Chunk]:
    """Whole documents, grouped until a chunk holds at least ``chunk_bytes`` characters of raw text.

    ``Chunk.input_bytes`` is how far the chunk moved through the input files (compressed bytes for .bz2),
    so progress can be shown against the files' total size.
    """
    reader = READERS[kind]
    docs: list[str] = []
    size = index = moved = 0
    for path in files:
        last = 0
        for doc, position in reader(path):
            moved += position - last
            last = position
            if not doc.strip():
                continue
            docs.append(doc)
            size += len(doc)
            if size >= chunk_bytes:
                yield Chunk(index, kind, docs, size, moved)
                docs, size, index, moved = [], 0, index + 1, 0
        moved += path.stat().st_size - last
    if docs or moved:
        yield Chunk(index, kind, docs, size, moved)


# -- raw document -> sentences (workers) -----------------------------------------------------------------

_segmenter = None


def split_sentences(paragraph: str) -> list[str]:
    """Rule-based sentence segmentation (sentencex: Wikimedia's segmenter, no models to download)."""
    global _segmenter
    if _segmenter is None:
        import sentencex

        _segmenter = sentencex.segment
    return [s.strip() for s in _segmenter("en", paragraph) if s.strip()]


_WIKI_DROP_TAGS = {"ref", "table", "gallery", "math", "timeline", "references"}
_WIKITEXT_FIXES = [(" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."), (" <unk> ", " "), ("<unk>", "")]


def _paragraph_sentences(paragraphs: list[str]) -> list[str]:
    out: list[str] = []
    for p in paragraphs:
        if p:
            out.extend(split_sentences(p))
    return out


def document_sentences(kind: str, raw: str) -> list[str]:
    if kind == "results4":
        return [line.strip() for line in raw.split("\n") if line.strip()]
    if kind == "wikitext":
        paragraphs = []
        for line in raw.split("\n"):
            line = line.strip()
            if not line or line.startswith("= "):
                continue  # section headings are not sentences
            for old, new in _WIKITEXT_FIXES:
                line = line.replace(old, new)
            paragraphs.append(line)
        return _paragraph_sentences(paragraphs)
    if kind == "wiki-xml":
        import mwparserfromhell

        try:
            code = mwparserfromhell.parse(raw)
            # Headings are not sentences; references, tables and galleries are not running text.
            drop = code.filter_headings(recursive=False) + code.filter_tags(
                recursive=True, matches=lambda node: str(node.tag).lower() in _WIKI_DROP_TAGS
            )
            for node in drop:
                try:
                    code.remove(node)
                except ValueError:  # inside a node removed already
                    pass
            plain = code.strip_code(normalize=True, collapse=True)
        except Exception:  # a malformed article: skip it rather than stop a 20 GB job
            return []
        paragraphs = [
            line.strip() for line in plain.split("\n") if line.strip() and not line.lstrip().startswith(("=", "|", "{"))
        ]
        return _paragraph_sentences(paragraphs)
    raise ValueError(kind)
