"""The readers' rules (data/checks.py, docs/data.md "What every reader checks"), one defect of each kind: a copy of a
valid tiny data set with that defect is refused through the CLI with exit 2 and one sentence naming the file, before
any results folder is made and before training starts."""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from tests.conftest import _prepared, rewrite_hdf5, run_cli

ARROW = "data-00000-of-00001.arrow"


@pytest.fixture(scope="session")
def flux_data(tmp_path_factory) -> Path:
    """``prepare flux1 --synthetic --preset tiny``, built once. Read only: tests change a :func:`linked_copy`."""
    return _prepared(tmp_path_factory, "flux1")


def linked_copy(source: Path, out: Path) -> Path:
    """A copy of a data folder whose files are hard links (no bytes copied, and not symlinks, which readers refuse
    out of the folder): change a file only through :func:`replace`, which writes a new one in its place."""
    shutil.copytree(source, out, copy_function=os.link)
    return out


def replace(path: Path, data: bytes) -> None:
    path.unlink()
    path.write_bytes(data)


def link_outside(path: Path, outside: Path) -> None:
    """``path`` made a symlink to a copy of itself outside its data folder: the same bytes, read from elsewhere."""
    outside.mkdir(parents=True, exist_ok=True)
    target = outside / path.name
    shutil.copyfile(path, target)
    path.unlink()
    path.symlink_to(target)


def refused(tmp_path: Path, capsys, benchmark: str, data: Path, *keys: str) -> str:
    """``run BENCH --preset tiny`` on ``data``: exit 2, one error sentence (returned, its whitespace joined), no
    traceback, no results folder. A run that is not refused stops after 2 steps (and fails here)."""
    results = tmp_path / "results"
    code = run_cli("run", benchmark, "--preset", "tiny", f"data.dir={data}", f"output.results_dir={results}",
                   "progress=false", "schedule.max_samples=64", *keys)  # fmt: skip
    printed = capsys.readouterr()
    text = printed.out + printed.err
    assert code == 2, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert not results.exists() or not any(results.iterdir()), f"a results folder was made: {list(results.iterdir())}"
    lines = [line for line in text.splitlines() if "error:" in line]
    assert len(lines) == 1, text[-3000:]
    return " ".join(text[text.index("error:") :].split())


# -- flux1's Arrow files ----------------------------------------------------------------------------------------------


def read_arrow(path: Path) -> pa.Table:
    return pa.ipc.open_stream(pa.memory_map(str(path))).read_all()


def write_arrow(path: Path, table: pa.Table) -> None:
    path.unlink()
    with pa.ipc.new_stream(str(path), table.schema) as writer:
        writer.write_table(table)


def with_column(table: pa.Table, name: str, values: pa.Array) -> pa.Table:
    return table.set_column(table.schema.get_field_index(name), name, values)


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


@pytest.mark.parametrize("kind", ["int32", "string", "list", "null"])
def test_a_flux_column_of_another_arrow_type_is_refused(kind, flux_data, tmp_path, capsys):
    data = linked_copy(flux_data, tmp_path / "data")
    path = data / "train" / ARROW
    table = read_arrow(path)
    n = table.num_rows
    values = {"int32": pa.array(range(n), pa.int32()), "string": pa.array(["x"] * n), "null": pa.nulls(n),
              "list": pa.array([[1.0]] * n)}[kind]  # fmt: skip
    write_arrow(path, with_column(table, "mean", values))
    said = refused(tmp_path, capsys, "flux1", data)
    assert f"{path}: column mean holds" in said and "not binary" in said


def test_a_later_flux_row_of_another_shape_is_refused(flux_data, tmp_path, capsys):
    from trainbench.data.flux_data import from_bytes, to_bytes

    data = linked_copy(flux_data, tmp_path / "data")
    path = data / "train" / ARROW
    table = read_arrow(path)
    blobs = table.column("mean").to_pylist()
    shape = from_bytes(blobs[0], "row 0").shape
    blobs[-1] = to_bytes(np.zeros((*shape[:-1], shape[-1] * 2)))
    write_arrow(path, with_column(table, "mean", pa.array(blobs, pa.binary())))
    said = refused(tmp_path, capsys, "flux1", data)
    assert f"{path}: row {len(blobs) - 1} of mean" in said


