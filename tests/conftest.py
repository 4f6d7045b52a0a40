"""Shared fixtures: small synthetic data sets, one trained tiny run, what the machine offers (a local Slurm cluster,
podman's limits), the test tiers and their grouping for parallel runs, and a way to run the CLI in-process.

Tiers (docs/testing.md): a test marked ``full`` runs only in ``make test-all``; every other test is in the fast tier
(``make test``) too. Under pytest-xdist (``-n auto --dist loadgroup``) the tests of one module stay on one worker, so
a module's fixtures are built once, and the tests that use the real cluster or the container image form one group
of their own; the expensive session fixtures are built once for all workers (:func:`built_once`)."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import resource
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from trainbench.cli import main as cli_main
from trainbench.data.synthetic_bert import SyntheticSpec, prepare_synthetic

REPO = Path(__file__).resolve().parents[1]
LOCAL_SLURM = REPO.parent / "shared" / "scripts" / "local-slurm"
CLUSTER_GROUP = "cluster"  # the xdist group of every test that uses the real Slurm cluster or the container image

# About how many seconds the longest xdist groups (a module's tests, the cluster's, a golden run) take in
# `make test-all` on CI's 2 cores, from two runs' --durations (2026-11-29): the order in which the workers are handed
# the groups, longest first. A group not named here took under 50 s and goes after them. Only the order matters:
# measure again (pytest --durations=0) when a group grows past its neighbours.
GROUP_SECONDS = {
    CLUSTER_GROUP: 1000,  # the image built (180 s) and used, and every job on the two-node cluster
    "test_rulesets": 420,  # ten tiny LoRA runs to the target for the package checker
    "test_perf": 280,
    "test_docs_commands": 230,  # the shared `converged` run, where no other group built it first
    "test_resume": 200,
    "test_bench": 190,
    "test_hostile_inputs": 180,
    "test_resume_safety": 155,
    "test_lora_train": 150,
    "test_teardown": 130,
    "golden_bert_accumulation4": 130,
    "test_llm": 100,
    "test_train": 90,
    "test_gpt_oss": 85,
    "golden_bert_1rank": 85,
    "test_launch_safety": 80,
    "test_moe": 60,
    "golden_bert_2ranks": 60,
    "golden_llama31_8b": 50,
}

# The tests run as root in CI, where every run would drop the page cache of a machine other work shares: the runs of
# the suite leave it as it is (their logs say cache_clear false, and why). tests/test_node.py drops it on purpose.
os.environ.setdefault("TRAINBENCH_CACHE_CLEAR", "0")


# -- tiers and parallel workers -----------------------------------------------------------------------------------


def pytest_configure(config):
    """Under pytest-xdist, each worker's share of the cores: torch's default, a thread per core in every worker and
    in every rank it starts, oversubscribed the machine (a tiny LoRA run took 109 s instead of 19). The runs honour
    OMP_NUM_THREADS, and their ranks inherit it."""
    # pytest-xdist's --loadscope-reorder (its default) hands out the groups by their number of tests, most first:
    # the cluster's group, few long tests, then started last (22 minutes into a run of the whole suite on 2 cores) and
    # set the wall time. The groups go out in the order pytest_collection_modifyitems leaves them: the longest first.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        import torch

        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    # The longest groups first, so that none starts last and alone: a worker takes the next group as its own nears
    # its end, and the short ones fill the ends of both workers' shares (the other groups keep the modules' order).
    items.sort(key=lambda item: -GROUP_SECONDS.get(item.get_closest_marker("xdist_group").args[0], 0))


@pytest.hookimpl(optionalhook=True)  # an xdist hook: pytest -p no:xdist runs without it
def pytest_xdist_node_collection_finished(node, ids):
    """Under --dist loadgroup every test's id ends in its group (each has one: its module's, or the cluster's);
    where one does not, the groups were lost (a pytest that pytest-xdist does not support) and the cluster's tests
    would run on several workers at once: stop before any test runs."""
    if node.config.getvalue("dist") != "loadgroup":
        return
    lost = [i for i in ids if "@" not in i.rsplit("::", 1)[-1]]
    if lost:
        pytest.exit(
            f"--dist loadgroup did not group {len(lost)} test(s) (e.g. {lost[0]}): this pytest and "
            "pytest-xdist do not work together; install the versions pyproject.toml pins",
            returncode=4,
        )


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """``build(folder)`` once for the whole test session, parallel workers included: the first worker to ask builds
    while the others wait for it, then all read the same folder. Built on failure again by the next that asks."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # shared by the workers of one session
    out, done = root / name, root / f"{name}.built"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            build(out)
            done.touch()
    return out


