"""WordPiece tokenization for BERT data preparation, on the `tokenizers` library.

``BertWordPieceTokenizer`` (lower-casing, accent stripping, Chinese-character and punctuation splitting)
defines the result. :class:`FastWordPiece` gives the same ids faster: it splits text into the words and
punctuation marks BERT's pre-tokenizer would produce and keeps each distinct word's ids in a cache, so
the Rust tokenizer runs once per distinct word instead of once per occurrence (about 4 times faster on
Wikipedia text, where a few ten thousand words cover almost every occurrence). Words with any non-ASCII
character go to the full tokenizer unchanged, so Unicode normalisation stays the library's.
Tests check the two agree.
"""

from __future__ import annotations

import os
import re
from itertools import chain
from pathlib import Path

from trainbench.errors import DataError

SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")

# BERT's whitespace: space, \t, \n, \r and the Unicode space separators (category Zs).
_WS = " \t\n\r\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000"
# BERT treats every non-alphanumeric printable ASCII character as punctuation.
_PUNCT = r"!-/:-@\[-`{-~"
_WORDS = re.compile(f"[^{_WS}{_PUNCT}]+|[{_PUNCT}]")
# ASCII control characters BERT deletes (it keeps \t \n \r as whitespace).
_CONTROL = dict.fromkeys([*range(0, 9), 11, 12, *range(14, 32), 127])


def read_vocab(path: str | Path) -> list[str]:
    """The vocabulary's tokens in id order; it must hold the special tokens BERT data needs."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"vocabulary {path} does not exist")
    try:
        words = path.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError:
        raise DataError(f"vocabulary {path} is not UTF-8 text (one token a line, like BERT's vocab.txt)") from None
    while words and words[-1] == "":
        words.pop()
    if not words:
        raise DataError(f"vocabulary {path} is empty")
    missing = [t for t in SPECIAL if t not in set(words)]
    if missing:
        raise DataError(f"vocabulary {path} has no {', '.join(missing)} token; BERT data needs {', '.join(SPECIAL)}")
    return words


def _tokenizer(vocab_path: Path):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # our workers are the parallelism
    from tokenizers import BertWordPieceTokenizer

    return BertWordPieceTokenizer(str(vocab_path), lowercase=True, strip_accents=None, clean_text=True)


class FastWordPiece:
    """Text -> WordPiece ids (no special tokens), equal to BertWordPieceTokenizer's, with a word cache."""

    max_cache = 2_000_000

    def __init__(self, vocab_path: str | Path):
        self.vocab = read_vocab(vocab_path)
        self.ids = {w: i for i, w in enumerate(self.vocab)}
        self.tokenizer = _tokenizer(Path(vocab_path))
        self._encode_one = self.tokenizer._tokenizer.encode
        self.cache: dict[str, list[int]] = {}

    def _word(self, word: str) -> list[int]:
        ids = self._encode_one(word.lower() if word.isascii() else word, add_special_tokens=False).ids
        if len(self.cache) >= self.max_cache:
            self.cache.clear()
        self.cache[word] = ids
        return ids

    def encode(self, text: str) -> list[int]:
        get, cache = self._word, self.cache
        text = text.translate(_CONTROL)
        return list(chain.from_iterable([cache[w] if w in cache else get(w) for w in _WORDS.findall(text)]))

    def encode_reference(self, text: str) -> list[int]:
        """The library's own path (slow); the tests compare :meth:`encode` against it."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids


def train_vocab(files: list[Path], kind: str, size: int, out: Path) -> Path:
    """Train a lower-cased WordPiece vocabulary of ``size`` tokens on the input's sentences; write vocab.txt."""
    from tokenizers import BertWordPieceTokenizer

    from trainbench.data.text import READERS, document_sentences

    if size < 100:
        raise DataError(f"--train-vocab {size} is too small; use at least 100 tokens")

    def sentences():
        for path in files:
            for doc, _ in READERS[kind](path):
                yield from document_sentences(kind, doc)

    tok = BertWordPieceTokenizer(lowercase=True)
    tok.train_from_iterator(sentences(), vocab_size=size, special_tokens=list(SPECIAL), show_progress=False)
    out.mkdir(parents=True, exist_ok=True)
    vocab = out / "vocab.txt"
    # The trainer numbers its alphabet in hash-map order, different from one process to the next: the special
    # tokens first, then the rest in string order, so the same input always gives the same vocab.txt (and data).
    learned = sorted(set(tok.get_vocab()) - set(SPECIAL))
    tmp = vocab.with_name("vocab.txt.tmp")
    tmp.write_text("".join(w + "\n" for w in [*SPECIAL, *learned]), encoding="utf-8")
    os.replace(tmp, vocab)
    return vocab
