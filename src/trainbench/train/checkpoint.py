"""Checkpoints for resuming a run: model, optimizer, position in the data and schedule, RNG states.

Model and optimizer go through torch distributed checkpoint (each rank writes its part; loading
re-shards), the loop's counters go into ``meta.json``, and every rank's RNG state into its own file.
Only trained parameters are saved: a frozen base (LoRA's) is read again from its own checkpoint, so a
fine-tuning run's checkpoint holds its adapters and their optimizer state.
A checkpoint is written into ``checkpoint_<i>.tmp/`` and renamed to ``checkpoint_<i>/`` once every
rank has finished, so a crash mid-save leaves the previous checkpoint intact.

Reading a checkpoint never runs code from it (results folders are shared and passed between people): the RNG
files hold tensors, numbers and strings only and load with ``torch.load(weights_only=True)``; distributed
checkpoint's ``.metadata`` (a pickle) is read by an unpickler that admits only the classes distributed checkpoint
writes there, its shard paths must stay inside the checkpoint, and the values it stores as bytes (the optimizer's
hyperparameters) load with ``weights_only=True`` too. Anything else is refused in one sentence.
"""

from __future__ import annotations

import errno
import io
import json
import pickle
import random
import shutil
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path, PurePath
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from trainbench.distributed import DistInfo
from trainbench.errors import DataError, UserError
from trainbench.runfiles import RunFiles

# Frozen parameters are not part of a run's state: they are what the run started from.
TRAINED = StateDictOptions(ignore_frozen_params=True)


@dataclass
class LoopState:
    """The loop's counters: with model, optimizer and RNG they define where a run stands."""

    step: int = 0
    samples: int = 0
    next_eval: int = 0
    run_start_ms: int = 0
    evals: list = field(default_factory=list)
    resumed: int = 0  # how many times this run was resumed
    log_bytes: int = 0  # length of the MLPerf log when the checkpoint was saved: what a resume keeps (0: all)


def checkpoint_dir(run_dir: Path, index: int) -> Path:
    return RunFiles(run_dir, index).checkpoint


def find_checkpoint(run_dir: Path, index: int) -> Path | None:
    """The newest complete checkpoint of run ``index`` (a crash between two renames leaves ``.old``)."""
    for path in (checkpoint_dir(run_dir, index), checkpoint_dir(run_dir, index).with_suffix(".old")):
        if (path / "meta.json").exists():
            return path
    return None


def _barrier(info: DistInfo) -> None:
    if info.world_size > 1:
        dist.barrier()


def _rng_state() -> dict:
    """Every RNG's state as tensors, numbers and strings only: it loads with ``weights_only=True``."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, words, gauss_next = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": version, "words": torch.tensor(words, dtype=torch.int64), "gauss_next": gauss_next},
    }  # fmt: skip
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))  # fmt: skip
    p = state["python"]
    random.setstate((p["version"], tuple(int(w) for w in p["words"].tolist()), p["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _read_rng(path: Path) -> dict:
    try:
        state = torch.load(path, weights_only=True)
    except Exception as e:  # weights_only refuses any object but tensors, numbers, strings and containers
        raise DataError(f"{path}: not an RNG state trainbench wrote ({_first_line(e)}); it is not loaded, since it "
                        "could run code: remove the checkpoint to start the run again") from None  # fmt: skip
    try:
        _check_rng(state)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise DataError(f"{path}: not an RNG state trainbench wrote ({e!r}); remove the checkpoint to start the run "
                        "again") from None  # fmt: skip
    return state


def _check_rng(state: Any) -> None:
    if not isinstance(state["torch"], torch.Tensor) or state["torch"].dtype != torch.uint8:
        raise ValueError("the torch state is not a uint8 tensor")
    if len(state["numpy"]["keys"]) != 624 or len(state["python"]["words"]) != 625:
        raise ValueError("the numpy or Python state has the wrong length")


# -- reading distributed checkpoint's files without running code ---------------------------------------------

_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")


class _MetadataUnpickler(pickle.Unpickler):
    """Admits what distributed checkpoint writes into ``.metadata`` (its own dataclasses, torch sizes, dtypes and
    layouts, paths) and nothing else: a pickle naming any other callable is refused before anything is called."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _METADATA_MODULES and not name.startswith("__"):
            found = getattr(__import__(module, fromlist=[name]), name, None)
            if isinstance(found, type) and found.__module__ == module:  # defined there, not imported into it
                return found
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            return getattr(torch, name)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return torch.serialization._get_layout
        if module == "pathlib" and name in ("PosixPath", "PurePosixPath", "Path"):
            return PurePath
        raise pickle.UnpicklingError(f"it names {module}.{name}, which a checkpoint's metadata never holds")


