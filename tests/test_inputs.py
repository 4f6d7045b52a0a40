"""Bad input ends in one sentence and a non-zero exit, before anything is written; never a traceback."""

from __future__ import annotations

import pytest
from conftest import run_cli


def one_sentence(out: str) -> None:
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    assert "Traceback" not in out and len(lines) == 1 and lines[0].startswith("error:"), out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc", "0"], "'distributed.nproc' must be at least 1"),
        (["micro_batch_size=0"], "'data.micro_batch_size' must be at least 1"),
        (["eval_batch_size=0"], "'data.eval_batch_size' must be at least 1"),
        (["global_batch_size=0"], "'data.global_batch_size' must be at least 1"),
        (["global_batch_size=-64"], "'data.global_batch_size' must be at least 1"),
        (["total_steps=0"], "'schedule.total_steps' must be at least 1"),
        (["optimizer.lr=-1e-3"], "'optimizer.lr' must be above 0"),
        (["schedule.max_samples=0"], "'schedule.max_samples' must be at least 1"),
        (["optimizer.beta1=1"], "'optimizer.beta1' must be at least 0 and below 1"),
        (["optimizer.lr=nan"], "'optimizer.lr' must be a finite number"),
        (["model.hidden_dropout=1.5"], "'model.hidden_dropout' must be at least 0 and below 1"),
        (["micro_batch_size=128"], "data.micro_batch_size=128 is more than each process's share"),
    ],
)
def test_a_value_out_of_range_is_refused_before_anything_is_written(args, message, small_data, tmp_path, capsys):
    code = run_cli("run", "bert", f"data.dir={small_data}", f"output.results_dir={tmp_path / 'res'}", *args)
    out = capsys.readouterr().out
    assert code == 2 and message in out, out
    one_sentence(out)
    assert not (tmp_path / "res").exists()


def test_the_machine_refusing_a_path_is_one_sentence(small_data, tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert run_cli("run", "bert", f"data.dir={small_data}", "eval_samples=256", f"output.results_dir={a_file}") == 1
    one_sentence(capsys.readouterr().out)
    assert run_cli("prepare", "bert", "--synthetic", "--out", a_file / "data") == 1
    one_sentence(capsys.readouterr().out)


def test_broken_inputs_are_one_sentence(small_data, tmp_path, capsys):
    vocab = tmp_path / "vocab.txt"
    vocab.write_bytes(bytes(range(128, 256)) * 4)
    text = tmp_path / "text.txt"
    text.write_text("one sentence. another one.\n\nsecond document here.\n")
    assert run_cli("prepare", "bert", "--input", text, "--vocab", vocab, "--out", tmp_path / "o") == 2
    out = capsys.readouterr().out
    assert "is not UTF-8 text" in out
    one_sentence(out)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    results = tmp_path / "res"
    assert run_cli("run", "bert", f"data.dir={small_data}", f"init_checkpoint={folder}",
                   f"output.results_dir={results}") == 2  # fmt: skip
    out = capsys.readouterr().out
    assert "is a folder; give the checkpoint file" in out and not results.exists()
    one_sentence(out)


def test_resume_refuses_keys_that_would_change_the_run_and_finds_its_data_from_anywhere(
    small_data, tmp_path, capsys, monkeypatch
):
    run_dir = tmp_path / "run"
    quick = ["progress=false", "telemetry_hz=0", "eval_samples=256", "eval.every_samples=320", "max_samples=320"]
    monkeypatch.chdir(small_data.parent)  # a relative data.dir, saved absolute
    assert run_cli("run", "bert", f"data.dir={small_data.name}", f"output.run_dir={run_dir}", *quick) == 1
    assert f"dir: {small_data}" in (run_dir / "config.yaml").read_text()
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    code = run_cli("run", "bert", f"data.dir={small_data}", f"output.run_dir={run_dir}", "resume=true", "lr=5e-3")
    out = capsys.readouterr().out
    assert code == 2 and "optimizer.lr=0.005 cannot apply" in out, out
    one_sentence(out)
    # What resume takes: the same values, and the keys it lists.
    code = run_cli("run", "bert", f"data.dir={small_data}", f"output.run_dir={run_dir}", "resume=true",
                   "progress=false", *quick)  # fmt: skip
    assert code == 1 and "finished already" in capsys.readouterr().out
