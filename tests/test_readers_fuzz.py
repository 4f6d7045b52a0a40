"""Generated damage to each reader's valid tiny data (truncations, other types and shapes, huge declared sizes, bad
values, files linked out of the folder) ends through the CLI in exit 2 and one sentence, never a traceback and never
a results folder: every reader refuses what it cannot train on before a run starts.

Each reader's tiny data is prepared once (conftest's fixtures); an example damages a hard-linked copy, replacing the
files it changes. The fast tier runs ``FAST`` examples a reader, ``make test-all`` ``FULL``. A damage a reader did
not check would be an expected failure below, naming the missing check (none is left)."""

from __future__ import annotations

import itertools
import json
import shutil
import struct
from pathlib import Path

import h5py
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import rewrite_hdf5
from tests.test_data_checks import (
    ARROW,
    link_outside,
    linked_copy,
    npy_bytes,
    read_arrow,
    refused,
    replace,
    with_column,
    write_arrow,
)

FAST, FULL = 12, 150
PROFILE = dict(deadline=None, database=None, derandomize=False, suppress_health_check=list(HealthCheck))
_examples = itertools.count()


@pytest.fixture(scope="session")
def flux_tiny(tmp_path_factory) -> Path:
    from tests.conftest import _prepared

    return _prepared(tmp_path_factory, "flux1")


@pytest.fixture(scope="session")
def llm_tiny(tmp_path_factory) -> Path:
    from tests.conftest import _prepared

    return _prepared(tmp_path_factory, "llama31_8b")


def truncate(data: Path, draw, files: list[str], keep_end: dict[str, int] | None = None) -> None:
    """One of ``files`` cut short; ``keep_end``: bytes at a file's end whose loss leaves it whole (JSON's newline, an
    Arrow stream's end marker)."""
    name = draw(st.sampled_from(files))
    path = data / name
    raw = path.read_bytes()
    spare = next((n for suffix, n in (keep_end or {}).items() if name.endswith(suffix)), 0)
    replace(path, raw[: draw(st.integers(0, max(len(raw) - 1 - spare, 0)))])


def npy_huge(path: Path, draw) -> None:
    """``path``'s .npy header declaring a huge shape, its bytes left as they were."""
    raw = path.read_bytes()
    end = raw.index(b"\n") + 1
    header = raw[:end].decode("latin1")
    start = header.index("'shape': (") + len("'shape': (")
    shape = f"{2 ** draw(st.integers(31, 62))}, {draw(st.integers(1, 9))}"
    text = header[:start] + shape + header[header.index(")", start) :]
    replace(path, text[: end - 1].ljust(end - 1).encode("latin1")[: end - 1] + b"\n" + raw[end:])


# -- flux1: Arrow streams, .npy rows and the empty prompt's encodings ----------------------------------------------

FLUX_FILES = ["train/" + ARROW, "eval/" + ARROW, "train/state.json", "eval/state.json",
              "empty_encodings/t5_empty.npy", "empty_encodings/clip_empty.npy"]  # fmt: skip
FLUX_TYPES = {"int32": pa.int32(), "string": pa.string(), "float64": pa.float64(), "list": pa.list_(pa.int8())}


def flux_column_type(data: Path, draw) -> None:
    split = draw(st.sampled_from(["train", "eval"]))
    path = data / split / ARROW
    table = read_arrow(path)
    names = ["t5_encodings", "clip_encodings", "mean", "logvar"] + (["timestep"] if split == "eval" else [])
    name = draw(st.sampled_from(names))
    kind = draw(st.sampled_from([k for k in [*FLUX_TYPES, "null", "missing"] if (k, name) != ("int32", "timestep")]))
    if kind == "missing":
        table = table.drop_columns([name])
    elif kind == "null":
        table = with_column(table, name, pa.nulls(table.num_rows))
    else:
        values = {"int32": list(range(table.num_rows)), "string": ["x"] * table.num_rows,
                  "float64": [0.5] * table.num_rows, "list": [[1]] * table.num_rows}[kind]  # fmt: skip
        table = with_column(table, name, pa.array(values, FLUX_TYPES[kind]))
    write_arrow(path, table)


