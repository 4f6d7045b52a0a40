"""Megatron's indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``), the token format NeMo and MLPerf ship, and
fixed-length training samples cut from it.

``.bin`` is every document's tokens back to back. ``.idx`` is, little-endian:

    magic b"MMIDIDX\\x00\\x00" | version u64 = 1 | dtype code u8 | sequence count u64 | document count u64
    | sizes int32[sequences] | byte pointers int64[sequences] | document index int64[documents]

with dtype codes 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16. Each sequence
here is one document (the document index is 0, 1, ..., n), as Megatron's preprocessing writes it.

:class:`PackedSamples` concatenates the documents in a seeded shuffled order (each one ends with the EOD
token when the writer appended it) and cuts the stream into samples of ``seq_length + 1`` tokens that
overlap by one (input and shifted label), then shuffles the samples with the same seed.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from trainbench.data import checks
from trainbench.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (as Megatron chooses), else int32."""
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.int32)


class IndexedWriter:
    """Append documents, then :meth:`finish`: files are written under temporary names and renamed at the end."""

    def __init__(self, prefix: str | Path, dtype: np.dtype):
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODES:
            raise ValueError(f"unsupported token dtype {self.dtype}")
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self._bin_tmp = self.prefix.with_name(self.prefix.name + ".bin.tmp")
        self._bin = open(self._bin_tmp, "wb")
        self.sizes: list[int] = []

    def add(self, tokens) -> None:
        arr = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(arr.tobytes(order="C"))
        self.sizes.append(len(arr))

    def finish(self) -> tuple[Path, Path]:
        self._bin.close()
        sizes = np.array(self.sizes, dtype=np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes):
            pointers[1:] = np.cumsum(sizes[:-1].astype(np.int64)) * self.dtype.itemsize
        doc_idx = np.arange(len(sizes) + 1, dtype=np.int64)
        idx_tmp = self.prefix.with_name(self.prefix.name + ".idx.tmp")
        with open(idx_tmp, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", CODES[self.dtype]))
            f.write(struct.pack("<Q", len(sizes)))
            f.write(struct.pack("<Q", len(doc_idx)))
            f.write(sizes.tobytes())
            f.write(pointers.tobytes())
            f.write(doc_idx.tobytes())
        bin_path, idx_path = Path(f"{self.prefix}.bin"), Path(f"{self.prefix}.idx")
        os.replace(self._bin_tmp, bin_path)
        os.replace(idx_tmp, idx_path)
        return bin_path, idx_path


class IndexedDataset:
    """Read-only, memory-mapped view of ``PREFIX.bin`` / ``PREFIX.idx``, checked as it opens: both files inside the
    prefix's folder, an integer token type, and the index's sizes, pointers and document index consistent with each
    other and with the ``.bin``'s size (:func:`check_index`). Token ids are checked by :meth:`check_ids`."""

    def __init__(self, prefix: str | Path):
        self.prefix = Path(prefix)
        idx_path, bin_path = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
        for p in (idx_path, bin_path):
            if not p.is_file():
                raise DataError(f"{p} does not exist (an indexed dataset is PREFIX.bin + PREFIX.idx)")
            checks.inside(self.prefix.parent, p)
        self.bin_path = bin_path
        with open(idx_path, "rb") as f:
            header = f.read(len(MAGIC) + 8 + 1 + 8 + 8)
        if len(header) < 34 or header[: len(MAGIC)] != MAGIC:
            raise DataError(f"{idx_path} is not a Megatron indexed-dataset index (bad magic)")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", header[len(MAGIC) :])
        if version != VERSION or code not in DTYPES:
            raise DataError(f"{idx_path}: version {version}, dtype code {code}: not supported")
        self.dtype = checks.integer_dtype(DTYPES[code], str(idx_path))
        expected = 34 + n_seq * 4 + n_seq * 8 + n_doc * 8
        if idx_path.stat().st_size != expected:
            raise DataError(f"{idx_path}: {idx_path.stat().st_size} bytes, expected {expected} (truncated?)")
        idx = np.memmap(idx_path, mode="r", dtype=np.uint8)
        self.sizes = np.frombuffer(idx, dtype=np.int32, count=n_seq, offset=34)
        self.pointers = np.frombuffer(idx, dtype=np.int64, count=n_seq, offset=34 + 4 * n_seq)
        self.doc_idx = np.frombuffer(idx, dtype=np.int64, count=n_doc, offset=34 + 12 * n_seq)
        check_index(idx_path, self.sizes, self.pointers, self.doc_idx, self.dtype.itemsize, bin_path.stat().st_size)
        tokens = int(self.sizes.sum(dtype=np.int64))
        self.tokens = np.memmap(bin_path, mode="r", dtype=self.dtype) if tokens else np.zeros(0, self.dtype)

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        start = self.pointers[i] // self.dtype.itemsize
        return self.tokens[start : start + self.sizes[i]]

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))

    def check_ids(self, vocab: int) -> None:
        """Every token id of the ``.bin`` in ``[0, vocab)``: one streamed pass over the file (numpy reads a few GB
        a second; the full C4 set takes minutes, the tiny one milliseconds)."""
        checks.ids_in_vocabulary([(str(self.bin_path), self.tokens)], vocab)


