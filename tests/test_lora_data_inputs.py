"""llama2_70b_lora's data inputs: NVIDIA's pickled npy never runs code, every bad source file is one sentence,
bad values are refused rather than trained on, a prepared folder changed afterwards is refused before a run makes
anything, and a full disk during prepare leaves nothing that looks finished. Generated bad files (fuzz) end the
same way."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import pickle
import shutil
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from conftest import run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


class Marker:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def cli(*args) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = run_cli(*args)
    return code, out.getvalue()


def prepare(source: Path, out: Path) -> tuple[int, str]:
    return cli("prepare", "llama2_70b_lora", "--source", source, "--out", out, "--no-progress")


def one_sentence(code: int, printed: str, out: Path) -> str:
    assert code == 2, printed
    assert "Traceback" not in printed and len([ln for ln in printed.splitlines() if ln.strip()]) == 1, printed
    assert not (out / "manifest.json").exists()
    return printed


def npy_rows(rows, folder: Path, name: str = "train.npy") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / name, np.array(rows, dtype=object), allow_pickle=True)
    return folder


def good_rows(n: int = 2) -> list[dict]:
    ids = np.arange(10, 40)
    mask = np.array([0] * 15 + [1] * 5 + [0] * 5 + [1] * 5)  # two sequences, each with its answer
    return [{"input_ids": ids, "loss_mask": mask, "seq_start_id": [0, 20]} for _ in range(n)]


def npy_source(tmp_path: Path, train_rows, valid_rows=None) -> Path:
    folder = tmp_path / "npy"
    npy_rows(train_rows, folder, "train.npy")
    npy_rows(good_rows() if valid_rows is None else valid_rows, folder, "validation.npy")
    return folder


# -- never running what a data file holds -------------------------------------------------------------------------


def test_a_crafted_npy_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "ran"
    source = npy_source(tmp_path, [{"input_ids": Marker(marker), "loss_mask": [1], "seq_start_id": [0]}])
    printed = one_sentence(*prepare(source, tmp_path / "out"), tmp_path / "out")
    assert not marker.exists()
    assert "posix.system" in printed and "does not load" in printed


def test_a_crafted_npy_whose_whole_payload_is_a_call_is_refused(tmp_path):
    marker = tmp_path / "ran"
    folder = tmp_path / "npy"
    npy_rows(good_rows(), folder, "validation.npy")
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "|O", "fortran_order": False, "shape": (1,)})
    (folder / "train.npy").write_bytes(b"\x93NUMPY\x01\x00" + header.getvalue()[8:] + pickle.dumps(Marker(marker)))
    one_sentence(*prepare(folder, tmp_path / "out"), tmp_path / "out")
    assert not marker.exists()


def test_nvidias_rows_as_np_save_writes_them_read_as_before(tmp_path):
    source = npy_source(tmp_path, good_rows(3))
    code, printed = prepare(source, tmp_path / "out")
    assert code == 0, printed
    tokens = np.load(tmp_path / "out" / "train" / "tokens.npy")
    assert len(tokens) == 90 and set(tokens.tolist()) == set(range(10, 40))


# -- one sentence for every bad file ------------------------------------------------------------------------------


def _write_npy_case(case: str, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    npy_rows(good_rows(), folder, "validation.npy")
    train = folder / "train.npy"
    if case == "empty file":
        train.write_bytes(b"")
    elif case == "truncated":
        npy_rows(good_rows(), folder)
        train.write_bytes(train.read_bytes()[:-40])
    elif case == "zero rows":
        np.save(train, np.array([], dtype=object), allow_pickle=True)
    elif case == "rows not dicts":
        npy_rows([[1, 2, 3], "text"], folder)
    elif case == "strings as ids":
        npy_rows([{"input_ids": ["a", "b"], "loss_mask": [0, 1], "seq_start_id": [0]}], folder)
    elif case == "not an object array":
        np.save(train, np.arange(10))


@pytest.mark.parametrize("case", ["empty file", "truncated", "zero rows", "rows not dicts", "strings as ids",
                                  "not an object array"])  # fmt: skip
def test_bad_npy_files_are_one_sentence(case, tmp_path):
    _write_npy_case(case, tmp_path / "npy")
    printed = one_sentence(*prepare(tmp_path / "npy", tmp_path / "out"), tmp_path / "out")
    assert "train.npy" in printed


def _parquet(folder: Path, table, name: str = "train.parquet") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, folder / name)
    return folder / name


PARQUET_CASES = {
    "truncated": None,
    "empty file": None,
    "integer text columns": pa.table({"input": [1, 2], "output": [3, 4]}),
    "null text": pa.table({"input": ["a", None], "output": ["b", "c"]}),
    "bytes that are not UTF-8": pa.table({"input": pa.array([b"\xff\xfe"], pa.binary()), "output": ["x"]}),
    "scalar input_ids": pa.table({"input_ids": [5, 6], "labels": [5, 6]}),
    "strings in input_ids": pa.table({"input_ids": [["a", "b"]], "labels": [[-100, 5]]}),
    "null input_ids": pa.table({"input_ids": [None], "labels": [[1]]}),
}


@pytest.mark.parametrize("case", list(PARQUET_CASES))
def test_bad_parquet_files_are_one_sentence(case, tmp_path):
    folder = tmp_path / "src"
    table = PARQUET_CASES[case]
    if table is None:
        path = _parquet(folder, pa.table({"input": ["a " * 50], "output": ["b"]}))
        path.write_bytes(b"" if case == "empty file" else path.read_bytes()[: path.stat().st_size // 2])
    else:
        _parquet(folder, table)
    _parquet(folder, pa.table({"input_ids": [[1, 2]], "labels": [[-100, 2]]}), "validation.parquet")
    extra = ["--tokenizer", tmp_path / "none.json"] if case in ("null text", "integer text columns") else []
    code, printed = cli("prepare", "llama2_70b_lora", "--source", folder, *extra, "--out", tmp_path / "out",
                        "--no-progress")  # fmt: skip
    one_sentence(code, printed, tmp_path / "out")


def test_text_columns_that_are_not_text_are_named(tmp_path):
    from test_lora_train import _word_tokenizer

    tok = _word_tokenizer(tmp_path / "tokenizer.json", 512)
    for case in ("integer text columns", "null text", "bytes that are not UTF-8"):
        folder = tmp_path / case.replace(" ", "_")
        _parquet(folder, PARQUET_CASES[case])
        _parquet(folder, pa.table({"input": ["w1"], "output": ["w2"]}), "validation.parquet")
        code, printed = cli("prepare", "llama2_70b_lora", "--source", folder, "--tokenizer", tok, "--out",
                            tmp_path / "out", "--no-progress")  # fmt: skip
        assert "not text" in one_sentence(code, printed, tmp_path / "out") or "null" in printed, printed


# -- bad values refused, not trained on ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "row, says",
    [
        ({"input_ids": [10.0, 11.7, 12.0], "loss_mask": [0, 1, 1], "seq_start_id": [0]}, "list of integers"),
        ({"input_ids": [10, 11, 12], "loss_mask": [0, 2, 1], "seq_start_id": [0]}, "must be 0 (no loss) or 1"),
        ({"input_ids": [10, 11, 12], "loss_mask": [0, 1, 1], "seq_start_id": []}, "must start at 0"),
        ({"input_ids": [10, 11, 12], "loss_mask": [0, 1, 1], "seq_start_id": [1]}, "must start at 0"),
        ({"input_ids": [10, 11, 12], "loss_mask": [0, 1, 1], "seq_start_id": [0, 2, 2]}, "rise strictly"),
        ({"input_ids": [10, 11, 12], "loss_mask": [0, 1, 1], "seq_start_id": [0, 5]}, "within the row"),
    ],
)
def test_bad_values_in_nvidias_rows_are_refused(row, says, tmp_path):
    source = npy_source(tmp_path, [row])
    assert says in one_sentence(*prepare(source, tmp_path / "out"), tmp_path / "out")


@pytest.mark.parametrize(
    "ids, labels, says",
    [
        ([10, 11, 12], [-100, -1, 12], "neither -100"),  # -1 would have made the prompt token an answer token
        ([10, 11, 12], [-100, 99, 12], "neither -100"),
        ([10.0, 11.5, 12.0], [-100, 11, 12], "list of integers"),
    ],
)
def test_bad_values_in_tokenised_parquet_are_refused(ids, labels, says, tmp_path):
    folder = tmp_path / "src"
    _parquet(folder, pa.table({"input_ids": [ids], "labels": [labels]}))
    _parquet(folder, pa.table({"input_ids": [[1, 2]], "labels": [[-100, 2]]}), "validation.parquet")
    assert says in one_sentence(*prepare(folder, tmp_path / "out"), tmp_path / "out")


# -- a prepared folder changed afterwards ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lora-prepared")
    assert run_cli("prepare", "llama2_70b_lora", "--synthetic", "--preset", "tiny", "--out", out) == 0
    return out


@pytest.mark.parametrize("damage", ["swapped", "truncated", "offsets edited", "tokens past the vocabulary"])
def test_a_prepared_folder_changed_afterwards_is_refused_before_a_run_makes_anything(prepared, damage, tmp_path):
    data = Path(shutil.copytree(prepared, tmp_path / "data"))
    train = data / "train"
    if damage == "swapped":
        os.replace(train / "tokens.npy", tmp_path / "t.npy")
        os.replace(train / "labels.npy", train / "tokens.npy")
        os.replace(tmp_path / "t.npy", train / "labels.npy")
    elif damage == "truncated":
        path = train / "tokens.npy"
        path.write_bytes(path.read_bytes()[:-1000])
    elif damage == "offsets edited":
        offsets = np.load(train / "seq_offsets.npy")
        offsets[5] = offsets[4]
        np.save(train / "seq_offsets.npy", offsets)
    else:
        tokens = np.load(train / "tokens.npy")
        tokens[3] = 10**6
        np.save(train / "tokens.npy", tokens)
    results = tmp_path / "results"
    code, printed = cli("run", "llama2_70b_lora", f"data.dir={data}", f"output.results_dir={results}",
                        "progress=false")  # fmt: skip
    assert code == 2 and "Traceback" not in printed and "again" in printed, printed
    assert not results.exists()


def test_a_global_batch_larger_than_the_training_set_is_refused(tmp_path):
    data = tmp_path / "data"
    assert run_cli("prepare", "llama2_70b_lora", "--synthetic", "--preset", "tiny", "--train-samples", "40",
                   "--eval-samples", "8", "--out", data) == 0  # fmt: skip
    code, printed = cli("run", "llama2_70b_lora", f"data.dir={data}", f"output.results_dir={tmp_path / 'r'}",
                        "data.global_batch_size=64", "data.micro_batch_size=8")  # fmt: skip
    assert code == 2 and "fewer than one global batch" in printed and not (tmp_path / "r").exists(), printed


# -- a full disk during prepare -----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["base weights", "arrays"])
def test_a_full_disk_during_prepare_is_one_sentence_and_leaves_no_manifest(where, tmp_path):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    target = "safetensors.torch.save_file" if where == "base weights" else "numpy.save"
    with mock.patch(target, full):
        code, printed = cli("prepare", "llama2_70b_lora", "--synthetic", "--preset", "tiny", "--out", tmp_path / "o")
    assert "the disk is full" in one_sentence(code, printed, tmp_path / "o")
    code, printed = cli("prepare", "llama2_70b_lora", "--synthetic", "--preset", "tiny", "--out", tmp_path / "o")
    assert code == 0 and (tmp_path / "o" / "manifest.json").exists(), printed  # the same command, with room, finishes


# -- generated bad files ------------------------------------------------------------------------------------------

HERE = Path(__import__("tempfile").mkdtemp(prefix="tb-fuzz-lora-"))

VALUES = st.one_of(
    st.integers(-(2**40), 2**40), st.floats(allow_nan=True), st.text(max_size=4), st.none(), st.booleans(),
    st.lists(st.one_of(st.integers(-5, 600), st.floats(-2, 600), st.text(max_size=2), st.none()), max_size=6),
)  # fmt: skip
ROW = st.one_of(st.dictionaries(st.sampled_from(["input_ids", "loss_mask", "seq_start_id", "x"]), VALUES),
                VALUES)  # fmt: skip


def _run_prepare_checked(source: Path, marker: Path) -> None:
    out = HERE / "out"
    shutil.rmtree(out, ignore_errors=True)
    code, printed = prepare(source, out)
    assert code in (0, 1, 2, 3), printed
    assert "Traceback" not in printed and len([ln for ln in printed.splitlines() if "error" in ln]) <= 1, printed
    assert not marker.exists()
    if code != 0:
        assert not (out / "manifest.json").exists()


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(rows=st.lists(ROW, max_size=3), cut=st.one_of(st.none(), st.integers(0, 400)), evil=st.booleans())
def test_generated_npy_files_end_in_a_sentence_never_a_traceback_or_a_call(rows, cut, evil):
    source = HERE / "npy"
    shutil.rmtree(source, ignore_errors=True)
    marker = HERE / "ran"
    payload = [*rows, Marker(marker)] if evil else rows
    npy_rows(good_rows(), source, "validation.npy")
    try:
        npy_rows(payload, source, "train.npy")
    except (ValueError, TypeError):  # numpy itself cannot make an array of these
        return
    if cut is not None:
        train = source / "train.npy"
        train.write_bytes(train.read_bytes()[:cut])
    _run_prepare_checked(source, marker)


PARQUET_COLUMN = st.one_of(
    st.lists(st.one_of(st.text(max_size=6), st.none()), min_size=1, max_size=3),
    st.lists(st.one_of(st.integers(-200, 600), st.none()), min_size=1, max_size=3),
    st.lists(st.one_of(st.lists(st.integers(-200, 600), max_size=5), st.none()), min_size=1, max_size=3),
    st.lists(st.binary(max_size=4), min_size=1, max_size=3),
)


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(names=st.sampled_from([("input_ids", "labels"), ("input", "output"), ("input_ids", "x")]),
       a=PARQUET_COLUMN, b=PARQUET_COLUMN, cut=st.one_of(st.none(), st.integers(0, 300)))  # fmt: skip
def test_generated_parquet_files_end_in_a_sentence_never_a_traceback(names, a, b, cut):
    source = HERE / "parquet"
    shutil.rmtree(source, ignore_errors=True)
    n = min(len(a), len(b))
    try:
        table = pa.table({names[0]: a[:n], names[1]: b[:n]})
    except (pa.ArrowException, TypeError, ValueError):
        return
    path = _parquet(source, table)
    _parquet(source, table, "validation.parquet")
    if cut is not None:
        path.write_bytes(path.read_bytes()[:cut])
    _run_prepare_checked(source, HERE / "never")
