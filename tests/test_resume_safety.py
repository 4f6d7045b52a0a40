"""Resuming a results folder never runs code from it and never continues with what the run did not start with:
crafted checkpoint files, damaged checkpoints, an edited config, a re-prepared data set or another base, two
processes at once, a stop at the step an eval is due, a full disk at a checkpoint; values refused when the config
is built, before any folder exists."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import pickle
import shutil
import signal
from pathlib import Path
from unittest import mock

import pytest
import yaml
from conftest import lock_held_elsewhere, run_cli, tiny_spec
from test_resume import events

from trainbench.data.synthetic_bert import prepare_synthetic
from trainbench.train import loop

BERT = ["progress=false", "log_every_steps=1", "schedule.max_samples=1280", "eval.every_samples=640",
        "eval_samples=256", "telemetry_hz=0"]  # fmt: skip


class Marker:
    """Unpickling it runs ``touch PATH``: what a crafted file in a shared results folder would do."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def crafted_pickle(marker: Path) -> bytes:
    return pickle.dumps({"torch": Marker(marker)})


def cli(*args) -> tuple[int, str]:
    """Exit code and what the command printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = run_cli(*args)
    return code, out.getvalue()


def error_lines(printed: str) -> list[str]:
    return [ln for ln in printed.splitlines() if ln.startswith("error:")]


def stop_at(step: int):
    """Send this process SIGTERM during training step ``step`` (as Slurm or a user would)."""
    original, count = loop.train_step, [0]

    def step_then_signal(*args, **kwargs):
        result = original(*args, **kwargs)
        count[0] += 1
        if count[0] == step:
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    return mock.patch.object(loop, "train_step", step_then_signal)


def stopped_bert_run(data: Path, run_dir: Path, step: int) -> Path:
    with stop_at(step):
        assert run_cli("run", "bert", f"data.dir={data}", f"output.run_dir={run_dir}", *BERT) == 3
    assert (run_dir / "checkpoint_0" / "meta.json").exists() and (run_dir / "result_0.txt.partial").exists()
    return run_dir


@pytest.fixture(scope="module")
def stopped_at_eval(small_data, tmp_path_factory) -> Path:
    """A tiny BERT run stopped by SIGTERM during step 10, the step whose 640 samples are due for an eval."""
    return stopped_bert_run(small_data, tmp_path_factory.mktemp("stopped") / "run", 10)


@pytest.fixture
def stopped(stopped_at_eval, tmp_path) -> Path:
    """A copy of the stopped run to change."""
    return Path(shutil.copytree(stopped_at_eval, tmp_path / "run"))


def resume(run_dir: Path) -> tuple[int, str]:
    return cli("run", "bert", f"output.run_dir={run_dir}", "resume=true")


# -- never running what a results folder holds ------------------------------------------------------------------


@pytest.mark.parametrize("name, says", [("rng_rank0.pt", "could run code"), (".metadata", "posix.system")])
def test_a_crafted_checkpoint_file_is_refused_and_never_runs(stopped, tmp_path, name, says):
    """The RNG file (torch.load) and distributed checkpoint's metadata (a pickle), each crafted to run a command."""
    marker = tmp_path / "ran"
    (stopped / "checkpoint_0" / name).write_bytes(crafted_pickle(marker))
    code, printed = resume(stopped)
    assert not marker.exists()
    assert code == 2 and len(error_lines(printed)) == 1 and "Traceback" not in printed, printed
    assert name in printed and says in printed


def test_checkpoint_metadata_naming_a_shard_outside_the_checkpoint_is_refused(stopped):
    from trainbench.train.checkpoint import SafeReader

    path = stopped / "checkpoint_0" / ".metadata"
    metadata = SafeReader(str(stopped / "checkpoint_0")).read_metadata()
    for info in metadata.storage_data.values():
        info.relative_path = "../../elsewhere.distcp"
    path.write_bytes(pickle.dumps(metadata))
    code, printed = resume(stopped)
    assert code == 2 and "outside the checkpoint folder" in printed, printed


