"""`trainbench prepare gpt3` and `prepare llama31_8b`: their options, and C4 or a synthetic language as Megatron
indexed datasets."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from trainbench.errors import UserError


def add_arguments(prep: argparse.ArgumentParser) -> None:
    """The options of `prepare gpt3`, `prepare llama31_8b` and `prepare llama2_70b_lora`."""
    llm = prep.add_argument_group("LLM benchmarks (gpt3, llama31_8b, llama2_70b_lora)")
    llm.add_argument("--source", metavar="DIR", help="gpt3, llama31_8b: folder of C4 json(.gz) files (c4-train.*, "
                     "c4-validation.*); llama2_70b_lora: GovReport as SCROLLS parquet (input, output), MLPerf's "
                     "tokenised parquet (input_ids, labels) or NVIDIA's train.npy/validation.npy")  # fmt: skip
    llm.add_argument("--tokenizer", metavar="FILE", help="tokenizer for text in --source: HF tokenizer.json (or, "
                     "llama2_70b_lora, SentencePiece tokenizer.model)")  # fmt: skip
    llm.add_argument("--eod-token", help="end-of-document token appended to each document (default: the tokenizer's)")
    llm.add_argument("--train-tokens", type=int, help="synthetic: training tokens (default 2,000,000)")


def prepare(args, bench) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from trainbench.console import console
    from trainbench.data import prepare_llm as p

    if args.synthetic == bool(args.source):
        raise UserError("give --source C4_DIR (with --tokenizer) or --synthetic, one of the two")
    out = Path(args.out)
    columns = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>5.1f}%"),
               TimeRemainingColumn()]  # fmt: skip
    if args.synthetic:
        cfg = bench.config(args.preset)
        spec = p.SyntheticLMSpec(vocab_size=cfg.model.vocab_size, train_tokens=args.train_tokens or 2_000_000,
                                 eval_tokens=200_000, seed=args.seed)  # fmt: skip
        if (out / "manifest.json").exists():
            if json.loads((out / "manifest.json").read_text()).get("spec") == spec.__dict__:
                console.print(f"{out} already holds this data set (manifest.json matches); nothing to do")
                return 0
            if not args.force:
                raise UserError(f"{out} already holds a different data set; choose another --out or add --force")
        with Progress(*columns, console=console, transient=True) as progress:
            task = progress.add_task("synthetic tokens", total=spec.train_tokens + spec.eval_tokens)
            m = p.prepare_synthetic_lm(out, spec, progress=lambda done, total: progress.update(task, completed=done))
        floor = m["loss_floor_nats"]
        console.print(
            f"wrote {spec.train_tokens:,} training and {spec.eval_tokens:,} eval tokens to {out} "
            f"(vocab {spec.vocab_size}; best possible log perplexity {floor:.3f})"
        )
        return 0
    if not args.tokenizer:
        raise UserError("--source needs --tokenizer tokenizer.json")
    workers = args.workers or p.default_workers()
    with Progress(*columns, console=console, transient=True, disable=args.no_progress) as progress:
        task = progress.add_task(f"tokenising with {workers} workers (MB of input)", total=None)

        def update(done, total):
            progress.update(task, completed=done / 1e6, total=total / 1e6)

        m = p.prepare_c4(Path(args.source), out, Path(args.tokenizer), workers, args.eod_token, progress=update)
    console.print(f"{m['documents']:,} documents, {m['tokens']:,} tokens into {out}/train and {out}/eval "
                  f"(EOD id {m['eod_id']}, vocab {m['vocab_size']})")  # fmt: skip
    return 0
