"""Reading a frozen base: an index that is not one, shard paths that leave the folder, tensors that are not weights,
damaged shard headers (generated), and the base's identity that a resume compares; each bad case one sentence."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainbench.errors import DataError
from trainbench.families.decoder.hf_checkpoint import (
    INDEX,
    HFCheckpoint,
    check_shapes,
    describe_change,
    identity,
    save_sharded,
)
from trainbench.families.decoder.lora import LoraModelConfig
from trainbench.families.decoder.model import DecoderLM

CFG = LoraModelConfig(vocab_size=64, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                      intermediate_size=24, rope_theta=10000.0, fused_qkv=True)  # fmt: skip


def write_base(folder: Path, seed: int = 0, dtype=torch.float32) -> Path:
    torch.manual_seed(seed)
    model = DecoderLM(CFG)
    model.init_weights(seed)
    save_sharded({k: v.to(dtype) for k, v in model.state_dict().items()}, folder, 3000)
    return folder


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return write_base(tmp_path_factory.mktemp("base"))


def copy(base: Path, to: Path) -> Path:
    return Path(shutil.copytree(base, to))


def load_error(folder: Path) -> str:
    with pytest.raises(DataError) as e, torch.device("meta"):
        with HFCheckpoint(folder) as ckpt:
            check_shapes(DecoderLM(CFG), ckpt, CFG)
    return str(e.value)


def set_index(folder: Path, value) -> None:
    (folder / INDEX).write_text(value if isinstance(value, str) else json.dumps(value))


@pytest.mark.parametrize(
    "index, says",
    [
        ({"weight_map": ["model.embed_tokens.weight"]}, "must map tensor names to shard file names"),
        ({"weight_map": {"a": 5}}, "must map tensor names to shard file names"),
        ({"metadata": {}}, "must map tensor names"),
        ([1, 2], "must map tensor names"),
        ("{not json", "not a safetensors index"),
        ({"weight_map": {}}, "names no tensor"),
    ],
)
def test_an_index_that_is_not_one_is_one_sentence(base, tmp_path, index, says):
    folder = copy(base, tmp_path / "b")
    set_index(folder, index)
    assert says in load_error(folder)


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors", ".."])
def test_an_index_naming_files_outside_its_folder_is_refused(base, tmp_path, name):
    folder = copy(base, tmp_path / "b")
    index = json.loads((folder / INDEX).read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = name
    set_index(folder, index)
    assert "outside its folder" in load_error(folder)


def test_an_integer_base_tensor_is_refused_not_cast(tmp_path):
    folder = write_base(tmp_path / "int", dtype=torch.int32)
    assert "stored as I32, not as floating point" in load_error(folder)


def test_the_console_names_a_float16_base_and_its_conversion(lora_data, tmp_path, capsys):
    data = Path(shutil.copytree(lora_data, tmp_path / "data"))  # changed below: a copy of the shared set
    from safetensors.torch import load_file, save_file

    for shard in (data / "base").glob("*.safetensors"):
        save_file({k: v.half() for k, v in load_file(shard).items()}, shard, metadata={"format": "pt"})
    capsys.readouterr()
    results = tmp_path / "r"
    assert run_cli("run", "llama2_70b_lora", f"data.dir={data}", f"output.results_dir={results}", "progress=false",
                   "telemetry_hz=0", "schedule.max_samples=8", "eval.every_samples=8") == 1  # fmt: skip
    out = capsys.readouterr().out
    assert "stored as float16, used as float32 (float16 widened exactly to float32)" in out, out


# -- the identity a resume compares ---------------------------------------------------------------------------------


def test_the_identity_is_stable_and_changes_with_the_base(base, tmp_path):
    assert identity(base) == identity(base) and describe_change(identity(base), identity(base)) is None
    other = write_base(tmp_path / "other", seed=1)  # the same shapes and headers, other weights
    assert "tensor data of shard" in describe_change(identity(base), identity(other))
    grown = copy(base, tmp_path / "grown")
    shard = sorted(grown.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes() + b"\0" * 8)
    assert "changed size" in describe_change(identity(base), identity(grown))
    halves = write_base(tmp_path / "halves", dtype=torch.float16)
    assert describe_change(identity(base), identity(halves)) is not None
    index = copy(base, tmp_path / "index")
    set_index(index, json.loads((index / INDEX).read_text()) | {"metadata": {"total_size": 1}})
    assert describe_change(identity(base), identity(index)) == "its index changed"


def test_the_identity_reads_headers_and_samples_not_the_whole_file(tmp_path):
    """A sparse shard of 4 GiB (header, then a hole): its identity is taken in well under a second."""
    import time

    header = json.dumps({"w": {"dtype": "BF16", "shape": [2**15, 2**16], "data_offsets": [0, 2**32]}}).encode()
    shard = tmp_path / "model.safetensors"
    with open(shard, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
    with open(shard, "r+b") as f:
        f.truncate(8 + len(header) + 2**32)
    start = time.perf_counter()
    value = identity(tmp_path)
    took = time.perf_counter() - start
    assert took < 1.0 and value["shards"]["model.safetensors"]["bytes"] == 8 + len(header) + 2**32


# -- generated damaged headers and indexes ------------------------------------------------------------------------

HERE = Path(__import__("tempfile").mkdtemp(prefix="tb-fuzz-weights-"))
DTYPES = st.sampled_from(["F32", "BF16", "F16", "I64", "BOOL", "F8_E4M3", "X9", ""])
ENTRY = st.fixed_dictionaries({"dtype": DTYPES, "shape": st.lists(st.integers(-2, 70), max_size=3),
                               "data_offsets": st.lists(st.integers(-10, 50_000), max_size=3)})  # fmt: skip


@settings(max_examples=120, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(
    header=st.one_of(st.dictionaries(st.sampled_from(["model.embed_tokens.weight", "lm_head.weight", "x"]), ENTRY),
                     st.just([]), st.integers()),
    length=st.one_of(st.none(), st.integers(0, 2**40)),
    extra=st.binary(max_size=64),
    index=st.one_of(st.none(), st.dictionaries(st.sampled_from(["model.embed_tokens.weight", "lm_head.weight"]),
                                               st.sampled_from(["model.safetensors", "../x", "", "a/b"]))),
)  # fmt: skip
def test_generated_damaged_shards_and_indexes_are_one_sentence(base, header, length, extra, index):
    folder = HERE / "w"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    body = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(body) if length is None else length) + body
                                               + extra)  # fmt: skip
    if index is not None:
        set_index(folder, {"weight_map": index})
    load_error(folder)  # a DataError, and nothing else
    with contextlib.suppress(DataError):
        identity(folder)


@pytest.mark.parametrize("damage", ["header length past the file", "header not JSON", "data cut short"])
def test_a_damaged_base_stops_the_run_in_one_sentence_before_any_folder(lora_data, tmp_path, damage):
    data = Path(shutil.copytree(lora_data, tmp_path / "data"))  # changed below: a copy of the shared set
    shard = sorted((data / "base").glob("*.safetensors"))[0]
    raw = shard.read_bytes()
    if damage == "header length past the file":
        raw = struct.pack("<Q", 2**40) + raw[8:]
    elif damage == "header not JSON":
        n = struct.unpack("<Q", raw[:8])[0]
        raw = raw[:8] + b"{" * n + raw[8 + n :]
    else:
        raw = raw[: len(raw) // 2]
    shard.write_bytes(raw)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = run_cli("run", "llama2_70b_lora", f"data.dir={data}", f"output.results_dir={tmp_path / 'r'}")
    text = printed.getvalue()
    assert code == 2 and "Traceback" not in text and len(text.strip().splitlines()) == 1, text
    assert shard.name in text and not (tmp_path / "r").exists()
