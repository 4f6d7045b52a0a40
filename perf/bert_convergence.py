"""Does a switch change what BERT learns? Train the same runs with it off and on, through `trainbench run`.

Two settings, each on one GPU, compiled, bf16, with two seeds per configuration:

- `--preset tiny` (default): the tiny preset to its target on its synthetic data, generated with half of the
  samples short (`short_seq_prob` 0.5, instead of 0.1) so that packed rows hold several sequences, and packed
  with the project's packer (at most 3 per row). Configurations: `fixed` (one sample per row, padding masked),
  `varlen` (packed rows, flash attention, `model.packed_attention=varlen`) and `cudnn` (packed rows, cuDNN's
  attention, `model.packed_attention=cudnn`), at the preset's 64 rows a step, and `_49rows`: 49 packed rows
  a step, about the 64 samples a step of the fixed layout. The question: is the target reached at the same
  eval?
- `--preset base`: packed rows from WikiText-2 with MLPerf's vocab (as bert_scaling.py prepares them), the base
  preset (12 x 768, head size 64, dropout 0.1 as in MLPerf) for `--samples`, `varlen` against `cudnn`: the
  masked-LM accuracy at each eval, far from any target.

Every run reports its masked-LM accuracy at each eval and its training loss. The seed-to-seed spread of one
configuration is the noise a switch's difference is judged against (with dropout, the kernels draw their masks
differently, so no two configurations match step by step).

    python perf/bert_convergence.py --out OUT [--preset tiny|base] [--data DIR] [--samples N] [--only NAME ...]

Writes OUT/bert_convergence.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "perf"))

from bert_scaling import prepare, run  # noqa: E402

PACKED = ["data.layout=packed"]
CONFIGS = {
    "fixed": ["data.layout=fixed"],
    "varlen": [*PACKED, "model.packed_attention=varlen"],
    "cudnn": [*PACKED, "model.packed_attention=cudnn"],
    # tiny: 64 packed rows hold about 83 samples (1.30 a row), so a step takes more samples than the fixed
    # layout's 64 and the schedule (per step) moves slower per sample; 49 rows hold about 64, as fixed rows do
    "varlen_49rows": [*PACKED, "model.packed_attention=varlen", "global_batch_size=49", "micro_batch_size=49"],
    "cudnn_49rows": [*PACKED, "model.packed_attention=cudnn", "global_batch_size=49", "micro_batch_size=49"],
}
SEEDS = (1, 2)


def prepare_tiny(work: Path) -> Path:
    """The tiny preset's synthetic data with half of the samples short, plus train_packed/ (at most 3 per row)."""
    import h5py
    import numpy as np

    sys.path.insert(0, str(REPO / "src"))
    from trainbench.benchmarks.bert import SYNTHETIC_SIZES, BertBenchmark
    from trainbench.data.bert_hdf5 import shard_record, write_arrays
    from trainbench.data.packing import PACKED_DTYPES, instances_from_fixed, pack, packed_predictions
    from trainbench.data.synthetic_bert import SyntheticSpec, prepare_synthetic

    out = work / "tiny_short"
    if (out / "train_packed").is_dir():
        return out
    d = BertBenchmark().config("tiny").data
    spec = SyntheticSpec(seq_length=d.seq_length, max_predictions=d.max_predictions, vocab_size=1024, seed=0,
                         short_seq_prob=0.5, **SYNTHETIC_SIZES["tiny"])  # fmt: skip
    prepare_synthetic(out, spec)
    columns = packed_predictions(d.seq_length, d.max_predictions, 0.15, 3)
    (out / "train_packed.tmp").mkdir(exist_ok=True)
    manifest = json.loads((out / "manifest.json").read_text())
    for i, shard in enumerate(sorted((out / "train").glob("*.hdf5"))):
        with h5py.File(shard) as f:
            fixed = {k: f[k][:] for k in f}
        packed = pack(instances_from_fixed(fixed), d.seq_length, 3, columns, np.random.default_rng(i))
        path = out / "train_packed.tmp" / shard.name
        write_arrays(path, packed, PACKED_DTYPES)
        # recorded as `prepare` records a shard: a run checks every shard the manifest lists, and refuses others
        manifest["files"][f"train_packed/{shard.name}"] = {"samples": int((packed["next_sentence_labels"] >= 0).sum())}
        manifest["files"][f"train_packed/{shard.name}"] |= shard_record(path, len(packed["input_ids"]), packed)
    (out / "manifest.json.tmp").write_text(json.dumps(manifest, indent=2) + "\n")  # after the shards: not newer
    (out / "manifest.json.tmp").replace(out / "manifest.json")
    (out / "train_packed.tmp").rename(out / "train_packed")  # whole, or not there
    return out


def read_history(results: Path) -> dict:
    """Eval accuracy by samples, and the mean training loss of the last quarter of the logged intervals."""
    (run_dir,) = [d for d in results.iterdir() if d.is_dir()]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = {r["samples"]: r["masked_lm_accuracy"] for r in rows if "masked_lm_accuracy" in r}
    losses = [r["loss"] for r in rows if "loss" in r]
    tail = losses[-max(1, len(losses) // 4) :]
    return {"evals": evals, "final_loss": sum(tail) / len(tail), "run_dir": str(run_dir)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data")
    p.add_argument("--work", type=Path, default=Path("/tmp/tb-scaling"))
    p.add_argument("--preset", choices=("tiny", "base"), default="tiny")
    p.add_argument("--samples", type=int, default=32_000, help="base: training samples per run")
    p.add_argument("--only", nargs="*", help="run only these configurations")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.preset == "tiny":
        setting = [f"data.dir={prepare_tiny(args.work)}"]
    else:  # a short stretch of base on WikiText: exit code 1 (target not reached) is expected
        setting = [f"data.dir={prepare(args.work, args.data)}", "global_batch_size=64", "micro_batch_size=64",
                   "schedule.warmup_steps=100", f"schedule.max_samples={args.samples}", "eval.every_samples=6400",
                   "eval_samples=256"]  # fmt: skip
    report = {"preset": args.preset, "runs": []}
    for name, overrides in CONFIGS.items():
        if (args.only and name not in args.only) or (args.preset == "base" and name not in ("varlen", "cudnn")):
            continue
        for seed in SEEDS:
            results = args.work / "convergence" / f"{args.preset}_{name}_seed{seed}"
            shutil.rmtree(results, ignore_errors=True)
            run([sys.executable, "-m", "trainbench", "run", "bert", "--preset", args.preset, *setting,
                 "perf.compile=true", "device=cuda", "log_every_steps=20", "progress=false", "telemetry_hz=0",
                 f"seed={seed}", f"output.results_dir={results}", *overrides], ok=(0, 1))  # fmt: skip
            report["runs"].append({"config": name, "seed": seed} | read_history(results))
            print(json.dumps(report["runs"][-1]), flush=True)
            (args.out / "bert_convergence.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
