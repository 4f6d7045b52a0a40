"""How far PyTorch's float32 square root on the CPU is from the correctly rounded one, and whether trainbench's
``optim.sqrt`` is it: NumPy's roots of 100,003 uniform inputs (seed 0) against ``torch.sqrt`` and ``optim.sqrt``.

    python perf/cpu_sqrt.py

Prints one JSON line: the CPU, PyTorch's version and the count of results that differ from NumPy's for each.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from trainbench.optim.sqrt import sqrt  # noqa: E402
from trainbench.telemetry import cpu_model  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    x = torch.rand(100_003) + 1e-8
    exact = torch.from_numpy(np.sqrt(x.numpy()))
    off = {"torch_sqrt_off": int((x.sqrt() != exact).sum()), "optim_sqrt_off": int((sqrt(x) != exact).sum())}
    machine = {"cpu": cpu_model() or platform.processor(), "torch": torch.__version__, "inputs": x.numel()}
    print(json.dumps(machine | off))


if __name__ == "__main__":
    main()
