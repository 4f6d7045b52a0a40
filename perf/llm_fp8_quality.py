"""Does pretraining in FP8 (``model.precision=fp8``) follow the bf16 loss curve? A Llama-shaped model of ``--width``
and ``--layers`` trained from scratch by ``trainbench run llama31_8b`` on the GPU (compiled, fused q/k/v as the
llama31-8b preset), or with ``--benchmark gpt_oss_20b`` a mixture of experts of that width and depth (the reference's
block: ``--experts`` experts of the model's width, 4 a token, heads of 64, a 128-token window on every other block;
FP8 then also in the experts' grouped products), on Wikipedia text: the WikiText files of ``--text``, split into
articles, one in 20 held out for eval, WordPiece-tokenised with ``--vocab`` (MLPerf's uncased BERT vocabulary)
through ``trainbench prepare``. For each seed, bf16 and FP8 see the same samples in the same order; every eval's log
perplexity and every logged training loss are recorded.

    python perf/llm_fp8_quality.py --out OUT/quality.json --text wikitext-2/ --vocab vocab.txt \\
        [--width 1024 --layers 8 --seq 1024 --batch 16 --samples 6144 --seeds 1 2 3 --pad-vocab 64]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def trainbench(*args: str) -> int:
    path = os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "trainbench", *args], check=False, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": path}).returncode  # fmt: skip


def articles(text: str) -> list[str]:
    """WikiText's articles: each starts at a top-level heading line `` = Title = ``."""
    parts = re.split(r"\n(?= = [^=].* = \n)", "\n" + text)
    return [p.strip() for p in parts if p.strip()]


def source_folder(text_dir: Path, out: Path) -> dict:
    """C4-style json lines from the WikiText files: one in 20 articles to the validation file."""
    docs = [a for f in sorted(text_dir.glob("*.txt")) for a in articles(f.read_text(encoding="utf-8"))]
    if not docs:
        raise SystemExit(f"--text {text_dir}: no WikiText .txt files there")
    out.mkdir(parents=True)
    held = [d for i, d in enumerate(docs) if i % 20 == 19]
    kept = [d for i, d in enumerate(docs) if i % 20 != 19]
    for name, part in (("wikitext-train.jsonl", kept), ("wikitext-validation.jsonl", held)):
        (out / name).write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
    return {"articles_train": len(kept), "articles_eval": len(held)}


def wordpiece_tokenizer(vocab: Path, out: Path) -> Path:
    """An HF tokenizer.json of the uncased WordPiece ``vocab`` (BERT's normaliser and pre-tokeniser)."""
    from tokenizers.implementations import BertWordPieceTokenizer

    BertWordPieceTokenizer(str(vocab), lowercase=True).save(str(out))
    return out


