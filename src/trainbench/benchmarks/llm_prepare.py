"""`trainbench prepare gpt3` and `prepare llama31_8b`: their options, and C4 or a synthetic language as Megatron
indexed datasets."""

from __future__ import annotations

import argparse
from pathlib import Path

from trainbench.errors import UserError

EXAMPLES = """examples:
  trainbench prepare {name} --synthetic --preset tiny --out data/{name}-tiny
  trainbench prepare {name} --source c4/en --tokenizer tokenizer.json --out data/{name}-c4
"""


def add_arguments(prep: argparse.ArgumentParser) -> None:
    """The options of `prepare gpt3` and `prepare llama31_8b`."""
    c4 = prep.add_argument_group("from C4")
    c4.add_argument("--source", metavar="DIR", help="folder of C4 json(.gz) files (c4-train.*, c4-validation.*)")
    c4.add_argument("--tokenizer", metavar="FILE", help="HF tokenizer.json for the text in --source")
    c4.add_argument("--eod-token", help="end-of-document token appended to each document (default: the tokenizer's)")
    c4.add_argument("--workers", type=int, default=0, help="worker processes (default: all cores)")
    syn = prep.add_argument_group("synthetic")
    syn.add_argument("--train-tokens", type=int, help="training tokens (default 2,000,000)")


def prepare(args, bench) -> int:
    from trainbench.benchmarks.prepare_common import claim, progress_bar
    from trainbench.console import console
    from trainbench.data import prepare_llm as p

    if args.synthetic == bool(args.source):
        raise UserError("give --source C4_DIR (with --tokenizer) or --synthetic, one of the two")
    out = Path(args.out)
    if args.synthetic:
        if args.train_tokens is not None and args.train_tokens < 1:
            raise UserError(f"--train-tokens must be at least 1, got {args.train_tokens}")
        cfg = bench.config(args.preset)
        spec = p.SyntheticLMSpec(vocab_size=cfg.model.vocab_size, train_tokens=args.train_tokens or 2_000_000,
                                 eval_tokens=200_000, seed=args.seed)  # fmt: skip
        if claim(out, spec.__dict__, args.force):
            return 0
        with progress_bar("synthetic tokens", spec.train_tokens + spec.eval_tokens, args.no_progress) as update:
            m = p.prepare_synthetic_lm(out, spec, progress=update)
        floor = m["loss_floor_nats"]
        console.print(
            f"wrote {spec.train_tokens:,} training and {spec.eval_tokens:,} eval tokens to {out} "
            f"(vocab {spec.vocab_size}; best possible log perplexity {floor:.3f})"
        )
        return 0
    if not args.tokenizer:
        raise UserError("--source needs --tokenizer tokenizer.json")
    workers = args.workers or p.default_workers()
    with progress_bar(f"tokenising with {workers} workers (MB of input)", None, args.no_progress) as update:
        m = p.prepare_c4(Path(args.source), out, Path(args.tokenizer), workers, args.eod_token,
                         progress=lambda done, total: update(done / 1e6, total / 1e6))  # fmt: skip
    console.print(f"{m['documents']:,} documents, {m['tokens']:,} tokens into {out}/train and {out}/eval "
                  f"(EOD id {m['eod_id']}, vocab {m['vocab_size']})")  # fmt: skip
    return 0
