"""Containers: the job script's command for each runtime (pyxis, Apptainer, podman), the image built from the package
registries (podman, with a Debian root file system made by mmdebstrap), every benchmark's tiny preset inside it,
the enroot squashfs and OCI archive made from it, and podman under a real two-node Slurm with its preflight.

Apptainer, Singularity and enroot are in neither Debian nor PyPI: their commands are checked as text, and the files
they take (the squashfs, the OCI archive) are checked by opening them here."""

import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import CLUSTER_GROUP, needs_two_nodes, only_run_dir, run_cli
from test_slurm import _wait_state

REPO = Path(__file__).resolve().parents[1]
IMAGE = "localhost/trainbench:test"


def _system(tmp_path: Path, container: str, gpus: int = 0, name: str = "boxed") -> Path:
    path = tmp_path / f"{name}.yaml"
    kind = f"gpus_per_node: {gpus}\n" if gpus else "gpus_per_node: 0\ntasks_per_node: 1\ndevice: cpu\ncpu_bind: null\n"
    path.write_text(f"nodes: 2\n{kind}partition: debug\ntime: '00:10:00'\nenv:\n  OMP_NUM_THREADS: '1'\n"
                    f"container:\n{container}")  # fmt: skip
    return path


def _script(tmp_path: Path, system: Path, data: Path) -> tuple[Path, str]:
    out = tmp_path / "r"
    assert run_cli("submit", "bert", "--preset", "tiny", "--system", system, "--dry-run", f"data.dir={data}",
                   f"output.results_dir={out}", "eval_samples=256") == 0  # fmt: skip
    run_dir = next(out.iterdir())
    return run_dir, (run_dir / "submit.sbatch").read_text()


def _rank_line(script: str, module: str) -> str:
    return next(line for line in script.splitlines() if line.startswith("srun ") and module in line)


def test_apptainer_runs_each_rank_in_the_sif_with_the_runs_paths_bound_and_gpus_passed(small_data, tmp_path):
    sif = tmp_path / "trainbench.sif"
    sif.write_bytes(b"SIF")
    system = _system(tmp_path, f"  runtime: apptainer\n  image: {sif}\n  mounts: ['/scratch:/scratch']\n", gpus=8)
    run_dir, script = _script(tmp_path, system, small_data)
    worker = _rank_line(script, "launch.worker")
    assert (f"apptainer exec --nv --bind /scratch:/scratch --bind {run_dir}:{run_dir} --bind {small_data}:{small_data}"
            f" {sif} /opt/trainbench/venv/bin/python -m trainbench.launch.worker") in worker  # fmt: skip
    assert _rank_line(script, "launch.preflight").split(" -m ")[0] == worker.split(" -m ")[0]
    assert "--container-image" not in script
    cpu_system = _system(tmp_path, f"  runtime: apptainer\n  image: {sif}\n", name="cpu")
    _, cpu_script = _script(tmp_path / "cpu", cpu_system, small_data)
    assert "apptainer exec --bind" in _rank_line(cpu_script, "launch.worker")  # no --nv without GPUs
    sif.unlink()
    assert run_cli("submit", "bert", "--preset", "tiny", "--system", system, "--dry-run", f"data.dir={small_data}",
                   f"output.results_dir={tmp_path / 'x'}") == 2  # fmt: skip


def test_podman_passes_the_rank_variables_the_network_and_the_gpus(small_data, tmp_path):
    section = "  runtime: podman\n  image: localhost/trainbench:0.1.0\n  runtime_command: podman-hpc\n"
    system = _system(tmp_path, section, gpus=4)
    run_dir, script = _script(tmp_path, system, small_data)
    worker = _rank_line(script, "launch.worker")
    assert (
        f"podman-hpc run --rm --network=host --uts=host --ipc=host -v {run_dir}:{run_dir} "
        f"-v {small_data}:{small_data} '--env=SLURM_*' --env=SLURMD_NODENAME --env=MASTER_ADDR --env=MASTER_PORT "
        "'--env=TRAINBENCH_*' --env=CUDA_VISIBLE_DEVICES --env=OMP_NUM_THREADS --device=nvidia.com/gpu=all "
        "localhost/trainbench:0.1.0 /opt/trainbench/venv/bin/python -m trainbench.launch.worker"
    ) in worker, worker
    finish = next(line for line in script.splitlines() if "launch.slurm finish" in line)
    assert finish.startswith("srun --nodes=1 --ntasks=1 podman-hpc run --rm")  # the bookkeeping runs in the image too


