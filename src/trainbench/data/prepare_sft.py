"""GovReport for Llama-2-70B LoRA, from any of the three forms users have, into one packed format (:mod:`.sft`).

- SCROLLS GovReport parquet (``input``, ``output`` columns) with the user's Llama-2 tokenizer (``tokenizer.json``
  or SentencePiece ``tokenizer.model``): each example becomes ``### Summarize the following text:\\n {input}\\n
  ### Summary:\\n `` (BOS first, the prompt, loss-free) then ``{output}`` and EOS (the answer, where the loss
  counts); examples longer than the row (8192 tokens) are dropped, as MLPerf's reference drops them.
- MLPerf's tokenised parquet (``input_ids``, ``labels`` with -100 over the prompt).
- NVIDIA's ``train.npy`` / ``validation.npy`` (rows of ``input_ids``, ``loss_mask``, ``seq_start_id``). These are
  pickled numpy object arrays; they are read by an unpickler that admits numpy's own array classes and nothing else,
  so a crafted file cannot run code (:func:`load_object_npy`).

MLPerf's two tokenised forms are pre-packed: each of their rows is one training row (GovReport: 3,901 training and
173 validation rows of 8192 tokens, several documents each), trained by MLPerf's reference and NVIDIA with causal
attention across the whole row, and counted as one sample by the reference convergence points. So each of their rows
stays one row here, as given (:data:`ROWS_AS_GIVEN`): its tokens and loss mask unchanged, one sequence to the loop
(positions from 0 across the row, attention causal across it, the eval's per-sequence mean taken over the row).
Text parquet is tokenised here, one example a sequence, and packed with attention kept inside each sequence.

Files whose names start with ``train`` are the training split, ``validation`` the eval split. Tokenised input is
checked, not trimmed: a sequence longer than a row, labels of another length than the tokens, token ids that are not
integers or lie past the model's vocabulary, labels other than -100 or the token itself, loss masks other than 0/1,
sequence starts that do not begin at 0 and rise within the row, text columns that are not text: each stops the
preparation with one sentence naming the file and row.

The synthetic source (``--synthetic``) writes a summarisation-shaped task a tiny model can learn with LoRA on a
random base: each example has one of ``topics`` topics; its "text" is 24-72 words drawn from that topic's 24
words, and its "summary" the topic's fixed 8-token phrase and EOS. It also writes the random base model as sharded
safetensors (``base/``), so tiny runs load their weights exactly as 70B runs do.
"""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from trainbench.data import sft
from trainbench.errors import DataError

PROMPT = "### Summarize the following text:\n {input}\n ### Summary:\n "
SPLITS = {"train": "train", "eval": "validation"}
# Source forms whose rows are MLPerf's training rows: each stays one row, attention causal across it.
ROWS_AS_GIVEN = ("tokens", "npy")

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
    columns = _schema_names(files[0])
    if {"input_ids", "labels"} <= columns:
        return "tokens"
    if {"input", "output"} <= columns:
        return "text"
    missing = "labels" if "input_ids" in columns else "output" if "input" in columns else "input"
    raise DataError(f"{files[0]}: no column '{missing}' (columns: {', '.join(sorted(columns))}); give GovReport "
                    "parquet with input and output, or tokenised parquet with input_ids and labels")  # fmt: skip


