"""What `submit` and `resubmit` record and refuse, with stand-in Slurm commands: a chain that sbatch stops half-way
is recorded job by job, a stopped run with no job after it goes again (or says how), a chain too long, a job record
that is not one, and two resubmits at once."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import lock_held_elsewhere, run_cli


def _error(capsys) -> str:
    out = capsys.readouterr().out.strip()
    assert out.startswith("error:") and "Traceback" not in out and out.count("\n") == 0, out
    return out


def stand_ins(folder: Path, **bodies: str) -> None:
    """Slurm's commands as small scripts on PATH (sinfo fits the test cluster; srun lists the pmi2 plugin)."""
    folder.mkdir(exist_ok=True)
    tools = {"sinfo": "echo 'debug*|up|infinite|2|2|(null)'", "srun": "echo 'MPI plugin types are...'; echo '  pmi2'",
             "squeue": "true"} | bodies  # fmt: skip
    for name, body in tools.items():
        (folder / name).write_text(f"#!/bin/bash\n{body}\n")
        (folder / name).chmod(0o755)


@pytest.fixture
def cluster(tmp_path, monkeypatch) -> Path:
    bin_dir = tmp_path / "bin"
    stand_ins(bin_dir)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return bin_dir


def test_a_chain_refused_half_way_is_recorded_job_by_job_and_resubmit_knows_it(small_data, tmp_path, cluster, capsys):
    count = tmp_path / "count"
    count.write_text("0")
    # sbatch accepts two jobs, then a QOS limit refuses the third
    stand_ins(
        cluster,
        sbatch=f"n=$(( $(cat {count}) + 1 )); echo $n > {count}; "
        'if [ $n -ge 3 ]; then echo "QOSMaxSubmitJobPerUserLimit" >&2; exit 1; fi; echo 100$n',
    )
    code = run_cli("submit", "bert", "--preset", "tiny", "--system", "local_cpu_2x1", "--chain", "4",
                   f"data.dir={small_data}", f"output.results_dir={tmp_path / 'r'}", "eval_samples=256")  # fmt: skip
    assert code == 2
    message = _error(capsys)
    assert "refused job 3 of the chain of 4" in message and "jobs 1001, 1002 are queued" in message
    run_dir = next((tmp_path / "r").iterdir())
    job = json.loads((run_dir / "job.json").read_text())
    assert job["job_ids"] == ["1001", "1002"] and job["job_id"] == "1001"
    # resubmit knows both: refused while they are queued
    stand_ins(cluster, squeue="echo '1002|1002|PENDING'", sbatch="echo 2001")
    assert run_cli("resubmit", run_dir) == 2
    assert "job 1002 of" in _error(capsys)


def test_a_chain_too_long_is_refused_before_anything_is_written(small_data, tmp_path, capsys):
    code = run_cli("submit", "bert", "--preset", "tiny", "--system", "local_cpu_2x1", "--chain", "1000000",
                   "--dry-run", f"data.dir={small_data}", f"output.results_dir={tmp_path / 'r'}")  # fmt: skip
    assert code == 2 and "from 1 to 100 jobs" in _error(capsys) and not (tmp_path / "r").exists()


def _run_script(run_dir: Path, tmp_path: Path, queue: str, requeue_ok: bool) -> subprocess.CompletedProcess:
    """The job script of ``run_dir`` as job 77 whose ranks checkpoint on USR1 (srun leaves the preempted marker),
    with ``queue`` as what squeue lists under the job's name."""
    bin_dir, log = tmp_path / "jobbin", tmp_path / "calls.log"
    stand_ins(bin_dir, srun=f'case "$*" in *launch.preflight*) exit 0;; esac; touch {run_dir}/preempted_0; exit 3',
              squeue=f"printf '{queue}'",
              scontrol=f'echo "scontrol $*" >> {log}; ' + ("true" if requeue_ok else "exit 1"))  # fmt: skip
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="77", SLURM_JOB_NODELIST="n1",
               SLURM_JOB_NAME="tb")  # fmt: skip
    return subprocess.run(["bash", str(run_dir / "submit.sbatch")], env=env, capture_output=True, text=True)


