"""Does the telemetry sampler slow training? BERT-base on one GPU, samples/s with telemetry off, 1 Hz and
10 Hz (interleaved, repeated); plus what its CSV holds (rows per second, value ranges), a profiled run's top
kernels, and a report of the folder.

    python perf/telemetry_overhead.py --out OUT [--steps 40] [--repeats 2]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def tb(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "trainbench", *args], env=env, capture_output=True, text=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--work", type=Path, default=Path("/tmp/tb-telemetry"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.work / "data"
    if not (data / "manifest.json").exists():
        r = tb("prepare", "bert", "--synthetic", "--preset", "base", "--train-samples", "20000", "--eval-samples",
               "1000", "--shards", "4", "--out", str(data))  # fmt: skip
        assert r.returncode == 0, r.stdout + r.stderr
    gbs = 256
    common = [f"data.dir={data}", "data.eval_samples=1000", f"schedule.max_samples={args.steps * gbs}",
              f"eval.every_samples={args.steps * gbs}", "progress=false", "log_every_steps=5"]  # fmt: skip
    results = []
    for repeat in range(args.repeats):
        for hz in (0, 1, 10):
            folder = args.work / f"runs-{hz}hz-{repeat}"
            shutil.rmtree(folder, ignore_errors=True)
            r = tb("run", "bert", "--preset", "base", *common, f"output.results_dir={folder}", f"telemetry_hz={hz}")
            run_dir = next(folder.iterdir())
            outcome = json.loads((run_dir / "run_0.json").read_text())
            row = {"telemetry_hz": hz, "repeat": repeat, "samples_per_s": outcome["train_samples_per_s"],
                   "energy": outcome.get("energy")}  # fmt: skip
            csvs = sorted(run_dir.glob("telemetry_*_gpu*.csv"))
            if csvs:
                with open(csvs[0], newline="") as f:
                    rows = list(csv.DictReader(f))
                span = (int(rows[-1]["time_ms"]) - int(rows[0]["time_ms"])) / 1000
                row["csv_rows"] = len(rows)
                row["csv_rows_per_s"] = round((len(rows) - 1) / span, 2) if span > 0 else None

                def rng(key, rows=rows):
                    vals = [float(x[key]) for x in rows if x[key] not in ("", None)]
                    return [min(vals), max(vals)] if vals else None

                row["ranges"] = {k: rng(k) for k in ("power_w", "gpu_temp_c", "mem_temp_c", "sm_clock_mhz",
                                                      "mem_clock_mhz", "gpu_util_pct", "mem_used_mib")}  # fmt: skip
                if hz == 10 and repeat == 0:
                    shutil.copy(csvs[0], args.out / "telemetry_10hz_gpu0.csv")
            results.append(row)
            print(json.dumps(row), flush=True)
            assert r.returncode in (0, 1), r.stdout + r.stderr
    folder = args.work / "runs-profile"
    shutil.rmtree(folder, ignore_errors=True)
    r = tb("run", "bert", "--preset", "base", *common, f"output.results_dir={folder}", "profile=true",
           "profile_start_step=10", "profile_steps=3")  # fmt: skip
    run_dir = next(folder.iterdir())
    shutil.copy(run_dir / "profile_0_kernels.csv", args.out / "profile_kernels.csv")
    r = tb("report", str(run_dir))
    shutil.copy(run_dir / "report.html", args.out / "report.html")
    (args.out / "telemetry_overhead.json").write_text(json.dumps(results, indent=1))
    print(r.stdout[-1500:])


if __name__ == "__main__":
    main()
