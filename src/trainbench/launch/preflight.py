"""The job step before a run: ``python -m trainbench.launch.preflight RUN_DIR INDEX``, one process per rank.

Each rank, inside the container where the system has one, checks what the run will need on its node: the results
folder is visible and writable, the data and the base weights are visible, and the node has the GPUs the system
file promises. It leaves ``preflight/<node>.<local rank>.ok`` or ``.failed`` (one sentence) in the results folder,
which the job script reads to name the node that failed. Then every rank joins one all-reduce over the job's ranks
(NCCL on GPUs, gloo on CPUs); rank 0 writes its bus bandwidth to ``preflight_<INDEX>.json``, which ``trainbench
report`` shows. A failing rank exits non-zero before the collective, and srun's --kill-on-bad-exit stops the rest.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import torch

from trainbench.errors import UserError

ALLREDUCE_BYTES = {"cuda": 256 << 20, "cpu": 16 << 20}
REPS = 5


def checks(run_dir: Path, gpus_per_node: int) -> str | None:
    """The first problem found on this node, as a sentence; None where everything the run needs is here."""
    if not run_dir.is_dir():
        return f"the results folder {run_dir} is not visible here"
    probe = run_dir / "preflight" / f".probe.{socket.gethostname()}.{os.getpid()}"
    try:
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        return f"the results folder {run_dir} is not writable here ({exc.strerror or exc})"
    from trainbench.resolve import load_run_config
    from trainbench.runfiles import CONFIG

    try:
        bench, cfg = load_run_config(run_dir / CONFIG)
    except UserError as exc:
        return f"the run's config could not be read: {exc}"
    for what, path in (("data folder", cfg.data.dir), ("base weights", getattr(cfg.model, "base_weights", None)),
                       ("initial checkpoint", getattr(cfg.model, "init_checkpoint", None))):  # fmt: skip
        if path and not Path(path).exists():
            return f"the {what} {path} is not visible here"
    try:
        bench.check_data(cfg)  # what submit checked where it ran: the data's files, shapes and manifest
    except UserError as exc:
        return f"the data is not usable here: {exc}"
    if gpus_per_node:
        if not torch.cuda.is_available():
            return f"no GPU is visible here (the system file says {gpus_per_node} per node)"
        if torch.cuda.device_count() < gpus_per_node:
            return (f"{torch.cuda.device_count()} GPU(s) are visible here, but the system file says "
                    f"{gpus_per_node} per node")  # fmt: skip
    return None


def allreduce_bandwidth(device: str) -> dict:
    """Time ``REPS`` all-reduces of ALLREDUCE_BYTES over the job's ranks (after two to warm up)."""
    import torch.distributed as dist

    n = dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    nbytes = ALLREDUCE_BYTES[device]
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
    for _ in range(2):
        dist.all_reduce(x)
    if device == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    t = time.perf_counter()
    for _ in range(REPS):
        dist.all_reduce(x)
    if device == "cuda":
        torch.cuda.synchronize()
    sec = (time.perf_counter() - t) / REPS
    algo = nbytes / sec / 1e9
    return {"bytes": nbytes, "seconds": sec, "algo_gb_per_s": algo, "bus_gb_per_s": algo * 2 * (n - 1) / n}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    run_dir, index = Path(argv[0]), int(argv[1])
    node = socket.gethostname()
    local = os.environ.get("SLURM_LOCALID", os.environ.get("LOCAL_RANK", "0"))
    from trainbench.launch.slurm import SYSTEM
    from trainbench.launch.systems import load_system

    try:
        system = load_system(str(run_dir / SYSTEM))
        problem = checks(run_dir, system.gpus_per_node)
    except UserError as exc:
        system, problem = None, str(exc)
    mark = run_dir / "preflight" / f"{node}.{local}"
    if problem is not None:
        print(f"preflight: node {node}, local rank {local}: {problem}", flush=True)
        try:
            mark.with_suffix(mark.suffix + ".failed").write_text(problem + "\n")
        except OSError:
            pass  # the folder is not visible: the job script says that the node never reported
        return 1
    mark.with_suffix(mark.suffix + ".ok").write_text("ok\n")
    from trainbench.distributed import init_distributed, shutdown

    device = system.device if system.device == "cpu" or torch.cuda.is_available() else "cpu"
    info = init_distributed(device, "auto", 300)
    try:
        import torch.distributed as dist

        nodes: list = [None] * info.world_size
        dist.all_gather_object(nodes, node)
        measured = allreduce_bandwidth(device)
        if info.is_main:
            out = {"index": index, "nodes": sorted(set(nodes)), "ranks": info.world_size, "device": device,
                   "allreduce": measured, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
            (run_dir / f"preflight_{index}.json").write_text(json.dumps(out, indent=2) + "\n")
            print(
                f"preflight: {len(out['nodes'])} node(s), {info.world_size} ranks ready; all-reduce of "
                f"{measured['bytes'] >> 20} MiB: bus bandwidth {measured['bus_gb_per_s']:.2f} GB/s",
                flush=True,
            )
    finally:
        shutdown(drain=True)
    return 0


if __name__ == "__main__":
    from trainbench.distributed import leave

    leave(main())  # never through Python's finalization: see leave()
