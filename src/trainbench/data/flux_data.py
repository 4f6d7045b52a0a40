"""flux1's data: the reference's preprocessed encodings, read as it publishes them, and seeded synthetic ones in the
same format.

The reference (mlcommons/training ``text_to_image``, torchtitan's flux) saves each split with HF ``datasets``'
``save_to_disk``: a folder of Arrow IPC stream files named by its ``state.json``, one row a sample with the binary
fields ``t5_encodings`` [256, 4096], ``clip_encodings`` [768], ``mean`` and ``logvar`` [16, 32, 32] (the VAE
encoder's latent distribution), each the bytes of ``np.save`` of a bf16 array viewed as uint16, and (eval) an int32
``timestep`` 0-7. The empty prompt's encodings are ``t5_empty.npy`` [1, 256, 4096] and ``clip_empty.npy`` [1, 768]
(float16) in a folder of their own. Nothing is unpickled: every array loads with ``allow_pickle=False`` after its
header is checked (data/checks.py), and a data file that resolves outside its folder is refused.

The synthetic set draws each sample from one of a few classes: a smooth latent pattern per class, and prompt
encodings that name the class through noise, so a model that reads the prompt predicts the latent and its eval loss
falls towards the floor of the unpredictable noise.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from trainbench.data import checks
from trainbench.data.steps import Step, batched, eval_share, rank_share
from trainbench.errors import DataError

FIELDS = ("t5_encodings", "clip_encodings", "mean", "logvar")
EMPTY = {"t5_encodings": "t5_empty.npy", "clip_encodings": "clip_empty.npy"}
STATE = "state.json"


def to_bytes(array: np.ndarray) -> bytes:
    """``array`` as the reference stores a field: bf16, viewed as uint16, saved by ``np.save``."""
    bits = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).to(torch.bfloat16).view(torch.uint16)
    buffer = io.BytesIO()
    np.save(buffer, bits.numpy(), allow_pickle=False)
    return buffer.getvalue()


def from_bytes(blob: bytes, where: str) -> np.ndarray:
    """A stored field as float32 (its header checked first: a row declaring a huge array allocates nothing)."""
    try:
        bits = checks.npy_from_bytes(blob, where, kinds="u")
    except DataError as e:
        raise DataError(f"{where}: not a numpy array of bf16 bits ({str(e).removeprefix(f'{where}: ')})") from None
    if bits.dtype != np.uint16:
        raise DataError(f"{where}: an array of {bits.dtype}, not bf16 bits (uint16)")
    return torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16).float().numpy()


def _is_binary(kind: pa.DataType) -> bool:
    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind)


class EncodedSplit:
    """One split's rows (memory-mapped: the full training set is 2.5 TB). Opening it checks what is cheap to check
    (the files inside the folder, one schema of the expected column types, no empty split); :meth:`check` checks every
    row's encodings and the timesteps before a run starts."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        state = self.folder / STATE
        try:
            files = [f["filename"] for f in json.loads(checks.inside(self.folder, state).read_text())["_data_files"]]
            if not all(isinstance(name, str) for name in files):
                raise TypeError("a file name that is not a string")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{state}: not a saved data set's state ({e}); prepare the data with `trainbench prepare "
                            "flux1`") from None  # fmt: skip
        if not files:
            raise DataError(f"{state} names no data files")
        self.files: list[tuple[Path, pa.Table]] = []
        for name in files:
            path = self.folder / name
            if Path(name).is_absolute() or ".." in Path(name).parts:
                raise DataError(f"{state} names {name!r}, a file outside its folder")
            real = checks.file_in(self.folder, path, f"a data file {state} names")
            try:
                table = pa.ipc.open_stream(pa.memory_map(str(real))).read_all()
            except (OSError, pa.ArrowException, ValueError) as e:
                raise DataError(f"{path}: not a whole Arrow stream ({str(e)[:160]})") from None
            self._check_schema(path, table.schema)
            self.files.append((path, table))
        self.table = pa.concat_tables([table for _, table in self.files])
        if self.table.num_rows == 0:
            raise DataError(f"{self.folder}: the split holds no rows (its Arrow files have a schema and no data)")

    def _check_schema(self, path: Path, schema: pa.Schema) -> None:
        """The fields flux1 reads, binary (the bytes of ``np.save``), and the eval's timestep an integer; every file
        of the split with the first one's schema (concatenating them would fail, or mix rows of other meanings)."""
        missing = [f for f in FIELDS if f not in schema.names]
        if missing:
            raise DataError(f"{path}: no {', '.join(missing)} column (columns: {schema.names})")
        for name in FIELDS:
            if not _is_binary(schema.field(name).type):
                raise DataError(f"{path}: column {name} holds {schema.field(name).type}, not binary (the bytes of a "
                                "saved bf16 array)")  # fmt: skip
        if "timestep" in schema.names and not pa.types.is_integer(schema.field("timestep").type):
            raise DataError(f"{path}: column timestep holds {schema.field('timestep').type}, not integers (0-7)")
        if self.files and not schema.equals(self.files[0][1].schema):
            raise DataError(f"{path}: a schema other than {self.files[0][0].name}'s ({schema.to_string()!r} against "
                            f"{self.files[0][1].schema.to_string()!r})")  # fmt: skip

    def __len__(self) -> int:
        return self.table.num_rows

    def field(self, name: str, index: int) -> np.ndarray:
        return from_bytes(self.table.column(name)[index].as_py(), f"{self.folder} row {index} {name}")

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: self.field(name, 0).shape for name in FIELDS}

    def check(self) -> dict[str, tuple[int, ...]]:
        """Every row's encodings of one shape and type, read from the Arrow offsets and each row's ``.npy`` header
        (a few bytes a row, no decoding): a row of another shape is refused here, not mid-run. Returns the shapes."""
        first: dict[str, tuple[bytes, int]] = {}
        for name in FIELDS:
            blob = self.table.column(name)[0].as_py()
            if blob is None:
                raise DataError(f"{self.files[0][0]}: row 0 of {name} is null")
            shape, _, _, offset = checks.npy_header(blob, f"{self.files[0][0]} row 0 {name}", kinds="u")
            from_bytes(blob, f"{self.files[0][0]} row 0 {name}")  # uint16, as the reference saves it
            first[name] = (blob[:offset], len(blob))
        for path, table in self.files:
            for name in FIELDS:
                header, length = first[name]
                row = 0
                for chunk in table.column(name).chunks:
                    _check_rows(path, name, chunk, row, header, length)
                    row += len(chunk)
        if "timestep" in self.table.column_names:
            self.timesteps()
        return {name: self.field(name, 0).shape for name in FIELDS}

    def timesteps(self) -> np.ndarray:
        if "timestep" not in self.table.column_names:
            raise DataError(f"{self.folder}: the eval set has no timestep column (its fixed timestep, 0-7)")
        column = self.table.column("timestep")
        if column.null_count:
            raise DataError(f"{self.folder}: {column.null_count} eval timestep(s) are null (each must be 0-7)")
        t = column.to_numpy()
        if t.min() < 0 or t.max() > 7:
            raise DataError(f"{self.folder}: eval timesteps must lie in 0-7, found {t.min()} to {t.max()}")
        return t

    def rows(self, indices) -> dict[str, np.ndarray]:
        return {name: np.stack([self.field(name, int(i)) for i in indices]) for name in FIELDS}