def flux_row(data: Path, draw) -> None:
    """One row's field of another shape or type, null, or declaring a huge array."""
    from trainbench.data.flux_data import from_bytes, to_bytes

    split = draw(st.sampled_from(["train", "eval"]))
    path = data / split / ARROW
    table = read_arrow(path)
    name = draw(st.sampled_from(["t5_encodings", "clip_encodings", "mean", "logvar"]))
    blobs = table.column(name).to_pylist()
    row = draw(st.integers(0, len(blobs) - 1))
    shape = from_bytes(blobs[row], "row").shape
    kind = draw(st.sampled_from(["shape", "dtype", "null", "huge", "garbage"]))
    if kind == "shape":
        other = draw(st.lists(st.integers(1, 9), min_size=1, max_size=3).filter(lambda s: tuple(s) != shape))
        blobs[row] = to_bytes(np.zeros(other))
    elif kind == "dtype":
        dtype = draw(st.sampled_from([np.float16, np.float32, np.int16, np.uint8]))
        blobs[row] = npy_bytes(np.zeros(shape, dtype))
    elif kind == "null":
        blobs[row] = None
    elif kind == "huge":
        blobs[row] = npy_bytes(np.zeros(draw(st.integers(1, 7)), np.uint16))
        end = blobs[row].index(b"\n") + 1
        header = blobs[row][:end].decode("latin1").replace("'shape': (", f"'shape': ({2**40}, ")
        blobs[row] = header[: end - 1].encode("latin1") + b"\n" + blobs[row][end:]
    else:
        blobs[row] = draw(st.binary(max_size=64))
    write_arrow(path, with_column(table, name, pa.array(blobs, pa.binary())))


def flux_timestep(data: Path, draw) -> None:
    path = data / "eval" / ARROW
    table = read_arrow(path)
    t = table.column("timestep").to_pylist()
    row = draw(st.integers(0, len(t) - 1))
    kind = draw(st.sampled_from(["range", "null", "nan"]))
    if kind == "range":
        t[row] = draw(st.one_of(st.integers(-(2**31), -1), st.integers(8, 2**31 - 1)))
        column = pa.array(t, pa.int32())
    elif kind == "null":
        t[row] = None
        column = pa.array(t, pa.int32())
    else:
        t[row] = draw(st.sampled_from([float("nan"), float("inf"), 0.5]))
        column = pa.array(t, pa.float64())
    write_arrow(path, with_column(table, "timestep", column))


def flux_split_shape(data: Path, draw) -> None:
    """A split emptied, or a second file of another schema added to it."""
    split = draw(st.sampled_from(["train", "eval"]))
    path = data / split / ARROW
    table = read_arrow(path)
    if draw(st.booleans()):
        write_arrow(path, table.slice(0, 0))
        return
    cut = draw(st.integers(1, table.num_rows - 1))
    write_arrow(path, table.slice(0, cut))
    rest = table.slice(cut)
    name = draw(st.sampled_from(rest.column_names))
    rest = rest.drop_columns([name]) if draw(st.booleans()) else with_column(rest, name, pa.nulls(rest.num_rows))
    with pa.ipc.new_stream(str(data / split / "data-00001.arrow"), rest.schema) as writer:
        writer.write_table(rest)
    state = {"_data_files": [{"filename": ARROW}, {"filename": "data-00001.arrow"}]}
    replace(data / split / "state.json", json.dumps(state).encode())


def flux_empty(data: Path, draw) -> None:
    """An empty prompt's encoding that is not one finite float array of the model's shape."""
    path = data / "empty_encodings" / draw(st.sampled_from(["t5_empty.npy", "clip_empty.npy"]))
    array = np.load(path)
    kind = draw(st.sampled_from(["scalar", "npz", "ints", "nan", "shape", "huge"]))
    if kind == "huge":
        npy_huge(path, draw)
        return
    if kind == "npz":
        path.unlink()
        with open(path, "wb") as f:
            np.savez(f, x=array)
        return
    blob = {"scalar": lambda: np.float16(draw(st.floats(-1, 1))), "ints": lambda: array.astype(np.int16),
            "nan": lambda: np.where(np.arange(array.size).reshape(array.shape) == 0, np.nan, array).astype(array.dtype),
            "shape": lambda: np.concatenate([array, array])}[kind]()  # fmt: skip
    replace(path, npy_bytes(np.asarray(blob)))