class SafeReader(FileSystemReader):
    """distributed checkpoint's file reader with its metadata unpickled by :class:`_MetadataUnpickler` and every
    shard path kept inside the checkpoint folder."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        rank = kwargs.get("rank")
        path = Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata")
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except OSError as e:
            raise DataError(f"{path}: cannot be read ({e.strerror or e}); the checkpoint is incomplete") from None
        except Exception as e:
            raise DataError(f"{path}: not a checkpoint's metadata ({_first_line(e)}); it is not loaded, since it "
                            "could run code") from None  # fmt: skip
        if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
            raise DataError(f"{path}: not a checkpoint's metadata ({type(metadata).__name__})")
        for info in metadata.storage_data.values():
            name = str(getattr(info, "relative_path", ""))
            if not name or "/" in name or "\\" in name or name in (".", ".."):
                raise DataError(f"{path}: names the shard file {name!r}, outside the checkpoint folder; refused")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """Values saved as bytes (the optimizer's hyperparameters) load with ``weights_only=True``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def _read_meta(path: Path) -> dict:
    file = path / "meta.json"
    try:
        meta = json.loads(file.read_text())
    except OSError as e:
        raise DataError(f"{file}: cannot be read ({e.strerror or e}); the checkpoint is incomplete") from None
    except ValueError as e:
        raise DataError(f"{file}: not JSON ({e}); the checkpoint is damaged: remove {path} to start the run "
                        "again") from None  # fmt: skip
    known = {f.name for f in fields(LoopState)} | {"world_size", "inputs"}
    if not isinstance(meta, dict) or not isinstance(meta.get("world_size"), int) or set(meta) - known:
        raise DataError(f"{file}: not a checkpoint's counters trainbench wrote; remove {path} to start the run again")
    return meta


def verify(path: Path, world_size: int) -> dict:
    """Read everything a resume will read from checkpoint ``path`` except the tensors' values (counters, metadata,
    RNG files), refusing what is damaged or could run code; returns its counters."""
    meta = _read_meta(path)
    SafeReader(str(path)).read_metadata()
    if meta["world_size"] == world_size:
        for rank in range(world_size):
            rng = path / f"rng_rank{rank}.pt"
            if rng.exists():
                _read_rng(rng)
    return meta


def save(run_dir: Path, index: int, model, optimizer, loop: LoopState, info: DistInfo) -> Path:
    final = checkpoint_dir(run_dir, index)
    tmp = final.with_suffix(".tmp")
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(info)
    model_state, optim_state = get_state_dict(model, optimizer, options=TRAINED)
    try:
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp), no_dist=info.world_size == 1)
        torch.save(_rng_state(), tmp / f"rng_rank{info.rank}.pt")
    except (OSError, CheckpointException) as e:
        raise _save_failed(tmp, e) from None
    _barrier(info)
    if info.is_main:
        try:
            (tmp / "meta.json").write_text(json.dumps(asdict(loop) | {"world_size": info.world_size}))
        except OSError as e:
            raise _save_failed(tmp, e) from None
        old = final.with_suffix(".old")
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    _barrier(info)
    return final


def _save_failed(tmp: Path, exc: BaseException) -> UserError:
    """One sentence for a checkpoint that could not be written; the previous one (if any) is intact."""
    shutil.rmtree(tmp, ignore_errors=True)
    causes = [exc, *getattr(exc, "failures", {}).values()] if isinstance(exc, CheckpointException) else [exc]
    full = any(getattr(c, "errno", None) == errno.ENOSPC or "No space left" in str(c) for c in causes)
    why = "the disk is full" if full else _first_line(exc)
    return UserError(f"could not write the checkpoint in {tmp.parent} ({why}); the previous checkpoint, if any, is "
                     "intact: make room and continue with resume=true")  # fmt: skip


def load(path: Path, model, optimizer, info: DistInfo) -> LoopState:
    meta = _read_meta(path)
    saved_world = meta.pop("world_size")
    meta.pop("inputs", None)
    model_state, optim_state = get_state_dict(model, optimizer, options=TRAINED)
    state = {"model": model_state, "optim": optim_state}
    try:
        dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafePlanner(), no_dist=info.world_size == 1)
    except CheckpointException as e:
        failures = list(getattr(e, "failures", {}).values())
        user = next((f for f in failures if isinstance(f, UserError)), None)
        if user is not None:
            raise DataError(str(user)) from None
        why = _first_line(failures[0]) if failures else _first_line(e)
        raise DataError(f"{path}: the checkpoint cannot be read ({why}); it is damaged or of another model: remove "
                        "it to start the run again") from None  # fmt: skip
    except (UserError, pickle.UnpicklingError, OSError, RuntimeError, ValueError, KeyError, EOFError) as e:
        if isinstance(e, UserError):
            raise
        raise DataError(f"{path}: the checkpoint cannot be read ({_first_line(e)}); it is damaged or of another "
                        "model: remove it to start the run again") from None  # fmt: skip
    # Not strict: the frozen parameters are absent on purpose (dcp.load has failed for any trained one missing).
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))  # fmt: skip
    rng = path / f"rng_rank{info.rank}.pt"
    if saved_world == info.world_size and rng.exists():  # on another world size the RNG streams differ anyway
        _set_rng_state(_read_rng(rng))
    return LoopState(**meta)