def _check_rows(path: Path, name: str, chunk: pa.Array, start: int, header: bytes, length: int) -> None:
    """Rows ``start`` on of one Arrow chunk of binary values: none null, each ``length`` bytes long and starting with
    ``header`` (the ``.npy`` header of row 0: one shape, one type). Vectorised over the offsets buffer."""
    if chunk.null_count:
        row = start + int(np.argmax(chunk.is_null().to_numpy(zero_copy_only=False)))
        raise DataError(f"{path}: row {row} of {name} is null")
    if not len(chunk):
        return
    width = np.int64 if pa.types.is_large_binary(chunk.type) else np.int32
    offsets = np.frombuffer(chunk.buffers()[1], dtype=width)[chunk.offset : chunk.offset + len(chunk) + 1]
    sizes = np.diff(offsets)
    if np.any(sizes != length):
        row = int(np.argmax(sizes != length))
        raise DataError(f"{path}: row {start + row} of {name} is {int(sizes[row]):,} bytes, not the {length:,} of "
                        "row 0 (an array of another shape or type)")  # fmt: skip
    data = np.frombuffer(chunk.buffers()[2], dtype=np.uint8)
    want = np.frombuffer(header, dtype=np.uint8)
    starts = offsets[:-1].astype(np.int64)
    for begin in range(0, len(starts), 8192):  # a few MB of indices at a time
        at = starts[begin : begin + 8192, None] + np.arange(len(want))
        differs = np.any(data[at] != want, axis=1)
        if differs.any():
            raise DataError(f"{path}: row {start + begin + int(np.argmax(differs))} of {name} is an array of another "
                            "shape or type than row 0 (its .npy header differs)")  # fmt: skip