def flux_state(data: Path, draw) -> None:
    """state.json naming a file outside its folder, none, or a file that is not a string."""
    name = draw(st.sampled_from(["../eval/" + ARROW, "/etc/hostname", 7, None, "missing.arrow"]))
    files = [] if name is None else [{"filename": name}]
    replace(data / "train" / "state.json", json.dumps({"_data_files": files}).encode())


FLUX = [
    lambda data, draw: truncate(data, draw, FLUX_FILES, {".arrow": 8, ".json": 1}),
    lambda data, draw: link_outside(data / draw(st.sampled_from(FLUX_FILES)), data.parent / "elsewhere"),
    flux_column_type, flux_row, flux_timestep, flux_split_shape, flux_empty, flux_state,
]  # fmt: skip


# -- Megatron indexed data: .idx + .bin ------------------------------------------------------------------------------

LLM_FILES = ["train/synthetic_000.idx", "train/synthetic_000.bin", "train/synthetic_001.idx",
             "train/synthetic_001.bin", "eval/synthetic_eval.idx", "eval/synthetic_eval.bin"]  # fmt: skip


def llm_index(data: Path, draw) -> None:
    """One entry of an index's sizes, pointers or document index, or its header's fields, made wrong."""
    path = data / draw(st.sampled_from([f for f in LLM_FILES if f.endswith(".idx")]))
    raw = bytearray(path.read_bytes())
    n_seq, n_doc = struct.unpack("<QQ", raw[18:34])
    part = draw(st.sampled_from(["size", "pointer", "document", "dtype", "version", "magic", "count"]))
    if part == "size":
        i = draw(st.integers(0, n_seq - 1))
        old = struct.unpack_from("<i", raw, 34 + 4 * i)[0]
        struct.pack_into("<i", raw, 34 + 4 * i, draw(st.integers(-(2**31), 2**31 - 1).filter(lambda v: v != old)))
    elif part == "pointer":
        i = draw(st.integers(0, n_seq - 1))
        at = 34 + 4 * n_seq + 8 * i
        old = struct.unpack_from("<q", raw, at)[0]
        struct.pack_into("<q", raw, at, draw(st.integers(-(2**63), 2**63 - 1).filter(lambda v: v != old)))
    elif part == "document":
        i = draw(st.sampled_from([0, n_doc - 1]))
        at = 34 + 12 * n_seq + 8 * i
        old = struct.unpack_from("<q", raw, at)[0]
        struct.pack_into("<q", raw, at, draw(st.integers(-(2**63), 2**63 - 1).filter(lambda v: v != old)))
    elif part == "dtype":
        raw[17] = draw(st.sampled_from([0, 6, 7, 9, 255]))
    elif part == "version":
        struct.pack_into("<Q", raw, 9, draw(st.integers(2, 2**64 - 1)))
    elif part == "magic":
        raw[draw(st.integers(0, 8))] ^= draw(st.integers(1, 255))
    else:
        at = draw(st.sampled_from([18, 26]))  # the sequence or the document count, made larger
        struct.pack_into("<Q", raw, at, draw(st.integers((n_seq if at == 18 else n_doc) + 1, 2**64 - 1)))
    replace(path, bytes(raw))


def llm_tokens(data: Path, draw) -> None:
    path = data / draw(st.sampled_from([f for f in LLM_FILES if f.endswith(".bin")]))
    tokens = np.fromfile(path, np.uint16)
    tokens[draw(st.integers(0, len(tokens) - 1))] = draw(st.integers(512, 65535))  # tiny's vocabulary: 512
    replace(path, tokens.tobytes())


