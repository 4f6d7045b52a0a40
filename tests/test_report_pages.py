"""The report's pages beyond one folder's table: the headline card (one run's time to train, several runs' score and
spread, compliance, hardware, version), evals drawn as points, `report A B` as a page, the index of a folder of
many, the exports read back by TensorBoard's and MLflow's own readers, and every page opened in headless Chromium.
All from copies of the one shared tiny run (``converged``)."""

from __future__ import annotations

import json
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli
from test_report import _ttt, make_folder

from trainbench import __version__
from trainbench.report.scoring import score_folder
from trainbench.version import provenance


def shown_version() -> str:
    """This trainbench as the reports show it: its version, and the commit's first 12 digits where it has one."""
    made = provenance()
    return made["version"] + (f" ({made['commit'][:12]})" if "commit" in made else "")


BENCH = {"kind": "throughput measurement (trainbench bench): not a time-to-train result", "benchmark": "bert",
         "preset": "tiny", "figures": "measured", "blocks": 2, "blocks_measured": None, "ranks": 1, "device": "cpu",
         "nodes": 1, "global_batch_size": 64, "samples_per_step": 64, "step_seconds": 0.5, "samples_per_s": 128.0,
         "tokens_per_s": 16384.0, "tokens_per_s_per_rank": 16384.0, "tokens_per_s_per_node": 16384.0, "mfu": None,
         "peak_memory_gib": None, "eval_seconds_per_sample": 0.001, "energy_joules_per_token": None,
         "ruleset": "5.0.0", "projection": None, "profile": None,
         "system": {"cpu": "Test CPU (8 logical cores)", "gpus": "none", "memory": "16 GB",
                    "trainbench": "9.9.9"}}  # fmt: skip


def bench_folder(path: Path, **fields) -> Path:
    """A measurement's folder as `trainbench bench` leaves it (bench.json and config.yaml), its figures given."""
    path.mkdir(parents=True)
    (path / "bench.json").write_text(json.dumps(BENCH | fields))
    (path / "config.yaml").write_text(f"benchmark: {fields.get('benchmark', 'bert')}\npreset: tiny\n")
    return path


def card(page: str) -> str:
    match = re.search(r'<div class="card">.*?</dl></div>', page, re.S)
    assert match, page[:2000]
    return match.group(0)


def test_one_run_is_headlined_by_its_time_to_train_and_what_a_score_needs(converged, tmp_path, capsys):
    folder = shutil.copytree(converged, tmp_path / "one")
    assert run_cli("report", folder) == 0
    out = capsys.readouterr().out
    ttt = _ttt((folder / "result_0.txt").read_text())
    system = json.loads((folder / "run_0.json").read_text())["system"]
    md = (folder / "report.md").read_text()
    assert md.splitlines()[2] == f"**{ttt:,.3f} min** — time to train (one run)"
    assert "No valid score" not in md and "no valid score" not in out
    assert "a score needs 10 runs of bert under ruleset 5.0.0" in md and "trainbench run --nexp 10" in md
    top = card((folder / "report.html").read_text())
    assert f"{ttt:,.3f} min" in top and "time to train (one run)" in top
    assert '<dd class="pass">the log passes' in top
    assert f"1 node x 1 rank; no GPU, CPU {system['cpu']}, memory {system['memory']}" in top
    assert system["trainbench"] == provenance() and f"trainbench {shown_version()}" in top
    assert f"{ttt:,.3f} min — time to train (one run)" in out