def tiny_spec(**changes) -> SyntheticSpec:
    base = dict(
        seq_length=128,
        max_predictions=20,
        vocab_size=1024,
        num_train_samples=2048,
        num_eval_samples=256,
        num_shards=3,
        seed=7,
    )
    return SyntheticSpec(**(base | changes))


@pytest.fixture(scope="session")
def small_data(tmp_path_factory) -> Path:
    """A few thousand samples in the tiny preset's shapes: enough for short runs."""
    return built_once(tmp_path_factory, "bert-small", lambda out: prepare_synthetic(out, tiny_spec()))


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """The data set `make demo` uses (`prepare bert --synthetic --preset tiny`)."""

    def build(out: Path) -> None:
        assert cli_main(["prepare", "bert", "--synthetic", "--preset", "tiny", "--out", str(out)]) == 0

    return built_once(tmp_path_factory, "bert-tiny", build)


def _prepared(tmp_path_factory, benchmark: str) -> Path:
    def build(out: Path) -> None:
        assert cli_main(["prepare", benchmark, "--synthetic", "--preset", "tiny", "--out", str(out)]) == 0

    return built_once(tmp_path_factory, f"{benchmark}-tiny", build)


@pytest.fixture(scope="session")
def lora_data(tmp_path_factory) -> Path:
    """``prepare llama2_70b_lora --synthetic --preset tiny``: rows and a tiny base model. Read only: a test that
    changes it works on a copy."""
    return _prepared(tmp_path_factory, "llama2_70b_lora")


@pytest.fixture(scope="session")
def llm_data(tmp_path_factory) -> Path:
    """``prepare llama31_8b --synthetic --preset tiny`` (gpt3's tiny preset reads the same data). Read only."""
    return _prepared(tmp_path_factory, "llama31_8b")


@pytest.fixture(scope="session")
def ctr_site(tmp_path_factory) -> Path:
    """examples/ctr_benchmark installed by pip, as a package of its own, into a folder of its own (``pip install
    --target``; put it on PYTHONPATH to use it). Built from a copy, so the checkout gets no build files."""

    def build(out: Path) -> None:
        source = out.parent / f"{out.name}-source"
        shutil.rmtree(source, ignore_errors=True)
        shutil.copytree(REPO / "examples" / "ctr_benchmark", source)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--no-index", "--target", str(out), str(source)], check=True, capture_output=True)  # fmt: skip

    return built_once(tmp_path_factory, "ctr-site", build)


@contextlib.contextmanager
def lock_held_elsewhere(folder: Path, what: str):
    """Another process holding ``folder``'s lock (runfiles.FolderLock) while the block runs; yields its pid."""
    import subprocess
    import sys

    code = ("import time; from trainbench.runfiles import FolderLock; "
            f"FolderLock({str(folder)!r}, {what!r}).acquire(); print('held', flush=True); time.sleep(60)")  # fmt: skip
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder.pid
    finally:
        holder.kill()
        holder.wait()


def run_cli(*args: str) -> int:
    return cli_main([str(a) for a in args])