def losses(run_dir: Path) -> tuple[dict, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = {r["samples"]: r["log_perplexity"] for r in rows if "log_perplexity" in r}
    train = {r["samples"]: r["loss"] for r in rows if "loss" in r}
    return evals, train


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="the results' JSON file")
    p.add_argument("--text", type=Path, required=True, help="a folder of WikiText .txt files")
    p.add_argument("--vocab", type=Path, required=True, help="a WordPiece vocab.txt")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--width", type=int, default=1024, help="hidden size (heads of 128, a quarter as many KV heads)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--samples", type=int, default=6144, help="training sequences (--batch of them a step)")
    p.add_argument("--every", type=int, default=512, help="eval every this many sequences")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--device", default="cuda", help="cpu: a check of this script (FP8 is then refused)")
    p.add_argument("--benchmark", default="llama31_8b", choices=("llama31_8b", "gpt_oss_20b"))
    p.add_argument("--experts", type=int, default=16, help="gpt_oss_20b: experts in each block")
    p.add_argument("--also", nargs="+", default=[], metavar="LABEL:KEY=VALUE[,KEY=VALUE]",
                   help="more runs beside bf16 and FP8 for each seed, e.g. "
                        "fp8-bf16-wgrad:model.precision=fp8,model.expert_weight_grad=bf16")  # fmt: skip
    p.add_argument("--pad-vocab", type=int, default=1, metavar="N",
                   help="the model's vocabulary rounded up to a multiple of N (16 or more for "
                        "model.output_precision=fp8, whose products take multiples of 16)")  # fmt: skip
    args = p.parse_args()
    if args.pad_vocab < 1:
        raise SystemExit(f"--pad-vocab {args.pad_vocab}: give a positive multiple")
    if args.width % 512:
        raise SystemExit(f"--width {args.width}: give a multiple of 512 (heads of 128, a quarter as many KV heads)")
    work = Path(tempfile.mkdtemp())
    split = source_folder(args.text, work / "source")
    tok = wordpiece_tokenizer(args.vocab, work / "tokenizer.json")
    if trainbench("prepare", args.benchmark, "--source", str(work / "source"), "--tokenizer", str(tok),
                  "--eod-token", "[SEP]", "--out", str(work / "data"), "--no-progress"):  # fmt: skip
        raise SystemExit("prepare failed")
    manifest = json.loads((work / "data" / "manifest.json").read_text())
    eval_tokens = sum(f["tokens"] for n, f in manifest["files"].items() if "validation" in n)
    shape = {
        "model.vocab_size": -(-manifest["vocab_size"] // args.pad_vocab) * args.pad_vocab,
        "model.hidden_size": args.width, "model.num_layers": args.layers,
        "model.num_heads": args.width // 128, "model.num_kv_heads": args.width // 512,
        "model.intermediate_size": args.width * 7 // 2, "data.seq_length": args.seq,
        "data.global_batch_size": args.batch, "data.micro_batch_size": args.batch,
        "data.eval_samples": eval_tokens // (args.seq + 1), "optimizer.lr": args.lr,
        "schedule.warmup_steps": max(1, args.samples // args.batch // 20),
        "schedule.total_steps": args.samples // args.batch, "schedule.max_samples": args.samples,
        "eval.every_samples": args.every, "eval.target": 0.0001,
    }  # fmt: skip
    if args.benchmark == "gpt_oss_20b":
        shape |= {"model.num_heads": args.width // 64, "model.num_kv_heads": args.width // 512,
                  "model.intermediate_size": args.width, "model.num_experts": args.experts,
                  "model.experts_per_token": 4, "model.sliding_window": 128}  # fmt: skip
    else:
        shape["model.fused_qkv"] = "true"
    overrides = [f"{k}={v}" for k, v in shape.items()]
    common = {"benchmark": args.benchmark, "width": args.width, "layers": args.layers, "seq": args.seq,
              "batch": args.batch,
              "training_tokens": args.samples * args.seq, "tokens_in_train_split": manifest["tokens"] - eval_tokens,
              "eval_tokens": eval_tokens, "lr": args.lr} | split  # fmt: skip
    runs_of_a_seed = [("bf16", ["model.precision=auto"]), ("fp8", ["model.precision=fp8"])]
    for also in args.also:
        label, _, keys = also.partition(":")
        if not label or "=" not in keys:
            raise SystemExit(f"--also {also!r}: give LABEL:KEY=VALUE[,KEY=VALUE]")
        runs_of_a_seed.append((label, keys.split(",")))
    results = []
    for seed in args.seeds:
        for label, keys in runs_of_a_seed:
            out = work / f"{label}_{seed}"
            code = trainbench("run", args.benchmark, "--preset", "tiny", f"data.dir={work / 'data'}",
                              f"output.results_dir={out}", f"device={args.device}", "progress=false",
                              f"perf.compile={str(args.device == 'cuda').lower()}", f"seed={seed}",
                              *overrides, *keys)  # fmt: skip
            row = {"precision": label, "seed": seed, "exit": code} | common
            runs = sorted(out.iterdir()) if out.is_dir() else []
            if runs:
                row["eval_log_perplexity"], row["train_loss"] = losses(runs[0])
            print(json.dumps(row), flush=True)
            results.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