@pytest.mark.parametrize("text, message", [
    ("  runtime: docker\n  image: x\n", "container.runtime must be one of pyxis, apptainer, podman"),
    ("  runtime: podman\n", "container.image is empty"),
    ("  image: x\n  mounts: ['data:/data']\n", "is not HOST:CONTAINER with absolute paths"),
    ("  image: x\n  mount: ['/a:/a']\n", "unknown container key(s) mount"),
    ("  image: x\n  mounts: /a:/a\n", "container.mounts should be a list"),
])  # fmt: skip
def test_a_bad_container_section_is_one_sentence(tmp_path, small_data, capsys, text, message):
    system = _system(tmp_path, text)
    assert run_cli("submit", "bert", "--preset", "tiny", "--system", system, "--dry-run", f"data.dir={small_data}",
                   f"output.results_dir={tmp_path / 'r'}") == 2  # fmt: skip
    assert message in capsys.readouterr().out


def test_both_container_forms_at_once_are_refused(tmp_path, small_data, capsys):
    system = tmp_path / "both.yaml"
    system.write_text("nodes: 1\ntasks_per_node: 1\ndevice: cpu\ncontainer_image: a\ncontainer:\n  image: b\n")
    assert run_cli("submit", "bert", "--preset", "tiny", "--system", system, "--dry-run", f"data.dir={small_data}",
                   f"output.results_dir={tmp_path / 'r'}") == 2  # fmt: skip
    assert "either as a container: section or as container_image/container_mounts" in capsys.readouterr().out


# -- the image, for real ----------------------------------------------------------------------------------------


def _cannot_build() -> str | None:
    missing = [t for t in ("podman", "mmdebstrap", "mksquashfs", "unsquashfs") if shutil.which(t) is None]
    if missing:
        return f"{', '.join(missing)} not installed (.ci/run installs podman, mmdebstrap and squashfs-tools)"
    if os.getuid() != 0:
        return "building the Debian root file system and running podman as CI does needs root"
    return None


def needs_podman(test):
    """A test of the image itself: ``make test-all`` only, in the cluster's group of parallel workers (the image is
    built once, by the worker that runs them)."""
    reason = _cannot_build()
    for mark in (pytest.mark.full, pytest.mark.xdist_group(CLUSTER_GROUP),
                 pytest.mark.skipif(reason is not None, reason=str(reason))):  # fmt: skip
        test = mark(test)
    return test


def podman(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *map(str, args)], capture_output=True, text=True, timeout=timeout)


# What building the image takes of the disk at its peak: the wheels, the build container's copy of the venv, the blob
# written from it and the image's layer (measured on 2026-11-30: 6.4 GB above where it started, for an image of 1.8 GB).
IMAGE_PEAK_GB = 6.5


def _too_little_disk() -> str | None:
    """Why the image cannot be built here for want of disk, or None: podman's storage (and the temporary folder the
    build writes its layer through) must have IMAGE_PEAK_GB free between them."""
    proc = podman("info", "--format", "{{.Store.GraphRoot}}", timeout=60)
    if proc.returncode != 0 or not proc.stdout.strip():
        return None  # the build itself says what is wrong with podman
    places = {Path(proc.stdout.strip()), Path(os.environ.get("TMPDIR", "/var/tmp"))}
    free = {os.stat(p).st_dev: shutil.disk_usage(p).free / 1e9 for p in places if p.exists()}
    if free and sum(free.values()) < IMAGE_PEAK_GB:
        where = " and ".join(sorted(str(p) for p in places if p.exists()))
        return (f"building the image takes about {IMAGE_PEAK_GB} GB of disk at its peak, and only "
                f"{sum(free.values()):.1f} GB is free on {where}")  # fmt: skip
    return None


@pytest.fixture(scope="session")
def image(podman_limits):
    """The CPU image, built once by `containers/image.sh cpu` (mmdebstrap, wheels gathered by pip, podman build), and
    removed at the end of the session (the Debian base is kept: the next build starts from it). Skips with the reason
    where the disk cannot hold the build."""
    why = _too_little_disk()
    if why:
        pytest.skip(why)
    proc = subprocess.run([str(REPO / "containers" / "image.sh"), "cpu"], env=dict(os.environ, IMAGE=IMAGE),
                          capture_output=True, text=True, timeout=1200)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    try:
        yield IMAGE
    finally:
        podman("rmi", "--force", IMAGE)


