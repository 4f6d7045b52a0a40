"""dlrmv4's data: Yambda listening events in the layout the reference stores them (mlcommons/training
``recommendation_v4``, ``dlrm_v3/datasets/yambda.py``), the flat store ``prepare`` builds from them, and the reader that
cuts samples into optimizer steps.

The reference's files (parquet, read here with pyarrow):

- ``train_sessions.parquet``: one row a listening session, sorted by ``uid`` then ``session_id``, with the lists
  ``item_ids``, ``timestamps`` (seconds), ``event_types`` (0 listen, 1 like, others neither), ``is_organic`` and
  ``played_ratio_pct``, one entry per event, all of one length in a row;
- ``artist_item_mapping.parquet`` (``item_id``, ``artist_id``) and ``album_item_mapping.parquet`` (``item_id``,
  ``album_id``).

A sample is one listen event of a user (its anchor) with at least ``min_history`` events of that user before it. Its
label is listen-plus (played 50 % or more); its history is the newest ``history_length // 3`` events of each pool
(listen-plus, like, skip) among the user's last ``SCAN_WINDOW`` events before it, in time order, each event tagged
with its pool's bit (1, 2, 4); its contextual features are the user and the hashed crosses of the anchor's columns.
Users are split into train and eval by a hash of their id: an eval user is never trained on.

``prepare`` reads the parquet files a record batch at a time (memory bounded by a batch, counts in 64 bits) and
writes the flat store, memory-mapped by every rank: the events' tracks, times, pool bits and organic flags, the
anchors of each split (event position and the user's first event), and the track-to-artist and track-to-album maps.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from trainbench.data.steps import Step, batched, eval_share, rank_share
from trainbench.errors import DataError

SESSIONS = "train_sessions.parquet"
ARTISTS = "artist_item_mapping.parquet"
ALBUMS = "album_item_mapping.parquet"
SESSION_COLUMNS = {"uid": "int", "session_id": "int", "item_ids": "list<int>", "timestamps": "list<int>",
                   "event_types": "list<int>", "is_organic": "list<int>",
                   "played_ratio_pct": "list<float>"}  # fmt: skip
EVENT_LISTS = ("item_ids", "timestamps", "event_types", "is_organic", "played_ratio_pct")
MAPPING_COLUMNS = {ARTISTS: {"item_id": "int", "artist_id": "int"}, ALBUMS: {"item_id": "int", "album_id": "int"}}
LISTEN, LIKE = 0, 1
LISTEN_PLUS_PCT = 50
LP, LIKED, SKIP = 1, 2, 4  # the pools' bits
SCAN_WINDOW = 20_000  # events before an anchor its history is drawn from (the reference's scan_window)
# The flat store: file -> (dtype, columns; None for a vector).
STORE = {"item": ("int64", None), "time": ("int64", None), "action": ("int8", None), "organic": ("int8", None),
         "train_anchors": ("int64", 3), "eval_anchors": ("int64", 3), "item_artist": ("int64", None),
         "item_album": ("int64", None)}  # fmt: skip
BATCH_ROWS = 65_536  # sessions a record batch


# -- hashing --------------------------------------------------------------------------------------------------------
def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over uint64 (wrapping): a hash of each value."""
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def hash_columns(columns: list[np.ndarray], salt: int = 0) -> np.ndarray:
    """A 64-bit hash of each row of ``columns`` (int arrays of one length), seeded by ``salt``."""
    h = mix64(np.full(len(columns[0]), salt, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15))
    for c in columns:
        with np.errstate(over="ignore"):
            h = mix64(h ^ mix64(np.asarray(c).astype(np.uint64)))
    return h


