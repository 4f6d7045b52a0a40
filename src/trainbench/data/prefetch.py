"""Overlap batch preparation with the training step."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterable, Iterator

import torch


def prefetch(iterable: Iterable, depth: int) -> Iterator:
    """Produce items of ``iterable`` in a background thread, ``depth`` ahead of the consumer."""
    if depth <= 0:
        yield from iterable
        return
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def offer(item) -> bool:
        """Put ``item`` unless the consumer has stopped; never blocks past a stop."""
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work():
        try:
            for item in iterable:
                if not offer(item):
                    return
        except BaseException as exc:  # handed to the consumer, raised there
            offer(exc)
            return
        offer(done)

    thread = threading.Thread(target=work, name="prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        # The producer is joined, not left to run: a daemon thread still inside torch's C++ code when the
        # interpreter exits is ended by a forced unwind that aborts the process ("terminate called without an
        # active exception"), which turned ranks that had logged run_stop into failed runs.
        stop.set()
        with contextlib.suppress(queue.Empty):
            while True:  # make room, so that a put in progress returns
                q.get_nowait()
        thread.join()


def pinned(steps: Iterable[list[dict]], device: torch.device) -> Iterator[list[dict]]:
    """Each step's micro-batches (dicts of numpy arrays) as tensors in page-locked host memory.

    A copy to the GPU from ordinary (pageable) memory makes the host wait until the GPU has finished all the
    work queued before it, so the next step could not be queued while this one runs; from page-locked memory
    the copy is queued like a kernel. Attributes of a step (its sample count) are kept. ``device`` is made current
    in the thread that runs this (the prefetch thread), else pinning would open a context on GPU 0 in every rank.
    """
    torch.cuda.set_device(device)
    for step in steps:
        out = type(step)({k: torch.from_numpy(v).pin_memory() for k, v in mb.items()} for mb in step)
        out.__dict__.update(getattr(step, "__dict__", {}))
        yield out
