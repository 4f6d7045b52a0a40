"""The lazy builder behind trainbench's Triton kernels (fp8.py, glu_kernel.py): built once on first use, None where
Triton is absent (the kernels themselves are checked against their torch forms in tests/test_gpu_fp8.py and
tests/test_gpu_moe.py)."""

import sys
import types

from trainbench.families.triton_kernels import lazy_kernel


def test_a_kernel_is_built_once_on_first_use_and_is_none_without_triton(monkeypatch):
    calls = []

    def define(triton, tl):
        calls.append((triton, tl))
        return f"kernel {len(calls)}"

    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    monkeypatch.setitem(sys.modules, "triton.language", None)
    absent = lazy_kernel(define)
    assert absent() is None and absent() is None and calls == []

    fake = types.ModuleType("triton")
    fake.language = types.ModuleType("triton.language")
    fake.cdiv = lambda a, b: -(-a // b)
    monkeypatch.setitem(sys.modules, "triton", fake)
    monkeypatch.setitem(sys.modules, "triton.language", fake.language)
    present = lazy_kernel(define)
    assert calls == []  # nothing built before the first use
    kernel, cdiv = present()
    assert kernel == "kernel 1" and calls == [(fake, fake.language)] and cdiv(10, 4) == 3
    assert present() == (kernel, cdiv) and len(calls) == 1
