"""GovReport for Llama-2-70B LoRA, from any of the three forms users have, into one packed format (:mod:`.sft`).

- SCROLLS GovReport parquet (``input``, ``output`` columns) with the user's Llama-2 tokenizer (``tokenizer.json``
  or SentencePiece ``tokenizer.model``): each example becomes ``### Summarize the following text:\\n {input}\\n
  ### Summary:\\n `` (BOS first, the prompt, loss-free) then ``{output}`` and EOS (the answer, where the loss
  counts); examples longer than the row (8192 tokens) are dropped, as MLPerf's reference drops them.
- MLPerf's tokenised parquet (``input_ids``, ``labels`` with -100 over the prompt).
- NVIDIA's ``train.npy`` / ``validation.npy`` (rows of ``input_ids``, ``loss_mask``, ``seq_start_id``): each row
  is cut back into its sequences. These are pickled numpy objects: read only files from a source you trust.

Files whose names start with ``train`` are the training split, ``validation`` the eval split. Tokenised input is
checked, not trimmed: a sequence longer than a row, labels of another length than the tokens, or token ids past
the model's vocabulary stop the preparation with one sentence naming the file and row.

The synthetic source (``--synthetic``) writes a summarisation-shaped task a tiny model can learn with LoRA on a
random base: each example has one of ``topics`` topics; its "text" is 24-72 words drawn from that topic's 24
words, and its "summary" the topic's fixed 8-token phrase and EOS. It also writes the random base model as sharded
safetensors (``base/``), so tiny runs load their weights exactly as 70B runs do.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from trainbench.data import sft
from trainbench.errors import DataError

PROMPT = "### Summarize the following text:\n {input}\n ### Summary:\n "
SPLITS = {"train": "train", "eval": "validation"}

Progress = Callable[[int, int], None]
Sequences = list[tuple[np.ndarray, np.ndarray]]


# -- tokenisers ------------------------------------------------------------------------------------------------


class TextTokenizer:
    """An HF ``tokenizer.json`` or a SentencePiece ``tokenizer.model``: ids of a prompt (with BOS) and of an
    answer (without), the EOS id and the vocabulary size."""

    def __init__(self, path: Path):
        self.path = path
        if not path.is_file():
            raise DataError(f"{path}: no such tokenizer file; give Llama-2's tokenizer.json or tokenizer.model")
        try:
            if path.suffix == ".json":
                from tokenizers import Tokenizer

                self._hf = Tokenizer.from_file(str(path))
                self.vocab_size = self._hf.get_vocab_size(with_added_tokens=False)
                eos = self._hf.token_to_id("</s>")
                self.bos = self._hf.token_to_id("<s>")
            else:
                import sentencepiece

                self._sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
                self._hf = None
                self.vocab_size = self._sp.get_piece_size()
                eos, self.bos = self._sp.eos_id(), self._sp.bos_id()
        except DataError:
            raise
        except Exception as e:  # both libraries raise their own types for unreadable files
            raise DataError(f"{path}: not a readable tokenizer ({e}); give tokenizer.json or tokenizer.model") from None
        if eos is None or eos < 0:
            raise DataError(f"{path}: the tokenizer has no end-of-sequence token </s>; is it Llama-2's?")
        self.eos = eos

    def encode(self, texts: list[str]) -> list[list[int]]:
        if self._hf is not None:
            return [e.ids for e in self._hf.encode_batch(texts, add_special_tokens=False)]
        return self._sp.encode(texts)

    def example(self, inputs: list[str], outputs: list[str]) -> Sequences:
        prompts = self.encode([PROMPT.format(input=x) for x in inputs])
        answers = self.encode(list(outputs))
        bos = [] if self.bos is None or self.bos < 0 else [self.bos]
        out = []
        for p, a in zip(prompts, answers, strict=True):
            tokens = np.array(bos + p + a + [self.eos], dtype=np.int64)
            mask = np.zeros(len(tokens), np.uint8)
            mask[len(bos) + len(p) :] = 1
            out.append((tokens, mask))
        return out


# -- the three sources -----------------------------------------------------------------------------------------


def split_files(source: Path, split: str, suffix: str) -> list[Path]:
    return sorted(p for p in source.iterdir() if p.name.startswith(split) and p.name.endswith(suffix))


def detect(source: Path) -> str:
    """``npy``, ``text`` (input/output parquet) or ``tokens`` (input_ids/labels parquet)."""
    if not source.is_dir():
        raise DataError(f"{source}: no such folder; give the folder of GovReport's parquet files or train.npy")
    if (source / "train.npy").exists():
        return "npy"
    files = split_files(source, "train", ".parquet")
    if not files:
        raise DataError(f"{source}: no train*.parquet and no train.npy; give SCROLLS GovReport's parquet files, "
                        "MLPerf's tokenised parquet or NVIDIA's train.npy/validation.npy")  # fmt: skip
    import pyarrow.parquet as pq

    columns = set(pq.read_schema(files[0]).names)
    if {"input_ids", "labels"} <= columns:
        return "tokens"
    if {"input", "output"} <= columns:
        return "text"
    missing = "labels" if "input_ids" in columns else "output" if "input" in columns else "input"
    raise DataError(f"{files[0]}: no column '{missing}' (columns: {', '.join(sorted(columns))}); give GovReport "
                    "parquet with input and output, or tokenised parquet with input_ids and labels")  # fmt: skip


def _columns(path: Path, names: list[str]):
    import pyarrow.parquet as pq

    have = set(pq.read_schema(path).names)
    for name in names:
        if name not in have:
            raise DataError(f"{path}: no column '{name}' (columns: {', '.join(sorted(have))})")
    table = pq.read_table(path, columns=names)
    return [table.column(n).to_pylist() for n in names]


def read_text(files: list[Path], tok: TextTokenizer, row_length: int, progress: Progress | None):
    """Tokenised examples of GovReport parquet files, and how many were dropped for being longer than a row."""
    out, dropped = [], 0
    for i, path in enumerate(files):
        inputs, outputs = _columns(path, ["input", "output"])
        for j in range(0, len(inputs), 256):
            for tokens, mask in tok.example(inputs[j : j + 256], outputs[j : j + 256]):
                if len(tokens) > row_length:
                    dropped += 1
                else:
                    out.append((tokens, mask))
        if progress:
            progress(i + 1, len(files))
    return out, dropped


def _checked(path: Path, row: int, tokens: np.ndarray, mask: np.ndarray, row_length: int, vocab: int):
    if len(tokens) > row_length:
        raise DataError(f"{path}: row {row} has {len(tokens)} tokens, more than a row's {row_length}; drop examples "
                        "longer than the sequence length when tokenising")  # fmt: skip
    if len(tokens) and (tokens.min() < 0 or tokens.max() >= vocab):
        raise DataError(f"{path}: row {row} has token id {int(tokens.max())}, past the model's vocabulary of "
                        f"{vocab}; was it tokenised with Llama-2's tokenizer?")  # fmt: skip
    if not mask.any():
        raise DataError(f"{path}: row {row} has no answer token to learn from (all labels -100)")
    return tokens, mask


def read_tokens(files: list[Path], row_length: int, vocab: int, progress: Progress | None) -> Sequences:
    out = []
    for i, path in enumerate(files):
        ids, labels = _columns(path, ["input_ids", "labels"])
        for row, (x, y) in enumerate(zip(ids, labels, strict=True)):
            if len(x) != len(y):
                raise DataError(f"{path}: row {row} has {len(y)} labels for {len(x)} input_ids; they must be as long")
            x, y = np.asarray(x, np.int64), np.asarray(y, np.int64)
            out.append(_checked(path, row, x, (y != sft.IGNORE).astype(np.uint8), row_length, vocab))
        if progress:
            progress(i + 1, len(files))
    return out


def read_npy(path: Path, row_length: int, vocab: int) -> Sequences:
    try:
        rows = np.load(path, allow_pickle=True)
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not a numpy file ({e})") from None
    out = []
    for r, row in enumerate(rows):
        if not isinstance(row, dict) or not {"input_ids", "loss_mask", "seq_start_id"} <= set(row):
            have = ", ".join(sorted(row)) if isinstance(row, dict) else type(row).__name__
            raise DataError(f"{path}: row {r} is not a dict of input_ids, loss_mask and seq_start_id ({have})")
        ids, mask = np.asarray(row["input_ids"], np.int64), np.asarray(row["loss_mask"], np.uint8)
        if len(ids) != len(mask):
            raise DataError(f"{path}: row {r} has {len(mask)} loss_mask values for {len(ids)} input_ids; they must "
                            "be as long")  # fmt: skip
        starts = [int(s) for s in row["seq_start_id"]] + [len(ids)]
        for a, b in zip(starts[:-1], starts[1:], strict=True):
            out.append(_checked(path, r, ids[a:b], mask[a:b], row_length, vocab))
    return out


def read_source(source: Path, tokenizer: Path | None, row_length: int, vocab: int, progress: Progress | None):
    """Every split of ``source`` as sequences; returns (kind, {split: sequences}, {split: dropped})."""
    kind = detect(source)
    splits, dropped = {}, {}
    tok = None
    if kind == "text":
        if tokenizer is None:
            raise DataError(f"{source} holds text (input, output): give --tokenizer tokenizer.json or tokenizer.model")
        tok = TextTokenizer(tokenizer)
        if tok.vocab_size != vocab:
            raise DataError(f"{tokenizer}: a vocabulary of {tok.vocab_size} tokens, but the model has {vocab}; give "
                            "Llama-2's tokenizer (or the model config of this tokenizer)")  # fmt: skip
    for split, prefix in SPLITS.items():
        if kind == "npy":
            path = source / f"{prefix}.npy"
            if not path.exists():
                raise DataError(f"{path}: missing; NVIDIA's data set has train.npy and validation.npy")
            splits[split], dropped[split] = read_npy(path, row_length, vocab), 0
            continue
        files = split_files(source, prefix, ".parquet")
        if not files:
            raise DataError(f"{source}: no {prefix}*.parquet files")
        if kind == "text":
            splits[split], dropped[split] = read_text(files, tok, row_length, progress)
        else:
            splits[split], dropped[split] = read_tokens(files, row_length, vocab, progress), 0
        if not splits[split]:
            raise DataError(f"{source}: every {prefix} example is longer than {row_length} tokens")
    return kind, splits, dropped


# -- synthetic -------------------------------------------------------------------------------------------------

BOS, EOS, PROMPT_START, PROMPT_END = 1, 2, (3, 4), (5, 6)
PHRASE, WORDS = 8, 24  # summary tokens per topic, words per topic
SUMMARY_IDS = range(8, 64)  # summaries use ids 8-63; texts 64 and up


def synthetic_topics(vocab: int, topics: int, seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each topic's words and summary phrase, from ``seed`` alone (the training and eval splits share them)."""
    if vocab <= SUMMARY_IDS.stop + WORDS:
        raise DataError(f"the synthetic task needs a vocabulary of more than {SUMMARY_IDS.stop + WORDS} tokens")
    rng = np.random.default_rng(seed)
    words = [rng.choice(np.arange(SUMMARY_IDS.stop, vocab), WORDS, replace=False) for _ in range(topics)]
    phrases = [rng.choice(np.array(SUMMARY_IDS), PHRASE) for _ in range(topics)]
    return words, phrases


def synthetic_split(vocab: int, topics: int, count: int, seed: int, stream: int) -> Sequences:
    """``count`` examples of the synthetic task (module docstring), drawn from random stream ``stream``."""
    words, phrases = synthetic_topics(vocab, topics, seed)
    rng = np.random.default_rng([seed, stream])
    out = []
    for _ in range(count):
        k = rng.integers(topics)
        text = rng.choice(words[k], rng.integers(24, 73))
        prompt = np.concatenate([[BOS, *PROMPT_START], text, PROMPT_END])
        answer = np.concatenate([phrases[k], [EOS]])
        tokens = np.concatenate([prompt, answer]).astype(np.int64)
        out.append((tokens, np.concatenate([np.zeros(len(prompt)), np.ones(len(answer))]).astype(np.uint8)))
    return out