def only_run_dir(results: Path) -> Path:
    dirs = [d for d in results.iterdir() if d.is_dir()]
    assert len(dirs) == 1, f"expected one run folder in {results}, found {dirs}"
    return dirs[0]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def free_port() -> int:
    """A TCP port of this machine free at the time of asking, for processes to meet at."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawned(worker, world: int, *args) -> None:
    """``worker(rank, world, port, *args)`` in ``world`` processes that meet at a free port of this machine."""
    import torch

    torch.multiprocessing.spawn(worker, args=(world, free_port(), *args), nprocs=world, join=True)


def spawn_ranks(worker, world: int, out: Path, *args):
    """``worker(rank, world, port, *args, out)`` in ``world`` processes that meet at a free port of this machine; what
    rank 0 wrote to ``out``, as JSON."""
    spawned(worker, world, *args, str(out))
    return json.loads(out.read_text())


def float8_layers(device: str = "cpu", width: int = 64):
    """Two of torchao's float8 training layers (``width`` to twice that, and back, seed 0) under a holder named as a
    decoder's blocks are (``root.model.layers``), whose forward runs one after the other."""
    import torch

    from trainbench.families import fp8

    torch.manual_seed(0)
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    root.model.layers = torch.nn.ModuleList([torch.nn.Linear(width, 2 * width, device=device),
                                             torch.nn.Linear(2 * width, width, bias=False, device=device)])  # fmt: skip
    assert fp8.train_blocks_in_fp8(root) == 2
    root.forward = lambda x: root.model.layers[1](torch.relu(root.model.layers[0](x)))
    return root


def torchao_weight_cast(layer):
    """torchao's own cast of ``layer.weight.t()``, as its float8 layer makes it in every call."""
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    c = layer.config.cast_config_weight
    return hp_tensor_to_float8_dynamic(layer.weight.detach().t(), c.target_dtype, layer.linear_mm_config,
                                       gemm_input_role=GemmInputRole.WEIGHT,
                                       round_scales_to_power_of_2=layer.config.round_scales_to_power_of_2)  # fmt: skip


def train_float8_layers(once: bool, stale_step: int | None = None, device: str = "cpu", width: int = 64,
                        compiled: bool = False) -> list:  # fmt: skip
    """:func:`float8_layers` trained 3 steps of 2 micro-batches with the fused AdamW (which leaves the weights'
    version counters alone); each micro-batch's output and each step's fp32 gradients. ``once``: the weights cast once
    a step (``fp8.cast_weights_once_a_step``); ``stale_step``: that step's casts left stale (no after_step);
    ``compiled``: the layers and the gradients' adds compiled. On CUDA the rows go through bf16 autocast, on the CPU
    they are bf16."""
    import torch

    from trainbench.families import fp8

    root = float8_layers(device, width)
    after_step = fp8.cast_weights_once_a_step(root, compiled=compiled) if once else None
    if compiled:
        for layer in root.model.layers:  # (compiled after the forward is swapped, as the blocks are)
            layer.compile(dynamic=False)
    opt = torch.optim.AdamW(root.parameters(), lr=1e-2, fused=True)
    cuda = device == "cuda"
    xs = [torch.randn(4, 128, width, generator=torch.Generator(device).manual_seed(i), device=device)
          for i in range(2)]  # fmt: skip
    xs = xs if cuda else [x.bfloat16() for x in xs]
    seen = []
    for step in range(3):
        for x in xs:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                out = root(x)
            out.float().square().mean().backward()
            seen.append(out.detach().float())
        seen += [p.grad.detach().clone() for p in root.parameters()]
        assert all(p.grad.dtype == torch.float32 for p in root.parameters())
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after_step is not None and step != stale_step:
            after_step()
    if once:
        assert all(getattr(layer, "_trainbench_weight_t", None) is not None for layer in root.model.layers)
    return seen


@pytest.fixture
def empty_compile_caches():
    """Each test compiles from empty dynamo caches, as a `trainbench` process (one model) does. The tests of many
    models in one process can otherwise fill the recompile limit of the code they share (a block's forward), past
    which dynamo runs that code eagerly: a path no run takes."""
    import torch

    torch._dynamo.reset()


def _why_a_run_failed(results: Path, code: int) -> str:
    """What a failed run left in ``results`` to say why: each run folder's outcome (run_0.json) and last metrics."""
    lines = [f"the run exited with {code}"]
    for run_dir in sorted(d for d in results.glob("*") if d.is_dir()):
        outcome, metrics = run_dir / "run_0.json", run_dir / "metrics.jsonl"
        lines.append(f"{run_dir.name}: " + (outcome.read_text().strip() if outcome.exists() else "no run_0.json"))
        lines += metrics.read_text().splitlines()[-4:] if metrics.exists() else ["no metrics.jsonl"]
    return "\n".join(lines)


