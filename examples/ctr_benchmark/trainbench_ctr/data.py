"""The data set: synthetic clicks as three arrays per split (``dense.npy``, ``sparse.npy``, ``label.npy``) and a
``manifest.json``; the reader that cuts them into optimizer steps the way every trainbench benchmark does."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from trainbench.data.steps import Step, batched, eval_share, rank_share
from trainbench.errors import DataError

SPLITS = ("train", "eval")
FILES = ("dense", "sparse", "label")


def write_synthetic(out: Path, spec: dict, progress: Callable[[int, int], None]) -> dict[str, int]:
    """Clicks drawn from a hidden logistic model of the dense features and one effect per category, so a model
    can learn them, but never perfectly (the hidden model's own AUC is the ceiling). Seeded by ``spec["seed"]``."""
    rng = np.random.default_rng(spec["seed"])
    weights = rng.normal(0, 0.6, spec["dense_features"])
    effects = rng.normal(0, 1.0, (spec["tables"], spec["table_size"]))
    written = {}
    for step, split in enumerate(SPLITS):
        n = spec[split]
        dense = rng.normal(0, 1, (n, spec["dense_features"])).astype(np.float32)
        # Categories of uneven popularity, as in click logs.
        sparse = np.minimum(rng.zipf(1.3, (n, spec["tables"])) - 1, spec["table_size"] - 1).astype(np.int64)
        logit = dense @ weights + effects[np.arange(spec["tables"]), sparse].sum(axis=1) - 1.0
        label = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        folder = out / split
        folder.mkdir(parents=True, exist_ok=True)
        for name, array in zip(FILES, (dense, sparse, label), strict=True):
            np.save(folder / f"{name}.npy", array)
        written[split] = n
        progress(step + 1, len(SPLITS))
    return written


def read_split(root: Path, split: str) -> dict[str, np.ndarray]:
    """One split's arrays, memory-mapped; one sentence where a file is missing or the lengths disagree."""
    arrays = {}
    for name in FILES:
        path = root / split / f"{name}.npy"
        if not path.is_file():
            raise DataError(f"{path} is missing; write the data set with `trainbench prepare ctr_tiny --synthetic`")
        arrays[name] = np.load(path, mmap_mode="r", allow_pickle=False)
    if len({len(a) for a in arrays.values()}) != 1:
        raise DataError(f"{root / split}: dense, sparse and label hold different numbers of samples")
    return arrays


class ClickSteps:
    """Optimizer steps forever from ``start_sample``: global batch k is samples [k*B, (k+1)*B) of a stream that
    visits the training set in a new seeded order each epoch; this rank takes its share (``rank_share``), cut into
    micro-batches. So the samples, and the losses, are the same on 1 rank as on N."""

    def __init__(self, arrays: dict[str, np.ndarray], seed: int, global_batch: int, micro_batch: int, rank: int,
                 world_size: int, start_sample: int) -> None:  # fmt: skip
        self.arrays, self.seed, self.global_batch, self.micro_batch = arrays, seed, global_batch, micro_batch
        self.share = np.asarray(rank_share(global_batch, rank, world_size))
        self.start_step = start_sample // global_batch
        self.size = len(arrays["label"])
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.size)}
        return self._orders[epoch]

    def __iter__(self) -> Iterator[Step]:
        step = self.start_step
        while True:
            positions = step * self.global_batch + self.share
            epochs, offsets = np.divmod(positions, self.size)
            rows = np.array([self._order(int(e))[o] for e, o in zip(epochs, offsets, strict=True)])
            arrays = {name: np.asarray(a[rows]) for name, a in self.arrays.items()}
            yield Step.split(arrays, self.micro_batch, self.global_batch)
            step += 1


def eval_batches(arrays: dict[str, np.ndarray], batch_size: int, rank: int, world_size: int) -> list[dict]:
    """This rank's share of the eval set, in batches (loaded into memory: it is read at every eval)."""
    share = eval_share(len(arrays["label"]), rank, world_size)
    return [{name: np.array(a[r.start : r.stop]) for name, a in arrays.items()} for r in batched(share, batch_size)]