def _schema_names(path: Path) -> set[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return set(pq.read_schema(path).names)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable parquet file ({_first_line(e)}); download it again") from None


def _columns(path: Path, names: list[str]):
    import pyarrow as pa
    import pyarrow.parquet as pq

    have = _schema_names(path)
    for name in names:
        if name not in have:
            raise DataError(f"{path}: no column '{name}' (columns: {', '.join(sorted(have))})")
    try:
        table = pq.read_table(path, columns=names)
        return [table.column(n).to_pylist() for n in names]
    except (pa.ArrowException, OSError, ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not a readable parquet file ({_first_line(e)}); download it again") from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def _texts(path: Path, column: str, values: list) -> list[str]:
    for row, value in enumerate(values):
        if not isinstance(value, str):
            what = "empty (null)" if value is None else f"a {type(value).__name__}, not text"
            raise DataError(f"{path}: row {row} of column '{column}' is {what}; GovReport's input and output are text")
    return values


def read_text(files: list[Path], tok: TextTokenizer, row_length: int, progress: Progress | None):
    """Tokenised examples of GovReport parquet files, and how many were dropped for being longer than a row."""
    out, dropped = [], 0
    for i, path in enumerate(files):
        inputs, outputs = _columns(path, ["input", "output"])
        inputs, outputs = _texts(path, "input", inputs), _texts(path, "output", outputs)
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


def integers(path: Path, row: int, what: str, value) -> np.ndarray:
    """``value`` (a list or array) as a 1-d int64 array, refusing what is not a sequence of integers."""
    try:
        array = np.asarray(value)
    except (ValueError, TypeError):
        array = np.asarray([None])
    if array.ndim != 1 or not (array.dtype.kind in "iub" or (array.dtype.kind == "f" and np.all(np.isfinite(array))
                                                               and np.all(array == np.round(array)))):  # fmt: skip
        shown = repr(value)[:60]
        raise DataError(f"{path}: row {row}: {what} must be a list of integers, got {shown}")
    return array.astype(np.int64)


def read_tokens(files: list[Path], row_length: int, vocab: int, progress: Progress | None) -> Sequences:
    out = []
    for i, path in enumerate(files):
        ids, labels = _columns(path, ["input_ids", "labels"])
        for row, (x, y) in enumerate(zip(ids, labels, strict=True)):
            x, y = integers(path, row, "input_ids", x), integers(path, row, "labels", y)
            if len(x) != len(y):
                raise DataError(f"{path}: row {row} has {len(y)} labels for {len(x)} input_ids; they must be as long")
            wrong = np.flatnonzero((y != sft.IGNORE) & (y != x))
            if len(wrong):
                raise DataError(f"{path}: row {row}: label {int(y[wrong[0]])} at position {int(wrong[0])} is neither "
                                f"{sft.IGNORE} (a prompt token, no loss) nor the token itself ({int(x[wrong[0]])}), "
                                "as MLPerf's tokenised GovReport has them")  # fmt: skip
            out.append(_checked(path, row, x, (y != sft.IGNORE).astype(np.uint8), row_length, vocab))
        if progress:
            progress(i + 1, len(files))
    return out


# What np.save writes for an object array of dicts of arrays: numpy's array reconstruction and nothing else.
_NUMPY_PICKLE = {
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
}  # fmt: skip


class _NumpyOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _NUMPY_PICKLE:
            raise pickle.UnpicklingError(f"it holds a pickled {module}.{name}")
        if module == "numpy":
            return getattr(np, name)
        core = np._core if hasattr(np, "_core") else np.core  # numpy 2 renamed numpy.core
        return getattr(getattr(core, module.rsplit(".", 1)[-1]), name)


def load_object_npy(path: Path) -> np.ndarray:
    """A .npy file of a pickled object array, read by an unpickler that admits only numpy's array classes: a file
    whose pickle names anything else (a function to call) is refused before anything is called."""
    from numpy.lib import format as npy

    try:
        with open(path, "rb") as f:
            version = npy.read_magic(f)
            if version == (1, 0):
                shape, _, dtype = npy.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, _, dtype = npy.read_array_header_2_0(f)
            else:
                raise ValueError(f"numpy file format version {version}")
            if not dtype.hasobject:
                raise DataError(f"{path}: an array of {dtype}, not NVIDIA's rows (a pickled array of dicts of "
                                "input_ids, loss_mask and seq_start_id)")  # fmt: skip
            array = _NumpyOnly(f).load()
    except DataError:
        raise
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror or e})") from None
    except pickle.UnpicklingError as e:
        raise DataError(f"{path}: {_first_line(e)}, which trainbench does not load (it could run code); NVIDIA's "
                        "files hold numpy arrays only: download them again") from None  # fmt: skip
    except Exception as e:  # an empty or cut file: EOFError, ValueError and others from the header or the pickle
        raise DataError(f"{path}: not a whole numpy file ({type(e).__name__}: {_first_line(e)}); download it "
                        "again") from None  # fmt: skip
    if not isinstance(array, np.ndarray) or array.shape != shape:
        raise DataError(f"{path}: its pickle is not the array of shape {shape} its header announces")
    return array


def read_npy(path: Path, row_length: int, vocab: int) -> Sequences:
    rows = load_object_npy(path)
    if rows.ndim != 1 or len(rows) == 0:
        raise DataError(f"{path}: holds {'no rows' if rows.size == 0 else f'an array of shape {rows.shape}'}; "
                        "NVIDIA's files hold one row of 8192 tokens per entry")  # fmt: skip
    out = []
    for r, row in enumerate(rows):
        if not isinstance(row, dict) or not {"input_ids", "loss_mask", "seq_start_id"} <= set(row):
            have = ", ".join(sorted(map(str, row))) if isinstance(row, dict) else type(row).__name__
            raise DataError(f"{path}: row {r} is not a dict of input_ids, loss_mask and seq_start_id ({have})")
        ids = integers(path, r, "input_ids", row["input_ids"])
        mask = integers(path, r, "loss_mask", row["loss_mask"])
        if len(ids) != len(mask):
            raise DataError(f"{path}: row {r} has {len(mask)} loss_mask values for {len(ids)} input_ids; they must "
                            "be as long")  # fmt: skip
        if len(mask) and (mask.min() < 0 or mask.max() > 1):
            raise DataError(f"{path}: row {r}: loss_mask holds {int(mask.max() if mask.max() > 1 else mask.min())}; "
                            "it must be 0 (no loss) or 1")  # fmt: skip
        starts = integers(path, r, "seq_start_id", row["seq_start_id"])
        if len(starts) == 0 or starts[0] != 0 or np.any(np.diff(starts) <= 0) or starts[-1] >= max(len(ids), 1):
            raise DataError(f"{path}: row {r}: seq_start_id {starts.tolist()[:8]} must start at 0 and rise strictly "
                            f"within the row's {len(ids)} tokens; every token belongs to one sequence")  # fmt: skip
        # The row as given: MLPerf's rows are trained whole (ROWS_AS_GIVEN); seq_start_id is checked, not used.
        out.append(_checked(path, r, ids, mask.astype(np.uint8), row_length, vocab))
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