def test_what_trainbench_writes_loads_with_the_safe_loaders(stopped):
    """The RNG files hold tensors, numbers and strings only: torch's weights-only loader reads them."""
    import torch

    state = torch.load(stopped / "checkpoint_0" / "rng_rank0.pt", weights_only=True)
    assert set(state) >= {"torch", "numpy", "python"}


@pytest.mark.parametrize(
    "damage",
    ["meta.json not JSON", "meta.json of another program", "truncated shard", "no .metadata", "rng file truncated"],
)
def test_a_damaged_checkpoint_is_one_sentence(stopped, damage):
    ckpt = stopped / "checkpoint_0"
    if damage == "meta.json not JSON":
        (ckpt / "meta.json").write_text("{not json")
    elif damage == "meta.json of another program":
        (ckpt / "meta.json").write_text('{"step": "ten"}')
    elif damage == "truncated shard":
        shard = next(ckpt.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:100])
    elif damage == "no .metadata":
        (ckpt / ".metadata").unlink()
    else:
        rng = ckpt / "rng_rank0.pt"
        rng.write_bytes(rng.read_bytes()[:50])
    code, printed = resume(stopped)
    assert code == 2 and len(error_lines(printed)) == 1 and "Traceback" not in printed, printed
    assert "checkpoint" in printed or "rng_rank0.pt" in printed


# -- never continuing with what the run did not start with --------------------------------------------------------


def test_an_edited_config_is_refused_naming_the_key(stopped):
    config = stopped / "config.yaml"
    text = config.read_text()
    values = yaml.safe_load(text)
    values["optimizer"]["lr"] = values["optimizer"]["lr"] * 10
    config.write_text(yaml.safe_dump(values, sort_keys=False))
    code, printed = resume(stopped)
    assert code == 2 and "optimizer.lr" in printed and "started with" in printed, printed
    config.write_text(text)  # restored, the run continues (the refusal left no lock behind)
    code, printed = resume(stopped)
    assert code == 1 and "resumed from" in printed, printed


def test_an_edited_config_is_refused_by_the_log_where_the_start_was_not_recorded(stopped):
    """A folder without inputs.json (an earlier version's): what the log declares still holds."""
    (stopped / "inputs.json").unlink()
    config = stopped / "config.yaml"
    values = yaml.safe_load(config.read_text())
    values["data"]["global_batch_size"] = 128
    values["data"]["micro_batch_size"] = 128
    config.write_text(yaml.safe_dump(values, sort_keys=False))
    code, printed = resume(stopped)
    assert code == 2 and "global_batch_size" in printed and "declares" in printed, printed


def test_a_data_set_prepared_again_is_refused(small_data, tmp_path):
    data = Path(shutil.copytree(small_data, tmp_path / "data"))
    run_dir = stopped_bert_run(data, tmp_path / "run", 2)
    shutil.rmtree(data)
    prepare_synthetic(data, tiny_spec(seed=8, num_train_samples=1024))
    code, printed = resume(run_dir)
    assert code == 2 and "data set changed" in printed, printed


def test_paths_are_saved_absolute_so_a_resume_from_elsewhere_reads_the_same(small_data, tmp_path, monkeypatch):
    data = Path(shutil.copytree(small_data, tmp_path / "data"))
    monkeypatch.chdir(tmp_path)
    run_dir = stopped_bert_run(Path("data"), tmp_path / "run", 2)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["data"]["dir"] == str(data) and saved["output"]["run_dir"] == str(run_dir)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    code, printed = resume(run_dir)
    assert code == 1 and "run 0: aborted" in printed, printed  # max_samples before the target: it ran to the end


def test_two_processes_on_one_run_folder_the_second_says_who_holds_it(stopped, tmp_path):
    with lock_held_elsewhere(stopped, "resume=true") as pid:
        code, printed = resume(stopped)
    assert code == 2 and "is in use" in printed and f"process {pid}" in printed, printed
    assert "trainbench_resumed" not in (stopped / "result_0.txt.partial").read_text()
    code, printed = resume(stopped)  # the holder is gone: its lock went with it
    assert code == 1, printed


