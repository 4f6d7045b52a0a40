"""Choosing how a model's blocks use the GPU (``perf.plan=auto``): a memory and time model of one step from what a
probe measured of one block on this GPU (measure/probe.py), the GPU's and the host's memory, and a search over the
layouts the placement can build.

A block of the decoder either keeps what it saved for its backward on the GPU, or keeps it in pinned host memory
(offloaded: copied out during the forward and back during the backward, on a side stream), or is recomputed (keeps
only its input, which can wait in host memory too). With ``L`` blocks of which ``R`` are recomputed and ``O``
offloaded (both spread over the depth, so that the copies are spread over the whole forward and backward), one
micro-batch costs

    time   = head + L x (forward + backward) + R x forward + the copies' stall
             (+ sharded over several GPUs: the collectives nothing hides + L x FSDP2's own copies of a block)
    memory = weights + optimizer + (L - R - O) x kept + (R x input, unless the inputs are offloaded)
             + in-flight copies + the step's working set + a margin

where the copies stall the step only where their bytes take longer over the host link than the forward (out) or the
backward (back) they overlap, at the link's rates measured while a step runs (the copies share the GPU's memory with
the compute), and where several GPUs of the node copy at once, at the share of its link each keeps then. The
search tries every (R, O, inputs offloaded) that fits the GPU and the host, keeps
what was given by hand, and takes the fastest. Several GPUs each hold a replica of the base where it fits; a sharded
base is the alternative the plan names where it does not.
"""

from __future__ import annotations

import dataclasses
from typing import Any

GIB = 2**30
# The offload releases an offloaded block's GPU copy two blocks after its forward and fetches two blocks ahead in the
# backward (families/decoder/offload.py): about two blocks' saved tensors are on the GPU besides those kept there.
IN_FLIGHT_BLOCKS = 2
# FSDP2 holds about two blocks whole at a time besides the shards (the one computing and the one gathered ahead).
GATHERED_BLOCKS = 2
# What NCCL's collectives move a second between the GPUs of one node while the blocks compute, each GPU's bytes sent
# (ring: (ranks - 1) / ranks of each tensor): 2 H200 over NVLink moved about 192 GB of the 8B's FP8 gathers and fp32
# reduce-scatters in 966 ms of NCCL's kernels a step (docs/performance.md, 2026-11-29). A node's figure: across nodes
# the network is slower, and the prediction then too high.
NODE_COLLECTIVE_BYTES_S = 200e9
# Bytes FSDP2's own kernels read and write on each GPU, beside NCCL's, for each parameter of a sharded block (fp32
# weights, gradients and optimizer state), a gather and a reduce-scatter (:func:`shard_copy_bytes`). On 2 H200 they
# were the 8B's pair's largest cost at equal depths: 11.7 ms a block a step of 8 micro-batches (copies, chunk_cat,
# casts and adds; docs/notes/node.md, 2026-11-30), about 4 % of its step, where one GPU has none of it.
MASTER_BYTES = 4
# GPU memory left unplanned: the allocator's rounding and stray buffers (expandable segments keep it small).
MARGIN = 0.03
# Host memory a plan may pin, of what the host has available: the rest stays for the data, the page cache, the ranks.
HOST_SHARE = 0.8
# The layout keys the plan sets; one given by hand (away from the preset's value) is kept as given.
LAYOUT_KEYS = ("model.base_precision", "model.base_sharding", "perf.activation_checkpointing", "perf.recompute_blocks",
               "perf.offload_blocks", "perf.offload_recomputed_inputs")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Resources:
    """What the machine offers each rank."""

    gpu_bytes: int  # usable memory of one GPU (total less what the driver and CUDA context take)
    host_bytes: int  # host memory available to this rank (the node's available memory / ranks on the node)
    gpus: int  # ranks in the run
    gpu_name: str = "GPU"
    fp8: bool = True  # FP8 tensor cores (compute capability 8.9 or newer)


