"""End-to-end speed of `trainbench prepare bert` on real Wikipedia text, in MB of raw text per second per core.

The corpus is WikiText-2 (valid + test, about 2.4 MB of Wikipedia articles) copied until it reaches
--size-mb (default 200), one file per copy; the vocabulary is
MLPerf's uncased BERT vocab. Each configuration runs the real command line in a fresh process and is timed
from process start to exit, so interpreter start-up, both passes, md5s and the manifest are all included.

    python perf/prepare_bert.py --workers 1 4 --out /tmp/prep-bench --json results.json

Caveat: a replicated corpus repeats its words, so the tokenizer's word cache is warmer than on the full
Wikipedia (about 2.4 MB of distinct text here against 20 GB there); the tokenizer is about a fifth of the
time per MB once the cache is warm.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"


def make_corpus(folder: Path, size_mb: float, data: Path) -> int:
    """WikiText-2 valid+test copied until size_mb; returns bytes written."""
    sources = [data / "text" / "wikitext-2" / name for name in ("valid.txt", "test.txt")]
    missing = [str(p) for p in sources if not p.exists()]
    if missing:
        sys.exit(f"skipped: {', '.join(missing)} not found (the corpus lives in ../shared beside the repository)")
    text = "".join(p.read_text() for p in sources)
    folder.mkdir(parents=True, exist_ok=True)
    written, copy = 0, 0
    while written < size_mb * 1e6:
        path = folder / f"wiki.{copy:04d}.txt"
        path.write_text(text)
        written += path.stat().st_size
        copy += 1
    return written


def run_once(corpus: Path, out: Path, workers: int, formats: str, num_shards: int, data: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        sys.executable, "-m", "trainbench", "prepare", "bert", "--input", str(corpus),
        "--vocab", str(data / "bert" / "vocab.txt"), "--out", str(out), "--workers", str(workers),
        "--formats", formats, "--num-shards", str(num_shards), "--eval-samples", "1000", "--eval-fraction", "0.05",
        "--no-progress",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"prepare failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    manifest = json.loads((out / "manifest.json").read_text())
    mb = manifest["input"]["text_characters"] / 1e6
    output_bytes = sum(f["bytes"] for f in manifest["files"].values())
    return {
        "workers": workers,
        "formats": formats,
        "text_mb": round(mb, 1),
        "seconds_end_to_end": round(seconds, 2),
        "seconds_in_prepare": manifest["run"]["seconds"],
        "mb_per_s": round(mb / seconds, 2),
        "mb_per_s_per_core": round(mb / seconds / workers, 3),
        "train_samples": manifest["statistics"]["train_samples"],
        "output_gb": round(output_bytes / 1e9, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=float, default=200, help="corpus size (default 200)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, os.cpu_count() or 1])
    p.add_argument("--formats", nargs="+", default=["fixed,varlength", "fixed"], help="--formats values to time")
    p.add_argument("--num-shards", type=int, default=64, help="about MLPerf's shard size at this corpus size")
    p.add_argument("--out", type=Path, default=Path("/tmp/trainbench-prepare-bench"))
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--data", type=Path, default=SHARED, help="folder with text/wikitext-2/ and bert/vocab.txt")
    args = p.parse_args()
    corpus = args.out / "corpus"
    size = make_corpus(corpus, args.size_mb, args.data)
    print(f"corpus: {size / 1e6:.1f} MB in {len(list(corpus.iterdir()))} files; {os.cpu_count()} cores", flush=True)
    results = []
    for formats in args.formats:
        for workers in args.workers:
            r = run_once(corpus, args.out / "prepared", workers, formats, args.num_shards, args.data)
            results.append(r)
            print(json.dumps(r), flush=True)
    shutil.rmtree(args.out / "prepared", ignore_errors=True)
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor() or platform.platform()}",
        "python": platform.python_version(),
        "results": results,
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