def test_flux_files_of_two_schemas_in_one_split_are_refused(flux_data, tmp_path, capsys):
    data = linked_copy(flux_data, tmp_path / "data")
    table = read_arrow(data / "eval" / ARROW)
    half = table.num_rows // 2
    write_arrow(data / "eval" / ARROW, table.slice(0, half))
    second = table.slice(half)
    second = with_column(second, "timestep", second.column("timestep").cast(pa.int64()))
    with pa.ipc.new_stream(str(data / "eval" / "data-00001.arrow"), second.schema) as writer:
        writer.write_table(second)
    files = [{"filename": ARROW}, {"filename": "data-00001.arrow"}]
    replace(data / "eval" / "state.json", json.dumps({"_data_files": files}).encode())
    said = refused(tmp_path, capsys, "flux1", data)
    assert f"{data / 'eval' / 'data-00001.arrow'}: a schema other than {ARROW}'s" in said


def test_an_empty_flux_split_is_refused(flux_data, tmp_path, capsys):
    data = linked_copy(flux_data, tmp_path / "data")
    path = data / "eval" / ARROW
    write_arrow(path, read_arrow(path).slice(0, 0))
    said = refused(tmp_path, capsys, "flux1", data)
    assert f"{data / 'eval'}: the split holds no rows" in said


@pytest.mark.parametrize("kind", ["null", "nan", "string", "9"])
def test_flux_timesteps_null_nan_text_or_out_of_range_are_refused(kind, flux_data, tmp_path, capsys):
    data = linked_copy(flux_data, tmp_path / "data")
    path = data / "eval" / ARROW
    table = read_arrow(path)
    t = table.column("timestep").to_pylist()
    t[-1] = {"null": None, "nan": float("nan"), "string": 3, "9": 9}[kind]
    t = [str(x) for x in t] if kind == "string" else t
    kind_type = {"null": pa.int32(), "nan": pa.float64(), "string": pa.string(), "9": pa.int32()}[kind]
    write_arrow(path, with_column(table, "timestep", pa.array(t, kind_type)))
    said = refused(tmp_path, capsys, "flux1", data)
    assert str(data / "eval") in said and "timestep" in said


def test_an_npy_header_declaring_a_huge_array_is_refused_before_allocating(flux_data, tmp_path, capsys):
    """2**40 float16 elements (2 TiB) declared in 2 MB: refused from the header, nothing allocated."""
    data = linked_copy(flux_data, tmp_path / "data")
    path = data / "empty_encodings" / "t5_empty.npy"
    raw = path.read_bytes()
    header_end = raw.index(b"\n") + 1
    header = raw[:header_end].decode("latin1")
    start, end = header.index("'shape': (") + len("'shape': ("), header.index(")", header.index("'shape'"))
    text = header[:start] + f"{2**40}," + header[end:]
    text = text[: header_end - 1].ljust(header_end - 1) + "\n"  # the header's length kept
    replace(path, text.encode("latin1") + raw[header_end:])
    said = refused(tmp_path, capsys, "flux1", data)
    assert f"{path}: an array of shape [{2**40}]" in said


@pytest.mark.parametrize("kind", ["scalar", "npz", "object", "nan"])
def test_an_empty_prompt_encoding_that_is_not_one_float_array_is_refused(kind, flux_data, tmp_path, capsys):
    data = linked_copy(flux_data, tmp_path / "data")
    path = data / "empty_encodings" / "clip_empty.npy"
    if kind == "npz":
        buffer = io.BytesIO()
        np.savez(buffer, x=np.zeros((1, 16), np.float16))
        blob = buffer.getvalue()
    elif kind == "object":
        buffer = io.BytesIO()
        np.save(buffer, np.array([[{"a": 1}]], dtype=object), allow_pickle=True)
        blob = buffer.getvalue()
    else:
        blob = npy_bytes(np.float16(1.0) if kind == "scalar" else np.full((1, 16), np.nan, np.float16))
    replace(path, blob)
    said = refused(tmp_path, capsys, "flux1", data)
    assert str(path) in said