def synthetic_split(vocab: int, topics: int, count: int, seed: int, stream: int,
                    words_a_text: tuple[int, int] = (24, 73), summary_share: float = 0.0) -> Sequences:  # fmt: skip
    """``count`` examples of the synthetic task (module docstring), drawn from random stream ``stream``; each text
    of ``words_a_text`` words (low inclusive, high exclusive), each summary the topic's phrase, repeated to
    ``summary_share`` of the text's words where that is longer."""
    return list(itertools.islice(_synthetic_examples(vocab, topics, seed, stream, words_a_text, summary_share), count))


def _synthetic_examples(vocab: int, topics: int, seed: int, stream: int, words_a_text: tuple[int, int],
                        summary_share: float) -> Iterator[tuple[np.ndarray, np.ndarray]]:  # fmt: skip
    """:func:`synthetic_split`'s examples, one after another, for as long as they are asked for."""
    words, phrases = synthetic_topics(vocab, topics, seed)
    rng = np.random.default_rng([seed, stream])
    while True:
        k = rng.integers(topics)
        text = rng.choice(words[k], rng.integers(*words_a_text))
        prompt = np.concatenate([[BOS, *PROMPT_START], text, PROMPT_END])
        repeats = max(1, round(summary_share * len(text) / PHRASE))
        answer = np.concatenate([np.tile(phrases[k], repeats), [EOS]])
        tokens = np.concatenate([prompt, answer]).astype(np.int64)
        yield tokens, np.concatenate([np.zeros(len(prompt)), np.ones(len(answer))]).astype(np.uint8)


# MLPerf's GovReport rows (pre-packed): 8,192 tokens, a few documents each, attention causal across the row; a
# summary about a tenth of a row's tokens (lora.ANSWER_SHARE).
GOVREPORT_WORDS, GOVREPORT_SUMMARY = (1000, 4000), 0.1


def synthetic_rows(vocab: int, topics: int, count: int, seed: int, stream: int, row: int) -> Sequences:
    """``count`` rows of exactly ``row`` tokens shaped as MLPerf's GovReport rows: examples of the synthetic task with
    long texts (:data:`GOVREPORT_WORDS`), whole while they fit, the last one's text cut so that its summary ends the
    row; each row one sequence (attention causal across it, as MLPerf's rows are trained)."""
    if row < 64:
        raise DataError(f"the synthetic GovReport rows need at least 64 tokens a row, not {row}")
    examples = _synthetic_examples(vocab, topics, seed, stream, GOVREPORT_WORDS, GOVREPORT_SUMMARY)
    out = []
    for _ in range(count):
        tokens, mask, room = [], [], row
        while room:
            t, m = next(examples)
            # BOS and the prompt's start; the prompt's end and the summary
            head, tail = 1 + len(PROMPT_START), len(PROMPT_END) + int(m.sum())
            if len(t) > room and room - tail >= head + 1:  # its text cut to fit (a word at least)
                t, m = np.concatenate([t[: room - tail], t[-tail:]]), np.concatenate([m[: room - tail], m[-tail:]])
            elif len(t) > room and not tokens:  # a row shorter than a word and a summary: the summary cut too
                answer = room - head - 1 - len(PROMPT_END)
                t = np.concatenate([t[: head + 1], PROMPT_END, t[-tail + len(PROMPT_END) :][: answer - 1], [EOS]])
                m = np.concatenate([np.zeros(head + 1 + len(PROMPT_END), np.uint8), np.ones(answer, np.uint8)])
            elif len(t) > room:  # too little room for another: the previous example's text takes it
                t, m = tokens.pop(), mask.pop()
                room += len(t)
                cut = len(t) - len(PROMPT_END) - int(m.sum())
                more = room - len(t)
                t = np.concatenate([t[:cut], np.repeat(t[cut - 1], more), t[cut:]])
                m = np.concatenate([m[:cut], np.zeros(more, np.uint8), m[cut:]])
            tokens.append(t)
            mask.append(m)
            room -= len(t)
        out.append((np.concatenate(tokens), np.concatenate(mask)))
    return out
