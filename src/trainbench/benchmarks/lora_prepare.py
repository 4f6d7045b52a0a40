"""`trainbench prepare llama2_70b_lora`: GovReport (three source forms) or the synthetic task, packed into rows."""

from __future__ import annotations

import argparse
import errno
from pathlib import Path

from trainbench.benchmarks.prepare_common import claim, synthetic_sizes
from trainbench.errors import DataError, UserError

# The tiny base is written in shards this small, so tiny runs read several shards as 70B runs do.
TINY_SHARD_BYTES = 100_000
TINY_TOPICS = 48  # the tiny preset's synthetic GovReport: its documents' topics
# What --force replaces of another data set in --out.
REPLACED = ("train", "eval", "base")


EXAMPLES = """examples:
  trainbench prepare llama2_70b_lora --synthetic --preset tiny --out data/lora-tiny
  trainbench prepare llama2_70b_lora --source gov_report/ --tokenizer tokenizer.model --out data/govreport
  trainbench prepare llama2_70b_lora --source mlperf_llama2_70b_lora/data/ --out data/govreport
"""


def add_arguments(prep: argparse.ArgumentParser) -> None:
    """The options of `prepare llama2_70b_lora`."""
    gov = prep.add_argument_group("from GovReport")
    gov.add_argument("--source", metavar="DIR", help="GovReport as SCROLLS parquet (input, output), MLPerf's "
                     "tokenised parquet (input_ids, labels) or NVIDIA's train.npy/validation.npy")  # fmt: skip
    gov.add_argument("--tokenizer", metavar="FILE", help="for text in --source: HF tokenizer.json or SentencePiece "
                     "tokenizer.model")  # fmt: skip
    syn = prep.add_argument_group("synthetic")
    syn.add_argument("--train-samples", type=int, help="training sequences (default: by preset)")
    syn.add_argument("--eval-samples", type=int, help="eval sequences (default: by preset)")


def prepare(args, bench) -> int:
    """Write the data set into ``args.out``; a disk that fills up ends in one sentence, and since the manifest is
    written last, a folder without one is never taken for a data set."""
    try:
        return _prepare(args, bench)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            where = e.filename or "while writing"
            raise DataError(f"{args.out}: the disk is full ({where}); nothing there is marked complete (no "
                            "manifest.json): make room and run the same command again") from None  # fmt: skip
        raise
    except Exception as e:
        if "No space left on device" in str(e):  # safetensors reports a full disk as its own error type
            raise DataError(f"{args.out}: the disk is full; nothing there is marked complete (no manifest.json): "
                            "make room and run the same command again") from None  # fmt: skip
        raise


def _prepare(args, bench) -> int:
    from rich.progress import BarColumn, Progress, TextColumn

    from trainbench.console import console
    from trainbench.data import prepare_sft as p
    from trainbench.data import sft

    if args.synthetic == bool(args.source):
        raise UserError("give --source GOVREPORT_DIR (with --tokenizer for text) or --synthetic, one of the two")
    cfg = bench.config(args.preset)
    row, vocab = cfg.data.seq_length, cfg.model.vocab_size
    out = Path(args.out)
    # The tiny preset's synthetic set writes its random base beside; the 70B's names none (138 GB): drawn from the seed
    writes_base = args.synthetic and args.preset == "tiny"
    if args.synthetic:
        sizes = synthetic_sizes(bench, args, {"train": "train_samples", "eval": "eval_samples"})
        spec = {"synthetic": True, "preset": args.preset, "seed": args.seed, "train": sizes["train"],
                "eval": sizes["eval"]}  # fmt: skip
        if claim(out, spec, args.force, REPLACED):
            return 0

        if writes_base:  # short examples packed
            splits = {"train": p.synthetic_split(vocab, TINY_TOPICS, spec["train"], args.seed, 1),
                      "eval": p.synthetic_split(vocab, TINY_TOPICS, spec["eval"], args.seed, 2)}  # fmt: skip
            _write_base(cfg, out / "base", args.seed)
        else:  # MLPerf's GovReport rows' shape; no base (138 GB at 70B): the run draws it from its seed
            splits = {split: p.synthetic_rows(vocab, TINY_TOPICS, spec[split], args.seed, stream, row)
                      for split, stream in (("train", 1), ("eval", 2))}  # fmt: skip
        kind, dropped = "synthetic", {"train": 0, "eval": 0}
    else:
        src = Path(args.source)
        spec = {"source": str(src.resolve()), "tokenizer": args.tokenizer, "preset": args.preset}
        if claim(out, spec, args.force, REPLACED):
            return 0
        columns = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} files")]
        with Progress(*columns, console=console, transient=True, disable=args.no_progress) as progress:
            task = progress.add_task("reading GovReport", total=None)
            kind, splits, dropped = p.read_source(src, Path(args.tokenizer) if args.tokenizer else None, row, vocab,
                                                  lambda done, total: progress.update(task, completed=done,
                                                                                      total=total))  # fmt: skip
    as_given = kind in p.ROWS_AS_GIVEN
    sizes = {split: sft.write_split(out / split, seqs, row, packed=not as_given) for split, seqs in splits.items()}
    manifest = {"format": sft.FORMAT, "benchmark": bench.name, "source": kind, "spec": spec, "seq_length": row,
                "vocab_size": vocab, "splits": sizes, "dropped_longer_than_row": dropped,
                "rows": "as given, attention causal across each row" if as_given
                else "packed, attention inside each sequence"}  # fmt: skip
    if writes_base:
        manifest["base_weights"] = "base"
    elif args.synthetic:
        manifest["base"] = sft.RANDOM_BASE
    sft.write_manifest(out, manifest)
    t, e = sizes["train"], sizes["eval"]
    if as_given:
        console.print(f"{t['rows']:,} training rows and {e['rows']:,} eval rows of at most {row} tokens, each "
                      f"kept as given (MLPerf's pre-packed rows, causal attention across each): {out}")  # fmt: skip
    else:
        console.print(f"{t['sequences']:,} training sequences in {t['rows']:,} rows of {row} tokens, "
                      f"{e['sequences']:,} eval sequences in {e['rows']:,} rows, into {out} ({kind}; dropped as "
                      f"longer than a row: {dropped['train']:,} training, {dropped['eval']:,} eval)")  # fmt: skip
    if writes_base:
        console.print(f"base model (random, {cfg.model.num_layers} layers) as sharded safetensors in {out / 'base'}")
    elif args.synthetic:
        console.print(f"no base model written: a run on these rows initialises its {cfg.model.num_layers}-layer base "
                      "from its seed (a throughput-and-cadence run, not a convergence result)")  # fmt: skip
    return 0


def _write_base(cfg, folder: Path, seed: int) -> None:
    """The tiny preset's frozen base: random weights from ``seed`` in several safetensors shards."""
    import torch

    from trainbench.families.decoder.hf_checkpoint import save_sharded
    from trainbench.families.decoder.model import DecoderLM

    torch.manual_seed(seed)
    model = DecoderLM(cfg.model)
    model.init_weights(seed)
    save_sharded(model.state_dict(), folder, TINY_SHARD_BYTES)