@pytest.mark.parametrize("name", ["empty_encodings/t5_empty.npy", "train/" + ARROW, "eval/state.json"])
def test_a_flux_file_linked_outside_the_data_folder_is_refused(name, flux_data, tmp_path, capsys):
    data = linked_copy(flux_data, tmp_path / "data")
    link_outside(data / name, tmp_path / "elsewhere")
    said = refused(tmp_path, capsys, "flux1", data)
    assert f"{data / name} resolves to {tmp_path / 'elsewhere' / Path(name).name}, outside its data folder" in said


# -- Megatron indexed data ------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def llm_tiny(tmp_path_factory) -> Path:
    return _prepared(tmp_path_factory, "llama31_8b")


def index_arrays(idx: Path) -> tuple[bytes, np.ndarray, np.ndarray, np.ndarray]:
    raw = idx.read_bytes()
    _, _, n_seq, n_doc = struct.unpack("<QBQQ", raw[9:34])
    sizes = np.frombuffer(raw, np.int32, n_seq, 34).copy()
    pointers = np.frombuffer(raw, np.int64, n_seq, 34 + 4 * n_seq).copy()
    docs = np.frombuffer(raw, np.int64, n_doc, 34 + 12 * n_seq).copy()
    return raw[:34], sizes, pointers, docs


@pytest.mark.parametrize("defect", ["past the end", "negative", "unaligned", "overlapping", "negative size"])
def test_index_pointers_and_sizes_that_disagree_with_the_bin_are_refused(defect, llm_tiny, tmp_path, capsys):
    data = linked_copy(llm_tiny, tmp_path / "data")
    idx = data / "train" / "synthetic_001.idx"
    head, sizes, pointers, docs = index_arrays(idx)
    last = len(pointers) - 1
    if defect == "past the end":
        pointers[last] += 2 * 1000
    elif defect == "negative":
        pointers[last] = -2
    elif defect == "unaligned":
        pointers[last] += 1
    elif defect == "overlapping":
        pointers[last] -= 2
    else:
        sizes[last], sizes[last - 1] = -1, sizes[last - 1] + sizes[last] + 1  # the total kept
    replace(idx, head + sizes.tobytes() + pointers.tobytes() + docs.tobytes())
    said = refused(tmp_path, capsys, "llama31_8b", data)
    assert f"{idx}:" in said


def test_a_token_id_past_the_vocabulary_in_the_last_shard_is_refused(llm_tiny, tmp_path, capsys):
    data = linked_copy(llm_tiny, tmp_path / "data")
    path = data / "train" / "synthetic_001.bin"
    tokens = np.fromfile(path, np.uint16)
    tokens[-2] = 512  # tiny's vocabulary is 512 ids
    replace(path, tokens.tobytes())
    said = refused(tmp_path, capsys, "llama31_8b", data)
    assert f"{path}: token ids reach 512" in said


def test_float_token_types_are_refused(llm_tiny, tmp_path, capsys):
    from trainbench.data.indexed import IndexedDataset, IndexedWriter

    data = linked_copy(llm_tiny, tmp_path / "data")
    prefix = data / "train" / "synthetic_001"
    shard = IndexedDataset(prefix)
    documents = [np.asarray(shard[i], np.float32) for i in range(len(shard))]
    del shard
    for suffix in (".bin", ".idx"):
        Path(f"{prefix}{suffix}").unlink()
    writer = IndexedWriter(prefix, np.float32)
    for document in documents:
        writer.add(document)
    writer.finish()
    said = refused(tmp_path, capsys, "llama31_8b", data)
    assert f"{prefix}.idx: tokens of type float32, not an integer type" in said