def llm_eod(data: Path, draw) -> None:
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["eod_id"] = draw(st.one_of(st.integers(512, 10**40), st.integers(-(10**40), -1), st.text(max_size=3),
                                        st.floats(), st.booleans(), st.lists(st.integers(), max_size=2)))  # fmt: skip
    replace(data / "manifest.json", json.dumps(manifest).encode())


LLM = [
    lambda data, draw: truncate(data, draw, [*LLM_FILES, "manifest.json"], {".json": 1}),
    lambda data, draw: link_outside(data / draw(st.sampled_from(LLM_FILES)), data.parent / "elsewhere"),
    llm_index, llm_tokens, llm_eod,
]  # fmt: skip


# -- llama2_70b_lora: packed rows as .npy arrays -----------------------------------------------------------------

LORA_ARRAYS = ["tokens.npy", "labels.npy", "seq_offsets.npy", "row_offsets.npy"]
LORA_FILES = [f"{s}/{n}" for s in ("train", "eval") for n in LORA_ARRAYS]


def lora_array(data: Path, draw) -> None:
    """An array of another type or shape, one value out of its range, or a header declaring a huge array."""
    path = data / draw(st.sampled_from(LORA_FILES))
    array = np.load(path)
    kind = draw(st.sampled_from(["float", "2d", "value", "huge", "pickle"]))
    if kind == "huge":
        npy_huge(path, draw)
        return
    if kind == "pickle":
        path.unlink()
        np.save(path, np.array([None, 1], dtype=object), allow_pickle=True)
        return
    if kind == "float":
        array = array.astype(np.float32) + 0.5
    elif kind == "2d":
        array = np.stack([array, array])
    else:
        array = array.copy()
        at = draw(st.integers(0, len(array) - 1))
        if path.name == "tokens.npy":
            array[at] = draw(st.sampled_from([-1, 512, 2**31 - 1]))
        elif path.name == "labels.npy":
            array[at] = draw(st.integers(2, 255))
        else:  # offsets that no longer rise from 0 to the end (a value moved between its neighbours would be valid)
            array[at] = draw(st.one_of(st.integers(-(2**40), -1), st.integers(int(array[-1]) + 1, 2**40)))
    replace(path, npy_bytes(array))


def lora_manifest(data: Path, draw) -> None:
    manifest = json.loads((data / "manifest.json").read_text())
    key = draw(st.sampled_from(["sequences", "rows", "tokens"]))
    split = draw(st.sampled_from(["train", "eval"]))
    old = manifest["splits"][split][key]
    manifest["splits"][split][key] = draw(st.one_of(st.integers().filter(lambda v: v != old), st.text(max_size=3)))
    replace(data / "manifest.json", json.dumps(manifest).encode())


LORA = [
    lambda data, draw: truncate(data, draw, [*LORA_FILES, "manifest.json"], {".json": 1}),
    lora_array, lora_manifest,
]  # fmt: skip


# -- bert: HDF5 shards, fixed rows (train/) and packed rows (train_packed/), and the eval set ------------------------

BERT_FOLDERS, PACKED_FOLDERS = ("train", "eval"), ("train_packed", "eval")  # what each layout's run reads
# Values past what the tiny model takes (1,024 ids, 2 segments, rows of 128), each within its dataset's type
BAD_VALUES = {"input_ids": [-1, 1024, 2**31 - 1], "masked_lm_ids": [-1, 1024], "segment_ids": [-1, 2, 127],
              "input_mask": [-1, 2], "masked_lm_positions": [-1, 128], "next_sentence_labels": [-2, 2],
              "position_ids": [-1, 128, 32767], "sequence_ids": [-1], "cls_positions": [-1, 128]}  # fmt: skip


