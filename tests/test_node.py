"""What a run does to its nodes and records of them: the page cache dropped where it may (and the log's cache_clear
saying whether it was), each node's record (CPUs, memory, GPUs, topology, NICs), and which trainbench made the run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, only_run_dir, run_cli

from trainbench import node, version
from trainbench.mlperf import read_log

# Two evals of 64 samples: the run is the header and a few steps.
SHORT = ["--preset", "tiny", "progress=false", "telemetry_hz=0", "eval_samples=64", "eval.every_samples=64",
         "schedule.max_samples=64"]  # fmt: skip


def _meminfo(key: str) -> int:
    line = next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith(f"{key}:"))
    return int(line.split()[1]) * 1024


# -- the page cache -------------------------------------------------------------------------------------------------


def test_drop_page_cache_says_what_happened(tmp_path, monkeypatch):
    target = tmp_path / "drop_caches"
    site = node.drop_page_cache(target, {node.SITE_CACHE_CLEAR_ENV: "0"})
    assert site.dropped and site.line == "page cache dropped (by the system file's cache_clear_command, on every node)"
    failed = node.drop_page_cache(target, {node.SITE_CACHE_CLEAR_ENV: "2"})
    assert not failed.dropped and failed.line == "page cache not dropped: the system file's cache_clear_command " \
        "exited with 2"  # fmt: skip
    off = node.drop_page_cache(target, {"TRAINBENCH_CACHE_CLEAR": "0"})
    assert not off.dropped and "TRAINBENCH_CACHE_CLEAR=0" in off.line
    monkeypatch.setattr(node.os, "geteuid", lambda: 1000)
    user = node.drop_page_cache(target, {})
    assert user.line == "page cache not dropped: not root and no cache_clear_command in the system file"
    assert not target.exists()  # nothing was written for any of them
    monkeypatch.setattr(node.os, "geteuid", lambda: 0)
    assert node.drop_page_cache(target, {}).dropped and target.read_text() == "3\n"
    refused = node.drop_page_cache(tmp_path, {})  # a folder takes no write: as a read-only /proc/sys would not
    assert not refused.dropped and refused.line.startswith(f"page cache not dropped: root, but {tmp_path} refused")


def test_root_drops_the_real_page_cache(tmp_path):
    """As root, on the kernel's own file: the pages of a file just read leave the cache."""
    if os.geteuid() != 0:
        pytest.skip("dropping the page cache needs root (the CI machine runs the tests as root)")
    data = tmp_path / "block"
    data.write_bytes(os.urandom(64 * 2**20))
    data.read_bytes()  # now in the page cache
    before = _meminfo("Cached")
    result = node.drop_page_cache(env={})
    if not result.dropped:
        pytest.skip(f"this machine's kernel refuses it: {result.how}")
    assert _meminfo("Cached") < before - 48 * 2**20, result


@pytest.mark.parametrize("who", ["root", "user"])
def test_a_run_logs_cache_clear_as_what_happened_and_says_so(who, small_data, tmp_path, monkeypatch, capsys):
    """A run as root writes 3 to the kernel's file (here a stand-in file, to see the write) and logs cache_clear true;
    one without the right writes nothing, logs false and says why. The log, the outcome, the summary and the config
    name the trainbench that made them."""
    target = tmp_path / "drop_caches"
    target.write_text("")
    monkeypatch.setattr(node, "DROP_CACHES", target)
    monkeypatch.delenv("TRAINBENCH_CACHE_CLEAR", raising=False)  # the suite leaves the cache as it is (conftest)
    if who == "user":
        monkeypatch.setattr(node.os, "geteuid", lambda: 1000)
    elif os.geteuid() != 0:
        pytest.skip("a run as root needs root (the CI machine runs the tests as root)")
    run_cli("run", "bert", f"data.dir={small_data}", f"output.results_dir={tmp_path / 'r'}", *SHORT)
    printed = capsys.readouterr().out
    run_dir = only_run_dir(tmp_path / "r")
    log = {e["key"]: e["value"] for e in read_log(run_dir / "result_0.txt")}
    if who == "root":
        assert target.read_text() == "3\n" and log["cache_clear"] is True
        assert f"run 0: page cache dropped (3 written to {target})" in printed, printed
    else:
        assert target.read_text() == "" and log["cache_clear"] is False
        assert "run 0: page cache not dropped: not root and no cache_clear_command in the system file" in printed
    made_by = version.provenance()
    assert log["trainbench_version"] == made_by["version"] and log.get("trainbench_commit") == made_by.get("commit")
    assert json.loads((run_dir / "run_0.json").read_text())["trainbench"] == made_by
    assert json.loads((run_dir / "summary.json").read_text())["trainbench"] == made_by
    assert (run_dir / "config.yaml").read_text().startswith(f"# resolved config, written by {version.describe()}\n")
    record = json.loads(next(run_dir.glob("node_*.json")).read_text())
    assert record["cpu"]["logical_cpus"] == len(list(Path("/sys/devices/system/cpu").glob("cpu[0-9]*"))) or \
        record["cpu"]["logical_cpus"] == os.cpu_count()  # fmt: skip
    assert record["memory_bytes"] == _meminfo("MemTotal") and record["software"]["trainbench"] == made_by


