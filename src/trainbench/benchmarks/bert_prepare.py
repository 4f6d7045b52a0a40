"""`trainbench prepare bert`: its options, and the data set from raw text or synthetic."""

from __future__ import annotations

import argparse
from pathlib import Path

from trainbench.data.text import WIKI_DUMP_URL
from trainbench.errors import UserError

WIKI_DUMP = "enwiki-*-pages-articles*.xml.bz2; the latest is at " + WIKI_DUMP_URL


EXAMPLES = """examples:
  trainbench prepare bert --synthetic --preset tiny --out data/bert-tiny
  trainbench prepare bert --input enwiki-20200101-pages-articles-multistream.xml.bz2 \\
      --vocab vocab.txt --out data/bert-wiki
  trainbench prepare bert --input results4/ --vocab vocab.txt --out data/bert --formats fixed,varlength,packed
  trainbench prepare bert --input wikitext-2/ --train-vocab 8000 --num-shards 16 --eval-samples 1000 --out data/wt2

an interrupted preparation from raw text continues with the same command plus --resume.
"""


def add_arguments(prep: argparse.ArgumentParser) -> None:
    """The options of `prepare bert`."""
    sizes = prep.add_argument_group("sizes")
    sizes.add_argument("--eval-samples", type=int, help="eval samples (raw text: default 10000; synthetic: by preset)")
    sizes.add_argument("--num-shards", "--shards", dest="shards", type=int,
                       help="training shards (raw text: default 4320; synthetic: by preset)")  # fmt: skip
    sizes.add_argument("--train-samples", type=int, help="synthetic: training samples (default: by preset)")
    raw = prep.add_argument_group("from raw text")
    raw.add_argument(
        "--input",
        nargs="+",
        metavar="PATH",
        help=f"text files or folders: a Wikipedia dump ({WIKI_DUMP}), results4 files, or WikiText",
    )
    raw.add_argument("--input-format", default="auto", help="auto (default), wiki-xml, results4 or wikitext")
    raw.add_argument("--vocab", help="WordPiece vocab.txt (MLPerf: the uncased BERT vocabulary, 30,522 tokens)")
    raw.add_argument("--train-vocab", type=int, metavar="SIZE", help="train a vocabulary of SIZE tokens instead")
    raw.add_argument("--workers", type=int, default=0, help="worker processes (default: all cores)")
    raw.add_argument("--max-memory-gb", type=float, help="memory bound: fewer workers run when it is low")
    raw.add_argument("--chunk-mb", type=float, default=4.0, help="raw text per work unit in MB (default 4)")
    raw.add_argument(
        "--formats",
        default="fixed,varlength",
        help="comma list of fixed, varlength, bins (4-bin split by length), packed (default fixed,varlength)",
    )
    raw.add_argument("--eval-fraction", type=float, default=0.01, help="documents held out for eval (default 0.01)")
    raw.add_argument("--max-seq-length", type=int, default=512, help="tokens per sample (default 512)")
    raw.add_argument("--max-predictions", type=int, default=76, help="masked tokens per sample at most (default 76)")
    raw.add_argument("--masked-lm-prob", type=float, default=0.15, help="fraction of tokens masked (default 0.15)")
    raw.add_argument("--short-seq-prob", type=float, default=0.1, help="chance of a shorter target (default 0.1)")
    raw.add_argument("--dupe-factor", type=int, default=10, help="passes over the documents (default 10)")
    raw.add_argument("--max-per-pack", type=int, default=3, help="sequences per packed row at most (default 3)")
    raw.add_argument("--resume", action="store_true", help="continue an interrupted preparation in --out")
    raw.add_argument("--keep-work", action="store_true", help="keep the intermediate files (OUT/.work)")


def prepare(args, bench) -> int:
    if args.synthetic == bool(args.input):
        raise UserError("give --input PATH (raw text) or --synthetic, one of the two")
    if args.input:
        return prepare_text(args)
    return prepare_synthetic_data(args, bench)


def prepare_text(args) -> int:
    from trainbench.console import console
    from trainbench.data.prepare_bert import Options, prepare

    spec_args = {
        "seed": args.seed,
        "max_seq_length": args.max_seq_length,
        "max_predictions": args.max_predictions,
        "masked_lm_prob": args.masked_lm_prob,
        "short_seq_prob": args.short_seq_prob,
        "dupe_factor": args.dupe_factor,
        "num_shards": 4320 if args.shards is None else args.shards,
        "eval_samples": 10000 if args.eval_samples is None else args.eval_samples,
        "eval_fraction": args.eval_fraction,
        "chunk_mb": args.chunk_mb,
        "formats": [f.strip() for f in args.formats.split(",") if f.strip()],
        "max_per_pack": args.max_per_pack,
    }
    opts = Options(
        workers=args.workers,
        max_memory_gb=args.max_memory_gb,
        resume=args.resume,
        force=args.force,
        keep_work=args.keep_work,
        progress=not args.no_progress,
    )
    m = prepare(args.input, args.out, args.vocab, spec_args, opts, args.train_vocab, args.input_format)
    st, inp = m["statistics"], m["input"]
    console.print(
        f"{inp['text_characters'] / 1e6:,.1f} MB of text ({inp['documents']:,} documents, {inp['tokens']:,} tokens) "
        f"-> {st['train_samples']:,} training samples in {m['spec']['num_shards']:,} shards and "
        f"{st['eval_samples']:,} eval samples, in {m['run']['seconds']:.1f} s with {m['run']['workers']} workers "
        f"({inp['text_characters'] / 1e6 / max(m['run']['seconds'], 1e-9):.2f} MB/s)"
    )
    console.print(
        f"mean length {st['mean_sequence_length']:.1f} tokens; by length {st['samples_by_length_bin']}; "
        f"masked {st['masked_fraction']:.4f}; random next {st['random_next_fraction']:.4f}"
    )
    console.print(f"data: {args.out}  (manifest: {Path(args.out) / 'manifest.json'})")
    return 0


def prepare_synthetic_data(args, bench) -> int:
    from trainbench.benchmarks.prepare_common import claim, progress_bar, synthetic_sizes
    from trainbench.console import console
    from trainbench.data.synthetic_bert import SyntheticSpec, prepare_synthetic

    cfg = bench.config(args.preset)
    sizes = synthetic_sizes(bench, args, {"num_train_samples": "train_samples", "num_eval_samples": "eval_samples",
                                          "num_shards": "shards"})  # fmt: skip
    spec = SyntheticSpec(
        seq_length=cfg.data.seq_length,
        max_predictions=cfg.data.max_predictions,
        vocab_size=cfg.model.vocab_size,
        seed=args.seed,
        **sizes,
    )
    out = Path(args.out)
    if claim(out, spec.__dict__, args.force):
        return 0
    with progress_bar(f"writing {spec.num_shards} shards", spec.num_shards + 1, args.no_progress) as update:
        written = prepare_synthetic(out, spec, progress=update)
    console.print(
        f"wrote {written['train_samples']:,} training samples in {spec.num_shards} shards and "
        f"{written['eval_samples']:,} eval samples to {out} (seq {spec.seq_length}, "
        f"{spec.max_predictions} predictions, vocab {spec.vocab_size})"
    )
    return 0
