"""The rules every data reader keeps, in one place: a reader (a benchmark's, a plugin's) checks its files with these
before training starts, so a damaged, crafted or mismatched file is one sentence naming it (a :class:`DataError`,
which the CLI prints before any results folder is made), never a traceback or an allocation mid-run.

- A file is read only where it really lies inside its data folder: a symlink (or a name with ``..``) that resolves
  outside is refused, so a data folder cannot make a run read, say, a home directory's files.
- A size a file declares (an array header, an index's counts) is checked against the file's own size before anything
  is allocated for it.
- ``.npy`` arrays are loaded without pickles, of plain numeric types only, never from an ``.npz`` archive, with their
  header's shape times item size equal to the bytes that follow it.
- Token ids are checked against the vocabulary over every shard, streamed in chunks, and token types are integers.
"""

from __future__ import annotations

import ast
import io
import math
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from trainbench.errors import DataError

NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGIC = b"PK\x03\x04"
# Larger than any array a reader loads whole (the empty prompt's encodings are 2 MB); a memory-mapped array is checked
# against its file's size instead.
MAX_LOADED_BYTES = 1 << 30
ID_CHUNK = 1 << 24  # tokens per chunk when scanning ids: 32-64 MB of memory at a time


def inside(folder: str | Path, path: str | Path) -> Path:
    """``path`` resolved, where it lies inside ``folder`` (both resolved: a data folder that is itself a link is
    fine); a file that resolves elsewhere, through a symlink or ``..``, is refused."""
    root, real = Path(folder).resolve(), Path(path).resolve()
    if real != root and root not in real.parents:
        raise DataError(f"{path} resolves to {real}, outside its data folder {root}; copy the file into the folder "
                        "instead of linking to it")  # fmt: skip
    return real


def file_in(folder: str | Path, path: str | Path, what: str = "a data file") -> Path:
    """:func:`inside`, for a file that must exist and be a regular file."""
    real = inside(folder, path)
    if not real.is_file():
        raise DataError(f"{path} does not exist or is not a file ({what})")
    return real


def declared_size(path: str | Path, declared: int, actual: int | None = None, what: str = "its header") -> None:
    """A size (bytes) that ``path``'s ``what`` declares, against the file's own size (or ``actual``)."""
    actual = os.path.getsize(path) if actual is None else actual
    if declared != actual:
        raise DataError(f"{path}: {what} declares {declared:,} bytes but the file holds {actual:,} (cut short or "
                        "altered)")  # fmt: skip


def integer_dtype(dtype, where: str, what: str = "tokens") -> np.dtype:
    """``dtype`` where it is an integer type (a float or other type would be truncated silently into ids)."""
    dtype = np.dtype(dtype)
    if dtype.kind not in "iu":
        raise DataError(f"{where}: {what} of type {dtype}, not an integer type")
    return dtype


