"""Which trainbench made a file: its version and, when it runs from a git checkout, the commit checked out.

Every file a run writes that a reader may compare (the MLPerf log's header, run_<i>.json, summary.json,
config.yaml) carries these, and ``trainbench package`` puts the source of that version beside the results.
The commit is read from ``.git`` itself (HEAD, the branch's ref, packed-refs; a worktree's ``.git`` file points to
its folder), so no git needs to be installed; only a layout that reading cannot follow asks ``git rev-parse``. An
installed trainbench (not a checkout) has a version and no commit. Every trainbench also records a digest of its own
source files (:func:`source_digest`): the commit names the checkout's HEAD, not files changed since, which the digest
tells apart.
"""

from __future__ import annotations

import functools
import hashlib
import re
import subprocess
from pathlib import Path

from trainbench import __version__

PACKAGE_DIR = Path(__file__).resolve().parent
UNKNOWN = "unknown"
_SHA = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


def checkout_root(package_dir: Path = PACKAGE_DIR) -> Path | None:
    """The git checkout this package's source lives in (``<root>/src/trainbench``), or None for an installed one."""
    root = package_dir.parent.parent
    if package_dir.parent.name == "src" and (root / ".git").exists() and (root / "pyproject.toml").is_file():
        return root
    return None


def git_dir(root: Path) -> Path | None:
    """The git folder of a checkout: ``.git`` itself, or where a worktree's ``.git`` file points."""
    dot = root / ".git"
    if dot.is_dir():
        return dot
    try:
        text = dot.read_text().strip()
    except OSError:
        return None
    if not text.startswith("gitdir:"):
        return None
    target = Path(text.removeprefix("gitdir:").strip())
    return target if target.is_absolute() else (root / target).resolve()


def read_head(git: Path) -> str | None:
    """The commit HEAD names, read from the files (a detached HEAD, a loose ref or packed-refs); None where they do
    not say (a ref kept in a format this does not read)."""
    try:
        head = (git / "HEAD").read_text().strip()
    except OSError:
        return None
    if _SHA.fullmatch(head):
        return head
    if not head.startswith("ref:"):
        return None
    ref = head.removeprefix("ref:").strip()
    common = git
    try:  # a worktree keeps its HEAD, and shares the refs of the main checkout's git folder
        common = (git / (git / "commondir").read_text().strip()).resolve()
    except OSError:
        pass
    for folder in dict.fromkeys((git, common)):
        try:
            sha = (folder / ref).read_text().strip()
        except OSError:
            continue
        if _SHA.fullmatch(sha):
            return sha
    for folder in dict.fromkeys((git, common)):
        try:
            lines = (folder / "packed-refs").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            sha, _, name = line.partition(" ")
            if name.strip() == ref and _SHA.fullmatch(sha):
                return sha
    return None


def _rev_parse(root: Path) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    sha = proc.stdout.strip()
    return sha if proc.returncode == 0 and _SHA.fullmatch(sha) else None


@functools.cache
def commit() -> str | None:
    """The commit of the checkout trainbench runs from; ``"unknown"`` in a checkout whose HEAD neither reading nor
    git could tell; None for an installed trainbench."""
    root = checkout_root()
    if root is None:
        return None
    git = git_dir(root)
    return (read_head(git) if git else None) or _rev_parse(root) or UNKNOWN


@functools.cache
def source_digest(package_dir: Path = PACKAGE_DIR) -> str:
    """The first 16 hex digits of the sha256 of this package's files (each one's path in the package and its bytes,
    in path order; compiled caches left out): which code ran, also where the files differ from the commit checked out
    or there is no checkout."""
    digest = hashlib.sha256()
    for path in sorted(package_dir.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            digest.update(path.relative_to(package_dir).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def provenance() -> dict[str, str]:
    """``{"version": ..., "commit": ..., "source": ...}`` (no commit for an installed trainbench): what run files
    record."""
    found = commit()
    return {"version": __version__} | ({"commit": found} if found else {}) | {"source": source_digest()}


def describe(record: dict | None = None) -> str:
    """``trainbench 0.1.0 (commit 1a2b3c4d5e6f, source 0123456789abcdef)`` of this trainbench, or of a record
    :func:`provenance` wrote (older records have no source)."""
    record = provenance() if record is None else record
    sha, source = record.get("commit"), record.get("source")
    said = ([f"commit {sha[:12]}"] if sha else []) + ([f"source {source}"] if source else [])
    return f"trainbench {record.get('version', UNKNOWN)}" + (f" ({', '.join(said)})" if said else "")
