"""flux1's data: the reference's preprocessed encodings, read as it publishes them, and seeded synthetic ones in the
same format.

The reference (mlcommons/training ``text_to_image``, torchtitan's flux) saves each split with HF ``datasets``'
``save_to_disk``: a folder of Arrow IPC stream files named by its ``state.json``, one row a sample with the binary
fields ``t5_encodings`` [256, 4096], ``clip_encodings`` [768], ``mean`` and ``logvar`` [16, 32, 32] (the VAE
encoder's latent distribution), each the bytes of ``np.save`` of a bf16 array viewed as uint16, and (eval) an int32
``timestep`` 0-7. The empty prompt's encodings are ``t5_empty.npy`` [1, 256, 4096] and ``clip_empty.npy`` [1, 768]
(float16) in a folder of their own. Nothing is unpickled: every array loads with ``allow_pickle=False``, and a data
file named outside its folder is refused.

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
    """A stored field as float32."""
    try:
        bits = np.load(io.BytesIO(blob), allow_pickle=False)
    except ValueError as e:
        raise DataError(f"{where}: not a numpy array of bf16 bits ({e})") from None
    if bits.dtype != np.uint16:
        raise DataError(f"{where}: an array of {bits.dtype}, not bf16 bits (uint16)")
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy()


class EncodedSplit:
    """One split's rows (memory-mapped: the full training set is 2.5 TB)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        state = self.folder / STATE
        try:
            files = [f["filename"] for f in json.loads(state.read_text())["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{state}: not a saved data set's state ({e}); prepare the data with `trainbench prepare "
                            "flux1`") from None  # fmt: skip
        tables = []
        for name in files:
            path = (self.folder / name).resolve()
            if path.parent != self.folder.resolve():
                raise DataError(f"{state} names {name!r}, a file outside its folder")
            try:
                tables.append(pa.ipc.open_stream(pa.memory_map(str(path))).read_all())
            except (OSError, pa.ArrowInvalid) as e:
                raise DataError(f"{path}: not an Arrow stream ({e})") from None
        if not tables:
            raise DataError(f"{state} names no data files")
        self.table = pa.concat_tables(tables)
        missing = [f for f in FIELDS if f not in self.table.column_names]
        if missing:
            raise DataError(f"{self.folder}: no {', '.join(missing)} column (columns: {self.table.column_names})")

    def __len__(self) -> int:
        return self.table.num_rows

    def field(self, name: str, index: int) -> np.ndarray:
        return from_bytes(self.table.column(name)[index].as_py(), f"{self.folder} row {index} {name}")

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: self.field(name, 0).shape for name in FIELDS}

    def timesteps(self) -> np.ndarray:
        if "timestep" not in self.table.column_names:
            raise DataError(f"{self.folder}: the eval set has no timestep column (its fixed timestep, 0-7)")
        t = self.table.column("timestep").to_numpy()
        if t.min() < 0 or t.max() > 7:
            raise DataError(f"{self.folder}: eval timesteps must lie in 0-7, found {t.min()} to {t.max()}")
        return t

    def rows(self, indices) -> dict[str, np.ndarray]:
        return {name: np.stack([self.field(name, int(i)) for i in indices]) for name in FIELDS}


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
    """The empty prompt's encodings [256, 4096] and [768], float32."""
    out = {}
    for field, name in EMPTY.items():
        path = Path(folder) / name
        try:
            array = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise DataError(f"{path}: cannot read the empty prompt's encoding ({e})") from None
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