# -- what a node is -------------------------------------------------------------------------------------------------


def test_a_node_record_holds_the_topology_and_says_what_was_missing(tmp_path, monkeypatch):
    empty = tmp_path / "empty_bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert node.gpu_topology() == {"text": None, "missing": "nvidia-smi not found on PATH"}
    tool = tmp_path / "bin" / "nvidia-smi"
    tool.parent.mkdir()
    tool.write_text('#!/bin/sh\n[ "$1 $2" = "topo -m" ] && printf "\\tGPU0\\tGPU1\\nGPU0\\t X \\tNV18\\n"\n')
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", str(tool.parent))
    assert node.gpu_topology() == {"text": "\tGPU0\tGPU1\nGPU0\t X \tNV18\n", "missing": None}
    tool.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate' >&2; exit 9\n")
    assert node.gpu_topology()["missing"] == "nvidia-smi topo -m exited with 9: NVIDIA-SMI has failed because it " \
        "could not communicate"  # fmt: skip
    # /sys/class/net and /sys/class/infiniband as a node with a 100 Gb/s NIC, a bridge and two NDR ports shows them
    net = tmp_path / "net"
    for name, files in {"ens1": {"operstate": "up", "speed": "100000", "mtu": "9000"},
                        "br0": {"operstate": "up", "speed": "-1", "mtu": "1500"}}.items():  # fmt: skip
        (net / name).mkdir(parents=True)
        for key, value in files.items():
            (net / name / key).write_text(value + "\n")
    (tmp_path / "pci" / "driver" / "mlx5_core").mkdir(parents=True)
    (tmp_path / "pci" / "dev").mkdir()
    (tmp_path / "pci" / "dev" / "driver").symlink_to(tmp_path / "pci" / "driver" / "mlx5_core")
    (net / "ens1" / "device").symlink_to(tmp_path / "pci" / "dev")
    assert node.network_interfaces(net) == [
        {"name": "br0", "device": False, "state": "up", "speed_mbps": None, "mtu": 1500, "driver": None},
        {"name": "ens1", "device": True, "state": "up", "speed_mbps": 100000, "mtu": 9000, "driver": "mlx5_core"},
    ]
    ib = tmp_path / "infiniband"
    for dev in ("mlx5_0", "mlx5_1"):
        port = ib / dev / "ports" / "1"
        port.mkdir(parents=True)
        (port / "state").write_text("4: ACTIVE\n")
        (port / "rate").write_text("400 Gb/sec (4X NDR)\n")
        (port / "link_layer").write_text("InfiniBand\n")
        (ib / dev / "fw_ver").write_text("28.39.1002\n")
    ports = node.infiniband(ib)
    assert [(p["device"], p["state"], p["rate"], p["link_layer"], p["firmware"], p["board"]) for p in ports] == [
        (d, "4: ACTIVE", "400 Gb/sec (4X NDR)", "InfiniBand", "28.39.1002", None) for d in ("mlx5_0", "mlx5_1")
    ]
    # The whole record, with no nvidia-smi and no NVML: written, and saying so.
    monkeypatch.setenv("PATH", str(empty))
    path = node.write_node_record(tmp_path)
    record = json.loads(path.read_text())
    assert path.name == f"node_{record['host']}.json" and record["gpu_topology"]["missing"]
    assert record["gpus"] == [] or record["gpus_missing"] is None
    assert node.read_node_records(tmp_path) == [record]