def write_split(folder: Path, columns: dict[str, list[bytes] | np.ndarray]) -> None:
    """A split as ``save_to_disk`` lays it out: one Arrow stream file and the state naming it."""
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {k: pa.array(v, type=pa.int32() if k == "timestep" else pa.binary()) for k, v in columns.items()}
    table = pa.table(arrays)
    name = "data-00000-of-00001.arrow"
    with pa.ipc.new_stream(str(folder / name), table.schema) as writer:
        writer.write_table(table)
    (folder / STATE).write_text(json.dumps({"_data_files": [{"filename": name}], "_split": None}) + "\n")


def read_empty(folder: Path) -> dict[str, np.ndarray]:
    """The empty prompt's encodings [256, 4096] and [768], float32: each file a ``.npy`` of floats inside ``folder``
    holding one encoding ([1, ...]), finite."""
    out = {}
    for field, name in EMPTY.items():
        path = Path(folder) / name
        array = checks.load_npy(path, folder, kinds="f")
        if array.ndim < 2 or array.shape[0] != 1:
            raise DataError(f"{path}: an array of shape {list(array.shape)}, not one encoding ([1, ...])")
        if not np.isfinite(array).all():
            raise DataError(f"{path}: the empty prompt's encoding holds NaN or infinite values")
        out[field] = np.asarray(array, dtype=np.float32)[0]
    return out


