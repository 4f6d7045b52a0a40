"""What every benchmark's ``trainbench prepare`` shares: the output folder claimed by its manifest, the synthetic
data set's size from the preset and the options, and the progress bar.

A data set's folder holds ``manifest.json``, written last, with the ``spec`` that made it: the same command again
finds it done, another command is refused unless ``--force``, and a folder without one is never taken for a data
set. docs/extending.md shows a benchmark's preparation built from these.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from trainbench.data.sft import write_manifest
from trainbench.errors import UserError

__all__ = ["claim", "progress_bar", "synthetic_sizes", "write_manifest"]


def claim(out: str | Path, spec: dict[str, Any], force: bool, replace: tuple[str, ...] = ()) -> bool:
    """True (and says so) where ``out`` already holds the data set ``spec`` describes: nothing to do. Another data
    set there is refused in one sentence unless ``force``; then its ``replace`` entries (files or folders) and its
    manifest are removed first. Otherwise ``out`` is created, empty of any manifest, and False returned."""
    from trainbench.console import console

    out = Path(out)
    manifest = out / "manifest.json"
    if manifest.exists():
        try:
            same = json.loads(manifest.read_text()).get("spec") == spec
        except (OSError, ValueError, AttributeError):
            same = False
        if same:
            console.print(f"{out} already holds this data set (manifest.json matches); nothing to do", markup=False)
            return True
        if not force:
            raise UserError(f"{out} already holds a different data set; choose another --out or add --force")
        for name in (*replace, "manifest.json"):
            path = out / name
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    elif out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a folder")
    out.mkdir(parents=True, exist_ok=True)
    return False


def synthetic_sizes(bench, args: argparse.Namespace, options: dict[str, str]) -> dict[str, int]:
    """The size of ``bench``'s synthetic data set for ``args.preset``: its ``synthetic_sizes`` entry, each field
    replaced by the option ``options`` maps it to where given (``{"num_train_samples": "train_samples"}``), which
    must be at least 1."""
    if args.preset not in bench.synthetic_sizes:
        raise UserError(f"--synthetic writes data for the presets {', '.join(bench.synthetic_sizes)} of {bench.name} "
                        f"only, not {args.preset}")  # fmt: skip
    sizes = dict(bench.synthetic_sizes[args.preset])
    for field, option in options.items():
        value = getattr(args, option, None)
        if value is not None:
            if value < 1:
                raise UserError(f"--{option.replace('_', '-')} must be at least 1, got {value}")
            sizes[field] = value
    return sizes


@contextlib.contextmanager
def progress_bar(description: str, total: float | None, disable: bool = False) -> Iterator[Callable[..., None]]:
    """A progress bar on the console while the block runs; yields ``update(done, total=None)``."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from trainbench.console import console

    columns = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>5.1f}%"),
               TimeRemainingColumn()]  # fmt: skip
    with Progress(*columns, console=console, transient=True, disable=disable) as progress:
        task = progress.add_task(description, total=total)

        def update(done: float, total: float | None = None) -> None:
            progress.update(task, completed=done, **({"total": total} if total is not None else {}))

        yield update
