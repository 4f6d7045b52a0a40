"""Reading a Hugging Face safetensors checkpoint straight into each rank's shards, and writing one.

A checkpoint folder holds ``model.safetensors`` or ``model.safetensors.index.json`` and the shards its
``weight_map`` names (``LlamaForCausalLM.save_pretrained``). Each parameter of the model — whole, or the
rank's part of a sharded one (an FSDP2 or tensor-parallel DTensor) — is filled from the rows and columns of the
file that it holds, read with safetensors' ``get_slice``: a rank never reads the whole model, and its host memory
grows by at most one parameter's share at a time.

Two layouts of the attention projections are read into either model layout (``DecoderConfig.fused_qkv``): HF's
``q_proj``, ``k_proj``, ``v_proj``, and the fused ``qkv_proj`` of MLPerf's Llama-2-70B checkpoint (rows q, then k,
then v). A fused parameter is cut from the three files' tensors and the other way round.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from torch import nn

from trainbench.errors import DataError
from trainbench.families.configs import DecoderConfig

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
QKV = ("q_proj", "k_proj", "v_proj")


class HFCheckpoint:
    """The tensors of a safetensors checkpoint folder, by name, opened lazily (nothing is read until asked)."""

    def __init__(self, folder: str | Path):
        from safetensors import safe_open

        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise DataError(f"{self.folder}: no such checkpoint folder; give the folder holding {INDEX} and its shards")
        index = self.folder / INDEX
        if index.exists():
            weight_map = read_index(index)
            files = sorted(set(weight_map.values()))
        elif (self.folder / SINGLE).exists():
            files, weight_map = [SINGLE], None
        else:
            raise DataError(f"{self.folder}: neither {INDEX} nor {SINGLE}; save the model with "
                            "save_pretrained(safe_serialization=True) or download its safetensors files")  # fmt: skip
        for name in files:
            if not (self.folder / name).exists():
                raise DataError(f"{self.folder / name}: named in {INDEX} but missing; download the checkpoint's "
                                "shards again")  # fmt: skip
        self._stack = ExitStack()
        self._open = {}
        self.where: dict[str, str] = {}
        for name in files:
            try:
                handle = self._stack.enter_context(safe_open(str(self.folder / name), framework="pt"))
            except Exception as e:  # safetensors raises its own error types for damaged headers
                raise DataError(
                    f"{self.folder / name}: not a readable safetensors file ({e}); download it again"
                ) from None
            self._open[name] = handle
            for key in handle.keys():
                if weight_map is None or weight_map.get(key) == name:
                    self.where[key] = name
        if weight_map is not None:
            missing = sorted(k for k, f in weight_map.items() if k not in self.where)
            if missing:
                raise DataError(f"{self.folder / weight_map[missing[0]]}: holds no tensor {missing[0]} that {INDEX} "
                                "places there; download the checkpoint again")  # fmt: skip

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def has(self, name: str) -> bool:
        return name in self.where

    def dtype(self, name: str) -> str:
        """The tensor's type as its file's header names it (``BF16``, ``F16``, ``F32``, ``I64``, ...)."""
        return str(self._open[self.where[name]].get_slice(name).get_dtype())

    def file_of(self, name: str) -> Path:
        return self.folder / self.where[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open[self.where[name]].get_slice(name).get_shape())

    def read(self, name: str, rows: slice, cols: slice | None) -> torch.Tensor:
        try:
            part = self._open[self.where[name]].get_slice(name)
            return part[rows] if cols is None else part[rows, cols]
        except Exception as e:  # safetensors' own error types: a file cut short or changed since it was opened
            raise DataError(f"{self.file_of(name)}: tensor {name} cannot be read ({_first_line(e)}); download the "
                            "checkpoint again") from None  # fmt: skip


# The types a frozen base may be stored in: floating point only (an integer tensor would be cast, and trained on,
# as if it were weights).
FLOAT_TYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def read_index(index: Path) -> dict[str, str]:
    """``weight_map`` of a safetensors index: tensor name -> shard file name, every shard a plain file name inside
    the index's folder (an index never sends the reader elsewhere on the disk)."""
    try:
        value = json.loads(index.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{index}: not a safetensors index ({_first_line(e)}); download it again") from None
    weight_map = value.get("weight_map") if isinstance(value, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):  # fmt: skip
        raise DataError(f"{index}: not a safetensors index (its weight_map must map tensor names to shard file "
                        "names); download it again")  # fmt: skip
    if not weight_map:
        raise DataError(f"{index}: its weight_map names no tensor; download it again")
    for name in set(weight_map.values()):
        if name != Path(name).name or name in (".", "..") or "\\" in name:
            raise DataError(f"{index}: names the shard '{name}', outside its folder; an index may name only files "
                            "beside it")  # fmt: skip
    return weight_map


SAMPLES, SAMPLE_BYTES = 16, 64 * 2**10  # per shard: 16 pieces of 64 KiB of its tensor data (all of a small one)


def identity(folder: str | Path) -> dict:
    """What a base checkpoint is, without reading all of it: the index's sha256, and per shard its name, size, the
    sha256 of its header (the 8-byte length and the JSON giving every tensor's name, type, shape and offsets) and the
    sha256 of 16 evenly spaced 64 KiB pieces of its tensor data (all of it below 1 MiB). Another base of the same
    shapes has the same headers; its sampled data differs. A full hash of the 70B base reads 138 GB (minutes at a
    file system's speed, at every start and resume); the samples read 1 MiB a shard (perf/base_identity.py)."""
    import hashlib

    root = Path(folder)
    index = root / INDEX
    files = sorted(set(read_index(index).values())) if index.exists() else [SINGLE]
    out: dict = {"index_sha256": hashlib.sha256(index.read_bytes()).hexdigest() if index.exists() else None,
                 "shards": {}}  # fmt: skip
    for name in files:
        path = root / name
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                head = f.read(8)
                length = int.from_bytes(head, "little") if len(head) == 8 else 0
                header = f.read(min(length, 100 * 2**20))  # safetensors caps its header at 100 MB
                start = 8 + len(header)
                data = hashlib.sha256()
                span = size - start
                if span <= SAMPLES * SAMPLE_BYTES:
                    data.update(f.read())
                else:
                    for i in range(SAMPLES):
                        f.seek(start + (span - SAMPLE_BYTES) * i // (SAMPLES - 1))
                        data.update(f.read(SAMPLE_BYTES))
        except OSError as e:
            raise DataError(f"{path}: cannot be read ({e.strerror or e})") from None
        out["shards"][name] = {"bytes": size, "header_sha256": hashlib.sha256(head + header).hexdigest(),
                               "data_sample_sha256": data.hexdigest()}  # fmt: skip
    return out


def describe_change(old: dict, new: dict) -> str | None:
    """A short phrase naming how two :func:`identity` values differ (None when they do not)."""
    if old == new:
        return None
    a, b = old.get("shards", {}), new.get("shards", {})
    for name in sorted(set(a) | set(b)):
        if name not in b:
            return f"shard {name} is gone"
        if name not in a:
            return f"shard {name} is new"
        if a[name].get("bytes") != b[name].get("bytes"):
            return f"shard {name} changed size ({a[name].get('bytes'):,} -> {b[name].get('bytes'):,} bytes)"
        if a[name].get("header_sha256") != b[name].get("header_sha256"):
            return f"the tensor headers of shard {name} changed"
        if a[name].get("data_sample_sha256") != b[name].get("data_sample_sha256"):
            return f"the tensor data of shard {name} changed"
    if old.get("index_sha256") != new.get("index_sha256"):
        return "its index changed"
    return "it differs"


def _sources(name: str, ckpt: HFCheckpoint, cfg: DecoderConfig) -> list[tuple[str, int, int]]:
    """Where the rows of the model's parameter ``name`` are in the checkpoint: (tensor, first row, rows) pieces,
    stacked in order."""
    d = cfg.head_dim
    sizes = {"q_proj": cfg.num_heads * d, "k_proj": cfg.kv_heads * d, "v_proj": cfg.kv_heads * d}
    prefix, _, leaf = name.rpartition(".")
    module_prefix, _, module = prefix.rpartition(".")
    if module == "qkv_proj" and not ckpt.has(name):
        return [(f"{module_prefix}.{m}.{leaf}", 0, sizes[m]) for m in QKV]
    if module in QKV and not ckpt.has(name):
        fused = f"{module_prefix}.qkv_proj.{leaf}"
        first = sum(sizes[m] for m in QKV[: QKV.index(module)])
        return [(fused, first, sizes[module])]
    return [(name, 0, -1)]


def _local_part(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The tensor this rank holds of ``param`` and where it starts in the whole parameter."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        return param.to_local(), tuple(offset)
    return param, (0,) * param.dim()


def _check_shape(name: str, want: tuple[int, ...], ckpt: HFCheckpoint, sources) -> None:
    for tensor, _, _ in sources:
        if not ckpt.has(tensor):
            raise DataError(f"{ckpt.folder}: no tensor {tensor} (for the model's {name}); is this checkpoint of "
                            "the model the config describes?")  # fmt: skip
        if ckpt.dtype(tensor) not in FLOAT_TYPES:
            raise DataError(f"{ckpt.file_of(tensor)}: tensor {tensor} is stored as {ckpt.dtype(tensor)}, not as "
                            f"floating point ({', '.join(FLOAT_TYPES)}); these are not a model's weights")  # fmt: skip
    shapes = [ckpt.shape(t) for t, _, _ in sources]
    got_rows = sum(s[0] if r < 0 else r for s, (_, _, r) in zip(shapes, sources, strict=True))
    trailing = {s[1:] for s in shapes}
    if len(trailing) != 1 or (got_rows, *trailing.pop()) != want:
        t = sources[0][0]
        raise DataError(f"{ckpt.file_of(t)}: tensor {t} has shape {list(ckpt.shape(t))}, but the model's {name} "
                        f"needs {list(want)}; set the model config of this checkpoint (model.* keys)")  # fmt: skip


def check_shapes(model: nn.Module, ckpt: HFCheckpoint, cfg: DecoderConfig, skip: tuple[str, ...] = ()) -> None:
    """Every parameter of ``model`` (on any device, the meta device included) whose name contains none of ``skip``
    is in ``ckpt`` with its shape; else DataError naming the file."""
    for name, param in model.named_parameters():
        if not any(s in name for s in skip):
            _check_shape(name, tuple(param.shape), ckpt, _sources(name, ckpt, cfg))


@torch.no_grad()
def fill(part: nn.Module, ckpt: HFCheckpoint, cfg: DecoderConfig, skip: tuple[str, ...] = (), prefix: str = "") -> int:
    """Copy into every parameter of ``part`` (whole or this rank's shard, materialised; named ``prefix`` + its name
    in the checkpoint) whose name contains none of ``skip`` the slices of ``ckpt`` it holds; returns bytes read."""
    read = 0
    for local_name, param in part.named_parameters():
        if any(s in local_name for s in skip):
            continue
        name = prefix + local_name
        local, offset = _local_part(param)
        if local.numel() == 0:
            continue
        first, count = offset[0], local.shape[0]
        cols = slice(offset[1], offset[1] + local.shape[1]) if local.dim() > 1 else None
        row = 0  # the row of the whole parameter where the current source begins
        for tensor, start, rows in _sources(name, ckpt, cfg):
            rows = ckpt.shape(tensor)[0] if rows < 0 else rows
            lo, hi = max(first, row), min(first + count, row + rows)
            if lo < hi:
                piece = ckpt.read(tensor, slice(start + lo - row, start + hi - row), cols)
                local[lo - first : hi - first].copy_(piece)
                read += piece.numel() * piece.element_size()
            row += rows
    return read


def load_into(model: nn.Module, folder: str | Path, cfg: DecoderConfig, skip: tuple[str, ...] = ()) -> int:
    """Fill every parameter of ``model`` (whole or sharded, already materialised) whose name contains none of
    ``skip`` from the checkpoint in ``folder``; returns the bytes read. Raises DataError naming the file for a
    missing shard or tensor and for a shape that does not match ``cfg``, before anything is copied."""
    with HFCheckpoint(folder) as ckpt:
        check_shapes(model, ckpt, cfg, skip)
        return fill(model, ckpt, cfg, skip)


def iter_shards(state: dict[str, torch.Tensor], max_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    shard: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > max_bytes:
            yield shard
            shard, size = {}, 0
        shard[name] = tensor
        size += nbytes
    if shard:
        yield shard


def save_sharded(state: dict[str, torch.Tensor], folder: str | Path, max_bytes: int) -> list[Path]:
    """Write ``state`` as HF does: shards of at most ``max_bytes`` (one tensor may exceed it) and the index."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shards = list(iter_shards({k: v.contiguous() for k, v in state.items()}, max_bytes))
    weight_map, paths = {}, []
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, name)
        paths.append(folder / name)
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2))
    return paths