def tiny_run_to_target_on_cuda(tmp_path, benchmark: str, *keys: str) -> Path:
    """``benchmark``'s tiny data prepared, then a run on CUDA with ``keys`` (a preset, overrides): it succeeds and its
    log passes the checker. Returns its run folder."""
    data = tmp_path / "data"
    assert run_cli("prepare", benchmark, "--synthetic", "--preset", "tiny", "--out", data) == 0
    code = run_cli("run", benchmark, *keys, f"data.dir={data}", f"output.results_dir={tmp_path / 'r'}", "device=cuda",
                   "progress=false")  # fmt: skip
    if code != 0:
        pytest.fail(_why_a_run_failed(tmp_path / "r", code))
    run_dir = only_run_dir(tmp_path / "r")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["runs"][0]["status"] == "success" and summary["runs"][0]["compliance"]["passed"]
    return run_dir


def losses_and_evals(common: list[str], runs: dict[str, list[str]], results: Path, metric: str) -> tuple[dict, dict]:
    """Each run of ``common`` plus its own arguments into ``results / name`` (a short run may stop before the target:
    its exit code is not asked): its losses and its evals' ``metric``, by name."""
    losses, evals = {}, {}
    for name, extra in runs.items():
        run_cli(*common, *extra, f"output.results_dir={results / name}")
        rows = read_metrics(only_run_dir(results / name))
        losses[name] = [r["loss"] for r in rows if "loss" in r]
        evals[name] = [r[metric] for r in rows if metric in r]
    return losses, evals


@pytest.fixture(scope="session")
def converged(tiny_data, tmp_path_factory) -> Path:
    """One tiny run to its target (``run bert --preset tiny``), with telemetry at 4 Hz: a finished, compliant results
    folder; what it printed is ``stdout.txt`` beside the folder."""

    def build(out: Path) -> None:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            code = run_cli("run", "bert", f"data.dir={tiny_data}", f"output.results_dir={out}", "progress=false",
                           "telemetry_hz=4")  # fmt: skip
        (out / "stdout.txt").write_text(printed.getvalue())  # what the run printed (beside its folder)
        assert code == 0, printed.getvalue()

    return only_run_dir(built_once(tmp_path_factory, "converged", build))


# -- what the machine offers: a local Slurm cluster, podman --------------------------------------------------------


def _sinfo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sinfo", "-h", *args], capture_output=True, text=True, timeout=30)


def _cluster_answers() -> bool:
    if shutil.which("sinfo") is None:
        return False
    proc = _sinfo("-o", "%a")
    return proc.returncode == 0 and "up" in proc.stdout


def _cannot_start_cluster() -> str | None:
    missing = [t for t in ("slurmctld", "slurmd", "munged", "sbatch") if shutil.which(t) is None]
    if missing:
        return f"no Slurm cluster answers sinfo, and {', '.join(missing)} not installed (.ci/run installs Slurm)"
    if not (LOCAL_SLURM / "start-local-slurm.sh").is_file():
        return f"no Slurm cluster answers sinfo, and {LOCAL_SLURM} (which starts one) is absent"
    if os.geteuid() != 0:
        return "no Slurm cluster answers sinfo, and starting the local one needs root"
    return None