@dataclasses.dataclass(frozen=True)
class BlockProbe:
    """One block of the model at the run's shape, as measured on this GPU (or given, in tests)."""

    kept_bytes: int  # what a block that is not recomputed saves for its backward
    input_bytes: int  # a recomputed block's input (all it saves)
    block_weight_bytes: int  # one block's parameters and buffers (FP8 base and its scales, adapters)
    other_weight_bytes: int  # everything else the model holds: embedding, output layer, norms
    optimizer_bytes_per_block: int  # the gradients and optimizer state of one block's trained parameters
    working_bytes: int  # the step's peak beyond weights, optimizer and the blocks' saved tensors (output layer, loss)
    forward_s: float  # one block's forward, per micro-batch
    backward_s: float  # one block's backward (not recomputing), per micro-batch
    head_s: float  # the rest of a micro-batch's step: embedding, output layer and loss, optimizer share
    to_host_bytes_s: float  # pinned copy rate, GPU to host, the GPU idle
    to_gpu_bytes_s: float  # pinned copy rate, host to GPU, the GPU idle
    # The same while a training step runs, as the offload's copies do (None: not measured, the idle rates stand)
    to_host_busy_bytes_s: float | None = None
    to_gpu_busy_bytes_s: float | None = None
    # One GPU's idle rates while every rank of the node copies the same way at once (None: one rank a node, or not
    # measured): the share of its own link a GPU keeps when the node's GPUs share the host's
    to_host_shared_bytes_s: float | None = None
    to_gpu_shared_bytes_s: float | None = None
    # The gradients and optimizer state of what the blocks do not hold (a trained embedding and output layer; 0 for
    # LoRA, whose adapters are all in the blocks)
    other_optimizer_bytes: int = 0
    # What a sharded block keeps whole between micro-batches besides its shards: its fp32 gradient and its gathered
    # weights, where FSDP2 reduces once a step (distributed.reduce_once_a_step; :func:`sharded`)
    whole_bytes_per_block: int = 0
    # A sharded block's gathered weights kept between micro-batches (distributed.keep_gathered; :func:`sharded`)
    gathered_bytes_per_block: int = 0
    # Of a micro-batch, the collectives no block's compute hides, where FSDP2 shards the model (:func:`sharded`)
    exposed_comm_s: float = 0.0
    # The GPU's own memory copy rate (bytes copied a second, each read once and written once; None: not measured)
    device_copy_bytes_s: float | None = None
    # Of a micro-batch, FSDP2's own kernels for one sharded block: the casts, copies in and out of its collectives'
    # buffers and the gradient's add (:func:`sharded`; 0 on one GPU, or where the copy rate was not measured)
    shard_copy_s: float = 0.0

    def rates(self) -> tuple[float, float]:
        """The copy rates a plan can count on, to the host and back: those measured while the GPU computes, times
        the share of the link a GPU keeps while the node's other GPUs copy too."""
        out = (self.to_host_busy_bytes_s or self.to_host_bytes_s) * _share(self.to_host_shared_bytes_s,
                                                                           self.to_host_bytes_s)  # fmt: skip
        back = (self.to_gpu_busy_bytes_s or self.to_gpu_bytes_s) * _share(self.to_gpu_shared_bytes_s,
                                                                          self.to_gpu_bytes_s)  # fmt: skip
        return out, back


def _share(shared: float | None, alone: float) -> float:
    return 1.0 if not shared else min(1.0, shared / alone)