@pytest.mark.parametrize("eod", [10**30, 512, -1, "0"])
def test_an_end_of_document_id_outside_the_vocabulary_is_refused(eod, llm_tiny, tmp_path, capsys):
    data = linked_copy(llm_tiny, tmp_path / "data")
    manifest = json.loads((data / "manifest.json").read_text())
    manifest |= {"source": "c4", "eod_id": eod, "vocab_size": 512}
    replace(data / "manifest.json", json.dumps(manifest).encode())
    said = refused(tmp_path, capsys, "gpt_oss_20b", data)
    assert str(data / "manifest.json") in said and "eod_id" in said


@pytest.mark.parametrize("name", ["synthetic_001.bin", "synthetic_000.idx"])
def test_indexed_files_linked_outside_the_folder_are_refused(name, llm_tiny, tmp_path, capsys):
    data = linked_copy(llm_tiny, tmp_path / "data")
    link_outside(data / "train" / name, tmp_path / "elsewhere")
    said = refused(tmp_path, capsys, "llama31_8b", data)
    assert f"{data / 'train' / name} resolves to" in said and "outside its data folder" in said


# -- the checks themselves, for any reader ---------------------------------------------------------------------------


def test_the_npy_loader_refuses_pickles_archives_records_and_misstated_sizes(tmp_path):
    from trainbench.data import checks
    from trainbench.errors import DataError

    good = tmp_path / "good.npy"
    np.save(good, np.arange(6, dtype=np.int32).reshape(2, 3))
    assert checks.load_npy(good, tmp_path, kinds="i").tolist() == [[0, 1, 2], [3, 4, 5]]
    cases = {
        "pickled.npy": (npy := io.BytesIO(), np.save(npy, np.array([None]), allow_pickle=True))[0].getvalue(),
        "records.npy": npy_bytes(np.zeros(2, dtype=[("a", "i4"), ("b", "f4")])),
        "cut.npy": good.read_bytes()[:-1],
        "long.npy": good.read_bytes() + b"\0",
        "floats.npy": npy_bytes(np.zeros(3, np.float32)),
        "empty.npy": b"",
    }
    for name, blob in cases.items():
        (tmp_path / name).write_bytes(blob)
        with pytest.raises(DataError, match=rf"^{tmp_path / name}: [^\n]+$"):
            checks.load_npy(tmp_path / name, tmp_path, kinds="iu")
    np.savez(tmp_path / "archive.npz", x=np.zeros(2))
    with pytest.raises(DataError, match="an .npz archive, not one .npy array"):
        checks.load_npy(tmp_path / "archive.npz", tmp_path)


def test_ids_are_checked_in_every_chunk_and_a_declared_id_must_be_a_small_integer(monkeypatch):
    from trainbench.data import checks
    from trainbench.errors import DataError

    monkeypatch.setattr(checks, "ID_CHUNK", 4)
    ids = np.zeros(10, np.uint16)
    checks.ids_in_vocabulary([("a.bin", ids), ("b.bin", ids)], vocab=8)
    ids[9] = 8
    with pytest.raises(DataError, match=r"^b.bin: token ids reach 8 \(at position 9\), outside the vocabulary of 8"):
        checks.ids_in_vocabulary([("a.bin", ids[:9]), ("b.bin", ids)], vocab=8)
    with pytest.raises(DataError, match="not an integer type"):
        checks.ids_in_vocabulary([("c.bin", np.zeros(3, np.float32))], vocab=8)
    for bad in (10**30, -1, 8, True, "3", 2.0):
        with pytest.raises(DataError, match="not a token id of the vocabulary of 8"):
            checks.token_id(bad, 8, "manifest.json", "eod_id")


# -- BERT's HDF5 shards against their record in manifest.json --------------------------------------------------------


