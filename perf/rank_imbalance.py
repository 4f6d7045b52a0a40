"""How long the slowest rank's attention keeps the others waiting under DDP, estimated from prepared packed rows.

Under DDP a step lasts as long as its slowest rank. With packed rows every rank's GEMMs see the same row width, but
the attention work of a row is the sum of its sequences' squared lengths, so it differs between ranks. This draws
random steps (world x accumulation x micro-batch rows, as the trainer's shuffled stream deals them out) from the
packed shards and reports the expected excess of the slowest rank's attention work over the mean rank's, as a
fraction; multiply by a step's attention time (from a profile) for milliseconds.

    python perf/rank_imbalance.py DATA_DIR/train_packed [--draws 4000]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import h5py
import numpy as np


def row_costs(folder: Path) -> np.ndarray:
    costs = []
    for path in sorted(folder.glob("*.hdf5")):
        with h5py.File(path, "r") as f:
            ids = f["sequence_ids"][:]
        for row in ids:
            _, lengths = np.unique(row[row > 0], return_counts=True)
            costs.append(float((lengths.astype(np.float64) ** 2).sum()))
    if not costs:
        raise SystemExit(f"error: no packed shards (*.hdf5 with sequence_ids) in {folder}")
    return np.asarray(costs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("packed", type=Path)
    p.add_argument("--draws", type=int, default=4000)
    args = p.parse_args()
    costs = row_costs(args.packed)
    rng = np.random.default_rng(0)
    out = {"rows": len(costs), "row_cost_cv": costs.std() / costs.mean(), "excess": {}}
    for world in (2, 4, 8):
        for micro, accumulation in ((48, 1), (48, 2), (96, 1)):
            per_rank = np.stack([rng.choice(costs, (world, accumulation * micro), replace=False).sum(1)
                                 for _ in range(args.draws)])  # fmt: skip
            excess = float(np.mean(per_rank.max(1) / per_rank.mean(1) - 1))
            out["excess"][f"{world} ranks, {micro}x{accumulation}"] = excess
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
