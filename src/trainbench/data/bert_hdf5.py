"""The MLPerf BERT HDF5 format (fixed length): writing, validating and reading shards.

One shard is one HDF5 file with six datasets of equal first dimension N:

    input_ids, input_mask, segment_ids     [N, seq_length]
    masked_lm_positions, masked_lm_ids     [N, max_predictions]   (padded with 0)
    next_sentence_labels                   [N]                    (1: B is a random sentence)

A dataset folder holds ``train/*.hdf5`` (many shards), ``eval/*.hdf5`` (the eval set) and ``vocab.txt``.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from trainbench.data.checks import inside
from trainbench.data.steps import Step, batched, eval_share, rank_share
from trainbench.errors import DataError

PACKED_KEYS = (
    "input_ids",
    "segment_ids",
    "position_ids",
    "sequence_ids",
    "masked_lm_positions",
    "masked_lm_ids",
    "next_sentence_labels",
    "cls_positions",
)

KEYS = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids", "next_sentence_labels")
# The dtypes MLPerf's conversion script writes; the reader accepts any integer type.
DTYPES = {
    "input_ids": "i4",
    "input_mask": "i1",
    "segment_ids": "i1",
    "masked_lm_positions": "i4",
    "masked_lm_ids": "i4",
    "next_sentence_labels": "i1",
}
# Per-token keys of the fixed layout: the ones a length bin cuts.
SEQUENCE_KEYS = ("input_ids", "input_mask", "segment_ids")
LAYOUTS = {"fixed": KEYS, "packed": PACKED_KEYS}


def expected_shape(key: str, n: int, seq_length: int, max_predictions: int) -> tuple[int, ...]:
    if key in ("input_ids", "input_mask", "segment_ids", "position_ids", "sequence_ids"):
        return (n, seq_length)
    if key in ("masked_lm_positions", "masked_lm_ids"):
        return (n, max_predictions)
    return (n,)


def write_arrays(path: str | Path, arrays: dict[str, np.ndarray], dtypes: dict[str, object]) -> None:
    """Write datasets atomically: to a temporary name first, renamed once complete, so a crash never
    leaves a file that looks finished."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with h5py.File(tmp, "w") as f:
        for key, dtype in dtypes.items():
            if isinstance(dtype, str):
                f.create_dataset(key, data=np.asarray(arrays[key]).astype(dtype, copy=False), compression=None)
            else:  # a variable-length dtype: arrays[key] is a list of 1-D arrays
                ds = f.create_dataset(key, shape=(len(arrays[key]),), dtype=dtype)
                if len(arrays[key]):
                    ds[:] = arrays[key]
    os.replace(tmp, path)


def write_shard(path: str | Path, arrays: dict[str, np.ndarray]) -> None:
    """One fixed-length shard (the KEYS datasets), written atomically."""
    write_arrays(path, arrays, DTYPES)


def fixed_arrays(inst, seq_length: int, max_predictions: int) -> dict[str, np.ndarray]:
    """The fixed-length KEYS arrays of :class:`trainbench.data.pretraining.Instances` (zero padded)."""
    n, lengths = len(inst), inst.lengths
    if n and int(lengths.max()) > seq_length:
        raise ValueError(f"an instance of {int(lengths.max())} tokens does not fit seq_length {seq_length}")
    row = np.repeat(np.arange(n), lengths)
    col = np.arange(int(lengths.sum())) - np.repeat(inst.offsets[:-1], lengths)
    input_ids = np.zeros((n, seq_length), np.int32)
    input_ids[row, col] = inst.tokens
    cols = np.arange(seq_length)
    counts = np.diff(inst.mask_offsets)
    mrow = np.repeat(np.arange(n), counts)
    mcol = np.arange(int(counts.sum())) - np.repeat(inst.mask_offsets[:-1], counts)
    positions = np.zeros((n, max_predictions), np.int32)
    ids = np.zeros((n, max_predictions), np.int32)
    positions[mrow, mcol] = inst.mask_pos
    ids[mrow, mcol] = inst.mask_ids
    return {
        "input_ids": input_ids,
        "input_mask": (cols < lengths[:, None]).astype(np.int8),
        "segment_ids": ((cols >= inst.len_a[:, None] + 2) & (cols < lengths[:, None])).astype(np.int8),
        "masked_lm_positions": positions,
        "masked_lm_ids": ids,
        "next_sentence_labels": inst.nsp.astype(np.int8),
    }


