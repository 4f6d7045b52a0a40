"""Checkpoints for resuming a run: model, optimizer, position in the data and schedule, RNG states.

Model and optimizer go through torch distributed checkpoint (each rank writes its part; loading
re-shards), the loop's counters go into ``meta.json``, and every rank's RNG state into its own file.
Only trained parameters are saved: a frozen base (LoRA's) is read again from its own checkpoint, so a
fine-tuning run's checkpoint holds its adapters and their optimizer state.
A checkpoint is written into ``checkpoint_<i>.tmp/`` and renamed to ``checkpoint_<i>/`` once every
rank has finished, so a crash mid-save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from trainbench.distributed import DistInfo
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
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(run_dir: Path, index: int, model, optimizer, loop: LoopState, info: DistInfo) -> Path:
    final = checkpoint_dir(run_dir, index)
    tmp = final.with_suffix(".tmp")
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(info)
    model_state, optim_state = get_state_dict(model, optimizer, options=TRAINED)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp), no_dist=info.world_size == 1)
    torch.save(_rng_state(), tmp / f"rng_rank{info.rank}.pt")
    _barrier(info)
    if info.is_main:
        (tmp / "meta.json").write_text(json.dumps(asdict(loop) | {"world_size": info.world_size}))
        old = final.with_suffix(".old")
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    _barrier(info)
    return final


def load(path: Path, model, optimizer, info: DistInfo) -> LoopState:
    meta = json.loads((path / "meta.json").read_text())
    saved_world = meta.pop("world_size")
    model_state, optim_state = get_state_dict(model, optimizer, options=TRAINED)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(path), no_dist=info.world_size == 1)
    # Not strict: the frozen parameters are absent on purpose (dcp.load has failed for any trained one missing).
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))  # fmt: skip
    rng = path / f"rng_rank{info.rank}.pt"
    if saved_world == info.world_size and rng.exists():  # on another world size the RNG streams differ anyway
        _set_rng_state(torch.load(rng, weights_only=False))
    return LoopState(**meta)
