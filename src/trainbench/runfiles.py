"""The names of the files in a results folder: the one place that builds them.

A results folder holds the runs of one invocation; run ``i`` has its MLPerf log (``result_<i>.txt``, named
``result_<i>.txt.partial`` until ``run_stop``), its outcome (``run_<i>.json``) and its checkpoint
(``checkpoint_<i>/``); the folder's ``config.yaml``, ``metrics.jsonl``, ``console.log`` and ``summary.json`` are
shared by its runs.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
CONSOLE = "console.log"
SUMMARY = "summary.json"
INPUTS = "inputs.json"  # the config and the identity of the data (and base weights) a run started with

_INDEXED = re.compile(r"^(?:result_(\d+)\.txt(?:\.partial)?|run_(\d+)\.json)$")


@dataclass(frozen=True)
class RunFiles:
    """The files of run ``index`` in ``run_dir``."""

    run_dir: Path
    index: int

    @property
    def log(self) -> Path:
        """The finished MLPerf log."""
        return self.run_dir / f"result_{self.index}.txt"

    @property
    def partial_log(self) -> Path:
        """The MLPerf log while the run goes on (and after it died)."""
        return self.run_dir / f"result_{self.index}.txt.partial"

    @property
    def outcome(self) -> Path:
        return self.run_dir / f"run_{self.index}.json"

    @property
    def checkpoint(self) -> Path:
        return self.run_dir / f"checkpoint_{self.index}"

    @property
    def preempted_marker(self) -> Path:
        """Left by rank 0 when the run stopped on a signal with a checkpoint (the launcher then says so)."""
        return self.run_dir / f"preempted_{self.index}"

    @property
    def finished(self) -> bool:
        """The run ended: its log has run_stop (it is renamed to its final name only then)."""
        return self.log.exists()


def run_indices(run_dir: Path) -> list[int]:
    """Indices of every run of ``run_dir`` that left a log (finished or not) or an outcome file."""
    found = {_INDEXED.match(p.name) for p in Path(run_dir).iterdir()} if Path(run_dir).is_dir() else set()
    return sorted({int(m.group(1) or m.group(2)) for m in found if m})


def finished_logs(run_dir: Path) -> list[Path]:
    return sorted(Path(run_dir).glob("result_*.txt"))


def partial_logs(run_dir: Path) -> list[Path]:
    return sorted(Path(run_dir).glob("result_*.txt.partial"))


def read_json(path: Path) -> dict:
    """A JSON object from a results folder (run_<i>.json, summary.json, job.json), or {} where it is missing or not
    whole (a write cut short)."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def rank_error(run_dir: Path, what: str, rank: int) -> Path:
    """Where rank ``rank`` (not 0, which prints its own) leaves the one sentence of the error that ended it in
    ``what`` (``run<i>``, ``bench<depth>``), for its launcher to name: otherwise only rank 0's errors reach the
    console, and a failure on another rank alone would show none."""
    return Path(run_dir) / f"error_{what}_rank{rank}.txt"


def other_ranks_error(run_dir: Path, what: str) -> str:
    """The first distinct sentence the other ranks left (:func:`rank_error`) for ``what``, as ``rank N: ...``
    (the count of ranks that said it), or ""; read as text, never run."""
    said: dict[str, list[int]] = {}
    for path in Path(run_dir).glob(f"error_{what}_rank*.txt"):
        rank = path.stem.rpartition("_rank")[2]
        if rank.isdigit() and path.is_file():
            with path.open(errors="replace") as f:  # a sentence: what is past its first 2,000 characters is not read
                said.setdefault(f.read(2000).strip(), []).append(int(rank))
    if not said:
        return ""
    sentence, ranks = min(said.items(), key=lambda item: min(item[1]))
    also = f" (and {len(ranks) - 1} more rank{'s' if len(ranks) > 2 else ''})" if len(ranks) > 1 else ""
    return f"rank {min(ranks)}{also}: {sentence}"


LOCK = ".lock"
# Held shared by every rank a local launcher starts, so the folder stays in use while any of them lives, even where
# the launcher itself is gone (killed with SIGKILL): a second run or resume probes it before it takes the folder.
RANKS_LOCK = ".lock.ranks"


def holder_text(what: str) -> str:
    """``what``, by whom, where, which process and since when: what a refused process prints about a lock's holder."""
    import getpass
    import os
    import socket
    import time

    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a container without the user in its passwd
        user = f"uid {os.getuid()}"
    return f"{what} by {user} on {socket.gethostname()}, process {os.getpid()}, since {since}"


class FolderLock:
    """One process at a time works in a results folder (or on one of its runs): an exclusive ``flock`` on
    ``<folder>/.lock`` (``.lock.run<i>``), held while the process trains (or submits) there and released by the
    kernel when it ends, however it ends. The lock file
    names its holder (user, host, process, command and since when), so a second process can say who holds it. The
    ranks a local launcher starts hold ``.lock.ranks`` shared for as long as each lives; taking any lock of the
    folder probes that one too, so the folder stays in use until the last rank of a run has ended.

    ``acquire`` raises :class:`~trainbench.errors.UserError` when another process holds the lock."""

    def __init__(self, folder: Path, what: str, name: str = LOCK):
        self.folder, self.what, self.name = Path(folder), what, name
        self._fd: int | None = None

    @classmethod
    def of_run(cls, folder: Path, index: int, what: str) -> FolderLock:
        """The lock of run ``index`` alone (the runs of a Slurm job array train side by side in one folder)."""
        return cls(folder, what, f"{LOCK}.run{index}")

    @property
    def path(self) -> Path:
        return self.folder / self.name

    def holder(self) -> str:
        try:
            return self.path.read_text().strip() or "another process"
        except OSError:
            return "another process"

    def acquire(self) -> FolderLock:
        import fcntl
        import os

        from trainbench.errors import UserError

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise UserError(f"{self._named()} is in use: {self.holder()}; wait for it to end or stop it, then try "
                            "again") from None  # fmt: skip
        ranks = FolderLock(self.folder, "", RANKS_LOCK)
        if not ranks.unheld():
            os.close(fd)
            raise UserError(f"{self._named()} is in use: {ranks.holder()}; wait for them to end or stop them, then "
                            "try again")  # fmt: skip
        os.ftruncate(fd, 0)
        os.pwrite(fd, (holder_text(self.what) + "\n").encode(), 0)
        self._fd = fd
        return self

    def _named(self) -> str:
        return str(self.folder) if self.name == LOCK else f"{self.folder} (run {self.name.rsplit('run', 1)[-1]})"

    def unheld(self) -> bool:
        """Whether no process holds this lock now (a probe: it is not kept); a lock file never made is unheld. Two
        probes at once (a job array's tasks starting together) would each see the other: a few tries apart tell an
        instant's probe from a holder."""
        import fcntl
        import os
        import time

        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return True
        try:
            for _ in range(5):
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return True
                except OSError:
                    time.sleep(0.05)
            return False
        finally:
            os.close(fd)  # drops the probe's lock too

    def share(self) -> FolderLock:
        """Hold this lock shared, beside the other ranks of one run: waits out a probe (:meth:`unheld`), which
        holds it for an instant; never held exclusively for longer."""
        import fcntl
        import os

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_SH)
        self._fd = fd
        return self

    def describe(self, what: str) -> None:
        """Write who the lock's holders are (:meth:`share` holders cannot each write it), for a refusal to name."""
        self.path.write_text(holder_text(what) + "\n")

    def release(self) -> None:
        if self._fd is not None:
            import os

            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