def check_index(idx_path: Path, sizes: np.ndarray, pointers: np.ndarray, doc_idx: np.ndarray, itemsize: int,
                bin_bytes: int) -> None:  # fmt: skip
    """The ``.idx``'s arrays against each other and the ``.bin``: sizes non-negative; pointers non-negative, whole
    tokens, in order, each document ending before the next begins and within the ``.bin``, which holds exactly the
    tokens the sizes count; the document index rising from 0 to the sequence count. A pointer past the end would
    fail mid-run; one that overlaps or skips would train on other tokens than the data's, silently."""

    def bad(what: str) -> DataError:
        return DataError(f"{idx_path}: {what}; the index does not describe its .bin (damaged or altered)")

    if len(sizes) and int(sizes.min()) < 0:
        raise bad(f"sequence {int(np.argmax(sizes < 0))} has a negative size ({int(sizes.min())})")
    tokens = int(sizes.sum(dtype=np.int64))
    checks.declared_size(idx_path.with_suffix(".bin"), tokens * itemsize, bin_bytes, f"{idx_path.name} ({tokens:,} "
                         f"tokens of {itemsize} bytes)")  # fmt: skip
    if len(pointers):
        ends = pointers + sizes.astype(np.int64) * itemsize
        past_end = (pointers > bin_bytes) | (ends > bin_bytes)
        unaligned = pointers % itemsize != 0
        for what, wrong in (("a negative byte pointer", pointers < 0), ("a pointer inside a token", unaligned),
                            ("a document that runs past the end of the .bin", past_end)):  # fmt: skip
            if np.any(wrong):
                raise bad(f"sequence {int(np.argmax(wrong))} has {what}")
        overlap = pointers[1:] < ends[:-1]
        if np.any(overlap):
            raise bad(f"sequence {int(np.argmax(overlap)) + 1} starts before the previous one ends (out of order or "
                      "overlapping)")  # fmt: skip
    if len(doc_idx) and (doc_idx[0] != 0 or doc_idx[-1] != len(sizes) or np.any(np.diff(doc_idx) < 0)):
        raise bad(f"the document index does not rise from 0 to the {len(sizes):,} sequences")


class PackedSamples:
    """Fixed-length samples of ``seq_length + 1`` tokens from one or more indexed datasets.

    The documents of all prefixes form one list; an epoch is a seeded permutation of it, concatenated.
    Sample ``i`` of the epoch is tokens ``[i * seq, i * seq + seq + 1)`` of that stream, and the samples are
    visited in a second seeded permutation. Deterministic in (seed, epoch) alone.
    """

    def __init__(self, datasets: list[IndexedDataset], seq_length: int, seed: int):
        self.datasets = datasets
        self.seq_length = seq_length
        self.seed = seed
        self._doc = np.concatenate([np.full(len(d), i, np.int32) for i, d in enumerate(datasets)] or [[]])
        self._row = np.concatenate([np.arange(len(d)) for d in datasets] or [[]])
        sizes = np.concatenate([d.sizes for d in datasets] or [[]]).astype(np.int64)
        self._sizes = sizes
        total = int(sizes.sum())
        self.samples_per_epoch = (total - 1) // seq_length if total > seq_length else 0
        if self.samples_per_epoch == 0:
            raise DataError(f"{total} tokens hold no sample of {seq_length + 1} tokens")
        self._epoch = -1

    def _prepare(self, epoch: int) -> None:
        if epoch == self._epoch:
            return
        rng = np.random.default_rng([self.seed, epoch])
        self._order = rng.permutation(len(self._sizes))
        self._starts = np.concatenate([[0], np.cumsum(self._sizes[self._order])])
        self._sample_order = rng.permutation(self.samples_per_epoch)
        self._epoch = epoch

    def sample(self, index: int) -> np.ndarray:
        """Global sample ``index`` (across epochs) as int64 [seq_length + 1]."""
        epoch, i = divmod(index, self.samples_per_epoch)
        self._prepare(epoch)
        begin = int(self._sample_order[i]) * self.seq_length
        end = begin + self.seq_length + 1
        out = np.empty(end - begin, dtype=np.int64)
        k = int(np.searchsorted(self._starts, begin, side="right")) - 1
        filled = 0
        while filled < len(out):
            doc = self._order[k]
            tokens = self.datasets[self._doc[doc]][int(self._row[doc])]
            offset = begin + filled - int(self._starts[k])
            take = min(len(tokens) - offset, len(out) - filled)
            out[filled : filled + take] = tokens[offset : offset + take]
            filled += take
            k += 1
        return out

    def batch(self, indices) -> np.ndarray:
        return np.stack([self.sample(int(i)) for i in indices])


def find_prefixes(folder: Path, what: str) -> list[Path]:
    """Every PREFIX with a PREFIX.idx in ``folder``, sorted."""
    if not folder.is_dir():
        raise DataError(f"{what}: {folder} does not exist")
    prefixes = sorted(p.with_suffix("") for p in folder.glob("*.idx"))
    if not prefixes:
        raise DataError(f"{what}: no indexed dataset (*.idx + *.bin) in {folder}")
    return prefixes