def npy_header(source: str | Path | bytes, where: str, kinds: str = "iuf",
               max_bytes: int | None = MAX_LOADED_BYTES) -> tuple[tuple[int, ...], np.dtype, bool, int]:  # fmt: skip
    """The (shape, dtype, fortran order, data offset) of a ``.npy`` file or blob, after checking what it declares:
    a ``.npy`` (not ``.npz``) of version 1-3, a plain numeric dtype whose kind is in ``kinds``, and shape x item size
    equal to the bytes after the header (and at most ``max_bytes``, where given): nothing is allocated for it yet."""
    if isinstance(source, bytes | bytearray | memoryview):
        stream, total = io.BytesIO(source), len(source)
    else:
        try:
            stream, total = open(source, "rb"), os.path.getsize(source)
        except OSError as e:
            raise DataError(f"{where}: cannot be read ({e.strerror or e})") from None
    with stream:
        magic = stream.read(8)
        if magic.startswith(ZIP_MAGIC):
            raise DataError(f"{where}: an .npz archive, not one .npy array")
        if not magic.startswith(NPY_MAGIC) or len(magic) < 8 or magic[6] not in (1, 2, 3):
            raise DataError(f"{where}: not a .npy array (no numpy header)")
        width = 2 if magic[6] == 1 else 4
        raw = stream.read(width)
        length = int.from_bytes(raw, "little") if len(raw) == width else -1
        offset = 8 + width + length
        if length < 0 or offset > total or length > 65536:
            raise DataError(f"{where}: a .npy header cut short or of an impossible length")
        text = stream.read(length).decode("latin1")
    try:
        header = ast.literal_eval(text)
        shape, fortran, dtype = tuple(header["shape"]), bool(header["fortran_order"]), np.dtype(header["descr"])
    except (ValueError, SyntaxError, KeyError, TypeError, MemoryError, RecursionError):
        raise DataError(f"{where}: an unreadable .npy header") from None
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None or dtype.kind not in kinds:
        raise DataError(f"{where}: an array of {dtype}, not of plain numbers ({', '.join(_KINDS[k] for k in kinds)})")
    if not all(isinstance(n, int) and n >= 0 for n in shape):
        raise DataError(f"{where}: a .npy header with the shape {list(shape)}")
    declared = math.prod(shape) * dtype.itemsize
    if max_bytes is not None and declared > max_bytes:
        raise DataError(f"{where}: an array of shape {list(shape)} ({declared:,} bytes), more than the "
                        f"{max_bytes:,} bytes an array of this kind may hold")  # fmt: skip
    declared_size(where, declared, total - offset, f"its .npy header (shape {list(shape)}, {dtype})")
    return shape, dtype, fortran, offset


_KINDS = {"i": "signed integers", "u": "unsigned integers", "f": "floats", "b": "booleans"}


def load_npy(path: str | Path, folder: str | Path, kinds: str = "iuf", mmap: bool = False,
             max_bytes: int | None = MAX_LOADED_BYTES) -> np.ndarray:  # fmt: skip
    """A ``.npy`` file inside ``folder``, its header checked first (:func:`npy_header`): loaded whole (at most
    ``max_bytes``), or memory-mapped with ``mmap`` (any size the file really holds)."""
    real = file_in(folder, path, "a .npy array")
    npy_header(real, str(path), kinds, None if mmap else max_bytes)
    try:
        return np.load(real, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise DataError(f"{path}: not a whole .npy array ({str(e)[:120]})") from None


def npy_from_bytes(blob: bytes, where: str, kinds: str = "iuf", max_bytes: int | None = MAX_LOADED_BYTES) -> np.ndarray:
    """A ``.npy`` blob (a row's field) as an array over the blob's memory, its header checked first."""
    shape, dtype, fortran, offset = npy_header(blob, where, kinds, max_bytes)
    array = np.frombuffer(blob, dtype=dtype, count=math.prod(shape), offset=offset)
    return array.reshape(shape, order="F" if fortran else "C")


def ids_in_vocabulary(chunks: Iterable[tuple[str, np.ndarray]], vocab: int, what: str = "token ids") -> None:
    """Every id of every array (named by its file) in ``[0, vocab)``, read ``ID_CHUNK`` ids at a time: a
    memory-mapped shard is streamed, not loaded. One pass over all the data: seconds for gigabytes."""
    for where, array in chunks:
        integer_dtype(array.dtype, where, what)
        flat = array.reshape(-1)
        for start in range(0, len(flat), ID_CHUNK):
            part = np.asarray(flat[start : start + ID_CHUNK])
            low, high = int(part.min()), int(part.max())
            if low < 0 or high >= vocab:
                bad = low if low < 0 else high
                at = start + int(np.argmax(part == bad))
                raise DataError(f"{where}: {what} reach {bad} (at position {at:,}), outside the vocabulary of "
                                f"{vocab:,} (model.vocab_size); data made with another tokenizer?")  # fmt: skip


def token_id(value, vocab: int, where: str, what: str) -> int:
    """A single token id a file declares (an end-of-document token): an integer in ``[0, vocab)``."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or not 0 <= int(value) < vocab:
        raise DataError(f"{where}: {what} is {value!r}, not a token id of the vocabulary of {vocab:,} "
                        "(model.vocab_size)")  # fmt: skip
    return int(value)