@dataclasses.dataclass(frozen=True)
class Plan:
    recompute: int  # the last R blocks recomputed
    offload: int  # of the others, O keep their saved tensors in host memory
    offload_inputs: bool  # recomputed blocks' inputs in host memory
    gpu_bytes: int  # predicted peak of one GPU
    host_bytes: int  # pinned host memory, per rank
    seconds: float  # predicted time of one micro-batch
    account: dict[str, int]  # the GPU's bytes by what holds them
    stall_s: float  # of ``seconds``, waiting for copies
    comm_s: float = 0.0  # of ``seconds``, the collectives' exposed time (BlockProbe.exposed_comm_s)
    shard_copy_s: float = 0.0  # of ``seconds``, FSDP2's own copies of every block (BlockProbe.shard_copy_s)

    def keys(self) -> dict[str, Any]:
        """The config keys that build this plan."""
        return {
            "perf.activation_checkpointing": self.recompute > 0,
            "perf.recompute_blocks": self.recompute,
            "perf.offload_blocks": self.offload,
            "perf.offload_recomputed_inputs": self.offload_inputs and self.recompute > 0,
        }


def evaluate(layers: int, p: BlockProbe, recompute: int, offload: int, inputs: bool) -> Plan:
    """The memory and time of one layout (see the module's formula)."""
    kept_here = layers - recompute - offload
    in_flight = min(offload, IN_FLIGHT_BLOCKS) * p.kept_bytes + (min(recompute, IN_FLIGHT_BLOCKS) * p.input_bytes
                                                                  if inputs else 0)  # fmt: skip
    account = {
        "weights": layers * p.block_weight_bytes + p.other_weight_bytes,
        "gradients and optimizer state": layers * p.optimizer_bytes_per_block + p.other_optimizer_bytes,
        f"{kept_here} blocks' saved activations": kept_here * p.kept_bytes,
        f"{recompute} recomputed blocks' inputs": 0 if inputs else recompute * p.input_bytes,
        "offload copies in flight": in_flight,
        "gradients kept whole and weights gathered (distributed.reduce_once_a_step)": layers * p.whole_bytes_per_block,
        "weights kept gathered through a step (distributed.keep_gathered)": layers * p.gathered_bytes_per_block,
        "output layer, loss and a block's backward (working set)": p.working_bytes,
    }
    to_host = offload * p.kept_bytes + (recompute * p.input_bytes if inputs else 0)
    forward = layers * p.forward_s
    backward = layers * p.backward_s + recompute * p.forward_s
    out_rate, back_rate = p.rates()
    stall = max(0.0, to_host / out_rate - forward) + max(0.0, to_host / back_rate - backward)
    copies = layers * p.shard_copy_s
    seconds = p.head_s + forward + backward + stall + p.exposed_comm_s + copies
    return Plan(recompute, offload, inputs, sum(account.values()), to_host, seconds, account, stall,
                p.exposed_comm_s, copies)  # fmt: skip


def shard_copy_bytes(ranks: int, gathered_as: int, reduce_bytes: int, gathers: float, reduces: float) -> float:
    """Bytes FSDP2's own kernels read and write on one GPU, for each parameter of a sharded block (fp32 as
    :data:`MASTER_BYTES`), in ``gathers`` gathers at ``gathered_as`` bytes a parameter (1: FP8, 2: bf16) and
    ``reduces`` reduce-scatters at ``reduce_bytes`` (2: bf16, 4: fp32). A gather casts the shard (read fp32, write
    it as gathered; an FP8 cast, torchao's, then copied once more into the collective's buffer) and copies the
    gathered block out of that buffer into the parameters (read, write). A reduce-scatter copies the whole gradient
    into its buffer (read, write), casts the shard it gets back to fp32 where it was reduced in less, and adds it
    to the shard's fp32 gradient (read both, write one)."""
    shard, g, r = 1 / ranks, gathered_as, reduce_bytes
    gather = (MASTER_BYTES + g) * shard + (2 * g * shard if g == 1 else 0) + 2 * g
    reduce = 2 * r + ((r + MASTER_BYTES) * shard if r < MASTER_BYTES else 0) + 3 * MASTER_BYTES * shard
    return gathers * gather + reduces * reduce


