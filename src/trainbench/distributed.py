"""Process groups, and what a benchmark's placement of its model hands the training loop.

One rank is the same code path as many: every helper is a no-op at world size 1."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from trainbench.errors import ConfigError, UserError


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    local_world_size: int = 1  # ranks on this node
    threads_note: str = ""  # on a CPU: how many threads each rank computes with, and why (the run's header says it)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def one_node(self) -> bool:
        return self.local_world_size >= self.world_size


def resolve_device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda was asked for but no CUDA device is visible; use device=cpu")
    return requested


def available_slots(device: str) -> int:
    """How many ranks this node can hold: GPUs on CUDA, usable cores on CPU."""
    if device == "cuda":
        return torch.cuda.device_count()
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


THREADS_WHY = "TRAINBENCH_THREADS_WHY"
"""Set beside OMP_NUM_THREADS by a launcher that chose it for its ranks (:func:`cpu_threads`): why, for their header."""


def cpu_threads(local_ranks: int, env: Mapping[str, str] = os.environ) -> tuple[int, str]:
    """Threads for each of ``local_ranks`` ranks that share this node's CPU, and why, in words.

    ``OMP_NUM_THREADS``, where set to a positive number (a system file's env, a user's pin), wins. Else this
    process's cores (its affinity) less those the 1-minute load average says are busy, shared out: threads beyond
    the free cores made tiny runs 2-40x slower than one thread on a busy machine. The load average counts the whole
    machine, so it is scaled to this process's share of the machine's cores (a container or a Slurm step that holds
    a few of them). A reduction split over another number of threads rounds differently, so only a pinned
    ``OMP_NUM_THREADS`` gives the same bits from one run to the next (tests/golden pins it)."""
    given = env.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return int(given), env.get(THREADS_WHY) or f"OMP_NUM_THREADS={given} as set"
    cores = available_slots("cpu")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    busy = min(cores, round(load * cores / max(cores, os.cpu_count() or cores)))
    free = max(1, cores - busy)
    ignored = f" (OMP_NUM_THREADS={given!r} is not a positive number: ignored)" if given else ""
    why = (f"{free} of this process's {cores} cores free at a 1-minute load average of {load:.2f}, shared by "
           f"{local_ranks} rank(s) on this node{ignored}")  # fmt: skip
    return max(1, free // local_ranks), why


def ranks_on_this_node(env: Mapping[str, str], world: int) -> int:
    """Ranks of a job of ``world`` that share this node: torchrun's LOCAL_WORLD_SIZE, or under srun the job's tasks
    over its nodes."""
    nodes = int(env.get("SLURM_NNODES", "1"))
    return min(world, int(env.get("LOCAL_WORLD_SIZE", str(max(1, world // nodes)))))


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def interface_towards(address: str) -> str | None:
    """The name of this host's network interface the kernel would send to ``address`` through, or None."""
    import psutil

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))  # a UDP connect sends nothing: it only picks the route
            local = s.getsockname()[0]
    except OSError:
        return None
    return next((name for name, addrs in psutil.net_if_addrs().items() if any(a.address == local for a in addrs)),
                None)  # fmt: skip


def choose_interface(env: MutableMapping[str, str]) -> None:
    """The network interface the ranks rendezvous and talk over. A name given (GLOO_SOCKET_IFNAME,
    NCCL_SOCKET_IFNAME, e.g. from a system file's env) must exist on this node, else one sentence before anything
    waits on it; none given, the interface that reaches MASTER_ADDR is used (a job on several nodes cannot use
    ``lo``)."""
    import psutil

    names = sorted(psutil.net_if_addrs())
    host = socket.gethostname()
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        for name in filter(None, env.get(var, "").split(",")):
            bare = name.lstrip("^=")
            # Gloo needs an exact name; NCCL also takes a prefix ("eth" for eth0) or an exclusion ("^docker").
            if name.startswith("^") or (var == "NCCL_SOCKET_IFNAME" and any(n.startswith(bare) for n in names)):
                continue
            if bare not in names:
                raise UserError(f"{var}={env[var]} names no network interface of {host} (it has {', '.join(names)}); "
                                "set it in the system file's env to one of them, or remove it to use the one that "
                                "reaches the first node")  # fmt: skip
    master = env.get("MASTER_ADDR", "")
    if master and master not in LOOPBACK and not env.get("GLOO_SOCKET_IFNAME"):
        chosen = interface_towards(master)
        if chosen:
            env["GLOO_SOCKET_IFNAME"] = chosen
            env.setdefault("NCCL_SOCKET_IFNAME", chosen)


