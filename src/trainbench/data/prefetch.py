"""Overlap batch preparation with the training step."""

from __future__ import annotations

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

    def work():
        try:
            for item in iterable:
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
        except BaseException as exc:  # handed to the consumer, raised there
            q.put(exc)
            return
        q.put(done)

    thread = threading.Thread(target=work, daemon=True)
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
        stop.set()


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