def write_varlength(path: str | Path, inst, vocab_size: int) -> dict[str, list[np.ndarray] | np.ndarray]:
    """MLPerf's variable-length layout: one variable-length row per sample, no padding and no input_mask.

    input_ids, segment_ids, masked_lm_positions and masked_lm_ids are variable-length datasets (int16 ids,
    int32 when the vocabulary has more than 32,767 entries); next_sentence_labels is int8. Returns the arrays
    written (each variable-length one as a list of rows).
    """
    id_type = np.int16 if vocab_size <= np.iinfo(np.int16).max + 1 else np.int32
    lengths = inst.lengths

    def rows(flat, offsets, dtype):
        flat = flat.astype(dtype)
        bounds = offsets.tolist()
        return [flat[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]

    segment = np.zeros(int(lengths.sum()), np.int8)
    starts = inst.offsets[:-1]
    for_b = np.repeat(starts + inst.len_a + 2, lengths) <= np.arange(len(segment))
    segment[for_b] = 1
    arrays = {
        "input_ids": rows(inst.tokens, inst.offsets, id_type),
        "segment_ids": rows(segment, inst.offsets, np.int8),
        "masked_lm_positions": rows(inst.mask_pos, inst.mask_offsets, np.int16),
        "masked_lm_ids": rows(inst.mask_ids, inst.mask_offsets, id_type),
        "next_sentence_labels": inst.nsp,
    }
    write_arrays(
        path,
        arrays,
        {
            "input_ids": h5py.vlen_dtype(id_type),
            "segment_ids": h5py.vlen_dtype(np.int8),
            "masked_lm_positions": h5py.vlen_dtype(np.int16),
            "masked_lm_ids": h5py.vlen_dtype(id_type),
            "next_sentence_labels": "i1",
        },
    )
    return arrays


@dataclass(frozen=True)
class ShardInfo:
    path: Path
    num_samples: int


def validate_shard(path: Path, seq_length: int, max_predictions: int, layout: str = "fixed") -> ShardInfo:
    """Check one shard's keys and shapes against the config; a problem is a DataError naming file and key.

    ``layout`` "packed" is the format of :mod:`trainbench.data.packing` (several sequences per row)."""
    keys = LAYOUTS[layout]
    try:
        size = os.path.getsize(path)
        f = h5py.File(path, "r")
    except OSError as exc:
        raise DataError(f"{path} is not a readable HDF5 file ({exc}); re-create it with `trainbench prepare`") from None
    with f:
        missing = [k for k in keys if k not in f]
        if missing:
            raise DataError(f"{path}: key '{missing[0]}' is missing (the shard has: {', '.join(sorted(f.keys()))})")
        n = f["input_ids"].shape[0]
        for key in keys:
            want = expected_shape(key, n, seq_length, max_predictions)
            got = f[key].shape
            if layout == "packed" and key not in ("input_ids", "segment_ids", "position_ids", "sequence_ids"):
                want = (n,) + got[1:]  # predictions and sequences per row are the packer's choice
            if got != want:
                raise DataError(
                    f"{path}: key '{key}' has shape {got}, expected {want} "
                    f"(data.seq_length={seq_length}, data.max_predictions={max_predictions})"
                )
            if f[key].dtype.kind not in "iu":
                raise DataError(f"{path}: key '{key}' has dtype {f[key].dtype}, expected integers")
            # uncompressed, a dataset's rows lie in the file: more than it holds is a header claiming what is not there
            if f[key].compression is None and f[key].nbytes > size:
                raise DataError(f"{path}: key '{key}' declares {f[key].shape} values ({f[key].nbytes:,} bytes) but "
                                f"the file holds {size:,} bytes (cut short or crafted)")  # fmt: skip
        if layout == "packed":  # a row's predictions, and its sequences' labels and [CLS] positions, side by side
            for a, b in (("masked_lm_positions", "masked_lm_ids"), ("next_sentence_labels", "cls_positions")):
                if f[a].ndim != 2 or f[a].shape != f[b].shape:
                    raise DataError(f"{path}: keys '{a}' {f[a].shape} and '{b}' {f[b].shape} are not two arrays of "
                                    "one shape [rows, columns]")  # fmt: skip
    return ShardInfo(path, n)


def find_shards(folder: Path, what: str, seq_length: int, max_predictions: int, layout="fixed") -> list[ShardInfo]:
    if not folder.is_dir():
        raise DataError(
            f"{what} folder {folder} does not exist; create the data with "
            f"`trainbench prepare bert --synthetic --out {folder.parent}` or point data.dir at it"
        )
    paths = sorted(p for p in folder.iterdir() if p.suffix in (".hdf5", ".h5"))
    if not paths:
        raise DataError(f"{what} folder {folder} holds no .hdf5 shards; run `trainbench prepare bert` first")
    for path in paths:  # (a shard linked from elsewhere: data this folder does not hold)
        inside(folder, path)
    return [validate_shard(p, seq_length, max_predictions, layout) for p in paths]


# -- each shard's record: what `prepare` wrote, checked before a run ------------------------------------------------
#
# `prepare` records, in manifest.json's entry of each shard it writes, the shard's rows, its size in bytes and the
# smallest and largest value of each of its datasets ("values"), counted from the arrays it writes. Before a run, every
# shard's header rows and size are compared with its record and the recorded values with what the model takes (token
# ids below model.vocab_size, ...): a stat and a header a shard, not a read of its rows. A shard changed after the
# manifest was written (modified later than it) is scanned instead, every value of it; so is nothing else.

SCAN_ROWS = 1 << 14  # rows read at a time when a shard is scanned (8 Mi ids of a 512-token row: 32 MB)


def value_ranges(arrays: dict[str, np.ndarray | list[np.ndarray]]) -> dict[str, list[int]]:
    """The [smallest, largest] value of each dataset (a fixed array, or a variable-length one's rows), for the
    shard's record; an empty dataset has none."""
    out = {}
    for key, array in arrays.items():
        flat = np.concatenate(array) if isinstance(array, list) and array else np.asarray(array)
        if flat.size:
            out[key] = [int(flat.min()), int(flat.max())]
    return out


def shard_record(path: Path, rows: int, arrays: dict[str, np.ndarray | list[np.ndarray]]) -> dict:
    """The record of the shard just written at ``path`` from ``arrays`` (``rows`` of them)."""
    return {"rows": int(rows), "bytes": path.stat().st_size, "values": value_ranges(arrays)}


@dataclass(frozen=True)
class ShardRecord:
    rows: int
    bytes: int
    values: dict[str, tuple[int, int]]


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _record(entry, where: str) -> ShardRecord:
    if not isinstance(entry, dict) or not _count(entry.get("rows")) or not _count(entry.get("bytes")):
        raise DataError(f"{where}: its record holds no counts of rows and bytes; prepare the data again")
    values = entry.get("values")
    if not isinstance(values, dict) or not all(
        isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
        and v[0] <= v[1] for v in values.values()):  # fmt: skip
        raise DataError(f"{where}: its record's values are not [smallest, largest] integers; prepare the data again")
    return ShardRecord(entry["rows"], entry["bytes"], {k: (v[0], v[1]) for k, v in values.items()})


def shard_records(root: Path, shards: list[ShardInfo]) -> tuple[dict[Path, ShardRecord], int] | None:
    """Each shard's record in ``root``/manifest.json and the manifest's modification time (ns); None where the
    manifest records no shard (no manifest, as for MLPerf's own files, or data prepared before shards were recorded).
    A manifest that cannot be read, a shard it does not list, or a record that is not counts is a DataError."""
    import json

    path = root / "manifest.json"
    if not path.exists():
        return None
    inside(root, path)
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise DataError(f"{path}: cannot be read as JSON ({str(e)[:120]}); prepare the data again") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not any(
        isinstance(entry, dict) and "values" in entry for entry in files.values()
    ):
        return None
    records = {}
    for shard in shards:
        name = shard.path.relative_to(root).as_posix()
        if name not in files:
            raise DataError(f"{shard.path}: a shard {path} does not list (added after `trainbench prepare`?); remove "
                            "it or prepare the data again")  # fmt: skip
        records[shard.path] = _record(files[name], f"{path}, {name}")
    return records, path.stat().st_mtime_ns


# dataset -> (smallest, largest, the range in words: "the vocabulary of 1,024 ids (model.vocab_size)")
Limits = dict[str, tuple[int, int, str]]


def _outside(path: Path, key: str, low: int, high: int, limits: Limits, how: str) -> None:
    lo, hi, what = limits[key]
    if low < lo or high > hi:
        raise DataError(f"{path}: {key} {how} {low if low < lo else high}, outside {what}; data made for another "
                        "model or preset?")  # fmt: skip


def check_record(shard: ShardInfo, record: ShardRecord, limits: Limits) -> None:
    """``shard``'s header rows and size against its record, and its recorded values against ``limits``."""
    size = os.path.getsize(shard.path)
    if (shard.num_samples, size) != (record.rows, record.bytes):
        raise DataError(f"{shard.path}: {shard.num_samples:,} rows and {size:,} bytes, but manifest.json records "
                        f"{record.rows:,} rows and {record.bytes:,} bytes (changed since `trainbench prepare`); "
                        "prepare the data again")  # fmt: skip
    for key in limits:
        if key not in record.values:
            if record.rows:
                raise DataError(f"{shard.path}: manifest.json records no values of {key}; prepare the data again")
            continue
        _outside(shard.path, key, *record.values[key], limits, "recorded in manifest.json reach")


def scan_shard(shard: ShardInfo, record: ShardRecord | None, limits: Limits) -> None:
    """Every value of ``shard``'s ``limits`` datasets read (``SCAN_ROWS`` rows at a time, vectorised) and checked
    against them, and against the shard's record where it has one."""
    try:
        _scan(shard, record, limits)
    except OSError as e:  # a block HDF5 cannot read back
        raise DataError(f"{shard.path}: cannot be read ({str(e)[:120]}); prepare the data again") from None


def _scan(shard: ShardInfo, record: ShardRecord | None, limits: Limits) -> None:
    with h5py.File(shard.path, "r") as f:
        for key in limits:
            low = high = None
            for start in range(0, shard.num_samples, SCAN_ROWS):
                part = f[key][start : start + SCAN_ROWS]
                if part.size:
                    low = int(part.min()) if low is None else min(low, int(part.min()))
                    high = int(part.max()) if high is None else max(high, int(part.max()))
            if low is None:
                continue
            _outside(shard.path, key, low, high, limits, "reach")
            if record is not None and record.values.get(key) != (low, high):
                raise DataError(f"{shard.path}: {key} holds values {low}..{high}, but manifest.json records "
                                f"{'..'.join(map(str, record.values[key])) if key in record.values else 'none'} "
                                "(changed since `trainbench prepare`); prepare the data again")  # fmt: skip


def changed_since(shards: list[ShardInfo], stamp: int) -> list[ShardInfo]:
    """The shards modified later than ``stamp`` (the manifest's modification time, ns)."""
    return [s for s in shards if s.path.stat().st_mtime_ns > stamp]


def read_rows(path: Path, rows: np.ndarray | None = None, keys=KEYS) -> dict[str, np.ndarray]:
    """The given keys of a shard (all rows, or the given rows in the given order) as int64 arrays."""
    with h5py.File(path, "r") as f:
        if rows is None:
            return {k: f[k][()].astype(np.int64) for k in keys}
        order = np.argsort(rows)
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        sorted_rows = rows[order]  # h5py fancy indexing wants increasing indices
        return {k: f[k][sorted_rows].astype(np.int64)[inverse] for k in keys}


class ShardCache:
    """Keeps the last few whole shards in memory: the sample order walks one shard at a time."""

    def __init__(self, capacity: int = 2, keys=KEYS):
        self.capacity = capacity
        self.keys = keys
        self._shards: OrderedDict[Path, dict[str, np.ndarray]] = OrderedDict()

    def get(self, path: Path) -> dict[str, np.ndarray]:
        if path in self._shards:
            self._shards.move_to_end(path)
        else:
            self._shards[path] = read_rows(path, keys=self.keys)
            while len(self._shards) > self.capacity:
                self._shards.popitem(last=False)
        return self._shards[path]


class GlobalSampleOrder:
    """The order in which the whole run sees training samples: independent of the number of ranks.

    Each epoch shuffles the shard order, then the rows inside each shard, from (seed, epoch) alone.
    Global batch k is samples [k*B, (k+1)*B) of this stream; every rank reads its own slice of it, so
    1 rank at batch B and R ranks at batch B/R train on exactly the same samples.
    """

    def __init__(self, shards: list[ShardInfo], seed: int):
        self.shards = shards
        self.seed = seed
        self.epoch_size = sum(s.num_samples for s in shards)

    def stream(self, start_sample: int = 0):
        """Yield (shard index, row) pairs from global sample ``start_sample`` on, across epochs."""
        epoch, offset = divmod(start_sample, self.epoch_size)
        while True:
            rng = np.random.default_rng([self.seed, epoch])
            for shard_index in rng.permutation(len(self.shards)):
                # Draw every shard's permutation, skipped or not, so the RNG stream (and with it the
                # order) is the same whether the run started at sample 0 or resumed mid-epoch.
                rows = rng.permutation(self.shards[shard_index].num_samples)
                if offset >= len(rows):
                    offset -= len(rows)
                    continue
                for row in rows[offset:]:
                    yield int(shard_index), int(row)
                offset = 0
            epoch += 1
            offset = 0


class TrainBatches:
    """Iterator over optimizer steps: each item is this rank's micro-batches for one global batch."""

    def __init__(
        self,
        shards,
        seed,
        global_batch_size,
        micro_batch_size,
        rank,
        world_size,
        start_sample=0,
        layout="fixed",
        length_bins=0,
    ):
        self.share = rank_share(global_batch_size, rank, world_size)
        per_rank = len(self.share)
        assert per_rank % micro_batch_size == 0, "batch sizes were validated by the config"
        self.shards = shards
        self.order = GlobalSampleOrder(shards, seed)
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.per_rank = per_rank
        self.rank = rank
        self.world_size = world_size
        self.start_sample = start_sample
        self.length_bins = length_bins
        self.keys = LAYOUTS[layout]
        self.packed = layout == "packed"
        self.cache = ShardCache(keys=self.keys)

    @property
    def epoch_size(self) -> int:
        return self.order.epoch_size

    def __iter__(self):
        stream = self.order.stream(self.start_sample)
        while True:
            picks = [next(stream) for _ in range(self.global_batch_size)]
            # Samples are sequences: a packed row holds several. Every rank counts the whole global batch
            # from the shards it caches, so all ranks agree without communicating.
            samples = self._count_sequences(picks) if self.packed else self.global_batch_size
            if self.length_bins:
                yield self._binned_step(picks, samples)
            else:
                mine = picks[self.share.start : self.share.stop]
                yield Step.split(self._gather(mine), self.micro_batch_size, samples)

    def _binned_step(self, picks: list[tuple[int, int]], samples: int) -> Step:
        """The length-balanced split of one global batch (the same samples as the plain split).

        The global batch is sorted by length, longest first; micro-step k takes the next
        world_size x micro_batch_size samples and deals them out round-robin, so the k-th micro-batch
        of every rank holds nearly the same lengths (no rank waits for another at the all-reduce).
        Each micro-batch is cut to the upper edge of its length bin (seq_length / length_bins steps),
        so short samples cost short rows and the model sees at most length_bins shapes.
        """
        lengths = np.array([self.cache.get(self.shards[s].path)["input_mask"][r].sum() for s, r in picks])
        order = np.argsort(-lengths, kind="stable")
        seq_length = self.cache.get(self.shards[picks[0][0]].path)["input_ids"].shape[1]
        width = -(-seq_length // self.length_bins)
        span = self.world_size * self.micro_batch_size
        step = Step(samples=samples)
        for k in range(0, self.global_batch_size, span):
            mine = order[k : k + span][self.rank :: self.world_size]
            batch = self._gather([picks[i] for i in mine])
            edge = min(seq_length, -(-int(lengths[mine].max()) // width) * width)
            step.append({key: v[:, :edge] if key in SEQUENCE_KEYS else v for key, v in batch.items()})
        return step

    def _count_sequences(self, picks: list[tuple[int, int]]) -> int:
        return sum(int((self.cache.get(self.shards[s].path)["next_sentence_labels"][r] >= 0).sum()) for s, r in picks)

    def _gather(self, picks: list[tuple[int, int]]) -> dict[str, np.ndarray]:
        shard_ids = np.fromiter((s for s, _ in picks), dtype=np.int64, count=len(picks))
        rows = np.fromiter((r for _, r in picks), dtype=np.int64, count=len(picks))
        out = {k: None for k in self.keys}
        for shard_index in np.unique(shard_ids):
            where = np.nonzero(shard_ids == shard_index)[0]
            data = self.cache.get(self.shards[shard_index].path)
            for k in self.keys:
                if out[k] is None:
                    out[k] = np.empty((len(picks),) + data[k].shape[1:], dtype=np.int64)
                out[k][where] = data[k][rows[where]]
        return out


def eval_batches(shards, eval_samples, eval_batch_size, rank, world_size) -> list[dict[str, np.ndarray]]:
    """This rank's part of the eval set (the first ``eval_samples`` samples of the eval files), in batches."""
    data = [read_rows(s.path) for s in shards]
    merged = {k: np.concatenate([d[k] for d in data]) for k in KEYS}
    total = len(merged["input_ids"])
    if eval_samples is not None:
        if eval_samples > total:
            raise DataError(f"data.eval_samples={eval_samples} but the eval files hold only {total} samples")
        total = eval_samples
    return [{k: v[b.start : b.stop] for k, v in merged.items()} for b in batched(eval_share(total, rank, world_size),
                                                                                   eval_batch_size)]  # fmt: skip