def init_distributed(device_kind: str, backend: str, timeout_s: float = 600.0) -> DistInfo:
    """Read torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE), or Slurm's (SLURM_PROCID, SLURM_LOCALID,
    SLURM_NTASKS) for a task started by srun, and join the process group (MASTER_ADDR/MASTER_PORT). A collective
    that waits longer than ``timeout_s`` raises on its rank (a dead peer's closed connection raises at once)."""
    env = os.environ
    world = int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", "1")))
    rank = int(env.get("RANK", env.get("SLURM_PROCID", "0")))
    local_rank = int(env.get("LOCAL_RANK", env.get("SLURM_LOCALID", "0")))
    local_world = ranks_on_this_node(env, world)
    if world > 1:
        # torch reads these from the environment; under srun they come from SLURM_* instead.
        env.setdefault("RANK", str(rank))
        env.setdefault("WORLD_SIZE", str(world))
        env.setdefault("LOCAL_RANK", str(local_rank))
    threads_line = ""
    if device_kind == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        threads, why = cpu_threads(local_world, env)
        torch.set_num_threads(threads)
        threads_line = f"{torch.get_num_threads()} CPU thread(s) a rank: {why}"
    if world > 1 and not dist.is_initialized():
        choose_interface(env)
        if backend == "auto":
            backend = "nccl" if device_kind == "cuda" else "gloo"
        dist.init_process_group(
            backend=backend,
            device_id=device if device_kind == "cuda" else None,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    return DistInfo(rank, local_rank, world, device, local_world, threads_line)


def single_rank_group(device: torch.device) -> None:
    """A process group of this process alone, where none exists: for what needs one on one rank too (FSDP2 over a
    single rank). The store is in memory; nothing listens on a port."""
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1, device_id=device if device.type == "cuda" else None)  # fmt: skip