@pytest.fixture(scope="session")
def bert_data(tmp_path_factory) -> Path:
    """``prepare bert --synthetic --preset tiny``, built once (the tiny preset's data). Read only."""
    return _prepared(tmp_path_factory, "bert")


def edited_manifest(data: Path, change) -> None:
    manifest = json.loads((data / "manifest.json").read_text())
    change(manifest)
    replace(data / "manifest.json", json.dumps(manifest).encode())


def test_bert_prepare_records_each_shards_rows_bytes_and_values(bert_data):
    import h5py

    files = json.loads((bert_data / "manifest.json").read_text())["files"]
    shards = sorted(p for p in bert_data.rglob("*.hdf5"))
    assert len(shards) == 9  # 8 train shards and the eval file, each recorded
    for path in shards:
        record = files[path.relative_to(bert_data).as_posix()]
        with h5py.File(path, "r") as f:
            assert record["rows"] == len(f["input_ids"]) and record["bytes"] == path.stat().st_size
            assert record["values"] == {k: [int(f[k][()].min()), int(f[k][()].max())] for k in f}


def test_a_bad_id_in_the_last_row_of_the_last_shard_is_refused_naming_the_shard(bert_data, tmp_path, capsys):
    data = linked_copy(bert_data, tmp_path / "data")
    last = sorted((data / "train").glob("*.hdf5"))[-1]
    rewrite_hdf5(last, lambda arrays: arrays["masked_lm_ids"].__setitem__((-1, -1), 1024))  # the vocabulary: 1,024
    said = refused(tmp_path, capsys, "bert", data)
    assert f"{last}: masked_lm_ids reach 1024, outside the vocabulary of 1,024 ids (model.vocab_size)" in said


def test_bert_data_of_a_larger_vocabulary_is_refused_from_the_record_alone(bert_data, tmp_path, capsys, monkeypatch):
    """Every shard's recorded values against the model, before reading any row of it."""
    from trainbench.data import bert_hdf5

    monkeypatch.setattr(bert_hdf5, "scan_shard", lambda *a: pytest.fail("a shard was read"))
    said = refused(tmp_path, capsys, "bert", bert_data, "model.vocab_size=512")
    assert "part_00000_of_00008.hdf5: input_ids recorded in manifest.json reach" in said
    assert "outside the vocabulary of 512 ids (model.vocab_size)" in said


@pytest.mark.parametrize("kind", ["rows", "bytes", "unlisted", "not counts", "values"])
def test_a_bert_shard_that_disagrees_with_its_record_is_refused(kind, bert_data, tmp_path, capsys):
    data = linked_copy(bert_data, tmp_path / "data")
    name = "train/part_00003_of_00008.hdf5"

    def change(manifest):
        entry = manifest["files"][name]
        if kind in ("rows", "bytes"):
            entry[kind] += 1
        elif kind == "unlisted":
            del manifest["files"][name]
        elif kind == "not counts":
            entry["rows"] = "8000"
        else:
            entry["values"]["segment_ids"] = [0, 2]  # past the model's 2 segments

    edited_manifest(data, change)
    said = refused(tmp_path, capsys, "bert", data)
    expected = {"rows": "rows and", "bytes": "bytes (changed since `trainbench prepare`)",
                "unlisted": "a shard", "not counts": "its record holds no counts of rows and bytes",
                "values": "segment_ids recorded in manifest.json reach 2, outside the 2 segments"}[kind]  # fmt: skip
    assert name in said and expected in said


def test_a_shard_changed_since_preparation_is_read_whole_and_its_values_compared_with_the_record(
    bert_data, tmp_path, capsys
):
    data = linked_copy(bert_data, tmp_path / "data")
    shard = data / "train" / "part_00005_of_00008.hdf5"
    from trainbench.resolve import build_config

    rewrite_hdf5(shard, lambda arrays: None)  # the same values, written again: a newer file that agrees with its record
    bench, cfg = build_config("bert", "tiny", [], {"data.dir": str(data), "progress": "false"})
    bench.check_data(cfg)
    out = capsys.readouterr().out
    assert "1 of the 8 shards in" in out and "every value of theirs is read and checked" in out

    def lower(arrays):  # an id still in the vocabulary, but not what the record says the shard holds
        arrays["input_ids"][arrays["input_ids"] == arrays["input_ids"].max()] = 7

    rewrite_hdf5(shard, lower)
    said = refused(tmp_path / "again", capsys, "bert", data)
    assert f"{shard}: input_ids holds values 0..1022, but manifest.json records 0..1023" in said


