"""Rank-0 output: messages to the terminal and to the run's console.log, and the live progress line."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

# soft_wrap: never break a long path across lines, so output stays copy-pasteable and greppable.
console = Console(highlight=False, soft_wrap=True)


class RunConsole:
    """Prints (rank 0 only) and appends the same plain text to ``console.log``."""

    def __init__(self, log_path: Path | None, enabled: bool = True):
        self.log_path = log_path
        self.enabled = enabled

    def say(self, message: str, style: str | None = None) -> None:
        if not self.enabled:
            return
        console.print(message, style=style)
        if self.log_path is not None:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            with open(self.log_path, "a") as f:
                f.write(f"[{stamp}] {message}\n")


class TrainProgress:
    """A live line: samples, loss, samples/s and the last eval metric. Silent when disabled."""

    def __init__(self, total_samples: int, metric_name: str, enabled: bool):
        self.enabled = enabled and console.is_terminal
        self.metric_name = metric_name
        if not self.enabled:
            return
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            TextColumn("{task.completed:,}/{task.total:,} samples"),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[rate]} samples/s"),
            TextColumn("{task.fields[metric]}"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        self.task = self.progress.add_task("train", total=total_samples, loss="-", rate="-", metric="")
        self.progress.start()

    def update(
        self, samples: int, loss: float | None = None, rate: float | None = None, metric: float | None = None
    ) -> None:
        if not self.enabled:
            return
        fields = {}
        if loss is not None:
            fields["loss"] = f"{loss:.4f}"
        if rate is not None:
            fields["rate"] = f"{rate:,.1f}"
        if metric is not None:
            fields["metric"] = f"{self.metric_name} {metric:.4f}"
        self.progress.update(self.task, completed=samples, **fields)

    def close(self) -> None:
        if self.enabled:
            self.progress.stop()