def test_a_stopped_chained_run_with_no_job_after_it_requeues_or_says_how_to_continue(small_data, tmp_path):
    assert run_cli("submit", "bert", "--preset", "tiny", "--system", "local_cpu_2x1", "--chain", "2", "--dry-run",
                   f"data.dir={small_data}", f"output.results_dir={tmp_path / 'r'}") == 0  # fmt: skip
    run_dir = next((tmp_path / "r").iterdir())
    state = lambda: json.loads((run_dir / "slurm_0.json").read_text())["state"]  # noqa: E731
    # a namesake is queued: it continues the run
    proc = _run_script(run_dir, tmp_path, "77\\n78\\n", True)
    assert proc.returncode == 0 and state() == "CONTINUES", proc.stderr
    # none queued (a resubmitted job, or the chain's last): this job goes again
    proc = _run_script(run_dir, tmp_path, "77\\n", True)
    assert proc.returncode == 0 and state() == "REQUEUED", proc.stderr
    assert "scontrol requeue 77" in (tmp_path / "calls.log").read_text()
    # and where Slurm refuses the requeue, the job says what continues the run
    proc = _run_script(run_dir, tmp_path, "77\\n", False)
    assert state() == "STOPPED" and f"trainbench resubmit {run_dir} continues it" in proc.stdout, proc.stdout


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"nexp": "three"}', '{"nexp": 0}', '{"job_ids": 5}',
                                  '{"nexp": 1, "job_id": [1]}'])  # fmt: skip
def test_a_malformed_job_record_is_one_sentence(small_data, tmp_path, cluster, capsys, text):
    assert run_cli("submit", "bert", "--preset", "tiny", "--system", "local_cpu_2x1", "--dry-run",
                   f"data.dir={small_data}", f"output.results_dir={tmp_path / 'r'}") == 0  # fmt: skip
    run_dir = next((tmp_path / "r").iterdir())
    (run_dir / "job.json").write_text(text)
    capsys.readouterr()
    assert run_cli("resubmit", run_dir) == 2
    assert "job.json" in _error(capsys)


def test_two_resubmits_at_once_the_second_says_who_holds_the_folder(small_data, tmp_path, cluster, capsys):
    assert run_cli("submit", "bert", "--preset", "tiny", "--system", "local_cpu_2x1", "--dry-run",
                   f"data.dir={small_data}", f"output.results_dir={tmp_path / 'r'}") == 0  # fmt: skip
    run_dir = next((tmp_path / "r").iterdir())
    with lock_held_elsewhere(run_dir, "trainbench resubmit"):
        capsys.readouterr()
        assert run_cli("resubmit", run_dir) == 2
        assert "is in use: trainbench resubmit by" in _error(capsys)


# -- report and package of a folder they must not take as one benchmark's -------------------------------------------


@pytest.fixture
def mixed(converged, tmp_path) -> Path:
    """The tiny BERT run's folder with a second log that names llama2_70b_lora."""
    import shutil

    folder = Path(shutil.copytree(converged, tmp_path / "mixed"))
    log = (folder / "result_0.txt").read_text()
    assert '"value": "bert"' in log
    (folder / "result_1.txt").write_text(log.replace('"value": "bert"', '"value": "llama2_70b_lora"'))
    return folder


def test_report_of_a_folder_mixing_benchmarks_is_refused_naming_them(mixed, capsys):
    capsys.readouterr()
    assert run_cli("report", mixed) == 2
    message = _error(capsys)
    assert "mixes benchmarks" in message and "result_1.txt: llama2_70b_lora" in message and "bert" in message
    assert not (mixed / "report.html").exists()


def test_package_of_a_folder_mixing_benchmarks_is_refused(mixed, tmp_path, capsys):
    capsys.readouterr()
    assert run_cli("package", mixed, "--org", "acme", "--system", "box", "--out", tmp_path / "pkg") == 2
    assert "mixes benchmarks" in _error(capsys) and not (tmp_path / "pkg").exists()


@pytest.mark.parametrize("org", ["..", ".", "a/b", "../up"])
def test_package_names_never_lead_outside_the_output_folder(converged, tmp_path, capsys, org):
    out = tmp_path / "deep" / "pkg"
    capsys.readouterr()
    assert run_cli("package", converged, "--org", org, "--system", "box", "--out", out) == 2
    assert "letters, digits" in _error(capsys)
    assert not (tmp_path / "deep").exists()