def is_eval_user(uid: np.ndarray, eval_fraction: float, salt: int) -> np.ndarray:
    """Whether each user is held out for eval: the top bits of its hash, as a fraction in [0, 1), below
    ``eval_fraction``."""
    unit = (hash_columns([uid], salt) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return unit < eval_fraction


# -- the reference's files ------------------------------------------------------------------------------------------
def _kind(arrow_type) -> str:
    import pyarrow as pa

    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        return f"list<{_kind(arrow_type.value_type)}>"
    if pa.types.is_integer(arrow_type):
        return "int"
    if pa.types.is_floating(arrow_type):
        return "float"
    return str(arrow_type)


def open_parquet(path: Path, columns: dict[str, str]):
    """``path`` as a pyarrow ParquetFile whose columns are exactly ``columns`` (name -> kind); one sentence where the
    file is missing, is no parquet file, or has other columns (a table of the wrong width) or types."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not path.is_file():
        raise DataError(f"{path} is missing: a Yambda folder holds {SESSIONS}, {ARTISTS} and {ALBUMS}")
    try:
        file = pq.ParquetFile(path)
        schema = file.schema_arrow
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{path} is not a readable parquet file ({e})") from None
    have = {f.name: _kind(f.type) for f in schema}
    if set(have) != set(columns):
        raise DataError(f"{path} has {len(have)} columns ({', '.join(have)}); the Yambda layout has {len(columns)} "
                        f"({', '.join(columns)})")  # fmt: skip
    wrong = [f"{n} is {have[n]}, not {kind}" for n, kind in columns.items() if have[n] != kind]
    if wrong:
        raise DataError(f"{path}: {'; '.join(wrong)}")
    return file


def _batches(file, path: Path) -> Iterator:
    import pyarrow as pa

    try:
        yield from file.iter_batches(batch_size=BATCH_ROWS)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{path} could not be read ({e})") from None


def read_mapping(path: Path, column: str) -> tuple[np.ndarray, np.ndarray]:
    """(item ids, their ``column`` ids) of a mapping file, checked non-negative."""
    file = open_parquet(path, MAPPING_COLUMNS[path.name])
    items, values = [], []
    for batch in _batches(file, path):
        i = batch.column("item_id").to_numpy(zero_copy_only=False).astype(np.int64)
        v = batch.column(column).to_numpy(zero_copy_only=False).astype(np.int64)
        if (i < 0).any() or (v < 0).any():
            raise DataError(f"{path}: a negative id (item_id or {column}); ids are row numbers of the tables")
        items.append(i)
        values.append(v)
    return (np.concatenate(items) if items else np.zeros(0, np.int64),
            np.concatenate(values) if values else np.zeros(0, np.int64))  # fmt: skip


def _session_lists(batch, path: Path, first_row: int) -> dict[str, np.ndarray]:
    """A record batch's event lists, flattened, with their rows' lengths checked equal."""
    import pyarrow.compute as pc

    lengths = None
    out = {}
    for name in EVENT_LISTS:
        column = batch.column(name)
        if column.null_count:
            raise DataError(f"{path}: {name} is missing in a session near row {first_row:,}")
        n = pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
        if lengths is None:
            lengths = n
        elif not np.array_equal(lengths, n):
            row = first_row + int(np.flatnonzero(lengths != n)[0])
            raise DataError(f"{path}: row {row:,} has {n[row - first_row]} {name} for {lengths[row - first_row]} "
                            "item_ids; every event list of a session has one entry an event")  # fmt: skip
        out[name] = column.flatten().to_numpy(zero_copy_only=False)
    out["lengths"] = lengths
    return out


class SourceScan:
    """What a pass over ``train_sessions.parquet`` finds: events, anchors per split and the largest ids, after checking
    every row (types, equal list lengths, ids not negative, rows sorted by uid then session_id)."""

    def __init__(self) -> None:
        self.events = self.train = self.eval = 0
        self.max_uid = self.max_item = -1


def scan_sessions(path: Path, min_history: int, eval_fraction: float, salt: int,
                  fill: Callable[[dict[str, Any]], None] | None = None) -> SourceScan:  # fmt: skip
    """Read ``path`` a record batch at a time; ``fill`` gets each batch's events and anchors (for the second pass)."""
    file = open_parquet(path, SESSION_COLUMNS)
    scan, row = SourceScan(), 0
    last_key, user, user_start = (-1, -1), -1, 0  # the last row's key; the last event's user and its first event
    for batch in _batches(file, path):
        uid = batch.column("uid").to_numpy(zero_copy_only=False).astype(np.int64)
        session = batch.column("session_id").to_numpy(zero_copy_only=False).astype(np.int64)
        keys = np.stack([uid, session], axis=1)
        prev = np.concatenate([[last_key], keys[:-1]])
        unsorted = (keys[:, 0] < prev[:, 0]) | ((keys[:, 0] == prev[:, 0]) & (keys[:, 1] <= prev[:, 1]))
        if unsorted.any():
            bad = row + int(np.flatnonzero(unsorted)[0])
            raise DataError(f"{path}: row {bad:,} is not after the row before it in (uid, session_id) order; the "
                            "reference's sessions are sorted by uid, then session_id, each pair once")  # fmt: skip
        if (uid < 0).any():
            raise DataError(f"{path}: a negative uid near row {row:,}; ids are row numbers of the tables")
        lists = _session_lists(batch, path, row)
        items = lists["item_ids"].astype(np.int64)
        if (items < 0).any() or (lists["timestamps"] < 0).any():
            raise DataError(f"{path}: a negative item id or timestamp near row {row:,}")
        ratio = np.nan_to_num(lists["played_ratio_pct"].astype(np.float32), nan=0.0)
        types = lists["event_types"].astype(np.int64)
        event_uid = np.repeat(uid, lists["lengths"])
        n = len(event_uid)
        position = scan.events + np.arange(n, dtype=np.int64)
        # The global position of each event's user's first event: a user may continue from the batch before.
        previous = np.concatenate([[user], event_uid[:-1]]) if n else event_uid
        first = np.maximum.accumulate(np.where(event_uid != previous, position, -1)) if n else position
        first = np.where(first < 0, user_start, first)
        index_in_user = position - first
        anchor = (types == LISTEN) & (index_in_user >= min_history)
        held_out = is_eval_user(event_uid, eval_fraction, salt)
        action = np.zeros(n, dtype=np.int8)
        listen = types == LISTEN
        action[listen & (ratio >= LISTEN_PLUS_PCT)] = LP
        action[types == LIKE] = LIKED
        action[listen & (ratio < LISTEN_PLUS_PCT)] = SKIP
        if fill is not None:
            fill({"start": scan.events, "item": items, "time": lists["timestamps"].astype(np.int64), "action": action,
                  "organic": lists["is_organic"].astype(np.int8),
                  "train": np.stack([position, first, event_uid], 1)[anchor & ~held_out],
                  "eval": np.stack([position, first, event_uid], 1)[anchor & held_out]})  # fmt: skip
        scan.train += int((anchor & ~held_out).sum())
        scan.eval += int((anchor & held_out).sum())
        if n:
            scan.max_item = max(scan.max_item, int(items.max()))
            user, user_start = int(event_uid[-1]), int(first[-1])
        scan.max_uid = max(scan.max_uid, int(uid.max()) if len(uid) else -1)
        scan.events += n
        if len(keys):
            last_key = (int(keys[-1, 0]), int(keys[-1, 1]))
        row += len(uid)
    return scan


def build_store(source: Path, out: Path, min_history: int, eval_fraction: float, salt: int,
                progress: Callable[[int, int], None]) -> dict[str, int]:  # fmt: skip
    """The flat store of the reference's files in ``source``, written to ``out/store``; returns the counts and the
    largest ids for the manifest. Two passes over the sessions: count and check, then fill memory-mapped arrays."""
    store = out / "store"
    store.mkdir(parents=True, exist_ok=True)
    artist_items, artists = read_mapping(source / ARTISTS, "artist_id")
    album_items, albums = read_mapping(source / ALBUMS, "album_id")
    progress(1, 4)
    scan = scan_sessions(source / SESSIONS, min_history, eval_fraction, salt)
    progress(2, 4)
    if scan.train == 0 or scan.eval == 0:
        raise DataError(f"{source / SESSIONS}: {scan.train:,} training and {scan.eval:,} eval samples (listen events "
                        f"with {min_history} or more events before them); both splits need some")  # fmt: skip
    items = max(scan.max_item, int(artist_items.max(initial=-1)), int(album_items.max(initial=-1))) + 1
    for name, (items_of, values) in {
        "item_artist": (artist_items, artists),
        "item_album": (album_items, albums),
    }.items():
        table = np.zeros(items, dtype=np.int64)
        table[items_of] = values
        np.save(store / f"{name}.npy", table)
    arrays = {
        name: np.lib.format.open_memmap(store / f"{name}.npy", mode="w+", dtype=STORE[name][0], shape=(scan.events,))
        for name in ("item", "time", "action", "organic")
    }
    arrays |= {f"{split}_anchors": np.lib.format.open_memmap(store / f"{split}_anchors.npy", mode="w+", dtype=np.int64,
                                                             shape=(getattr(scan, split), 3))
               for split in ("train", "eval")}  # fmt: skip
    filled = {"train": 0, "eval": 0}

    def fill(part: dict[str, Any]) -> None:
        s, n = part["start"], len(part["item"])
        for name in ("item", "time", "action", "organic"):
            arrays[name][s : s + n] = part[name]
        for split in ("train", "eval"):
            k = len(part[split])
            arrays[f"{split}_anchors"][filled[split] : filled[split] + k] = part[split]
            filled[split] += k

    scan_sessions(source / SESSIONS, min_history, eval_fraction, salt, fill)
    for a in arrays.values():
        a.flush()
    progress(3, 4)
    max_artist, max_album = int(artists.max(initial=0)), int(albums.max(initial=0))
    progress(4, 4)
    return {"events": scan.events, "train": scan.train, "eval": scan.eval, "max_uid": scan.max_uid,
            "max_item": items - 1, "max_artist": max_artist, "max_album": max_album}  # fmt: skip


# -- synthetic data in the reference's layout -----------------------------------------------------------------------
def write_synthetic(out: Path, spec: dict[str, Any]) -> None:
    """Seeded listening sessions in the reference's layout, with structure a model can learn: each user has a few
    favourite artists, most of its listens are of their tracks, and a listen is played through (listen-plus) with the
    chance sigmoid(signal x [the artist is a favourite] - signal / 2 + user bias + artist quality + track quality +
    0.3 x organic), the qualities normal with spreads ``artist_quality`` and ``item_quality``. The candidate's own
    rows learn its qualities from every user's listens, and a user's earlier events show its favourites and its bias,
    so both predict the label, for users never trained on too."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(spec["seed"])
    users, items, artists, albums = (spec[k] for k in ("users", "items", "artists", "albums"))
    item_artist = rng.integers(0, artists, items)
    item_album = (item_artist * max(1, albums // artists) + rng.integers(0, max(1, albums // artists), items)) % albums
    quality = rng.normal(0, spec["artist_quality"], artists)[item_artist] + rng.normal(0, spec["item_quality"], items)
    popularity = 1.0 / np.arange(1, items + 1) ** 0.6
    popularity = rng.permutation(popularity / popularity.sum())
    by_artist = [np.flatnonzero(item_artist == a) for a in range(artists)]
    rows: dict[str, list] = {k: [] for k in SESSION_COLUMNS}
    for u in range(users):
        n = int(rng.integers(spec["min_events"], spec["max_events"] + 1))
        favourites = rng.choice([a for a in range(artists) if len(by_artist[a])], spec["favourites"], replace=False)
        own = np.concatenate([by_artist[a] for a in favourites])
        track = np.where(rng.random(n) < spec["loyalty"], rng.choice(own, n), rng.choice(items, n, p=popularity))
        organic = (rng.random(n) < 0.6).astype(np.int8)
        liked = np.isin(item_artist[track], favourites)
        logit = spec["signal"] * (liked - 0.5) + rng.normal(0, spec["user_bias"]) + quality[track] + 0.3 * organic
        played = np.where(rng.random(n) < 1 / (1 + np.exp(-logit)), rng.uniform(50, 100, n), rng.uniform(0, 50, n))
        types = np.where(rng.random(n) < 0.15 / (1 + np.exp(-logit)), LIKE, LISTEN).astype(np.int64)
        times = 1_700_000_000 + u * 7 + np.cumsum(rng.integers(60, 4000, n))
        cuts = np.arange(0, n, spec["session_events"])
        for s, a in enumerate(cuts):
            b = a + spec["session_events"]
            rows["uid"].append(u)
            rows["session_id"].append(s)
            rows["item_ids"].append(track[a:b].tolist())
            rows["timestamps"].append(times[a:b].tolist())
            rows["event_types"].append(types[a:b].tolist())
            rows["is_organic"].append(organic[a:b].tolist())
            rows["played_ratio_pct"].append(played[a:b].astype(np.float32).tolist())
    out.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([("uid", pa.int64()), ("session_id", pa.int64()), ("item_ids", pa.list_(pa.int64())),
                        ("timestamps", pa.list_(pa.int64())), ("event_types", pa.list_(pa.int8())),
                        ("is_organic", pa.list_(pa.int8())), ("played_ratio_pct", pa.list_(pa.float32()))])  # fmt: skip
    pq.write_table(pa.table(rows, schema=schema), out / SESSIONS, row_group_size=4096)
    ids = np.arange(items, dtype=np.int64)
    pq.write_table(pa.table({"item_id": ids, "artist_id": item_artist.astype(np.int64)}), out / ARTISTS)
    pq.write_table(pa.table({"item_id": ids, "album_id": item_album.astype(np.int64)}), out / ALBUMS)


# -- the flat store and its samples ---------------------------------------------------------------------------------
def read_manifest(root: Path, benchmark: str) -> dict[str, Any]:
    path = root / "manifest.json"
    if not path.is_file():
        raise DataError(f"{root} holds no {benchmark} data set (no manifest.json); write one with `trainbench prepare "
                        f"{benchmark} --synthetic --out {root}` or `--source DIR --out {root}`")  # fmt: skip
    try:
        manifest = json.loads(path.read_text())
        spec = manifest["spec"]
        counts = manifest["counts"]
        int(counts["events"])
    except (ValueError, KeyError, TypeError):
        raise DataError(f"{path} is not a {benchmark} manifest") from None
    if manifest.get("benchmark") != benchmark:
        raise DataError(f"{root} holds data of {manifest.get('benchmark')!r}, not of {benchmark}")
    return {"spec": spec, "counts": counts}


def open_store(root: Path, counts: dict[str, int]) -> dict[str, np.ndarray]:
    """The flat store's arrays, memory-mapped, each checked against its type and width and the manifest's counts."""
    arrays = {}
    lengths = {"item": counts["events"], "time": counts["events"], "action": counts["events"],
               "organic": counts["events"], "train_anchors": counts["train"], "eval_anchors": counts["eval"],
               "item_artist": counts["max_item"] + 1, "item_album": counts["max_item"] + 1}  # fmt: skip
    for name, (dtype, columns) in STORE.items():
        path = root / "store" / f"{name}.npy"
        if not path.is_file():
            raise DataError(f"{path} is missing; write the data set again with `trainbench prepare dlrmv4`")
        try:
            a = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as e:
            raise DataError(f"{path} is not a readable .npy file ({e})") from None
        shape = (lengths[name],) if columns is None else (lengths[name], columns)
        if a.dtype != np.dtype(dtype) or a.shape != shape:
            raise DataError(f"{path} holds {a.dtype} {list(a.shape)}, not {dtype} {list(shape)} as the manifest says "
                            "(a table of the wrong width or length)")  # fmt: skip
        arrays[name] = a
    return arrays


class SampleBuilder:
    """Samples (the model's arrays) of anchors, from the flat store; the rows each table is looked up at are checked
    against the tables' sizes, one sentence where one is past its table."""

    def __init__(self, store: dict[str, np.ndarray], model, root: Path):
        self.store, self.root = store, root
        self.history = model.history
        self.per_pool = model.history_length // 3
        self.crosses = model.crosses
        self.rows = {"uid": model.uid_rows, "item": model.item_rows, "artist": model.artist_rows,
                     "album": model.album_rows}  # fmt: skip

    def _history(self, position: int, first: int) -> np.ndarray:
        start = max(first, position - SCAN_WINDOW)
        action = np.asarray(self.store["action"][start:position])
        keep = [np.flatnonzero(action == bit)[-self.per_pool :] for bit in (LP, LIKED, SKIP)]
        return start + np.sort(np.concatenate(keep))

    def build(self, anchors: np.ndarray) -> dict[str, np.ndarray]:
        """The samples of ``anchors`` ([n, 3]: event position, the user's first event, the user)."""
        s, n, hist = self.store, len(anchors), self.history
        out = {k: np.zeros((n, hist), dtype=np.int64) for k in ("hist_item", "hist_artist", "hist_album",
                                                                 "hist_action")}  # fmt: skip
        out["hist_len"] = np.zeros(n, dtype=np.int64)
        uids = anchors[:, 2]
        for i, (position, first, _) in enumerate(anchors):
            events = self._history(int(position), int(first))
            k = len(events)
            if k:
                item = np.asarray(s["item"][events])
                out["hist_item"][i, hist - k :] = item
                out["hist_artist"][i, hist - k :] = self._lookup("item_artist", item)
                out["hist_album"][i, hist - k :] = self._lookup("item_album", item)
                out["hist_action"][i, hist - k :] = np.asarray(s["action"][events])
            out["hist_len"][i] = k
        position = anchors[:, 0]
        item = np.asarray(s["item"][position])
        artist, album = self._lookup("item_artist", item), self._lookup("item_album", item)
        hour = (np.asarray(s["time"][position]) // 3600) % 24
        columns = {"uid": uids, "item_id": item, "artist_id": artist, "album_id": album, "hour_of_day": hour,
                   "is_organic": np.asarray(s["organic"][position]).astype(np.int64)}  # fmt: skip
        cross = [(hash_columns([columns[k] for k in c.keys], j + 1) % np.uint64(c.rows)).astype(np.int64)
                 for j, c in enumerate(self.crosses)]  # fmt: skip
        out |= {"uid": uids.astype(np.int64), "cross": np.stack(cross, 1) if cross else np.zeros((n, 0), np.int64),
                "cand_item": item, "cand_artist": artist, "cand_album": album,
                "label": (np.asarray(s["action"][position]) == LP).astype(np.float32)}  # fmt: skip
        self._check_rows(out)
        return out

    def _lookup(self, table: str, item: np.ndarray) -> np.ndarray:
        mapping = self.store[table]
        if len(item) and int(item.max()) >= len(mapping):
            raise DataError(f"{self.root}: track id {int(item.max()):,} is past {table}.npy's {len(mapping):,} tracks")
        return np.asarray(mapping[item])

    def _check_rows(self, out: dict[str, np.ndarray]) -> None:
        looked_up = {"uid": ("uid",), "item": ("hist_item", "cand_item"), "artist": ("hist_artist", "cand_artist"),
                     "album": ("hist_album", "cand_album")}  # fmt: skip
        for table, keys in looked_up.items():
            top = max(int(out[k].max(initial=0)) for k in keys)
            if top >= self.rows[table]:
                raise DataError(f"{self.root}: {table} id {top:,} is past the {table} table's {self.rows[table]:,} "
                                f"rows (model.{table}_rows)")  # fmt: skip


class AnchorOrder:
    """A seeded permutation of [0, n) per epoch, computed index by index (a 4-round Feistel network over the next even
    power of two, walking its cycle back into range): no array of n is held, whatever n."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self.half = max(1, (max(1, n - 1).bit_length() + 1) // 2)
        self.mask = np.uint64((1 << self.half) - 1)

    def _round(self, x: np.ndarray, epoch: int) -> np.ndarray:
        left, right = x >> np.uint64(self.half), x & self.mask
        for r in range(4):
            f = hash_columns([right], salt=(self.seed * 1_000_003 + epoch) * 8 + r) & self.mask
            left, right = right, left ^ f
        return (left << np.uint64(self.half)) | right

    def __call__(self, index: np.ndarray, epoch: int) -> np.ndarray:
        x = self._round(index.astype(np.uint64), epoch)
        out = x >= np.uint64(self.n)
        while out.any():
            x[out] = self._round(x[out], epoch)
            out = x >= np.uint64(self.n)
        return x.astype(np.int64)


class YambdaSteps:
    """Optimizer steps forever from ``start_sample``: global batch k is samples [k*B, (k+1)*B) of a stream that visits
    the training anchors in a new seeded order each epoch; this rank builds its share, cut into micro-batches."""

    def __init__(self, builder: SampleBuilder, anchors: np.ndarray, seed: int, global_batch: int, micro_batch: int,
                 rank: int, world_size: int, start_sample: int) -> None:  # fmt: skip
        self.builder, self.anchors = builder, anchors
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.share = np.asarray(rank_share(global_batch, rank, world_size), dtype=np.int64)
        self.start_step = start_sample // global_batch
        self.order = AnchorOrder(len(anchors), seed)

    def __iter__(self) -> Iterator[Step]:
        step = self.start_step
        while True:
            epochs, offsets = np.divmod(step * self.global_batch + self.share, len(self.anchors))
            rows = np.concatenate([self.order(offsets[epochs == e], int(e)) for e in np.unique(epochs)])
            anchors = np.asarray(self.anchors[rows])
            yield Step.split(self.builder.build(anchors), self.micro_batch,
                             self.global_batch)  # fmt: skip
            step += 1


class YambdaEval:
    """This rank's share of the eval anchors (the first ``total``), in batches built at each pass (nothing of the eval
    set is held between evals); each batch carries its samples' eval indices and the eval set's size, which the exact
    AUC needs. Every rank passes the same number of batches, a rank with fewer samples ending on an empty one: the
    sharded tables' lookups (``perf.sharded_tables``) are an exchange every rank must join, batch for batch."""

    def __init__(self, builder: SampleBuilder, anchors: np.ndarray, total: int, batch_size: int, rank: int,
                 world_size: int) -> None:  # fmt: skip
        self.builder, self.anchors, self.total = builder, anchors, total
        self.batches = batched(eval_share(total, rank, world_size), batch_size)
        most = max(len(batched(eval_share(total, r, world_size), batch_size)) for r in range(world_size))
        end = eval_share(total, rank, world_size).stop
        self.batches += [range(end, end)] * (most - len(self.batches))

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        for r in self.batches:
            anchors = np.asarray(self.anchors[r.start : r.stop])
            batch = self.builder.build(anchors)
            yield batch | {"index": np.arange(r.start, r.stop, dtype=np.int64),
                           "eval_size": np.array([self.total], dtype=np.int64)}  # fmt: skip
