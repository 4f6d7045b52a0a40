"""Blocks whose saved activations wait in pinned host memory between their forward and their backward.

A block that keeps its activations holds them on the GPU from its forward until its backward; one that is recomputed
holds almost nothing but repeats its forward. A third way, for some blocks: what the block saves for its backward
(autograd's saved tensors, compiled graphs' included) is copied to pinned host memory on a side stream while the GPU
goes on computing, the GPU copy is released, and one or two blocks ahead of the backward it is copied back. The
copies cost GPU time only where the link cannot keep up (about 50 GB/s on PCIe Gen5 against a block of the 70B LoRA
saving 1.36 GiB in about 12 ms of forward), so the offloaded blocks are spread evenly over the ones that keep their
activations. docs/notes/lora-fp8-one-gpu.md measures it.

Only tensors the block made are moved: its parameters and buffers, what the whole model shares (rotary tables,
masks) and anything smaller than ``MIN_BYTES`` stay where they are.

The end of this module runs a block's forward as its placement chose, from outside the block
(:func:`run_from_outside`): as it is, recomputed in the backward, with its saved tensors here, or both;
:mod:`trainbench.families.decoder.memory` chooses which blocks do what.
"""

from __future__ import annotations

import contextlib
import functools
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainbench.errors import ConfigError

MIN_BYTES = 8 << 20  # smaller saved tensors stay on the GPU: not worth a copy's launch
RELEASE_AFTER_BLOCKS = 2  # an offloaded block's GPU tensors are freed once this many blocks' forwards have followed
PREFETCH_BLOCKS = 2  # the backward fetches the offloaded blocks up to this many blocks ahead of the one it is in


@dataclass(eq=False)
class _Saved:
    """One saved tensor: on the GPU until its copy to ``host`` is known done, then fetched back into ``back``."""

    gpu: torch.Tensor | None
    host: torch.Tensor
    copied: torch.cuda.Event
    back: torch.Tensor | None = None
    fetched: torch.cuda.Event | None = None
    uses: int = 1  # unpacks still to come; at 0 the fetched copy is autograd's alone
    view: tuple | None = None  # a view's (stride, storage offset, span): fetched back into a base of its layout


