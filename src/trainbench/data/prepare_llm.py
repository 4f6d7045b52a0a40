"""Data for the LLM benchmarks: C4 json.gz tokenised into Megatron indexed datasets, or a synthetic language.

C4 (``allenai/c4`` ``en``, as MLPerf ships it) is files of JSON lines with a ``text`` field. Each file is
tokenised on its own worker into ``OUT/train/NAME`` or ``OUT/eval/NAME`` (``.bin`` + ``.idx``; validation
files are those with ``validation`` in their name), each document followed by the EOD token, as Megatron's
``preprocess_data.py --append-eod`` does. The tokenizer is an HF ``tokenizer.json`` (Llama 3's ships as one).
A finished output is skipped on a rerun, so an interrupted preparation resumes file by file.

The synthetic source writes a seeded first-order Markov language: after token t comes one of four fixed
successors with probabilities 0.5/0.25/0.15/0.1 (1.21 nats), documents of 32-400 tokens, each ended by
EOD (id 0). The best possible log perplexity is known (:func:`synthetic_floor`), so a tiny model has a
meaningful target.
"""

from __future__ import annotations

import gzip
import json
import math
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from trainbench.data.indexed import IndexedWriter, token_dtype
from trainbench.data.sft import write_manifest
from trainbench.errors import DataError, UserError

SUCCESSOR_PROBS = np.array([0.5, 0.25, 0.15, 0.1])
EOD = 0


@dataclass(frozen=True)
class SyntheticLMSpec:
    vocab_size: int
    train_tokens: int
    eval_tokens: int
    seed: int = 1234
    num_shards: int = 2


def synthetic_floor(spec: SyntheticLMSpec) -> float:
    """Expected per-token loss of the true model, nats: successor entropy, plus a uniform first token and the
    EOD decision amortised over the mean document length (216)."""
    successor = float(-(SUCCESSOR_PROBS * np.log(SUCCESSOR_PROBS)).sum())
    return successor + (math.log(spec.vocab_size - 1) + math.log(369)) / 216


def _synthetic_docs(rng: np.random.Generator, successors: np.ndarray, tokens: int):
    written = 0
    while written < tokens:
        n = int(rng.integers(32, 401))
        doc = np.empty(n + 1, dtype=np.int64)
        doc[0] = rng.integers(1, len(successors))
        picks = rng.choice(4, size=n, p=SUCCESSOR_PROBS)
        for j in range(1, n):
            doc[j] = successors[doc[j - 1], picks[j]]
        doc[n] = EOD
        written += n + 1
        yield doc


