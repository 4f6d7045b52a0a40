"""Fine-tuning data: tokenised (prompt, answer) sequences with a loss mask, packed into fixed-length rows.

On disk (one folder per split, ``train/`` and ``eval/``, and ``manifest.json`` beside them):

- ``tokens.npy`` (int32): every sequence's tokens, concatenated in row order;
- ``labels.npy`` (uint8): 1 where a token is an answer token, i.e. where its prediction counts in the loss;
- ``seq_offsets.npy`` (int64, sequences + 1): where each sequence starts in ``tokens``;
- ``row_offsets.npy`` (int64, rows + 1): which sequences each row holds (row r: sequences
  ``row_offsets[r]`` to ``row_offsets[r+1]``), packed first-fit by decreasing length.

A row as the model sees it (:func:`row_arrays`): ``tokens`` padded to the row length, ``targets`` (the next token
where it is an answer token of the same sequence, else -100), ``positions`` (from 0 in every sequence) and
``segments`` (which sequence of the row; padding is a segment of its own), so attention stays inside each sequence
and a packed row trains exactly what its sequences would one by one. Where every row holds one sequence (MLPerf's
rows as given) positions and segments are left out: attention is plainly causal across the row, the fast path.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainbench.data.checks import load_npy
from trainbench.data.steps import Step, rank_share
from trainbench.errors import DataError

FORMAT = "trainbench-sft-1"
FILES = ("tokens.npy", "labels.npy", "seq_offsets.npy", "row_offsets.npy")
IGNORE = -100


def pack(lengths: Sequence[int], row_length: int) -> list[list[int]]:
    """First-fit decreasing: sequence indices grouped into rows of at most ``row_length`` tokens (deterministic:
    ties keep the input order)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        if n > row_length:
            raise ValueError(f"sequence {i} has {n} tokens, more than a row's {row_length}")
        for r, free in enumerate(room):
            if n <= free:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(row_length - n)
    return rows


def write_split(folder: Path, sequences: list[tuple[np.ndarray, np.ndarray]], row_length: int,
                packed: bool = True) -> dict[str, int]:  # fmt: skip
    """Pack ``sequences`` ((tokens, answer mask) pairs) into rows and write them, or with ``packed=False`` each
    sequence as a row of its own, in the given order; returns the split's sizes."""
    if packed:
        rows = pack([len(t) for t, _ in sequences], row_length)
    else:
        longest = max((len(t) for t, _ in sequences), default=0)
        if longest > row_length:
            raise ValueError(f"a row of {longest} tokens is longer than {row_length}")
        rows = [[i] for i in range(len(sequences))]
    order = [i for row in rows for i in row]
    folder.mkdir(parents=True, exist_ok=True)
    lengths = np.array([len(sequences[i][0]) for i in order], dtype=np.int64)
    arrays = {
        "tokens.npy": np.concatenate([sequences[i][0] for i in order]).astype(np.int32),
        "labels.npy": np.concatenate([sequences[i][1] for i in order]).astype(np.uint8),
        "seq_offsets.npy": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        "row_offsets.npy": np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64),
    }
    for name, array in arrays.items():
        np.save(folder / name, array)
    return {"sequences": len(sequences), "rows": len(rows), "tokens": int(lengths.sum()),
            "answer_tokens": int(arrays["labels.npy"].sum())}  # fmt: skip


# A data set's manifest's "base" where it names no base checkpoint (synthetic rows at the 70B's shape): the run
# initialises the base from its seed
RANDOM_BASE = "random, initialised from the run's seed (a throughput-and-cadence run, not a convergence result)"


def write_manifest(out: Path, manifest: dict) -> None:
    """Written last, through a rename: a folder with a manifest holds a whole data set."""
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, out / "manifest.json")


def read_manifest(root: Path, name: str) -> dict:
    path = root / "manifest.json"
    if not path.exists():
        raise DataError(f"{root}: no manifest.json; write the data set with `trainbench prepare {name}`")
    try:
        manifest = json.loads(path.read_text())
    except ValueError as e:
        raise DataError(f"{path}: not JSON ({e}); prepare the data set again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{path}: not a {FORMAT} data set; write one with `trainbench prepare {name}`")
    return manifest