@dataclass(eq=False)
class _BlockState:
    index: int
    keep: set[int]  # storage addresses of the block's own parameters and buffers
    host: list[torch.Tensor] = field(default_factory=list)  # pinned buffers, reused step after step in pack order
    saved: list[_Saved] = field(default_factory=list)  # this step's, in pack order
    slot: int = 0


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements cover its span of memory without gaps or overlap, in some order of its dimensions
    (contiguous, or a permutation of contiguous): then a copy with the same strides is one block of bytes."""
    expected = 1
    for size, stride in sorted(((n, s) for n, s in zip(t.shape, t.stride(), strict=True) if n != 1),
                               key=lambda p: p[1]):  # fmt: skip
        if stride != expected:
            return False
        expected *= size
    return True


def _movable(t: torch.Tensor) -> bool:
    """A CUDA tensor worth copying. A view that does not cover its storage (attention's value, a slice of the fused
    q/k/v projection's output) is moved too, as a compact copy: kept, it would hold its whole base on the GPU."""
    return t.device.type == "cuda" and t.numel() * t.element_size() >= MIN_BYTES and 0 not in t.stride()


class HostOffload:
    """Saved activations of ``blocks[i]`` for each ``i`` in ``offloaded`` kept in pinned host memory; ``install``
    wires it into the blocks (their ``saved_to_host``, read where the placement runs them:
    :mod:`~trainbench.families.decoder.memory`) and a forward hook on every block, which counts the blocks a forward
    and a backward have reached."""

    def __init__(self, blocks: Sequence[nn.Module], offloaded: Iterable[int]):
        self.blocks = list(blocks)
        self.offloaded = sorted(set(offloaded))
        self.stream = torch.cuda.Stream()
        self.states = {i: _BlockState(i, self._own_storages(self.blocks[i])) for i in self.offloaded}
        self.in_flight: deque[tuple[int, _BlockState]] = deque()  # (block index reached when packed, state)
        self.bytes_per_step = 0
        self._current: _BlockState | None = None
        self._shared: set[int] = set()
        self._dedup: dict[tuple, _Saved] = {}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    @staticmethod
    def _own_storages(block: nn.Module) -> set[int]:
        return {_storage(t) for t in [*block.parameters(), *block.buffers()] if t.device.type != "meta"}

    def install(self) -> HostOffload:
        for i, block in enumerate(self.blocks):
            if not placed_from_outside(block):
                run_from_outside(block)
            if i in self.states:
                block.saved_to_host = self
            self._hooks.append(block.register_forward_hook(self._after_forward(i)))
        return self

    def remove(self) -> None:
        """Undo :meth:`install` (the pinned buffers go with this object)."""
        for handle in self._hooks:
            handle.remove()
        for i in self.states:
            self.blocks[i].saved_to_host = None
        self._hooks.clear()

    # -- forward ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def saving(self, block: nn.Module, shared: Iterable[torch.Tensor | None]) -> Iterator[None]:
        """Around ``block``'s forward: what it saves goes to host memory (``shared``: the model-wide tensors it was
        given, which stay)."""
        state = self.states[self.blocks.index(block)]
        if state.index == self.offloaded[0]:
            self.bytes_per_step = 0
        state.saved, state.slot = [], 0
        self._current, self._dedup = state, {}
        self._shared = {_storage(t) for t in shared if t is not None}
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._current = None
        self.in_flight.append((state.index, state))

    def _pack(self, t: torch.Tensor) -> object:
        state = self._current
        if state is None or not _movable(t) or _storage(t) in state.keep or _storage(t) in self._shared:
            return t
        key = (_storage(t), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if key in self._dedup:  # the same tensor saved twice (two nodes' inputs): one copy
            self._dedup[key].uses += 1
            return self._dedup[key]
        host = self._host_buffer(state, t)
        compute = torch.cuda.current_stream()
        self.stream.wait_stream(compute)  # t is written
        with torch.cuda.stream(self.stream):
            # a view is made compact on the copy stream first (its memory, from that stream's pool, is freed there)
            host.copy_(t if dense(t) else t.contiguous(), non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(self.stream)
        saved = _Saved(gpu=t, host=host, copied=copied)
        if not dense(t):  # compiled backward graphs check their inputs' strides: the view comes back as it was
            span = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) + 1
            saved.view = (t.stride(), t.storage_offset(), span)
        state.saved.append(saved)
        self._dedup[key] = saved
        self.bytes_per_step += t.numel() * t.element_size()
        return saved

    def _host_buffer(self, state: _BlockState, t: torch.Tensor) -> torch.Tensor:
        """The block's pinned buffer for its next saved tensor (shapes repeat step after step); allocated once."""
        stride = t.stride() if dense(t) else torch.empty(t.shape, device="meta").stride()  # a view: compact
        if state.slot < len(state.host):
            host = state.host[state.slot]
            if host.shape != t.shape or host.stride() != stride or host.dtype != t.dtype:
                host = state.host[state.slot] = torch.empty_strided(t.shape, stride, dtype=t.dtype, pin_memory=True)
        else:
            host = torch.empty_strided(t.shape, stride, dtype=t.dtype, pin_memory=True)
            state.host.append(host)
        state.slot += 1
        return host

    def _after_forward(self, index: int):
        def hook(module: nn.Module, args, output):
            if not torch.is_grad_enabled():
                return None
            self._release(before=index - RELEASE_AFTER_BLOCKS + 1)
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda grad: self._reached_backward(index))
            return None

        return hook

    def _release(self, before: int) -> None:
        """Free the GPU copies of blocks packed before block ``before``: the compute stream waits for their copies
        first, so their memory is reused only after the bytes are in host memory."""
        compute = torch.cuda.current_stream()
        while self.in_flight and self.in_flight[0][0] < before:
            _, state = self.in_flight.popleft()
            for saved in state.saved:
                if saved.gpu is not None:
                    compute.wait_event(saved.copied)
                    saved.gpu = None

    # -- backward --------------------------------------------------------------------------------
    def _reached_backward(self, index: int) -> None:
        """The backward is about to enter block ``index``: everything still on the GPU may go (the forward is
        over), and the offloaded blocks down to ``index - PREFETCH_BLOCKS`` start coming back."""
        self._release(before=len(self.blocks))
        for i in reversed(self.offloaded):
            if index - PREFETCH_BLOCKS <= i <= index:
                self._fetch(self.states[i])

    def _fetch(self, state: _BlockState) -> None:
        for saved in state.saved:
            if saved.gpu is None and saved.back is None and saved.uses > 0:
                self._fetch_one(saved)

    def _fetch_one(self, saved: _Saved) -> None:
        compute = torch.cuda.current_stream()
        if saved.view is not None:
            stride, offset, span = saved.view
            base = torch.empty(span, dtype=saved.host.dtype, device=compute.device)
            back = base.as_strided(saved.host.shape, stride, offset)
        else:
            back = torch.empty_strided(saved.host.shape, saved.host.stride(), dtype=saved.host.dtype,
                                       device=compute.device)  # fmt: skip
        self.stream.wait_stream(compute)  # the memory ``back`` reuses is free on the compute stream
        with torch.cuda.stream(self.stream):
            back.copy_(saved.host, non_blocking=True)
        saved.back, saved.fetched = back, torch.cuda.Event()
        saved.fetched.record(self.stream)

    def _unpack(self, packed: object) -> torch.Tensor:
        if not isinstance(packed, _Saved):
            return packed  # type: ignore[return-value]
        if packed.gpu is not None:
            return packed.gpu
        if packed.back is None:  # not prefetched (the backward met it before its block's hook ran)
            self._fetch_one(packed)
        torch.cuda.current_stream().wait_event(packed.fetched)
        back = packed.back
        packed.uses -= 1
        if packed.uses <= 0:  # autograd holds it as long as the backward needs it; nothing here keeps it alive
            packed.back = None
        return back


def spread(count: int, kept: int) -> list[int]:
    """``count`` block indices spread evenly over the first ``kept`` blocks (those that keep their activations)."""
    if count > kept:
        raise ConfigError(f"perf.offload_blocks={count} but only {kept} blocks keep their activations "
                          "(the others are recomputed: lower perf.recompute_blocks)")  # fmt: skip
    return [k * kept // count for k in range(count)]


def offload_blocks(blocks: Sequence[nn.Module], count: int, device: torch.device,
                   recomputed_inputs: bool = False) -> HostOffload | None:  # fmt: skip
    """Offload ``count`` of the blocks that keep their activations (``checkpointing`` off), and with
    ``recomputed_inputs`` the input of every recomputed block (all such a block keeps); None for neither."""
    if not count and not recomputed_inputs:
        return None
    if device.type != "cuda":
        what = f"perf.offload_blocks={count}" if count else "perf.offload_recomputed_inputs=true"
        raise ConfigError(f"{what} needs a CUDA device (pinned host memory and a copy stream); this run is on "
                          f"{device.type}")  # fmt: skip
    kept = [i for i, b in enumerate(blocks) if not getattr(b, "checkpointing", False)]
    chosen = [kept[i] for i in spread(count, len(kept))] if count else []
    if recomputed_inputs:
        chosen += [i for i, b in enumerate(blocks) if getattr(b, "checkpointing", False)]
    return HostOffload(blocks, chosen).install()


class _RecomputedFromHost(torch.autograd.Function):
    """A recomputed block whose input is all it saves (``save_for_backward``, where the offload's hooks send it to
    host memory). The forward runs the block as the recomputation will, with gradients on, so both give the same
    values bit for bit (a forward without gradients may run another compiled graph), and keeps nothing of it; the
    backward restores the RNG (dropout) and autocast state, runs the block again and back-propagates through it."""

    @staticmethod
    def forward(ctx, x, fn, rope, mask, _needs_grad=None):
        ctx.fn, ctx.rope, ctx.mask = fn, rope, mask
        ctx.rng = (torch.get_rng_state(), torch.cuda.get_rng_state(x.device))
        ctx.autocast = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        ctx.save_for_backward(x)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_drop, _dropped):
            out = fn(x.detach().requires_grad_(), rope, mask)
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.random.fork_rng(devices=[x.device]):
            torch.set_rng_state(ctx.rng[0])
            torch.cuda.set_rng_state(ctx.rng[1], x.device)
            with torch.enable_grad(), torch.autocast("cuda", dtype=ctx.autocast[1], enabled=ctx.autocast[0]):
                out = ctx.fn(x, ctx.rope, ctx.mask)
        torch.autograd.backward(out, grad)
        return x.grad if ctx.needs_input_grad[0] else None, None, None, None, None


def _drop(t: torch.Tensor) -> None:
    return None


def _dropped(_: None) -> torch.Tensor:
    raise RuntimeError("a recomputed block's forward keeps nothing for a backward")


def recompute_from_host(fn, x: torch.Tensor, rope, mask) -> torch.Tensor:
    """``fn(x, rope, mask)`` recomputed in the backward from ``x``, which waits in host memory meanwhile (call it
    inside :meth:`HostOffload.saving`)."""
    # An input that needs no gradient (the first block's, from a frozen embedding) still must carry the block's
    # adapters' gradients, and a function's output requires grad only where an input does: an empty tensor that
    # requires grad goes in beside it. (Made a leaf that requires grad instead, the input would be held on the GPU
    # by its gradient's accumulator until the backward, out of the offload's reach.)
    return _RecomputedFromHost.apply(x, fn, rope, mask, None if x.requires_grad else _NEEDS_GRAD)


_NEEDS_GRAD = torch.empty(0, requires_grad=True)


# -- a block's forward as its placement runs it (recomputed, offloaded, or as it is), set from outside the block --
def own_forward(block: nn.Module) -> Callable:
    """The block's own forward (its class's: the architecture), bound to it."""
    return type(block).forward.__get__(block)


def _run(block: nn.Module, forward: Callable, x: torch.Tensor, rope=None, mask: torch.Tensor | None = None):
    """``block``'s forward as the placement runs it: ``forward`` (the block's own, or its compiled form) as it is,
    recomputed in the backward (``block.checkpointing``), and/or with what it saves in host memory
    (``block.saved_to_host``)."""
    if not torch.is_grad_enabled() or (block.saved_to_host is None and not block.checkpointing):
        return forward(x, rope, mask)
    if block.saved_to_host is None:
        return checkpoint(forward, x, rope, mask, use_reentrant=False)
    shared = [*(rope or ()), mask if isinstance(mask, torch.Tensor) else None]
    with block.saved_to_host.saving(block, shared):
        if not block.checkpointing:
            return forward(x, rope, mask)
        # A recomputed block keeps only its input, and that waits in host memory too (torch's non-reentrant
        # checkpoint holds it in a closure, out of the offload's reach).
        return recompute_from_host(forward, x, rope, mask)


def run_from_outside(block: nn.Module, forward: Callable | None = None) -> None:
    """Run ``block`` through :func:`_run` from now on, around ``forward`` (its own forward where None, or what
    replaces it, as its compiled form); what it keeps (``checkpointing``, ``saved_to_host``) is left as it was, and
    is nothing special where never set."""
    if "checkpointing" not in vars(block):
        block.checkpointing = False
    if "saved_to_host" not in vars(block):
        block.saved_to_host = None
    block.forward = functools.partial(_run, block, forward if forward is not None else own_forward(block))


def placed_from_outside(block: nn.Module) -> bool:
    """Whether ``block`` runs through :func:`_run`."""
    forward = vars(block).get("forward")
    return isinstance(forward, functools.partial) and forward.func is _run