def test_bert_data_prepared_before_shards_were_recorded_loads_with_a_note(bert_data, tmp_path, capsys):
    from trainbench.resolve import build_config

    data = linked_copy(bert_data, tmp_path / "data")
    edited_manifest(data, lambda m: [entry.pop("values", None) for entry in m["files"].values()])
    bench, cfg = build_config("bert", "tiny", [], {"data.dir": str(data)})
    bench.check_data(cfg)
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "only the token ids of the first 1,024 rows" in notes[0]
    (data / "manifest.json").unlink()  # MLPerf's own files: no manifest at all
    bench.check_data(cfg)
    assert "only the token ids of the first 1,024 rows" in capsys.readouterr().out


def test_a_bert_shard_declaring_rows_it_does_not_hold_or_packed_columns_that_differ_is_refused(tmp_path):
    """Checked from the shard's header alone, so data without a record (MLPerf's own files) is held to it too."""
    import h5py

    from trainbench.data.bert_hdf5 import PACKED_KEYS, validate_shard
    from trainbench.errors import DataError

    huge = tmp_path / "huge.hdf5"
    with h5py.File(huge, "w") as f:  # datasets declared, nothing written: a file of a few KB
        for key, columns in (
            ("input_ids", 128),
            ("input_mask", 128),
            ("segment_ids", 128),
            ("masked_lm_positions", 20),
            ("masked_lm_ids", 20),
            ("next_sentence_labels", 0),
        ):
            f.create_dataset(key, shape=(2**40, columns) if columns else (2**40,), dtype="i4")  # fmt: skip
    with pytest.raises(DataError, match=r"key 'input_ids' declares \(1099511627776, 128\) values .* but the file "
                                        r"holds [0-9,]+ bytes \(cut short or crafted\)"):  # fmt: skip
        validate_shard(huge, 128, 20)
    packed = tmp_path / "packed.hdf5"
    columns = {"masked_lm_positions": 40, "masked_lm_ids": 39, "next_sentence_labels": 3, "cls_positions": 3}
    with h5py.File(packed, "w") as f:
        for key in PACKED_KEYS:
            f.create_dataset(key, data=np.zeros((4, columns.get(key, 128)), np.int32))
    with pytest.raises(DataError, match=r"keys 'masked_lm_positions' \(4, 40\) and 'masked_lm_ids' \(4, 39\) are not"):
        validate_shard(packed, 128, 20, "packed")


def test_a_lora_array_whose_header_declares_more_than_its_file_is_refused_before_it_is_mapped(
    lora_data, tmp_path, capsys
):
    """A header whose shape x item size overflows a 64-bit length (2**59 x 2 int64s) made numpy's memory map raise
    an OverflowError: the header is now checked against the file first."""
    data = linked_copy(lora_data, tmp_path / "data")
    path = data / "train" / "seq_offsets.npy"
    raw = path.read_bytes()
    end = raw.index(b"\n") + 1
    header = raw[:end].decode("latin1")
    start = header.index("'shape': (") + len("'shape': (")
    header = header[:start] + f"{2**59}, 2" + header[header.index(")", start) :]
    replace(path, header[: end - 1].ljust(end - 1).encode("latin1")[: end - 1] + b"\n" + raw[end:])
    said = refused(tmp_path, capsys, "llama2_70b_lora", data)
    assert f"{path}: its .npy header (shape [{2**59}, 2], int64) declares 9,223,372,036,854,775,808 bytes" in said
    assert "prepare the data set again" in said