def sharded(p: BlockProbe, ranks: int, reduce_once_a_step: bool = False, reduce_bytes: int = 4,
            micro_batches: int = 1, gather_bytes: int = 0, gathered_as: int = 2, outer_kept: bool = False,
            head_apart: bool = False) -> BlockProbe:  # fmt: skip
    """One GPU's share of ``p``'s memory where FSDP2 shards every parameter, its gradient and its optimizer state
    over ``ranks``: the shards, plus :data:`GATHERED_BLOCKS` blocks held whole at a time (the one computing and the
    next, gathered ahead; in backward a block's gradient before its reduce-scatter), counted at the probe's own size
    of a block's weights as an upper bound (the gathered copies are bf16 or FP8, not fp32). ``reduce_once_a_step``:
    every block's gradient (fp32, as its weights) and its gathered weights held whole between micro-batches too,
    counted at twice the probe's size of a block's weights (an upper bound: the gathered copies are bf16 or FP8).
    ``gather_bytes`` (1 for FP8 gathers, 2 for bf16, 4 for fp32; 0: not kept): every block's gathered weights held
    through a step (``distributed.keep_gathered``), at that many bytes for each of the probe's fp32 ones; nothing
    more where ``reduce_once_a_step`` counts them already.

    Time: a block's gathers and reduce-scatters overlap the compute of the blocks beside it (notes/node.md: 1-3 %
    of the step exposed on 2 and 4 GPUs), and are not counted. What nothing hides is the rest of the model's
    (``other_weight_bytes``, fp32: the embedding, the output layer, the norms): gathered in bf16 before a
    micro-batch's first block and its gradients reduce-scattered (``reduce_bytes`` a parameter: 4 in fp32, 2 in bf16)
    after its last, at :data:`NODE_COLLECTIVE_BYTES_S`; with ``reduce_once_a_step``, once in a step's
    ``micro_batches``. ``outer_kept`` (``distributed.keep_outer_gathered``): gathered once a step, kept between the
    micro-batches; ``head_apart``: the output layer's reduce-scatter runs beside the blocks' backward, and only the
    embedding's (half the rest: an untied decoder's two are the same size) is left after the last block. It runs at
    the backward's start, the step's peak of memory: its gradient once more in the reduce's type (the buffer the
    reduce-scatter reads) and its shard in fp32 are counted in the working set (measured: 3.0 GiB more for the 8B
    on 2 H200, bf16 reduce-scatters; this counts 2.9).

    And FSDP2's own kernels for each block, which run beside NCCL's in every gather and reduce-scatter and which
    one GPU does not have (:func:`shard_copy_bytes`, at twice the probe's ``device_copy_bytes_s``: a copy reads and
    writes each byte): each micro-batch gathers a block twice (forward, and again for its backward) at
    ``gathered_as`` bytes a parameter and reduce-scatters it once; the weights kept gathered (``gather_bytes``)
    gather twice a step, and ``reduce_once_a_step`` reduce-scatters once a step and gathers once a micro-batch (its
    backward's) and once more a step."""
    if ranks <= 1:
        return p
    params = p.other_weight_bytes / 4
    once = 1 / max(1, micro_batches)
    reduced = reduce_bytes * (0.5 if head_apart else 1)  # bytes a parameter of the rest, after the last block
    # (reduce_once_a_step keeps everything gathered between micro-batches, and reduces once a step; keep_gathered
    # keeps the root's unit gathered with the blocks, whatever outer_kept says)
    kept = outer_kept or gather_bytes > 0
    per_micro_batch = (2 + reduced) * once if reduce_once_a_step else 2 * (once if kept else 1) + reduced
    exposed = params * per_micro_batch * (ranks - 1) / ranks / NODE_COLLECTIVE_BYTES_S
    # (keep_gathered: the step's first forward and last backward; reduce_once_a_step alone: its first forward and
    # every backward, the blocks resharded after their forward as usual)
    gathers = 2 * once if gather_bytes else 1 + once if reduce_once_a_step else 2
    per_param = shard_copy_bytes(ranks, gathered_as, reduce_bytes, gathers, once if reduce_once_a_step else 1)
    copy_s = p.block_weight_bytes / MASTER_BYTES * per_param / (2 * p.device_copy_bytes_s) \
        if p.device_copy_bytes_s else 0.0  # fmt: skip
    head_peak = params / 2 * (2 * reduce_bytes + 4 / ranks) if head_apart else 0
    return dataclasses.replace(
        p,
        working_bytes=p.working_bytes + int(head_peak),
        whole_bytes_per_block=2 * p.block_weight_bytes if reduce_once_a_step else 0,
        gathered_bytes_per_block=0 if reduce_once_a_step else p.block_weight_bytes * gather_bytes // 4,
        block_weight_bytes=p.block_weight_bytes // ranks,
        other_weight_bytes=p.other_weight_bytes // ranks + GATHERED_BLOCKS * p.block_weight_bytes,
        optimizer_bytes_per_block=p.optimizer_bytes_per_block // ranks,
        other_optimizer_bytes=p.other_optimizer_bytes // ranks,
        exposed_comm_s=exposed,
        shard_copy_s=copy_s,
    )