def test_several_runs_are_headlined_by_the_score_its_spread_and_the_compliance_of_each(converged, tmp_path):
    folder = make_folder(converged, tmp_path / "five", [0.0, 1.0, 2.0, 3.0, 4.0])
    assert run_cli("report", folder) == 0
    # each run's time from its own log, as the report reads it (the converged run's time plus 0 to 4 minutes, in
    # whole milliseconds: adding minutes to the first run's float can round the other way at the third decimal)
    ttt = [_ttt((folder / f"result_{i}.txt").read_text()) for i in range(5)]
    assert ttt == pytest.approx([ttt[0] + k for k in range(5)])
    score = score_folder(folder)
    top = card((folder / "report.html").read_text())
    assert score.score_min == pytest.approx(ttt[2]) and f"{score.score_min:,.3f} min" in top
    assert "MLPerf score: mean of 3 of 5 runs" in top
    assert f"the runs averaged: {ttt[1]:,.3f} to {ttt[3]:,.3f} min (standard deviation " \
           f"{statistics.stdev(ttt[1:4]):,.3f} min" in top  # fmt: skip
    assert f"every run that counts: {ttt[0]:,.3f} to {ttt[4]:,.3f} min" in top
    assert "MLPerf asks for 10 runs of bert under ruleset 5.0.0; this folder has 5" in top
    assert "all 5 logs pass" in top
    failing = make_folder(converged, tmp_path / "failing", [0.0, None, 1.0])
    assert run_cli("report", failing) == 0
    top = card((failing / "report.html").read_text())
    assert '<dd class="fail">1 of 3 logs fail' in top and "run 1:" in top
    two = make_folder(converged, tmp_path / "two", [0.0, 1.0])
    assert run_cli("report", two) == 0
    top = card((two / "report.html").read_text())
    assert f"{ttt[0]:,.3f} to {_ttt((two / 'result_1.txt').read_text()):,.3f} min" in top
    assert "too few for an olympic mean" in top


def test_each_eval_is_a_point_against_samples_never_a_line_between_two(converged, tmp_path, monkeypatch):
    from trainbench.report import plots

    drawn, real = [], plots._png
    monkeypatch.setattr(plots, "_png", lambda fig: drawn.append(fig) or real(fig))
    folder = shutil.copytree(converged, tmp_path / "one")
    assert run_cli("report", folder) == 0
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["samples"], r["masked_lm_accuracy"]) for r in rows if "masked_lm_accuracy" in r]
    assert len(evals) >= 2
    (ax,) = next(fig for fig in drawn if "at each eval" in fig.axes[0].get_title()).axes
    assert ax.get_xlabel() == "samples trained" and ax.get_xlim()[0] == 0
    (points,) = [line for line in ax.get_lines() if line.get_label() == "run 0"]
    assert list(zip(points.get_xdata(), points.get_ydata(), strict=True)) == evals
    assert points.get_linestyle() == "None" and points.get_marker() == "o"


def test_two_folders_are_compared_on_a_page_with_curves_and_what_differs(converged, tmp_path, capsys, monkeypatch):
    a = make_folder(converged, tmp_path / "a", [0.0, 1.0, 2.0])
    b = make_folder(converged, tmp_path / "b", [2.0, 3.0, 4.0])
    (b / "config.yaml").write_text((b / "config.yaml").read_text().replace("  lr: 0.01\n", "  lr: 0.02\n"))
    outcome = json.loads((b / "run_0.json").read_text())
    outcome["system"]["cpu"] = "Another CPU (64 logical cores)"
    (b / "run_0.json").write_text(json.dumps(outcome))
    monkeypatch.chdir(tmp_path)
    assert run_cli("report", a, b) == 0
    out = capsys.readouterr().out
    ratio = score_folder(b).score_min / score_folder(a).score_min
    assert "B/A" in out and f"{ratio:.3f}" in out  # the terminal table, as before
    page = (tmp_path / "compare_a_vs_b.html").read_text()
    assert page.count('<div class="card">') == 2 and page.count('src="data:image/png;base64,') == 2
    assert "<h2>masked_lm_accuracy vs samples, both folders</h2>" in page
    assert "<tr><td>optimizer.lr</td><td>0.01</td><td>0.02</td></tr>" in page
    assert "other keys are the same" in page
    cpu = next(row for row in re.findall(r"<tr[^>]*>.*?</tr>", page) if "<td>cpu</td>" in row)
    assert cpu.startswith('<tr class="differs">') and "Another CPU (64 logical cores)" in cpu
    torch_row = next(row for row in re.findall(r"<tr[^>]*>.*?</tr>", page) if "<td>torch</td>" in row)
    assert torch_row.startswith("<tr>")  # the same on both sides: not marked
    assert run_cli("report", a, b, "--out", tmp_path / "mine.html") == 0 and (tmp_path / "mine.html").exists()
    assert run_cli("report", a, "--out", tmp_path / "x.html") == 2
    assert "give two folders" in capsys.readouterr().out