@pytest.fixture(scope="session")
def slurm_cluster():
    """A Slurm cluster that answers sinfo: the machine's own, or the local two-node one (../shared/scripts/local-slurm,
    Debian's slurmctld, slurmd and munge, each node in its own network namespace) started here and stopped at the
    end of the session. Skips with the reason where neither can be had."""
    started = False
    if not _cluster_answers():
        why = _cannot_start_cluster()
        if why:
            pytest.skip(why)
        start = LOCAL_SLURM / "start-local-slurm.sh"
        # Every core for the nodes: the script counts them with nproc, which would count this worker's OMP_NUM_THREADS.
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        env |= {"SLURM_NODES": "2", "SLURM_CPUS": str(len(os.sched_getaffinity(0)))}
        proc = subprocess.run(["bash", str(start)], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{start} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        started = True
    try:
        yield
    finally:
        if started:
            subprocess.run(["bash", str(LOCAL_SLURM / "stop-local-slurm.sh")], capture_output=True, timeout=300)


@pytest.fixture(scope="session")
def two_slurm_nodes(slurm_cluster):
    nodes = set(_sinfo("-N", "-o", "%N").stdout.split())
    if len(nodes) < 2:
        pytest.skip(f"the cluster has {len(nodes)} node(s); these tests need two (SLURM_NODES=2 start-local-slurm.sh)")


def needs_two_nodes(test):
    """A test that submits real jobs to a cluster of at least two nodes: ``make test-all`` only, in the cluster's
    group of parallel workers."""
    for mark in (pytest.mark.full, pytest.mark.xdist_group(CLUSTER_GROUP), pytest.mark.usefixtures("two_slurm_nodes")):
        test = mark(test)
    return test


def _limit(which: int, at_most: int | None = None) -> str:
    """This process's soft:hard limit as podman's ulimit option writes it (-1: unlimited), ``at_most`` where given."""
    values = [v if at_most is None or (v != resource.RLIM_INFINITY and v <= at_most) else at_most
              for v in resource.getrlimit(which)]  # fmt: skip
    return ":".join(str(-1 if v == resource.RLIM_INFINITY else v) for v in values)


@pytest.fixture(scope="session")
def podman_limits(tmp_path_factory):
    """podman's configuration for this machine, where the caller set none (CONTAINERS_CONF): its default ulimits
    (nofile 1048576) are more than a container of this machine may take ("error setting rlimit type 7"), so each
    container gets this process's own limits, its process limit no more than the kernel's pid_max; runc where it is
    installed (crun fails on cgroups v1 without systemd), and cgroupfs where systemd does not run the machine. The
    variable reaches podman, image.sh and the Slurm jobs started from this session."""
    if os.environ.get("CONTAINERS_CONF"):
        yield os.environ["CONTAINERS_CONF"]
        return
    # A process limit above the kernel's pid_max was refused too (seen: 32,769 refused, 32,768 taken, pid_max 32,768).
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text()) if Path("/proc/sys/kernel/pid_max").exists() else None
    ulimits = f'"nofile={_limit(resource.RLIMIT_NOFILE)}", "nproc={_limit(resource.RLIMIT_NPROC, pid_max)}"'
    lines = ["[containers]", f"default_ulimits = [{ulimits}]", "[engine]"]
    if shutil.which("runc"):
        lines.append('runtime = "runc"')
    if not Path("/run/systemd/system").is_dir():
        lines.append('cgroup_manager = "cgroupfs"')
    conf = tmp_path_factory.mktemp("podman") / "containers.conf"
    conf.write_text("\n".join(lines) + "\n")
    os.environ["CONTAINERS_CONF"] = str(conf)
    try:
        yield str(conf)
    finally:
        os.environ.pop("CONTAINERS_CONF", None)


def rewrite_hdf5(path: Path, change) -> None:
    """An HDF5 shard written again, its datasets changed in place by ``change`` (a new file: newer than the data's
    manifest)."""
    import h5py

    with h5py.File(path, "r") as f:
        arrays = {k: f[k][()] for k in f}
    change(arrays)
    path.unlink()
    with h5py.File(path, "w") as f:
        for key, value in arrays.items():
            f.create_dataset(key, data=value)


def single_gpu_tier() -> list:
    """The marks of every test module of the single-GPU tier (tests/test_gpu_*.py but test_gpu_multi.py): the ``gpu``
    marker, torch's compile caches emptied first, and a skip with the reason where no CUDA device is visible."""
    import pytest
    import torch

    return [
        pytest.mark.gpu,
        pytest.mark.usefixtures("empty_compile_caches"),
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is visible"),
    ]