def with_rows(p: BlockProbe, factor: int) -> BlockProbe:
    """``p`` at ``factor`` times the probe's rows a micro-batch: what a block saves, a recomputed block's input and
    the working set grow with the rows (all of the working set, an upper bound), and so do the times: the model
    counts a row's time as the same in a larger micro-batch (what a larger one gains is measured, not modelled)."""
    return dataclasses.replace(
        p,
        kept_bytes=p.kept_bytes * factor,
        input_bytes=p.input_bytes * factor,
        working_bytes=p.working_bytes * factor,
        forward_s=p.forward_s * factor,
        backward_s=p.backward_s * factor,
        head_s=p.head_s * factor,
    )


def best(layers: int, p: BlockProbe, r: Resources, fixed: dict[str, Any]) -> tuple[Plan | None, Plan]:
    """The fastest layout that fits (None where none does) and the one needing the least GPU memory (what the
    refusal names). ``fixed``: layout keys given by hand."""
    usable = int(r.gpu_bytes * (1 - MARGIN))
    host = int(r.host_bytes * HOST_SHARE)
    fastest, smallest = None, None
    for recompute in _choices(fixed, "perf.recompute_blocks", range(layers + 1), layers):
        for offload in _choices(fixed, "perf.offload_blocks", range(layers - recompute + 1), layers):
            if offload > layers - recompute:
                continue
            for inputs in _choices(fixed, "perf.offload_recomputed_inputs", (False, True), layers):
                if inputs and not recompute:
                    continue
                plan = evaluate(layers, p, recompute, offload, inputs)
                if smallest is None or (plan.gpu_bytes, plan.seconds) < (smallest.gpu_bytes, smallest.seconds):
                    smallest = plan
                if plan.gpu_bytes <= usable and plan.host_bytes <= host:
                    if fastest is None or plan.seconds < fastest.seconds:
                        fastest = plan
    assert smallest is not None
    return fastest, smallest


def _choices(fixed: dict[str, Any], key: str, default, layers: int):
    if key not in fixed:
        return default
    value = fixed[key]
    if key == "perf.recompute_blocks":
        if not fixed.get("perf.activation_checkpointing", True):
            return (0,)
        return (value or layers,)  # 0 with checkpointing on means every block
    return (value,)


def fixed_keys(cfg, preset) -> dict[str, Any]:
    """The layout keys of ``cfg`` set away from the preset's config ``preset``: kept as given."""
    from trainbench.config import leaves

    ours, theirs = leaves(cfg), leaves(preset)

    def value(table, key):
        return getattr(table[key].owner, table[key].field.name)

    out = {}
    for key in LAYOUT_KEYS:
        if key in ours and value(ours, key) != value(theirs, key):
            out[key] = value(ours, key)
    if "perf.activation_checkpointing" in out and not out["perf.activation_checkpointing"]:
        out.setdefault("perf.recompute_blocks", 0)
        out.setdefault("perf.offload_recomputed_inputs", False)
    return out


