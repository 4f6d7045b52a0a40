"""Triton kernels built on first use: the import of Triton, and so the kernels' compilation, waits until a GPU
tensor needs them, and a machine without Triton (CPU-only installs) falls back to torch's operations."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def lazy_kernel(define: Callable[[Any, Any], Any]) -> Callable[[], tuple[Any, Callable[[int, int], int]] | None]:
    """A getter of ``(kernel, triton.cdiv)``, where ``define(triton, triton.language)`` returns the ``@triton.jit``
    kernel. The first call imports Triton and builds the kernel; later calls return the same pair. None, every call,
    where Triton cannot be imported."""

    @functools.cache
    def get() -> tuple[Any, Callable[[int, int], int]] | None:
        try:
            import triton
            import triton.language as tl
        except ImportError:
            return None
        return define(triton, tl), triton.cdiv

    return get


@functools.cache
def triton_available() -> bool:
    """Whether Triton imports here (the kernels built on first use need it; without it they fall back to torch)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
