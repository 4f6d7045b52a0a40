"""Scoring, the report and the submission package."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import run_cli

from trainbench import version
from trainbench.mlperf import check_compliance
from trainbench.report.scoring import score_folder, score_runs
from trainbench.version import describe

SRC = Path(version.__file__).resolve().parent

# -- olympic scoring -----------------------------------------------------------------------------------------


def test_olympic_mean_drops_fastest_and_slowest():
    assert score_runs([3.0, 1.0, 2.0])[:2] == (2.0, True)
    score, valid, _, counted = score_runs([5.0, 1.0, 2.0, 3.0, 10.0])
    assert valid and score == pytest.approx((2 + 3 + 5) / 3) and sorted(counted) == [0, 2, 3]


def test_one_failed_run_is_dropped_as_the_slowest():
    score, valid, reason, counted = score_runs([3.0, None, 1.0, 2.0])
    assert valid and score == pytest.approx((2 + 3) / 2) and "dropped as the slowest" in reason
    assert sorted(counted) == [0, 3]
    assert score_runs([3.0, None, 1.0])[:2] == (3.0, True)  # 3 runs, one failed: fastest dropped too


def test_two_failed_runs_make_the_result_invalid():
    score, valid, reason, _ = score_runs([1.0, None, 2.0, None, 3.0])
    assert score is None and not valid and "2 of 5 runs did not count" in reason


@pytest.mark.parametrize(
    ("benchmark", "ruleset", "gbs", "between"),
    [("bert", "5.0.0", 448, None), ("bert", "5.0.0", 768, (448, 1536)), ("llama31_8b", "5.1.0", 16, None),
     ("llama31_8b", "5.1.0", 48, (32, 64)), ("llama2_70b_lora", "5.1.0", 8, None),
     ("llama2_70b_lora", "5.1.0", 64, (32, 128))],
)  # fmt: skip
def test_samples_to_target_at_a_batch_are_those_of_mlperf_loggings_rcp_checker(benchmark, ruleset, gbs, between):
    """The reference point, or the interpolation between the two around the batch, that the RCP checker builds."""
    from mlperf_logging.rcp_checker.rcp_checker import RCP_Checker

    from trainbench.mlperf import reference_convergence

    point = reference_convergence(benchmark, ruleset, gbs)
    checker = RCP_Checker("training", ruleset, benchmark, verbose=False)
    record = checker._find_rcp(gbs, "full_rcps")
    if record is None:
        low, high = checker._find_top_min_rcp(gbs, "full_rcps"), checker._find_bottom_max_rcp(gbs, "full_rcps")
        record = checker._create_interp_rcp(gbs, low, high)[1]
    assert point.between == between
    assert point.mean_samples == pytest.approx(record["RCP Mean"], rel=1e-12)


def test_no_samples_to_target_outside_the_reference_batches_or_rulesets():
    from trainbench.mlperf import reference_convergence

    assert reference_convergence("llama2_70b_lora", "5.1.0", 4) is None  # below the smallest reference batch
    assert reference_convergence("bert", "5.0.0", 20_000) is None  # above the largest
    assert reference_convergence("bert", "0.7.0", 768) is None  # a ruleset mlperf-logging has no RCP file for


def test_projected_time_to_train_is_reference_samples_over_the_rate_plus_the_cadences_evals():
    from trainbench.report.projection import project

    # LoRA at GBS 8: 3,178.67 samples (the olympic mean of 20 reference runs); evals every 384 samples from 1,536
    # (the first FLOOR(0.125 x 8 + 2) = 3 skipped): 1,536 ... 3,456, six of them.
    lora = project("llama2_70b_lora", 8, samples_per_s=1.0, eval_seconds=30.0)
    assert (lora.first_eval_samples, lora.eval_every_samples, lora.evals) == (1536, 384, 6)
    assert lora.samples_to_target == pytest.approx(3178.667, abs=1e-3) and lora.between is None
    assert lora.minutes == pytest.approx(3178.667 / 60 + 6 * 30 / 60, abs=1e-4)
    # BERT at GBS 768: between the 448 and 1536 points; evals every FLOOR(0.05 (230.23 x 768 + 3e6), 25,000) =
    # 150,000 samples, the first at 150,000.
    bert = project("bert", 768, samples_per_s=10_000.0, eval_seconds=0.0)
    assert bert.between == (448, 1536) and bert.eval_every_samples == 150_000 and bert.first_eval_samples == 150_000
    assert bert.evals == 1 + math.ceil((bert.samples_to_target - 150_000) / 150_000)
    assert bert.train_minutes == pytest.approx(bert.samples_to_target / 10_000 / 60)
    assert project("llama31_8b", 8, 1.0, 0.0) is None  # below the smallest reference batch (16)
    with pytest.raises(ValueError, match="samples_per_s > 0"):
        project("bert", 768, 0.0, 1.0)


def test_where_there_is_no_projection_the_reason_is_said():
    """The batch outside the reference points names their span; a scaled-down preset and a ruleset without points
    say so (bench.json's projection_none, the console and the report)."""
    from trainbench.report.projection import why_none

    assert why_none("bert", 96, None, False) == (
        "the reference convergence points of bert (ruleset 5.0.0) span global batches 256 to 16,384, and 96 is "
        "outside them")  # fmt: skip
    assert "16 to 128, and 8 is outside" in why_none("llama31_8b", 8, None, False)
    assert why_none("bert", 768, None, True).startswith("a scaled-down preset")
    assert "no reference convergence points of bert for ruleset 0.7.0" in why_none("bert", 768, "0.7.0", False)


def test_too_few_runs_have_no_score():
    assert score_runs([1.0, 2.0])[:2] == (None, False)
    assert score_runs([])[:2] == (None, False)


# -- folders made from a real run ------------------------------------------------------------------------------


def _shifted(log: str, extra_ms: int) -> str:
    """The log with run_stop (and every line after the last eval) moved ``extra_ms`` later."""
    lines = log.splitlines()
    out = []
    for line in lines:
        event = json.loads(line.split(":::MLLOG", 1)[1])
        if event["key"] == "run_stop":
            event["time_ms"] += extra_ms
        out.append(":::MLLOG " + json.dumps(event))
    return "\n".join(out) + "\n"


def _aborted(log: str) -> str:
    """The log of a run that stopped short of the target: last eval below 0.720, run_stop aborted."""
    events = [json.loads(line.split(":::MLLOG", 1)[1]) for line in log.splitlines()]
    last_eval = max(i for i, e in enumerate(events) if e["key"] == "eval_accuracy")
    events[last_eval]["value"] = 0.61
    for e in events:
        if e["key"] == "run_stop":
            e["metadata"]["status"] = "aborted"
    return "".join(":::MLLOG " + json.dumps(e) + "\n" for e in events)


def make_folder(converged: Path, dest: Path, extra_minutes: list[float | None]) -> Path:
    """A results folder of len(extra_minutes) runs: the converged run's log with run_stop moved; None:
    a run whose log says aborted (it does not count)."""
    shutil.copytree(converged, dest)
    for p in list(dest.glob("result_*.txt")) + list(dest.glob("run_*.json")):
        p.unlink()
    base = (converged / "result_0.txt").read_text()
    outcome = json.loads((converged / "run_0.json").read_text())
    for i, extra in enumerate(extra_minutes):
        log = _aborted(base) if extra is None else _shifted(base, int(extra * 60_000))
        (dest / f"result_{i}.txt").write_text(log)
        (dest / f"run_{i}.json").write_text(json.dumps(outcome | {"index": i}))
    return dest


def test_score_matches_mlperf_loggings_result_summarizer(converged, tmp_path):
    from mlperf_logging.result_summarizer import result_summarizer

    assert not check_compliance(tmp_path / "x", "5.0.0").passed  # a missing file does not pass
    for name, extras in {"five": [0.5, 0.0, 2.0, 1.0, 4.0], "one_failed": [0.5, None, 2.0, 1.0, 4.0]}.items():
        folder = make_folder(converged, tmp_path / name, extras)
        ours = score_folder(folder)
        assert ours.valid, ours.reason
        package = tmp_path / f"pkg_{name}"
        assert run_cli("package", folder, "--org", "tb", "--system", "cpu", "--out", package) == 1  # too few runs
        bench_dir = package / "tb" / "results" / "cpu" / "bert"
        theirs, _, scaling = result_summarizer._compute_strong_score_standalone(
            "bert", "cpu", False, str(bench_dir), "training", "5.0.0"
        )
        assert scaling == 1.0
        assert ours.score_min == pytest.approx(theirs, rel=1e-9), name
    assert not check_compliance(tmp_path / "one_failed" / "result_1.txt", "5.0.0").passed


def test_report_writes_html_and_markdown_with_plots(converged, tmp_path, capsys):
    folder = make_folder(converged, tmp_path / "three", [0.0, 1.0, 2.0])
    assert run_cli("report", folder) == 0
    out = capsys.readouterr().out
    assert "score: " in out and "report.html" in out
    page = (folder / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') >= 4  # eval, loss, throughput, CPU (no GPU here)
    md = (folder / "report.md").read_text()
    assert "— MLPerf score: mean of 1 of 3 runs" in md and "plots/eval.png" in md
    for name in ("eval.png", "loss.png", "throughput.png", "cpu.png"):
        assert (folder / "plots" / name).stat().st_size > 5000
    expected = (converged / "result_0.txt").read_text()
    assert score_folder(folder).score_min == pytest.approx(1.0 + _ttt(expected))


def _ttt(log: str) -> float:
    events = [json.loads(line.split(":::MLLOG", 1)[1]) for line in log.splitlines()]
    start = next(e["time_ms"] for e in events if e["key"] == "run_start")
    stop = next(e["time_ms"] for e in events if e["key"] == "run_stop")
    return (stop - start) / 60_000


def test_report_renders_in_headless_chromium(converged, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        pytest.skip("no headless Chromium (Debian package chromium) on this machine")
    folder = make_folder(converged, tmp_path / "render", [0.0, 1.0, 2.0])
    assert run_cli("report", folder) == 0
    # A copy of the page that writes, once loaded, each image's decoded width into the DOM.
    probe = folder / "probe.html"
    probe.write_text((folder / "report.html").read_text().replace(
        "</body>",
        "<script>window.addEventListener('load', () => document.body.setAttribute('data-widths',"
        " Array.from(document.images).map(i => i.naturalWidth).join(',')));</script></body>",
    ))  # fmt: skip
    proc = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000", "--dump-dom",
         probe.as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    match = re.search(r'data-widths="([^"]*)"', proc.stdout)
    assert match, proc.stderr[-2000:]
    widths = [int(w) for w in match.group(1).split(",")]
    assert len(widths) >= 4 and all(w > 100 for w in widths)
    assert "Score:" in proc.stdout or "score" in proc.stdout.lower()


def test_compare_two_folders(converged, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the comparison's page is written
    a = make_folder(converged, tmp_path / "a", [0.0, 1.0, 2.0])
    b = make_folder(converged, tmp_path / "b", [2.0, 3.0, 4.0])
    assert run_cli("report", a, b) == 0
    out = capsys.readouterr().out
    assert "B/A" in out and "score (min)" in out
    ratio = (score_folder(b).score_min) / (score_folder(a).score_min)
    assert f"{ratio:.3f}" in out and (tmp_path / "compare_a_vs_b.html").is_file()


def test_package_layout_and_system_description(converged, tmp_path, capsys, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert run_cli("package", converged, "--org", "acme", "--system", "cpu_box", "--out", tmp_path) == 1
    assert not list(cwd.iterdir())  # the package checker's own log file is not left where the command ran
    out = capsys.readouterr().out
    root = tmp_path / "acme"
    assert (root / "results" / "cpu_box" / "bert" / "result_0.txt").exists()
    desc = json.loads((root / "systems" / "cpu_box.json").read_text())
    assert desc["submitter"] == "acme" and desc["number_of_nodes"] == "1"
    assert "passed: System description checker passed for cpu_box" in out
    assert "expected 10" in out and "runs: 1 finished, of the 10 a bert submission needs (run it with --nexp 10)" in out
    assert (
        "Detailed log output" not in (root / "package_checker.log").read_text()
    )  # its own copy, in a temporary folder
    assert run_cli("package", converged, "--org", "a b", "--system", "x", "--out", tmp_path) == 2
    # The code that ran, beside the results: trainbench's source (no caches) and the run's resolved config.
    impl = root / "benchmarks" / "bert" / "implementations" / f"trainbench-{version.__version__}"
    assert (impl / "src" / "trainbench" / "train" / "loop.py").read_text() == (SRC / "train" / "loop.py").read_text()
    assert (impl / "src" / "trainbench" / "systems" / "dgxh100_8x8.yaml").is_file()  # package data
    assert not list(impl.rglob("__pycache__")) and not list(impl.rglob("*.pyc"))
    assert (impl / "config_cpu_box.yaml").read_text() == (converged / "config.yaml").read_text()
    assert describe() in (impl / "README.md").read_text() and f"implementation: {impl}" in " ".join(out.split())
    # The system description is what the run recorded of its node, not what this machine is: a record edited to
    # another machine's CPU shows that CPU, and a field it lacks stays empty and is named.
    folder = tmp_path / "recorded"
    shutil.copytree(converged, folder)
    record_path = next(folder.glob("node_*.json"))
    record = json.loads(record_path.read_text())
    record["cpu"] |= {"model": "Recorded CPU 9000", "sockets": 2, "cores_per_socket": 48, "logical_cpus": 192}
    del record["memory_bytes"]
    record_path.write_text(json.dumps(record))
    capsys.readouterr()
    run_cli("package", folder, "--org", "acme", "--system", "recorded", "--out", tmp_path / "p2")
    out = " ".join(capsys.readouterr().out.split())
    desc = json.loads((tmp_path / "p2" / "acme" / "systems" / "recorded.json").read_text())
    assert (desc["host_processor_model_name"], desc["host_processors_per_node"], desc["host_processor_core_count"],
            desc["host_processor_vcpu_count"]) == ("Recorded CPU 9000", "2", "48", "192")  # fmt: skip
    assert desc["host_memory_capacity"] == "" and "host_memory_capacity" in out.split("nothing recorded, empty:")[1]
    assert f"system description from the runs' records of 1 node(s): {record['host']}" in out
    assert desc["framework"].startswith(describe()) and desc["operating_system"] == record["os"]


def test_check_fails_on_any_checker_warning_and_on_a_log_that_is_no_record_of_one_run(converged, tmp_path, capsys):
    from trainbench.mlperf import read_log

    log = (converged / "result_0.txt").read_text()
    lines = log.splitlines()
    stop = next(ln for ln in lines if '"run_stop"' in ln)
    rest = [ln for ln in lines if ln != stop]
    cases = {
        # A kill between run_stop and the rename used to leave two run_stops: the checker only warns.
        "two_run_stops": log + stop + "\n",
        # run_stop moved before the evals: 0.04 min to train where the run took longer.
        "stop_moved": "\n".join(rest[:12] + [stop] + rest[12:]) + "\n",
    }
    for name, text in cases.items():
        folder = tmp_path / name
        shutil.copytree(converged, folder)
        (folder / "result_0.txt").write_text(text)
        assert run_cli("check", folder) == 1, name
        out = capsys.readouterr().out
        assert ("EXACTLY_ONE" in out) if name == "two_run_stops" else ("time order" in out), (name, out)
        score = score_folder(folder)
        assert not score.runs[0].compliant, name
    # The report takes the final metric and the samples from the log, not from run_0.json.
    folder = tmp_path / "outcome_disagrees"
    shutil.copytree(converged, folder)
    outcome = json.loads((folder / "run_0.json").read_text())
    (folder / "run_0.json").write_text(json.dumps(outcome | {"final_metric": 0.99, "samples": 1}))
    run = score_folder(folder).runs[0]
    last = [e for e in read_log(folder / "result_0.txt") if e["key"] == "eval_accuracy"][-1]
    assert run.final_metric == last["value"] and run.samples == last["metadata"]["epoch_num"]


def test_package_shows_every_checker_warning(converged, tmp_path, capsys):
    folder = make_folder(converged, tmp_path / "one_failed", [0.5, None, 2.0, 1.0, 4.0])
    capsys.readouterr()
    run_cli("package", folder, "--org", "tb", "--system", "cpu", "--out", tmp_path / "pkg")
    out = capsys.readouterr().out
    assert "warning:" in out and "does not comply" in out, out


def test_report_on_a_folder_without_runs_or_with_broken_files_is_one_sentence(converged, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_cli("report", empty) == 2 and "holds no runs" in capsys.readouterr().out
    broken = tmp_path / "broken"
    shutil.copytree(converged, broken)
    (broken / "result_0.txt").write_bytes(bytes(range(256)) * 8)
    (broken / "run_0.json").write_text("")
    (broken / "metrics.jsonl").write_text((converged / "metrics.jsonl").read_text() + '{"run": 0, "st')
    code = run_cli("report", broken)
    out = capsys.readouterr().out
    assert code == 0 and "Traceback" not in out and "no time to train" in out


def test_report_marks_dropped_runs_names_the_system_and_says_what_is_missing(converged, tmp_path, capsys):
    folder = make_folder(converged, tmp_path / "five", [0.5, None, 2.0, 1.0, 4.0])
    assert run_cli("report", folder) == 0
    md = (folder / "report.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in md.splitlines() if line.startswith("| ") and "run" not in line}
    assert rows["0"].rstrip(" |").endswith("dropped: fastest") and rows["1"].rstrip(" |").endswith("does not count")
    assert all(rows[i].rstrip(" |").endswith("averaged") for i in ("2", "3", "4"))
    assert "MLPerf asks for 10 runs of bert; this folder has 5" in md
    assert "Energy is empty: it needs GPU telemetry" in md
    system = next(line for line in md.splitlines() if line.startswith("System:"))
    assert "torch " in system and "cpu " in system and "python " in system
    assert "max-width:980px" not in (folder / "report.html").read_text()