def gib(n: float) -> str:
    return f"{n / GIB:,.1f} GiB"


def describe(plan: Plan, layers: int, r: Resources, fixed: dict[str, Any], tokens: int) -> list[str]:
    """The plan and the numbers behind it, for the console."""
    kept = layers - plan.recompute - plan.offload
    given = f"; kept as given: {', '.join(f'{k}={v}' for k, v in fixed.items())}" if fixed else ""
    lines = [
        f"layout (perf.plan=auto) for {r.gpus} x {r.gpu_name} of {gib(r.gpu_bytes)}, {gib(r.host_bytes)} of host "
        f"memory a rank: {kept} blocks keep their activations on the GPU, {plan.offload} keep them in host memory, "
        f"{plan.recompute} are recomputed" + (" (their inputs in host memory)" if plan.offload_inputs else "") + given,
        f"  predicted: {plan.seconds:.2f} s a micro-batch ({tokens / plan.seconds:,.0f} tokens/s a GPU: compute "
        f"{plan.seconds - plan.stall_s - plan.comm_s - plan.shard_copy_s:.3f} s, waiting for host copies "
        f"{plan.stall_s:.3f} s"
        + (f", FSDP2's copies {plan.shard_copy_s:.3f} s" if plan.shard_copy_s else "")
        + (
            ""
            if r.gpus == 1
            else f", exposed communication {plan.comm_s:.3f} s"
            if plan.comm_s
            else ", the collectives not modelled"
        )
        + f"), {gib(plan.gpu_bytes)} of the GPU's {gib(r.gpu_bytes)}, {gib(plan.host_bytes)} pinned host memory",
        "  GPU memory: " + ", ".join(f"{what} {gib(n)}" for what, n in plan.account.items() if n),
    ]
    return lines


def refusal(name: str, smallest: Plan, layers: int, r: Resources, p: BlockProbe) -> str:
    """One sentence: why nothing fits, and what would."""
    usable = r.gpu_bytes * (1 - MARGIN)
    if smallest.gpu_bytes > usable:
        need = smallest.gpu_bytes / (1 - MARGIN)
        return (f"{name} does not fit one {r.gpu_name} of {gib(r.gpu_bytes)}: even with every block recomputed and "
                f"its input in host memory it needs {gib(need)} (weights {gib(smallest.account['weights'])}); use GPUs "
                f"of at least {gib(need)}, or several GPUs with the base sharded (model.base_precision=auto "
                f"--nproc N)")  # fmt: skip
    # The GPU could hold it, but not with the host memory there is: the least host memory a fitting plan needs.
    need_host = min(evaluate(layers, p, rc, o, i).host_bytes for rc in range(layers + 1) for o in range(layers - rc + 1)
                    for i in (False, True) if (i is False or rc)
                    and evaluate(layers, p, rc, o, i).gpu_bytes <= usable)  # fmt: skip
    return (f"{name} fits one {r.gpu_name} of {gib(r.gpu_bytes)} only with {gib(need_host)} of pinned host memory a "
            f"rank, and this machine has {gib(r.host_bytes)} available a rank ({HOST_SHARE:.0%} of it may be pinned); "
            f"free host memory or run fewer ranks a node")  # fmt: skip


def host_available_bytes() -> int:
    """MemAvailable of /proc/meminfo (or, where absent, the physical memory), capped by a cgroup's limit."""
    return _within_cgroup(_meminfo("MemAvailable:"))


def host_total_bytes() -> int:
    """MemTotal of /proc/meminfo (or, where absent, the physical memory), capped by a cgroup's limit: what a node's
    ranks can hold together, whatever they hold already."""
    return _within_cgroup(_meminfo("MemTotal:"))


def _meminfo(field: str) -> int:
    import os
    from pathlib import Path

    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _within_cgroup(available: int) -> int:
    from pathlib import Path

    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            available = min(available, int(text))
    return available