# -- the MLPerf eval cadence across a stop ------------------------------------------------------------------------


@pytest.mark.full
def test_a_stop_at_an_eval_step_keeps_every_eval_where_an_uninterrupted_run_has_it(stopped, small_data, tmp_path):
    code, printed = cli("run", "bert", f"data.dir={small_data}", f"output.run_dir={tmp_path / 'whole'}", *BERT)
    assert code == 1, printed
    whole = json.loads((tmp_path / "whole" / "run_0.json").read_text())["evals"]
    assert [samples for samples, _ in whole] == [640, 1280]
    code, printed = resume(stopped)
    assert code == 1, printed
    resumed = json.loads((stopped / "run_0.json").read_text())["evals"]
    assert [samples for samples, _ in resumed] == [640, 1280], resumed
    evals = [e["metadata"]["epoch_num"] for e in events(stopped / "result_0.txt") if e["key"] == "eval_accuracy"]
    assert evals == [640, 1280]


# -- a full disk at a checkpoint ----------------------------------------------------------------------------------


@pytest.mark.full
def test_a_full_disk_at_a_checkpoint_is_one_sentence_and_the_run_stays_resumable(small_data, tmp_path):
    import torch.distributed.checkpoint as dcp

    original, calls = dcp.save, [0]

    def save_until_full(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(*args, **kwargs)

    run_dir = tmp_path / "run"
    with mock.patch.object(dcp, "save", save_until_full):
        code, printed = cli("run", "bert", f"data.dir={small_data}", f"output.run_dir={run_dir}", *BERT,
                            "checkpoint_every_steps=4")  # fmt: skip
    assert code == 2 and len(error_lines(printed)) == 1 and "the disk is full" in printed, printed
    outcome = json.loads((run_dir / "run_0.json").read_text())
    assert (
        outcome["status"] == "interrupted"
        and json.loads((run_dir / "checkpoint_0" / "meta.json").read_text())["step"] == 4
    )
    code, printed = resume(run_dir)
    assert code == 1 and "resumed from" in printed, printed


# -- values refused when the config is built ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "bench, override, says",
    [
        ("llama2_70b_lora", "output.telemetry_hz=4096", "between 0.01 and 100"),
        ("llama2_70b_lora", "model.lora_targets=bucket", "not a linear layer"),
        ("llama2_70b_lora", "model.lora_targets=..", "not a linear layer"),
        ("llama2_70b_lora", "model.lora_targets=0.5", "not a linear layer"),
        ("llama2_70b_lora", "seed=-3", "at least 0"),
        ("llama2_70b_lora", "eval.target=2147483648", "at most"),
        ("llama2_70b_lora", "eval.target=-1", "above 0"),
        ("llama2_70b_lora", "optimizer.weight_decay=1e308", "at most 1"),
        ("llama2_70b_lora", "model.norm_eps=16", "below 1"),
        ("llama2_70b_lora", "schedule.max_samples=4", "less than one global batch"),
        ("llama2_70b_lora", "benchmark=1", "not a key to set"),
        ("bert", "data.length_bins=-2", "at least 0"),
        ("bert", "eval.target=1.5", "at most 1"),
        ("bert", "preset=large", "not a key to set"),
        ("bert", "distributed.tp=2", "does not divide the 1 ranks"),
    ],
)
def test_values_are_refused_before_any_folder_exists(bench, override, says, tmp_path):
    code, printed = cli("run", bench, "--preset", "tiny", f"data.dir={tmp_path / 'none'}",
                        f"output.results_dir={tmp_path / 'results'}", override)  # fmt: skip
    assert code == 2 and says in printed and len(error_lines(printed)) == 1, printed
    assert not (tmp_path / "results").exists()


# -- llama2_70b_lora: another base, another data set, a relative base path ------------------------------------------

LORA = ["progress=false", "telemetry_hz=0", "log_every_steps=1", "eval.every_samples=32", "schedule.max_samples=128"]


def stopped_lora_run(data: Path, run_dir: Path, *extra: str) -> Path:
    with stop_at(2):
        assert run_cli("run", "llama2_70b_lora", f"data.dir={data}", f"output.run_dir={run_dir}", *LORA, *extra) == 3
    return run_dir