@pytest.fixture(scope="session")
def bert_packed(tmp_path_factory) -> Path:
    """`prepare bert` from text with `--formats fixed,packed` in the tiny preset's shapes (packed rows exist only
    for data prepared from text): train/, train_packed/, eval/ and their records. Read only."""
    from tests.conftest import built_once, run_cli
    from tests.test_prepare import write_results4, write_vocab

    def build(out: Path) -> None:
        text = out.parent / "bert-packed-text"
        args = ["--input", write_results4(text / "results4"), "--vocab", write_vocab(text / "vocab.txt"), "--out", out,
                "--max-seq-length", "128", "--max-predictions", "20", "--dupe-factor", "3", "--num-shards", "4",
                "--eval-samples", "100", "--eval-fraction", "0.2", "--chunk-mb", "0.03", "--no-progress",
                "--workers", "1", "--formats", "fixed,packed"]  # fmt: skip
        assert run_cli("prepare", "bert", *args) == 0

    return built_once(tmp_path_factory, "bert-packed", build)


def hdf5_files(data: Path, folders: tuple[str, ...]) -> list[str]:
    return sorted(str(p.relative_to(data)) for folder in folders for p in (data / folder).glob("*.hdf5"))


def bert_files(data: Path) -> list[str]:
    return hdf5_files(data, BERT_FOLDERS)


def bert_shard(folders: tuple[str, ...]):
    """A key missing, of floats, or of another shape."""

    def damage(data: Path, draw) -> None:
        path = data / draw(st.sampled_from(hdf5_files(data, folders)))
        kind = draw(st.sampled_from(["missing", "float", "shape"]))

        def change(arrays):
            key = draw(st.sampled_from(sorted(arrays)))
            if kind == "missing":
                del arrays[key]
            elif kind == "float":
                arrays[key] = arrays[key].astype(np.float32)
            else:
                arrays[key] = arrays[key][..., :-1] if arrays[key].ndim > 1 else arrays[key][:-1]

        rewrite_hdf5(path, change)

    return damage


def bert_value(folders: tuple[str, ...]):
    """One value of one dataset past what the model takes (ids past the vocabulary, positions past the row, ...)."""

    def damage(data: Path, draw) -> None:
        path = data / draw(st.sampled_from(hdf5_files(data, folders)))

        def change(arrays):
            key = draw(st.sampled_from(sorted(k for k in arrays if k in BAD_VALUES)))
            at = tuple(draw(st.integers(0, n - 1)) for n in arrays[key].shape)
            arrays[key][at] = draw(st.sampled_from(BAD_VALUES[key]))

        rewrite_hdf5(path, change)

    return damage


def bert_huge(folders: tuple[str, ...]):
    """Every dataset of a shard declaring 2**31 to 2**40 rows that the file does not hold."""

    def damage(data: Path, draw) -> None:
        path = data / draw(st.sampled_from(hdf5_files(data, folders)))
        with h5py.File(path, "r") as f:
            shapes = {k: (f[k].shape, f[k].dtype) for k in f}
        rows = 2 ** draw(st.integers(31, 40))
        path.unlink()
        with h5py.File(path, "w") as f:
            for key, (shape, dtype) in shapes.items():
                f.create_dataset(key, shape=(rows, *shape[1:]), dtype=dtype)

    return damage


def bert_record(folders: tuple[str, ...]):
    """A shard's record in manifest.json that disagrees with it or with the model, or is not counts; a shard the
    manifest does not list."""

    def damage(data: Path, draw) -> None:
        name = draw(st.sampled_from(hdf5_files(data, folders)))
        manifest = json.loads((data / "manifest.json").read_text())
        entry = manifest["files"][name]
        kind = draw(st.sampled_from(["rows", "bytes", "values", "type", "unlisted", "added"]))
        if kind in ("rows", "bytes"):
            entry[kind] = draw(st.integers(0, 2**40).filter(lambda v: v != entry[kind]))
        elif kind == "values":
            key = draw(st.sampled_from(sorted(k for k in entry["values"] if k in BAD_VALUES)))
            bad, (lo, hi) = draw(st.sampled_from(BAD_VALUES[key])), entry["values"][key]
            entry["values"][key] = [min(lo, bad), max(hi, bad)]
        elif kind == "type":
            entry[draw(st.sampled_from(["rows", "bytes", "values"]))] = draw(st.one_of(
                st.text(max_size=3), st.none(), st.floats(), st.lists(st.integers(), max_size=3)))  # fmt: skip
        elif kind == "unlisted":
            del manifest["files"][name]
        else:  # a shard added beside the prepared ones
            path = data / name
            shutil.copyfile(path, path.with_name("part_99999_of_99999.hdf5"))
        replace(data / "manifest.json", json.dumps(manifest).encode())

    return damage