def test_too_little_disk_for_the_image_is_a_skip_that_says_how_much(monkeypatch, tmp_path):
    """Where podman's storage cannot hold the build, its tests skip with one sentence, not an error halfway through."""
    import test_containers as here

    monkeypatch.setattr(here, "podman", lambda *a, **k: subprocess.CompletedProcess(a, 0, f"{tmp_path}\n", ""))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(shutil, "disk_usage", lambda p: SimpleNamespace(free=2.0e9))
    assert here._too_little_disk() == (
        f"building the image takes about 6.5 GB of disk at its peak, and only 2.0 GB is free on {tmp_path}"
    )
    monkeypatch.setattr(shutil, "disk_usage", lambda p: SimpleNamespace(free=10e9))
    assert here._too_little_disk() is None


@needs_podman
@pytest.mark.parametrize("bench", ["bert", "llama2_70b_lora"])
def test_the_tiny_preset_trains_to_its_target_inside_the_image(image, tmp_path, bench):
    """Data and results on bind mounts, the logs checked from outside by this checkout's checker."""
    data, results = tmp_path / "data", tmp_path / "results"
    results.mkdir()
    listed = podman("run", "--rm", image, "trainbench", "list")
    assert listed.returncode == 0 and bench in listed.stdout, listed.stderr
    mounts = ["-v", f"{data}:{data}", "-v", f"{results}:{results}"]
    # This worker's share of the cores, as the ranks it starts outside a container inherit it (tests/conftest.py): a
    # container's torch would otherwise take a thread per core beside the other workers' and run several times slower.
    mounts += [f"--env=OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"] if "OMP_NUM_THREADS" in os.environ else []
    data.mkdir()
    prep = podman("run", "--rm", *mounts, image, "trainbench", "prepare", bench, "--synthetic", "--preset", "tiny",
                  "--out", data)  # fmt: skip
    assert prep.returncode == 0, prep.stdout[-1500:] + prep.stderr[-1500:]
    run = podman("run", "--rm", *mounts, image, "trainbench", "run", bench, "--preset", "tiny", f"data.dir={data}",
                 f"output.results_dir={results}", "progress=false")  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    run_dir = only_run_dir(results)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["runs"][0]["status"] == "success" and summary["runs"][0]["compliance"]["passed"]
    assert run_cli("check", run_dir) == 0


@needs_podman
def test_the_enroot_squashfs_and_the_oci_archive_hold_a_working_trainbench(image, tmp_path):
    """Each file is checked and deleted before the next is made: the squashfs unpacked is the image's size again (about
    2 GB), and the test's folder would otherwise hold all three to the end of the session."""
    env = dict(os.environ, IMAGE=image)

    def made(kind: str, out: Path) -> Path:
        proc = subprocess.run([str(REPO / "containers" / "image.sh"), kind, str(out)], env=env, capture_output=True,
                              text=True, timeout=900)  # fmt: skip
        assert proc.returncode == 0 and out.is_file(), proc.stderr[-2000:]
        return out

    # The squashfs as enroot would unpack it: the image's environment in /etc/environment, trainbench runs from it.
    sqsh, root = made("sqsh", tmp_path / "trainbench.sqsh"), tmp_path / "root"
    try:
        assert subprocess.run(["unsquashfs", "-q", "-n", "-d", root, sqsh], capture_output=True).returncode == 0
        environment = (root / "etc" / "environment").read_text()
        assert "PATH=/opt/trainbench/venv/bin:" in environment
        listed = podman("run", "--rm", "--rootfs", root, "/bin/sh", "-c", "set -a; . /etc/environment; trainbench list")
        assert listed.returncode == 0 and "llama31_8b" in listed.stdout, listed.stderr[-2000:]
    finally:
        sqsh.unlink(missing_ok=True)
        shutil.rmtree(root, ignore_errors=True)
    # The OCI archive as `apptainer build x.sif oci-archive://...` reads it: a layout, an index, its manifest's blobs.
    oci = made("oci", tmp_path / "trainbench.oci.tar")
    try:
        with tarfile.open(oci) as tar:
            names = set(tar.getnames())
            assert json.load(tar.extractfile("oci-layout"))["imageLayoutVersion"] == "1.0.0"
            index = json.load(tar.extractfile("index.json"))
            digest = index["manifests"][0]["digest"].replace(":", "/")
            manifest = json.load(tar.extractfile(f"blobs/{digest}"))
            for blob in [manifest["config"], *manifest["layers"]]:
                assert f"blobs/{blob['digest'].replace(':', '/')}" in names
    finally:
        oci.unlink(missing_ok=True)


