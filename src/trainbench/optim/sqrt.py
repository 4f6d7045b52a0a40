"""A square root that gives the same bits on every CPU.

On the CPU, PyTorch's float32 ``sqrt`` goes through MKL's vector math, which is not correctly rounded and differs by
processor: against NumPy's roots of 100,003 uniform inputs, 641 were one unit in the last place off on an Intel Xeon
and 19,698 on an AMD EPYC (``perf/cpu_sqrt.py``), so the same CPU run computed other bits on the two machines. The
float64 root rounded back to the input's type is the correctly rounded root (53 bits hold 2 x 24 + 2), and was on
both. GPUs keep ``torch.sqrt``, which is correctly rounded there.
"""

from __future__ import annotations

import torch


def sqrt(t: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root of ``t``, whatever the CPU."""
    if t.device.type != "cpu" or t.dtype == torch.float64:
        return t.sqrt()
    return t.double().sqrt().to(t.dtype)


def foreach_sqrt(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`sqrt` of each tensor; one ``torch._foreach_sqrt`` off the CPU."""
    if not tensors or tensors[0].device.type != "cpu":
        return torch._foreach_sqrt(tensors)
    return [sqrt(t) for t in tensors]