def resume_lora(run_dir: Path) -> tuple[int, str]:
    return cli("run", "llama2_70b_lora", f"output.run_dir={run_dir}", "resume=true")


def test_a_lora_run_resumed_on_another_base_is_refused(lora_data, tmp_path):
    data = Path(shutil.copytree(lora_data, tmp_path / "data"))
    run_dir = stopped_lora_run(data, tmp_path / "run")
    other = tmp_path / "other"
    assert run_cli("prepare", "llama2_70b_lora", "--synthetic", "--preset", "tiny", "--seed", "99", "--out", other) == 0
    shutil.rmtree(data / "base")
    shutil.copytree(other / "base", data / "base")  # a random base of the same shapes, as a re-download might be
    code, printed = resume_lora(run_dir)
    assert code == 2 and "base weights changed" in printed and len(error_lines(printed)) == 1, printed


def test_a_lora_run_resumed_on_a_data_set_prepared_again_is_refused(lora_data, tmp_path):
    data = Path(shutil.copytree(lora_data, tmp_path / "data"))
    run_dir = stopped_lora_run(data, tmp_path / "run")
    assert run_cli("prepare", "llama2_70b_lora", "--synthetic", "--preset", "tiny", "--seed", "5", "--train-samples",
                   "3000", "--force", "--out", data) == 0  # fmt: skip
    code, printed = resume_lora(run_dir)
    assert code == 2 and "data set changed" in printed and len(error_lines(printed)) == 1, printed


def test_a_relative_base_path_is_saved_absolute(lora_data, tmp_path, monkeypatch):
    data = Path(shutil.copytree(lora_data, tmp_path / "data"))
    monkeypatch.chdir(tmp_path)
    run_dir = stopped_lora_run(data, tmp_path / "run", "model.base_weights=data/base")
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["model"]["base_weights"] == str(data / "base")
    (tmp_path / "elsewhere" / "data").mkdir(parents=True)  # a relative path would now name this empty folder
    monkeypatch.chdir(tmp_path / "elsewhere")
    code, printed = resume_lora(run_dir)
    assert code in (0, 1) and "resumed from" in printed, printed


def test_a_rank_0_that_slurm_started_checks_the_run_before_it_trains(stopped, monkeypatch, capsys):
    """No launcher checked for it: the worker itself refuses an edited config, before any collective."""
    from trainbench.launch import worker
    from trainbench.train.duties import StopSignal

    monkeypatch.setattr(StopSignal, "install_early", classmethod(lambda cls: None))
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("TRAINBENCH_RUN_LOCKED", raising=False)
    config = stopped / "config.yaml"
    values = yaml.safe_load(config.read_text())
    values["optimizer"]["lr"] = values["optimizer"]["lr"] * 10
    config.write_text(yaml.safe_dump(values, sort_keys=False))
    capsys.readouterr()
    assert worker.main([str(stopped), "0", "--resume"]) == 1
    out = capsys.readouterr().out
    assert "optimizer.lr" in out and "started with" in out, out


def test_values_a_checkpoint_stores_as_bytes_load_without_running_code(tmp_path):
    """distributed checkpoint keeps the optimizer's hyperparameters as torch.save bytes: they load weights-only."""
    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from trainbench.train.checkpoint import SafePlanner

    marker = tmp_path / "ran"
    crafted = io.BytesIO()
    torch.save(Marker(marker), crafted)
    planner = SafePlanner()
    planner.set_up_planner({"lr": 0.1}, None, True)
    at, zero = MetadataIndex("lr"), torch.Size([0])
    item = ReadItem(type=LoadItemType.BYTE_IO, dest_index=at, dest_offsets=zero, storage_index=at,
                    storage_offsets=zero, lengths=zero)  # fmt: skip
    crafted.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(item, crafted)
    assert not marker.exists()
    plain = io.BytesIO()
    torch.save(0.25, plain)
    plain.seek(0)
    planner.load_bytes(item, plain)
    assert planner.original_state_dict["lr"] == 0.25