def prepare_synthetic_lm(out: Path, spec: SyntheticLMSpec, progress: Callable[[int, int], None] | None = None):
    rng = np.random.default_rng(spec.seed)
    successors = rng.integers(1, spec.vocab_size, size=(spec.vocab_size, 4))
    dtype = token_dtype(spec.vocab_size)
    total, done = spec.train_tokens + spec.eval_tokens, 0
    parts = [("train", f"synthetic_{i:03d}", spec.train_tokens // spec.num_shards) for i in range(spec.num_shards)]
    parts.append(("eval", "synthetic_eval", spec.eval_tokens))
    for split, name, tokens in parts:
        writer = IndexedWriter(out / split / name, dtype)
        for doc in _synthetic_docs(rng, successors, tokens):
            writer.add(doc)
        writer.finish()
        done += tokens
        if progress:
            progress(done, total)
    manifest = {"source": "synthetic", "spec": asdict(spec), "loss_floor_nats": synthetic_floor(spec)}
    write_manifest(out, manifest)
    return manifest


# -- C4 -----------------------------------------------------------------------------------------------


def eod_id(tokenizer, name: str | None) -> int:
    names = [name] if name else ["<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>", "[SEP]"]
    for n in names:
        i = tokenizer.token_to_id(n)
        if i is not None:
            return i
    raise UserError(f"the tokenizer has none of the end-of-document tokens {names}; name one with --eod-token")


def _tokenize_file(src: str, prefix: str, tokenizer_path: str, eod: int, batch: int = 512) -> tuple[int, int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    writer = IndexedWriter(prefix, token_dtype(tok.get_vocab_size()))
    docs = tokens = 0
    opener = gzip.open if src.endswith(".gz") else open
    try:
        with opener(src, "rt", encoding="utf-8") as f:
            texts: list[str] = []
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    texts.append(json.loads(line)["text"])
                except (json.JSONDecodeError, KeyError, TypeError) as exc:
                    raise DataError(f"{src}:{line_no}: not a JSON object with a 'text' field ({exc})") from exc
                if len(texts) == batch:
                    tokens += _write_batch(tok, writer, texts, eod)
                    docs += len(texts)
                    texts = []
            tokens += _write_batch(tok, writer, texts, eod)
            docs += len(texts)
    except (EOFError, OSError) as exc:
        raise DataError(f"{src}: cannot be read to the end ({exc}); is it truncated?") from exc
    writer.finish()
    return docs, tokens


def _write_batch(tok, writer: IndexedWriter, texts: list[str], eod: int) -> int:
    n = 0
    for enc in tok.encode_batch(texts, add_special_tokens=False) if texts else []:
        writer.add(enc.ids + [eod])
        n += len(enc.ids) + 1
    return n


def c4_files(source: Path) -> list[Path]:
    if not source.is_dir():
        raise UserError(f"--source {source} is not a folder of C4 json(.gz) files")
    files = sorted(p for p in source.iterdir() if p.name.endswith((".json.gz", ".json", ".jsonl", ".jsonl.gz")))
    if not files:
        raise UserError(f"--source {source} holds no .json.gz / .json / .jsonl files")
    if not any("validation" in p.name for p in files):
        raise UserError(f"--source {source} has no validation file (a name with 'validation', as c4-validation.*)")
    return files


def prepare_c4(source: Path, out: Path, tokenizer_path: Path, workers: int, eod_token: str | None = None,
               progress: Callable[[int, int], None] | None = None) -> dict:  # fmt: skip
    from tokenizers import Tokenizer

    if not tokenizer_path.is_file() or tokenizer_path.suffix != ".json":
        raise UserError(
            f"--tokenizer {tokenizer_path}: give an HF tokenizer.json (a SentencePiece .model converts to one with "
            "transformers' `LlamaTokenizerFast.from_pretrained(...).save_pretrained(...)`)"
        )
    tok = Tokenizer.from_file(str(tokenizer_path))
    eod = eod_id(tok, eod_token)
    files = c4_files(source)
    sizes = {f: f.stat().st_size for f in files}
    total, done = sum(sizes.values()), 0
    jobs = {}
    stats = {"documents": 0, "tokens": 0, "files": {}}
    with ProcessPoolExecutor(max_workers=max(1, workers)) as pool:
        for f in files:
            split = "eval" if "validation" in f.name else "train"
            prefix = out / split / f.name.split(".json")[0]
            if Path(f"{prefix}.idx").exists() and Path(f"{prefix}.bin").exists():
                done += sizes[f]  # finished in an earlier run
                continue
            jobs[pool.submit(_tokenize_file, str(f), str(prefix), str(tokenizer_path), eod)] = f
        for fut in as_completed(jobs):
            f = jobs[fut]
            docs, tokens = fut.result()
            stats["documents"] += docs
            stats["tokens"] += tokens
            stats["files"][f.name] = {"documents": docs, "tokens": tokens}
            done += sizes[f]
            if progress:
                progress(done, total)
    manifest = {"source": str(source), "tokenizer": str(tokenizer_path), "eod_id": eod,
                "vocab_size": tok.get_vocab_size(), "workers": workers} | stats  # fmt: skip
    write_manifest(out, manifest)
    return manifest


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