def all_reduce_sum(tensor: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def exchange_rows(tensor: torch.Tensor, out_sizes: list[int], in_sizes: list[int],
                  group: dist.ProcessGroup | None = None) -> torch.Tensor:  # fmt: skip
    """``tensor``'s rows by all-to-all over ``group`` (the default one where None), without autograd: ``in_sizes[j]``
    rows to rank j, ``out_sizes[j]`` from it; what arrived, in rank order."""
    out = tensor.new_empty((sum(out_sizes), *tensor.shape[1:]))
    dist.all_to_all_single(out, tensor.contiguous(), out_sizes, in_sizes, group=group)
    return out


def shutdown(drain: bool = False, abort_wait_s: float = 30.0) -> None:
    """Leave the process group. ``drain`` (every rank got here normally): a barrier first, which waits for every
    collective still in flight on this rank (an FSDP prefetch, say); a Gloo worker thread still holding one at exit
    aborted the process ("terminate called without an active exception"). Never after an error: a barrier would wait
    for ranks that will not come. Not closed by the barrier: a finished work freed by a Gloo worker thread while the
    interpreter finalizes aborts the process the same way; a rank's process therefore ends through :func:`leave`.

    After an error, NCCL's communicators are aborted, not destroyed: torch's ``destroy_process_group`` first lets
    every NCCL collective in flight finish, and one that a failed rank left waiting on the others never does, so the
    rank that raised would hang instead of exiting (and its launcher would never learn of the failure). The abort
    runs beside the main thread; where it has not ended after ``abort_wait_s`` (an abort can wait on a kernel that
    waits on a peer), the process leaves at once with exit code 1, its output flushed, rather than let the
    interpreter's exit unwind a thread inside NCCL (which aborts the process). Its launcher then stops the others."""
    if not dist.is_initialized():
        return
    if drain:
        dist.barrier()
        dist.destroy_process_group()
        return
    if "nccl" not in str(dist.get_backend()):
        dist.destroy_process_group()
        return
    import threading

    from torch.distributed.distributed_c10d import _abort_process_group

    ender = threading.Thread(target=_abort_process_group, name="trainbench-nccl-abort", daemon=True)
    ender.start()
    ender.join(abort_wait_s)
    if ender.is_alive():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def leave(code: int) -> NoReturn:
    """End a rank's process with ``code`` once its work is written and its process group left, without Python's
    finalization. A Gloo worker thread frees a finished collective's work (and the tensors it held) just after the
    collective returns; where such a tensor has a Python object, freeing it takes the GIL, and a thread that asks for
    the GIL while the interpreter finalizes is ended by pthread_exit, whose unwinding through the work's destructor
    aborts the process ("terminate called without an active exception"; read from a core dump: ProcessGroupGloo::
    runLoop -> ~AsyncBarrierWork -> ~AsyncAllgatherWork -> decref_pyobject -> take_gil -> PyThread_exit_thread). A
    barrier before leaving does not close it: the barrier's own work holds the works before it. A rank that had
    finished its measurement died so after its last step, and its launcher reported the run failed.

    What finalization would still do is done here first: logging's handlers flushed and closed, stdout and stderr
    flushed. Every file the run writes is closed by then (the loop's ``finally``)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def fsdp_reduce_once_a_step(root: torch.nn.Module) -> Callable[[], contextlib.AbstractContextManager]:
    """``Placed.no_sync`` for a model sharded by FSDP2 (``root`` and its sharded blocks): around a micro-batch's
    forward and backward, FSDP2 keeps the gradients whole and unreduced (added into those of the micro-batches
    before; the step's last backward adds its own and reduce-scatters them all at once) and leaves the weights
    gathered after the backward, so that the next micro-batch's forward gathers none."""

    @contextlib.contextmanager
    def unreduced() -> Iterator[None]:
        root.set_requires_gradient_sync(False)
        root.set_reshard_after_backward(False)
        try:
            yield
        finally:
            root.set_requires_gradient_sync(True)
            root.set_reshard_after_backward(True)

    return unreduced


def reduce_once_a_step(placed: Placed) -> None:
    """``distributed.reduce_once_a_step``: ``placed``'s FSDP2 reduce-scatters once a step
    (:func:`fsdp_reduce_once_a_step`), said on the console; a layout without FSDP2 (tensor parallelism alone) has
    nothing to defer, and says so."""
    _fsdp2_no_sync(placed, "distributed.reduce_once_a_step", "no reduce-scatter to defer",
                   fsdp_reduce_once_a_step,
                   "FSDP2 reduce-scatters the gradients once a step (distributed.reduce_once_a_step): the "
                   "micro-batches before the last keep theirs whole and unreduced, their weights gathered")  # fmt: skip


def _fsdp2_no_sync(placed: Placed, key: str, nothing: str, wrap: Callable[[torch.nn.Module], Callable],
                   says: str) -> None:  # fmt: skip
    """``placed.no_sync`` replaced by ``wrap(placed.module)`` where FSDP2 placed the model, ``says`` on the console;
    a layout without FSDP2 keeps its own and says that ``key`` finds ``nothing`` there."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(placed.module, FSDPModule):
        placed.notes.append(f"{key}: this layout has no FSDP2, so {nothing}")
        return
    placed.no_sync = wrap(placed.module)
    placed.notes.append(says)


# The blocks FSDP2 was told to reshard after their forward (the placements' ``shard_blocks``): what
# ``distributed.keep_gathered`` keeps gathered instead between a step's micro-batches (:func:`keep_gathered`).
RESHARDED_AFTER_FORWARD: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def fsdp_keep_gathered(root: torch.nn.Module, before: Callable[[], contextlib.AbstractContextManager]
                       ) -> Callable[[], contextlib.AbstractContextManager]:  # fmt: skip
    """``Placed.no_sync`` for a model sharded by FSDP2 whose blocks stay gathered between the micro-batches of a
    step: around each micro-batch but the last (inside ``before``, the no_sync there was), the blocks that reshard
    after their forward (:data:`RESHARDED_AFTER_FORWARD`) keep their weights gathered for the backward, and no block
    reshards after its backward, so that the next micro-batch gathers none. The step's last micro-batch runs as
    without the key: its forward reshards those blocks, its backward gathers them again and reshards every block
    after it, before the optimizer's update (and an eval, outside the context, gathers as usual)."""
    from torch.distributed.fsdp import FSDPModule

    blocks = [m for m in root.modules() if m in RESHARDED_AFTER_FORWARD and isinstance(m, FSDPModule)]

    @contextlib.contextmanager
    def kept() -> Iterator[None]:
        with before():
            for block in blocks:
                block.set_reshard_after_forward(False, recurse=False)
            root.set_reshard_after_backward(False)
            try:
                yield
            finally:
                for block in blocks:
                    block.set_reshard_after_forward(True, recurse=False)
                root.set_reshard_after_backward(True)

    return kept


def keep_gathered(placed: Placed) -> None:
    """``distributed.keep_gathered``: ``placed``'s FSDP2 gathers each block's weights twice a step instead of twice a
    micro-batch (:func:`fsdp_keep_gathered`, over whatever ``placed.no_sync`` already did), said on the console; a
    layout without FSDP2 has nothing to keep, and says so."""
    before = placed.no_sync
    _fsdp2_no_sync(placed, "distributed.keep_gathered", "no gathers to save",
                   lambda root: fsdp_keep_gathered(root, before),
                   "FSDP2 keeps the blocks' weights gathered through a step's micro-batches "
                   "(distributed.keep_gathered): two gathers of each a step, the first forward's and the last "
                   "backward's")  # fmt: skip


def fsdp_keep_outer_gathered(units: list[torch.nn.Module], before: Callable[[], contextlib.AbstractContextManager]
                             ) -> Callable[[], contextlib.AbstractContextManager]:  # fmt: skip
    """``Placed.no_sync`` for a decoder sharded by FSDP2 whose layers outside the blocks stay gathered between the
    micro-batches of a step (``distributed.keep_outer_gathered``): around each micro-batch but the last (inside
    ``before``), ``units`` (the root, which holds the embedding and the final norm, and the output layer where it is
    sharded apart) are not resharded after their backward, so that the next micro-batch gathers none of them. Their
    gradients are still reduce-scattered each micro-batch. They are gathered through each micro-batch's forward and
    backward anyway, so the peak holds nothing more. The step's last micro-batch reshards them after its backward,
    before the optimizer's update changes the shards."""

    @contextlib.contextmanager
    def kept() -> Iterator[None]:
        with before():
            for unit in units:
                unit.set_reshard_after_backward(False, recurse=False)
            try:
                yield
            finally:
                for unit in units:
                    unit.set_reshard_after_backward(True, recurse=False)

    return kept


@dataclass
class Placed:
    """A model on its rank's devices, as a benchmark's placement returns it to the training loop.

    ``module`` owns the parameters (the optimizer and checkpoints see it); ``model`` is what the step calls (the
    module itself, or a DDP or compiled wrapper of it). ``no_sync()`` is entered around the forward and backward of
    every micro-batch but a step's last, so gradients are reduced once per step (DDP's ``no_sync``; FSDP2's with
    ``distributed.reduce_once_a_step``, :func:`fsdp_reduce_once_a_step`; else none, and FSDP2 reduces each).
    ``mark_cuda_graph_steps``: the compiled step replays CUDA graphs, and each micro-batch must tell it that the
    previous replay's outputs are used up. ``notes``: lines for
    the run's console on what placement chose. ``comm_precision``: the lowest precision its collectives carry, in
    MLPerf's names (``bfloat16`` where FSDP gathers bf16 parameters or DDP reduces bf16 gradients), ``fp32``
    otherwise and on one rank. ``after_step``: run after every optimizer step (FP8 weights gathered in FP8: their
    scales for the next step's gathers). ``before_step(micro_batches)``: run with a training step's micro-batches on
    the device, before the first forward (dlrmv4's sharded tables: every micro-batch's rows looked up at once).
    ``rearrange(optimizer, canonical)``: parameters moved between the ranks
    after an optimizer step, before ``after_step`` (a mixture's experts by their load), and with ``canonical`` back
    to their placement's own order before a checkpoint's save."""

    module: torch.nn.Module
    model: Callable
    no_sync: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    mark_cuda_graph_steps: bool = False
    notes: list[str] = field(default_factory=list)
    comm_precision: str = "fp32"
    after_step: Callable[[], None] | None = None
    before_step: Callable[[list], None] | None = None
    rearrange: Callable[[Any, bool], None] | None = None

    def also_after_step(self, f: Callable[[], None] | None) -> None:
        """Run ``f`` (where given) after every optimizer step, after what already runs there."""
        if f is None:
            return
        before = self.after_step
        if before is None:
            self.after_step = f
            return

        def after_step() -> None:
            before()
            f()

        self.after_step = after_step
