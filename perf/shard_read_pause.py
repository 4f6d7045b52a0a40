"""How long loading one training shard takes, and how long it pauses the other Python threads.

The trainer reads a whole shard when its sample order enters it (``ShardCache``), in the prefetch thread. This
times that read for the first shard of a folder and, from a second thread that wakes every millisecond, the
longest gap it sees meanwhile: a read that held the interpreter lock would stall the training thread that long.

    python perf/shard_read_pause.py DIR/train_packed [--layout packed]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from trainbench.data.bert_hdf5 import LAYOUTS, read_rows  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shards", type=Path, help="a folder of HDF5 shards")
    p.add_argument("--layout", default="packed", choices=sorted(LAYOUTS))
    args = p.parse_args()
    path = sorted(args.shards.glob("*.hdf5"))[0]
    gaps: list[float] = []
    done = threading.Event()

    def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    thread = threading.Thread(target=ticker)
    thread.start()
    time.sleep(0.05)
    start = time.perf_counter()
    rows = read_rows(path, keys=LAYOUTS[args.layout])
    seconds = time.perf_counter() - start
    done.set()
    thread.join()
    print(json.dumps({"shard": str(path), "rows": len(rows["input_ids"]), "read_s": round(seconds, 4),
                      "longest_pause_ms": round(max(gaps) * 1000, 2)}))  # fmt: skip


if __name__ == "__main__":
    main()