# -- podman under Slurm, with the preflight ------------------------------------------------------------------------


def _podman_system(tmp_path: Path, mounts: str = "") -> Path:
    """local_cpu_2x1 (two nodes, one CPU rank each), each rank in its own podman container."""
    return _system(tmp_path, f"  runtime: podman\n  image: {IMAGE}\n" + (f"  mounts: [{mounts}]\n" if mounts else ""),
                   name="podman_2x1")  # fmt: skip


@needs_podman
@needs_two_nodes
def test_tiny_bert_on_two_slurm_nodes_in_podman_containers_reaches_its_target_after_a_preflight(
    image, tiny_data, tmp_path, capsys
):
    code = run_cli("submit", "bert", "--preset", "tiny", "--system", _podman_system(tmp_path), f"data.dir={tiny_data}",
                   f"output.results_dir={tmp_path / 'results'}")  # fmt: skip
    assert code == 0 and "submitted job" in capsys.readouterr().out
    run_dir = next((tmp_path / "results").iterdir())
    state = _wait_state(run_dir, {"COMPLETED", "FAILED", "PREFLIGHT_FAILED"}, timeout=600)
    out = (run_dir / f"slurm-{state['job_id']}.out").read_text()
    assert state["state"] == "COMPLETED", out[-3000:]
    run = json.loads((run_dir / "summary.json").read_text())["runs"][0]
    assert run["status"] == "success" and run["compliance"]["passed"], run
    assert run_cli("check", run_dir) == 0
    # The preflight met both nodes and measured the all-reduce; the report shows it.
    pre = json.loads((run_dir / "preflight_0.json").read_text())
    assert pre["nodes"] == ["tbn1", "tbn2"] and pre["ranks"] == 2 and pre["allreduce"]["bus_gb_per_s"] > 0
    assert sorted(p.name for p in (run_dir / "preflight").iterdir()) == ["tbn1.0.ok", "tbn2.0.ok"]
    assert run_cli("report", run_dir) == 0
    assert "Preflight of run 0: 2 node(s) (tbn1, tbn2), 2 ranks on cpu" in (run_dir / "report.md").read_text()
    # Each rank ran in its own container of the image (the image's python, the node's hostname).
    outcome = json.loads((run_dir / "run_0.json").read_text())
    assert outcome["system"]["executable"] == "/opt/trainbench/venv/bin/python", outcome["system"]


@needs_podman
@needs_two_nodes
def test_a_preflight_that_fails_names_the_node_and_why_and_no_run_starts(image, tiny_data, tmp_path, capsys):
    """The system mounts an empty folder over the data's: inside the containers the data is not there."""
    empty = tmp_path / "empty"
    empty.mkdir()
    system = _podman_system(tmp_path, mounts=f"'{empty}:{tiny_data}'")
    code = run_cli("submit", "bert", "--preset", "tiny", "--system", system, f"data.dir={tiny_data}",
                   f"output.results_dir={tmp_path / 'results'}")  # fmt: skip
    assert code == 0
    run_dir = next((tmp_path / "results").iterdir())
    state = _wait_state(run_dir, {"COMPLETED", "FAILED", "PREFLIGHT_FAILED"}, timeout=300)
    out = (run_dir / f"slurm-{state['job_id']}.out").read_text()
    assert state["state"] == "PREFLIGHT_FAILED", out[-3000:]
    for node in ("tbn1", "tbn2"):
        assert (
            f"preflight failed on node {node}: the data is not usable here: training data folder {tiny_data}/train "
            "does not exist"
        ) in out, out
    assert not (run_dir / "run_0.json").exists() and not (run_dir / "result_0.txt").exists()