def bert_damage(folders: tuple[str, ...]) -> list:
    return [
        lambda data, draw: truncate(data, draw, hdf5_files(data, folders)),
        lambda data, draw: link_outside(data / draw(st.sampled_from(hdf5_files(data, folders))),
                                        data.parent / "elsewhere"),
        bert_shard(folders), bert_value(folders), bert_huge(folders), bert_record(folders),
    ]  # fmt: skip


BERT, BERT_PACKED = bert_damage(BERT_FOLDERS), bert_damage(PACKED_FOLDERS)


# -- the readers ---------------------------------------------------------------------------------------------------

READERS = {  # benchmark, its data's fixture, the damage it is given, the keys its run is given
    "flux1": ("flux1", "flux_tiny", FLUX, ()),
    "llama31_8b": ("llama31_8b", "llm_tiny", LLM, ()),
    "llama2_70b_lora": ("llama2_70b_lora", "lora_data", LORA, ()),
    "bert": ("bert", "tiny_data", BERT, ()),
    "bert_packed": ("bert", "bert_packed", BERT_PACKED, ("data.layout=packed", "eval_samples=100")),
}


def damaged_data_is_refused(reader: str, draw, request, tmp_path: Path, capsys) -> None:
    benchmark, fixture, damage, keys = READERS[reader]
    example = tmp_path / f"example{next(_examples)}"
    data = linked_copy(request.getfixturevalue(fixture), example / "data")
    draw(st.sampled_from(damage))(data, draw)
    refused(example, capsys, benchmark, data, *keys)


@pytest.mark.parametrize("reader", READERS)
@settings(max_examples=FAST, **PROFILE)
@given(draw=st.data())
def test_damaged_data_of_every_reader_is_one_sentence_before_any_folder(reader, draw, request, tmp_path, capsys):
    damaged_data_is_refused(reader, draw.draw, request, tmp_path, capsys)


@pytest.mark.full
@pytest.mark.parametrize("reader", READERS)
@settings(max_examples=FULL, **PROFILE)
@given(draw=st.data())
def test_much_damaged_data_of_every_reader_is_one_sentence_before_any_folder(reader, draw, request, tmp_path, capsys):
    damaged_data_is_refused(reader, draw.draw, request, tmp_path, capsys)


# -- BERT and LoRA: a file linked from outside; a bad id past what BERT scans ------------------------------------


def _lora_link(data: Path) -> None:
    link_outside(data / "train" / "tokens.npy", data.parent / "elsewhere")


def _bert_link(data: Path) -> None:
    link_outside(data / bert_files(data)[0], data.parent / "elsewhere")


def _bert_late_id(data: Path) -> None:
    def change(arrays):
        arrays["input_ids"][-1, 1] = 1024  # tiny's vocabulary: 1,024 ids; the last row of the last shard

    rewrite_hdf5(data / [f for f in bert_files(data) if f.startswith("train")][-1], change)


@pytest.mark.parametrize(
    "reader, damage",
    [
        pytest.param("llama2_70b_lora", _lora_link),
        pytest.param("bert", _bert_link),
        pytest.param("bert", _bert_late_id),
    ],
)  # fmt: skip
def test_a_file_linked_from_outside_and_a_late_bad_id_are_refused_before_any_folder(reader, damage, request, tmp_path):
    """Asked of the benchmark's check_data (what the CLI runs before any folder), not through a run that would train."""
    from trainbench.errors import DataError
    from trainbench.resolve import build_config

    benchmark, fixture, _, _ = READERS[reader]
    data = linked_copy(request.getfixturevalue(fixture), tmp_path / "data")
    damage(data)
    bench, cfg = build_config(benchmark, "tiny", [], {"data.dir": str(data)})
    with pytest.raises(DataError, match="outside its data folder|outside the vocabulary"):
        bench.check_data(cfg)