@dataclass
class Split:
    """One split on disk, memory-mapped."""

    folder: Path
    row_length: int

    def __post_init__(self):
        missing = [f for f in FILES if not (self.folder / f).exists()]
        if missing:
            raise DataError(f"{self.folder}: {missing[0]} is missing; prepare the data set again")
        self.tokens, self.labels, self.seq_offsets, self.row_offsets = (self._mapped(name) for name in FILES)

    def _mapped(self, name: str) -> np.ndarray:
        """One array, memory-mapped once it lies inside the folder and its header's shape and type agree with the
        file's size (a header declaring more than the file holds is refused before anything is mapped)."""
        try:
            return load_npy(self.folder / name, self.folder, kinds="iubf", mmap=True)
        except DataError as e:
            raise DataError(f"{e}; prepare the data set again") from None

    def check(self, sizes: dict, vocab: int) -> None:
        """The arrays against each other and against the manifest's ``sizes`` of this split (sequences, rows,
        tokens): types, lengths, offsets from 0 rising to the ends, every row within the row length and every
        token in the vocabulary. An array swapped, cut or edited is one sentence here, not an error mid-run."""

        def bad(what: str) -> DataError:
            return DataError(f"{self.folder}: {what}; the data set was changed after `prepare`: prepare it again")

        kinds = {"tokens.npy": "iu", "labels.npy": "u", "seq_offsets.npy": "i", "row_offsets.npy": "i"}
        for name, array in zip(FILES, (self.tokens, self.labels, self.seq_offsets, self.row_offsets), strict=True):
            if array.ndim != 1 or array.dtype.kind not in kinds[name]:
                raise bad(f"{name} is an array of {array.dtype} and shape {array.shape}, not what prepare writes")
        want = {"sequences": self.sequences, "rows": self.rows, "tokens": len(self.tokens)}
        for key, have in want.items():
            if not isinstance(sizes, dict) or sizes.get(key) != have:
                listed = sizes.get(key) if isinstance(sizes, dict) else None
                raise bad(f"its arrays hold {have:,} {key} but manifest.json lists {listed}")
        seq, rows = np.asarray(self.seq_offsets), np.asarray(self.row_offsets)
        if len(self.labels) != len(self.tokens):
            raise bad(f"labels.npy has {len(self.labels):,} entries for {len(self.tokens):,} tokens")
        if seq[0] != 0 or seq[-1] != len(self.tokens) or np.any(np.diff(seq) <= 0):
            raise bad("seq_offsets.npy does not rise from 0 to the token count")
        if rows[0] != 0 or rows[-1] != self.sequences or np.any(np.diff(rows) <= 0):
            raise bad("row_offsets.npy does not rise from 0 to the sequence count")
        longest = int(np.max(seq[rows[1:]] - seq[rows[:-1]]))
        if longest > self.row_length:
            raise bad(f"a row holds {longest} tokens, more than data.seq_length={self.row_length}")
        if len(self.tokens) and (int(self.tokens.min()) < 0 or int(self.tokens.max()) >= vocab):
            raise bad(f"token ids run from {int(self.tokens.min())} to {int(self.tokens.max())}, outside the "
                      f"vocabulary of {vocab}")  # fmt: skip
        if len(self.labels) and int(self.labels.max()) > 1:
            raise bad("labels.npy holds values other than 0 and 1")

    @property
    def rows(self) -> int:
        return len(self.row_offsets) - 1

    @property
    def sequences(self) -> int:
        return len(self.seq_offsets) - 1

    @property
    def whole_rows(self) -> bool:
        """Every row holds one sequence (MLPerf's rows as given): attention is causal across each row, and the model
        needs neither positions nor segments (padding after the sequence is never attended to by its tokens)."""
        return self.rows == self.sequences

    def row_arrays(self, rows: Sequence[int]) -> dict[str, np.ndarray]:
        """Model inputs of ``rows`` ([len(rows), row_length] each): tokens, targets, ``seq_ids`` (which sequence each
        token belongs to, -1 for padding: the eval's per-sequence mean), and for rows of several sequences their
        ``positions`` and ``segments``."""
        n, length = len(rows), self.row_length
        tokens = np.zeros((n, length), np.int64)
        targets = np.full((n, length), IGNORE, np.int64)
        positions = np.zeros((n, length), np.int64)
        segments = np.full((n, length), -1, np.int64)  # padding: a segment of its own
        for b, r in enumerate(rows):
            at = 0
            for s in range(int(self.row_offsets[r]), int(self.row_offsets[r + 1])):
                lo, hi = int(self.seq_offsets[s]), int(self.seq_offsets[s + 1])
                tok, lab = self.tokens[lo:hi], self.labels[lo:hi]
                end = at + hi - lo
                tokens[b, at:end] = tok
                targets[b, at : end - 1] = np.where(lab[1:] > 0, tok[1:], IGNORE)
                positions[b, at:end] = np.arange(hi - lo)
                segments[b, at:end] = s
                at = end
        if self.whole_rows:
            return {"tokens": tokens, "targets": targets, "seq_ids": segments}
        return {"tokens": tokens, "targets": targets, "positions": positions, "segments": segments, "seq_ids": segments}


class RowSteps:
    """Optimizer steps of packed rows: the rows in a seeded order, reshuffled every epoch; global batch k is rows
    [k*B, (k+1)*B) of that endless stream, and data-parallel rank r takes its contiguous share."""

    def __init__(self, split: Split, seed: int, gbs: int, micro: int, rank: int, world: int, start_row: int):
        self.split, self.seed, self.gbs, self.micro = split, seed, gbs, micro
        self.rank, self.world, self.start = rank, world, start_row

    def order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.split.rows)

    def __iter__(self) -> Iterator[Step]:
        k, cached = self.start, (-1, None)
        share = rank_share(self.gbs, self.rank, self.world)
        while True:
            rows = []
            for j in range(k + share.start, k + share.stop):
                epoch, i = divmod(j, self.split.rows)
                if cached[0] != epoch:
                    cached = (epoch, self.order(epoch))
                rows.append(int(cached[1][i]))
            yield Step.split(self.split.row_arrays(rows), self.micro, self.gbs)
            k += self.gbs