def test_two_benchmarks_are_refused_in_one_sentence_unless_asked(converged, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a = shutil.copytree(converged, tmp_path / "a")
    b = shutil.copytree(converged, tmp_path / "b")
    summary = json.loads((b / "summary.json").read_text())
    (b / "summary.json").write_text(json.dumps(summary | {"benchmark": "llama2_70b_lora"}))
    assert run_cli("report", a, b) == 2
    said = " ".join(capsys.readouterr().out.split())
    assert f"error: {a} holds bert/tiny and {b} holds llama2_70b_lora/tiny: two different benchmarks" in said
    assert "--allow-different" in said and not list(tmp_path.glob("compare_*.html"))
    assert run_cli("report", a, b, "--allow-different") == 0
    assert "llama2_70b_lora/tiny" in (tmp_path / "compare_a_vs_b.html").read_text()
    x = bench_folder(tmp_path / "x")
    y = bench_folder(tmp_path / "y", benchmark="llama31_8b", tokens_per_s=32768.0)
    assert run_cli("report", x, y) == 2 and "two different benchmarks" in capsys.readouterr().out
    assert run_cli("report", x, y, "--allow-different") == 0
    page = (tmp_path / "compare_x_vs_y.html").read_text()
    assert "<tr><td>tokens/s</td><td>16,384</td><td>32,768</td><td>2</td></tr>" in page
    assert "<tr><td>benchmark</td><td>bert</td><td>llama31_8b</td></tr>" in page  # the config diff


def test_a_folder_of_many_is_indexed_with_a_link_to_each_report(converged, tmp_path, capsys):
    root = tmp_path / "results"
    three = make_folder(converged, root / "nightly" / "20261201T000000Z-bert-tiny", [0.0, 1.0, 2.0])
    one = shutil.copytree(converged, root / converged.name)
    bench = bench_folder(root / "bench" / "20261202T000000Z-bert-tiny-bench")
    broken = shutil.copytree(converged, root / "broken")
    (broken / "summary.json").write_text(json.dumps(json.loads((broken / "summary.json").read_text())
                                                    | {"mlperf_benchmark": 5}))  # fmt: skip
    shutil.copytree(converged, root / ".hidden")
    assert run_cli("report", root) == 0
    out = capsys.readouterr().out
    page = (root / "index.html").read_text()
    assert "4 folders (1 could not be reported)" in page and ".hidden" not in page
    links = re.findall(r'<a href="([^"]+)">([^<]+)</a>', page)
    assert sorted(name for _, name in links) == sorted(p.relative_to(root).as_posix() for p in (three, one, bench))
    for href, _ in links:
        assert (root / href).is_file() and (root / href).name == "report.html"
    rows = re.findall(r"<tr><td>.*?</tr>", page)
    row = next(r for r in rows if three.name in r)
    assert f"{score_folder(three).score_min:,.3f} min" in row and "3 runs: 3 success" in row
    assert "all 3 logs pass" in row and "2026-" in row and f"trainbench {__version__}" in row
    bench_row = next(r for r in rows if bench.name in r)
    assert "16,384 tokens/s" in bench_row and "1 x cpu" in bench_row and "Test CPU (8 logical cores)" in bench_row
    assert "2026-12-02 00:00 UTC" in bench_row and "trainbench 9.9.9" in bench_row
    assert "cannot be reported" in next(r for r in rows if "broken" in r) and "mlperf_benchmark should" in page
    assert "index: " in out and "4 folders under" in out
    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    assert run_cli("report", empty) == 2 and "holds no runs" in capsys.readouterr().out


def test_the_bench_report_names_its_hardware(tmp_path, capsys):
    folder = bench_folder(tmp_path / "m", ranks=2, nodes=1, device="NVIDIA H200",
                          system=BENCH["system"] | {"gpus": "8 x NVIDIA H200 (141 GB)"})  # fmt: skip
    assert run_cli("report", folder) == 0
    line = "Hardware: 2 x NVIDIA H200; 1 node x 2 ranks; GPUs 8 x NVIDIA H200 (141 GB), CPU Test CPU (8 logical " \
           "cores), memory 16 GB; trainbench 9.9.9"  # fmt: skip
    assert line in (folder / "report.md").read_text() and line in (folder / "report.html").read_text()
    assert "hardware: 2 x NVIDIA H200" in capsys.readouterr().out
    old = bench_folder(tmp_path / "old", system=None)  # measured before bench.json recorded the machine
    assert run_cli("report", old) == 0
    assert "Hardware: 1 x cpu; 1 node x 1 rank; machine not recorded" in (old / "report.md").read_text()


# -- exports, read back by the tools' own readers ------------------------------------------------------------------


def test_export_to_tensorboard_is_read_back_by_its_event_reader(converged, tmp_path, capsys):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install -e '.[tensorboard]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = tmp_path / "results"
    folder = make_folder(converged, root / "three", [0.0, 1.0, 2.0])
    bench_folder(root / "m")
    tb = tmp_path / "tb"
    assert run_cli("report", root, "--export", "tensorboard", tb) == 0
    assert "tensorboard: 4 run(s) written" in capsys.readouterr().out
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    score = score_folder(folder)
    for run in score.runs:
        events = EventAccumulator(str(tb / "three" / f"run_{run.index}"))
        events.Reload()
        ttt = events.Scalars("result/time_to_train_min")
        assert [e.value for e in ttt] == [pytest.approx(run.time_to_train_min, rel=1e-6)]
        text = events.Tensors("result/text_summary")[0].tensor_proto.string_val[0].decode()
        assert "**status**: success" in text and "**compliance**: pass" in text
        config = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
        assert "    benchmark: bert" in config
    events = EventAccumulator(str(tb / "three" / "run_0"))
    events.Reload()
    evals = [(r["samples"], r["masked_lm_accuracy"], r["time_ms"] / 1000) for r in rows if "masked_lm_accuracy" in r]
    got = [(e.step, e.value, e.wall_time) for e in events.Scalars("eval/masked_lm_accuracy")]
    assert got == [(s, pytest.approx(v, rel=1e-6), pytest.approx(t)) for s, v, t in evals]
    losses = [(r["samples"], r["loss"]) for r in rows if "loss" in r]
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(s, pytest.approx(v, rel=1e-6))
                                                                         for s, v in losses]  # fmt: skip
    bench = EventAccumulator(str(tb / "m"))
    bench.Reload()
    assert bench.Scalars("bench/tokens_per_s")[0].value == 16384.0
    assert run_cli("report", root, "--export", "tensorboard", tb) == 0  # again: nothing written twice
    out = capsys.readouterr().out
    assert "0 run(s) written to" in out and "4 already there" in out