def write_synthetic(out: Path, spec: dict, progress) -> dict[str, int]:
    """Seeded samples of ``spec``'s shapes in the reference's format: ``train/``, ``eval/`` (timesteps i % 8) and
    ``empty_encodings/``."""
    rng = np.random.default_rng(spec["seed"])
    c, h, w = spec["latent"]
    tokens, width, pooled, classes = spec["text_tokens"], spec["text_width"], spec["pooled_width"], spec["classes"]
    # Smooth latent patterns: coarse noise upsampled, so neighbouring patches agree (as a real latent's do).
    coarse = rng.normal(0, 1, (classes, c, max(h // 4, 1), max(w // 4, 1)))
    patterns = np.repeat(np.repeat(coarse, h // coarse.shape[2], axis=2), w // coarse.shape[3], axis=3)
    # After the reference's scaling, (z - 0.1159) x 0.3611, a latent is about N(0, 1): so z = pattern / 0.3611 + shift.
    prompts = rng.normal(0, 1, (classes, tokens, width))
    vectors = rng.normal(0, 1, (classes, pooled))
    written = {}
    for step, split in enumerate(("train", "eval")):
        n = spec[split]
        label = rng.integers(0, classes, n)
        columns: dict[str, list] = {f: [] for f in FIELDS}
        for i in range(n):
            k = label[i]
            columns["t5_encodings"].append(to_bytes(prompts[k] + rng.normal(0, 0.5, (tokens, width))))
            columns["clip_encodings"].append(to_bytes(vectors[k] + rng.normal(0, 0.5, pooled)))
            columns["mean"].append(to_bytes((patterns[k] + rng.normal(0, 0.1, (c, h, w))) / 0.3611 + 0.1159))
            columns["logvar"].append(to_bytes(np.full((c, h, w), 2 * np.log(0.05))))
        if split == "eval":
            columns["timestep"] = np.arange(n, dtype=np.int32) % 8
        write_split(out / split, columns)
        written[split] = n
        progress(step + 1, 3)
    empty = out / "empty_encodings"
    empty.mkdir(parents=True, exist_ok=True)
    np.save(empty / EMPTY["t5_encodings"], rng.normal(0, 1, (1, tokens, width)).astype(np.float16), allow_pickle=False)
    np.save(empty / EMPTY["clip_encodings"], rng.normal(0, 1, (1, pooled)).astype(np.float16), allow_pickle=False)
    progress(3, 3)
    return written


def sample_noise(seed: int, index: int, latent: tuple[int, ...]) -> dict[str, np.ndarray]:
    """A training sample's randomness, a function of the seed and its place in the sample order alone (so N ranks
    draw what one does): its timestep (uniform in [0, 1)), the noise, the draw from the latent's distribution, and
    whether it trains on the empty prompt (10 %)."""
    rng = np.random.default_rng([seed, index])
    return {"t": np.float32(rng.random()), "noise": rng.standard_normal(latent, dtype=np.float32),
            "eps": rng.standard_normal(latent, dtype=np.float32), "drop": np.float32(rng.random() < 0.1)}  # fmt: skip


class FluxSteps:
    """Optimizer steps: global batch k is samples [k*B, (k+1)*B) of the seeded order; rank r takes its share, each
    sample with its own randomness (:func:`sample_noise`)."""

    def __init__(self, split: EncodedSplit, seed: int, gbs: int, micro: int, rank: int, world: int, start: int,
                 empty: dict[str, np.ndarray]):  # fmt: skip
        self.split, self.seed, self.gbs, self.micro, self.empty = split, seed, gbs, micro, empty
        self.rank, self.world, self.start = rank, world, start
        self.order = np.random.default_rng(seed).permutation(len(split))
        self.latent = split.shapes()["mean"]

    def __iter__(self):
        k = self.start
        while True:
            positions = [k + i for i in rank_share(self.gbs, self.rank, self.world)]
            batch = self.split.rows([self.order[p % len(self.order)] for p in positions])
            draws = [sample_noise(self.seed, p, self.latent) for p in positions]
            batch |= {name: np.stack([d[name] for d in draws]) for name in ("t", "noise", "eps")}
            dropped = np.array([d["drop"] > 0 for d in draws])
            for name, encoding in self.empty.items():  # the empty prompt's encodings in place of the sample's
                batch[name][dropped] = encoding
            yield Step.split(batch, self.micro, self.gbs)
            k += self.gbs


class FluxEval:
    """This rank's eval batches, made as they are read: each sample at its fixed timestep (its ``timestep`` / 8) with
    its noise and its draw from the latent's distribution fixed by its index."""

    def __init__(self, split: EncodedSplit, batch_size: int, rank: int, world: int, samples: int):
        self.split, self.batch_size = split, batch_size
        self.share = eval_share(min(samples, len(split)), rank, world)
        self.timesteps = split.timesteps()
        self.latent = split.shapes()["mean"]

    def __iter__(self):
        for indices in batched(self.share, self.batch_size):
            batch = self.split.rows(indices)
            batch["t"] = (self.timesteps[list(indices)] / 8).astype(np.float32)
            batch["step_index"] = self.timesteps[list(indices)].astype(np.int64)
            draws = [np.random.default_rng([0, i]).standard_normal((2, *self.latent), dtype=np.float32)
                     for i in indices]  # fmt: skip
            batch["noise"], batch["eps"] = np.stack([d[0] for d in draws]), np.stack([d[1] for d in draws])
            yield batch