# -- which trainbench -----------------------------------------------------------------------------------------------

SHA_A, SHA_B, SHA_C = "a" * 40, "b" * 40, "c" * 40


def test_the_commit_is_read_from_the_git_folder_without_git(tmp_path, monkeypatch):
    git = tmp_path / "git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "refs" / "heads" / "main").write_text(SHA_A + "\n")
    assert version.read_head(git) == SHA_A
    (git / "refs" / "heads" / "main").unlink()  # after git gc: the ref is in packed-refs
    (git / "packed-refs").write_text(f"# pack-refs with: peeled fully-peeled sorted\n{SHA_B} refs/heads/main\n")
    assert version.read_head(git) == SHA_B
    (git / "HEAD").write_text(SHA_C + "\n")  # a detached HEAD
    assert version.read_head(git) == SHA_C
    # A worktree: its .git is a file naming its folder, which keeps HEAD and shares the refs of the main one.
    tree = tmp_path / "tree"
    wt_git = git / "worktrees" / "tree"
    wt_git.mkdir(parents=True)
    (wt_git / "HEAD").write_text("ref: refs/heads/feature\n")
    (wt_git / "commondir").write_text("../..\n")
    (git / "refs" / "heads" / "feature").write_text(SHA_A + "\n")
    (tree / "src" / "trainbench").mkdir(parents=True)
    (tree / "pyproject.toml").write_text("")
    (tree / ".git").write_text(f"gitdir: {wt_git}\n")
    assert version.checkout_root(tree / "src" / "trainbench") == tree
    assert version.read_head(version.git_dir(tree)) == SHA_A
    # An installed trainbench (site-packages/trainbench) has no checkout: a version and no commit.
    installed = tmp_path / "site-packages" / "trainbench"
    installed.mkdir(parents=True)
    assert version.checkout_root(installed) is None
    monkeypatch.setattr(version, "checkout_root", lambda: None)
    version.commit.cache_clear()
    try:
        source = version.source_digest()
        assert version.provenance() == {"version": version.__version__, "source": source}
        assert version.describe() == f"trainbench {version.__version__} (source {source})"
    finally:
        version.commit.cache_clear()


def test_the_commit_of_this_checkout_is_the_one_git_names():
    if version.checkout_root() is None or shutil.which("git") is None:
        pytest.skip("trainbench does not run from a git checkout here, or git is not installed")
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert version.commit() == head


def test_the_source_digest_follows_the_package_s_files_and_nothing_else(tmp_path):
    """Two copies of the package have one digest; a byte changed in one file, or a file added, changes it; compiled
    caches do not. The commit cannot tell a tree changed since it from the commit itself: the digest can."""
    first, second = tmp_path / "a" / "trainbench", tmp_path / "b" / "trainbench"
    shutil.copytree(version.PACKAGE_DIR, first, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copytree(version.PACKAGE_DIR, second, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    digest = version.source_digest.__wrapped__
    assert digest(first) == digest(second) == digest(version.PACKAGE_DIR)  # (uncached: the files as they are now)
    assert len(digest(first)) == 16 and int(digest(first), 16) >= 0
    (second / "__pycache__").mkdir(exist_ok=True)
    (second / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"cache")
    assert digest(second) == digest(first)
    path = second / "version.py"
    path.write_text(path.read_text() + "\n")
    changed = digest(second)
    assert changed != digest(first)
    (second / "extra.py").write_text("")
    assert digest(second) not in (changed, digest(first))
    assert f"source {version.source_digest()}" in version.describe()


def test_a_package_names_runs_made_by_other_source_and_not_runs_recorded_before_the_digest(tmp_path):
    """The package's README and console compare the trainbench that made the runs with the one packaging them, key by
    key of what the runs recorded: a run recorded before the source digest (version and commit alone) matches where
    those match; another digest is named."""
    from trainbench.report.package import write_implementation

    here = version.provenance()
    older = {k: v for k, v in here.items() if k != "source"}
    assert write_implementation(tmp_path / "a", tmp_path, "box", [older]) == []
    other = write_implementation(tmp_path / "b", tmp_path, "box", [here | {"source": "0" * 16}])
    assert len(other) == 1 and "source 0000000000000000" in other[0] and "package again" in other[0], other