def test_export_to_mlflow_is_read_back_by_its_client(converged, tmp_path, capsys, monkeypatch):
    pytest.importorskip("mlflow", reason="MLflow is not installed (pip install -e '.[mlflow]')")
    from mlflow.tracking import MlflowClient

    folder = make_folder(converged, tmp_path / "three", [0.0, 1.0, None])
    store = tmp_path / "mlruns"
    assert run_cli("report", folder, "--export", "mlflow", store) == 0
    assert "mlflow: 3 run(s) written" in capsys.readouterr().out
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads a file store only when asked
    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    experiment = client.get_experiment_by_name("trainbench/bert")
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    assert sorted(runs) == [f"three/run_{i}" for i in range(3)]
    score = score_folder(folder)
    config = (folder / "config.yaml").read_text()
    for run in score.runs:
        got = runs[f"three/run_{run.index}"]
        assert got.data.metrics["result/time_to_train_min"] == pytest.approx(run.time_to_train_min)
        assert got.data.tags["trainbench.status"] == run.status
        assert got.data.tags["trainbench.compliance"] == ("pass" if run.compliant else "fail")
        assert got.info.status == ("FINISHED" if run.counts else "FAILED")
        assert got.data.params["optimizer.lr"] == "0.01" and got.data.params["benchmark"] == "bert"
        assert got.data.tags["trainbench.version"] == f"trainbench {shown_version()}"
        assert got.info.start_time == run.start_ms
        artifacts = {a.path for a in client.list_artifacts(got.info.run_id)}
        assert artifacts == {"config.yaml", f"result_{run.index}.txt"}
    assert "  lr: 0.01" in config
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    history = client.get_metric_history(runs["three/run_0"].info.run_id, "eval/masked_lm_accuracy")
    evals = [(r["samples"], r["masked_lm_accuracy"], r["time_ms"]) for r in rows if "masked_lm_accuracy" in r]
    assert [(m.step, m.value, m.timestamp) for m in history] == evals
    assert run_cli("report", folder, "--export", "mlflow", store) == 0
    assert "0 run(s) written" in capsys.readouterr().out and len(client.search_runs([experiment.experiment_id])) == 3


