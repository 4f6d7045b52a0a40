"""All-reduce bandwidth on this node through PyTorch and NCCL, at the sizes DDP sends for BERT-large.

Times fp32 all-reduces of 25 MB (a DDP bucket), 100 MB and 1.34 GB (all of BERT-large's gradients) on every GPU
of the node, once per NCCL protocol (NCCL's own choice, then NCCL_PROTO=Simple, LL128 and LL), each in its own
processes (NCCL reads the variable at start), and reports algorithm bandwidth (bytes / time) and bus bandwidth
(x 2(n-1)/n, what each link carries in a ring), and which transport NCCL took between the GPUs (NCCL_DEBUG).

    python perf/nccl_allreduce.py --out OUT [--gpus 4] [--protocols default]

Writes OUT/nccl_allreduce.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

SIZES_MB = (25, 100, 1340)


def worker() -> None:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    result = {}
    for mb in SIZES_MB:
        x = torch.ones(mb * 2**20 // 4, device="cuda")
        for _ in range(3):
            dist.all_reduce(x)
        reps = 20 if mb < 1000 else 5
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        dist.barrier()
        start.record()
        for _ in range(reps):
            dist.all_reduce(x)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / reps
        algbw = x.numel() * 4 / seconds / 1e9
        result[f"{mb}MB"] = {"ms": seconds * 1e3, "algbw_GBps": algbw, "busbw_GBps": algbw * 2 * (world - 1) / world}
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path)
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument(
        "--protocols",
        nargs="+",
        default=["default", "Simple", "LL128", "LL"],
        choices=["default", "Simple", "LL128", "LL"],
        help="NCCL protocols to time (default: all four)",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker()
    args.out.mkdir(parents=True, exist_ok=True)
    report = {}
    for proto in args.protocols:
        env = dict(os.environ, NCCL_DEBUG="INFO")
        if proto != "default":
            env["NCCL_PROTO"] = proto
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.gpus}",
               __file__, "--worker"]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = (proc.stdout + proc.stderr).splitlines()
        results = [json.loads(line.split("RESULT ", 1)[1]) for line in lines if "RESULT " in line]
        transports = sorted({m.group(1) for line in lines if (m := re.search(r"via (\S+)", line))})
        report[proto] = {"returncode": proc.returncode, "transports": transports}
        if results:
            report[proto] |= results[0]
        else:
            report[proto]["error"] = "\n".join(lines[-15:])
        print(proto, json.dumps(report[proto]), flush=True)
    (args.out / "nccl_allreduce.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