MISSING = [
    ("tensorboard", "torch.utils.tensorboard", "pip install -e '.[tensorboard]'"),
    ("mlflow", "mlflow", "pip install -e '.[mlflow]'"),
    ("wandb", None, "give one of tensorboard, mlflow"),
]


@pytest.mark.parametrize("tool, module, says", MISSING)
def test_an_export_without_its_library_or_to_another_tool_is_one_sentence(tool, module, says, converged, tmp_path,
                                                                          capsys, monkeypatch):  # fmt: skip
    if module:
        monkeypatch.setitem(sys.modules, module, None)  # import fails, as where it is not installed
        if tool == "mlflow":
            for name in ("mlflow.entities", "mlflow.exceptions", "mlflow.tracking"):
                monkeypatch.setitem(sys.modules, name, None)
    assert run_cli("report", converged, "--export", tool, tmp_path / "out") == 2
    said = capsys.readouterr().out
    assert says in said and said.count("error:") == 1 and not (tmp_path / "out").exists()


# -- every page in a browser ---------------------------------------------------------------------------------------


def chromium() -> str:
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        pytest.skip("no headless Chromium (Debian package chromium) on this machine")
    return browser


def opened(browser: str, page: Path, tmp_path: Path) -> tuple[str, Path]:
    """The page's DOM once loaded, with each image's decoded width written into it, and a screenshot."""
    probe = page.with_name(f"probe_{page.name}")
    probe.write_text(page.read_text().replace(
        "</body>",
        "<script>window.addEventListener('load', () => document.body.setAttribute('data-widths',"
        " Array.from(document.images).map(i => i.naturalWidth).join(',')));</script></body>",
    ))  # fmt: skip
    args = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000"]
    proc = subprocess.run([*args, "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120)
    shot = tmp_path / f"{page.parent.name}_{page.stem}.png"
    subprocess.run([*args, "--window-size=1000,800", f"--screenshot={shot}", page.as_uri()], capture_output=True,
                   timeout=120)  # fmt: skip
    probe.unlink()
    return proc.stdout, shot


def test_every_page_renders_in_headless_chromium(converged, tmp_path, monkeypatch):
    from PIL import Image

    browser = chromium()
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "results"
    one = shutil.copytree(converged, root / "one")
    three = make_folder(converged, root / "three", [0.0, 1.0, 2.0])
    bench = bench_folder(root / "bench")
    assert run_cli("report", root) == 0  # every folder's report, and the index
    assert run_cli("report", one, three, "--out", tmp_path / "compare.html") == 0
    pages = {"one": (one / "report.html", 4), "three": (three / "report.html", 4), "bench": (bench / "report.html", 0),
             "compare": (tmp_path / "compare.html", 2), "index": (root / "index.html", 0)}  # fmt: skip
    for name, (page, images) in pages.items():
        dom, shot = opened(browser, page, tmp_path)
        match = re.search(r'data-widths="([^"]*)"', dom)
        assert match, (name, dom[-2000:])
        widths = [int(w) for w in match.group(1).split(",") if w]
        assert len(widths) >= images and all(w > 100 for w in widths), (name, widths)
        assert name == "index" or 'class="figure"' in dom, name
        with Image.open(shot) as img:  # drawn: more than a blank page
            assert img.size == (1000, 800) and len(img.convert("L").getcolors()) > 20, name
