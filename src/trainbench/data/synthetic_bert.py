"""Seeded synthetic BERT pretraining data with structure a model can learn.

Uniform random tokens would teach nothing: masked-LM accuracy would stay at 1/vocab. Instead the text
is drawn from a topic-wise Markov chain, so both tasks have real signal:

* The vocabulary's words are split into topics, and every document (chain) has a keyword of its
  topic. Each token is the keyword with probability ``P_KEYWORD``; otherwise it continues a Markov
  chain in which each word has a likely successor (``P_FIRST``), a second one (``P_SECOND``), and
  otherwise any word of its topic.
* The two parts are learned at different speeds, as in real text. Finding the keyword is content-
  based: attention to the tokens of the same segment, which a 2-layer model learns within a few
  hundred steps; it alone gives masked-LM accuracy of about ``P_KEYWORD``. The chain needs a
  positional "previous/next token" head, which takes thousands of steps on CPU and lifts the ceiling
  to about 0.95. (With the chain alone the tiny preset stalled near 0.3 for 800 steps.)
* Sentence B either continues sentence A's chain or (``is_random_next``, label 1) comes from
  another chain, usually of another topic, so next-sentence prediction is learnable too.

Instances follow the shape of Google's ``create_pretraining_data.py``: ``[CLS] A [SEP] B [SEP]``,
``short_seq_prob`` 0.1 of shorter targets, 15% of tokens masked (80% [MASK], 10% random word, 10%
kept), at most ``max_predictions`` per sample, positions sorted and padded with 0.
Everything is vectorised over samples with numpy; a shard depends only on (seed, shard index).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainbench.data.bert_hdf5 import shard_record, write_shard

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
PAD, UNK, CLS, SEP, MASK = range(len(SPECIALS))
NUM_TOPICS = 8
P_FIRST, P_SECOND = 0.9, 0.05
P_KEYWORD = 0.75
MASKED_LM_PROB = 0.15
SHORT_SEQ_PROB = 0.1


@dataclass(frozen=True)
class SyntheticSpec:
    seq_length: int
    max_predictions: int
    vocab_size: int
    num_train_samples: int
    num_eval_samples: int
    num_shards: int
    seed: int
    short_seq_prob: float = SHORT_SEQ_PROB  # share of samples shorter than seq_length (uniform length)


def word(i: int) -> str:
    """A pronounceable, unique word for index i (base-70 syllables, at least two)."""
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    parts = []
    while True:
        i, r = divmod(i, len(syllables))
        parts.append(syllables[r])
        if i == 0 and len(parts) >= 2:
            return "".join(reversed(parts))


def vocabulary(vocab_size: int) -> list[str]:
    assert vocab_size > len(SPECIALS) + NUM_TOPICS * 4, "vocab_size too small for the synthetic generator"
    return SPECIALS + [word(i) for i in range(vocab_size - len(SPECIALS))]


class Language:
    """The Markov chain: per-topic word ranges and each word's two likely successors."""

    def __init__(self, vocab_size: int, seed: int):
        rng = np.random.default_rng([seed, 0xB0E7])
        words = vocab_size - len(SPECIALS)
        self.vocab_size = vocab_size
        self.per_topic = words // NUM_TOPICS
        self.topic_base = len(SPECIALS) + self.per_topic * np.arange(NUM_TOPICS)
        ids = np.arange(vocab_size)
        topic = np.clip((ids - len(SPECIALS)) // self.per_topic, 0, NUM_TOPICS - 1)
        base = self.topic_base[topic]
        self.first = base + rng.integers(self.per_topic, size=vocab_size)
        self.second = base + rng.integers(self.per_topic, size=vocab_size)

    def chains(self, rng: np.random.Generator, topics: np.ndarray, length: int) -> np.ndarray:
        n = len(topics)
        out = np.empty((n, length), dtype=np.int64)
        state = self.topic_base[topics] + rng.integers(self.per_topic, size=n)
        for j in range(length):
            out[:, j] = state
            u = rng.random(n)
            anywhere = self.topic_base[topics] + rng.integers(self.per_topic, size=n)
            state = np.where(
                u < P_FIRST, self.first[state], np.where(u < P_FIRST + P_SECOND, self.second[state], anywhere)
            )
        keyword = self.topic_base[topics] + rng.integers(self.per_topic, size=n)
        return np.where(rng.random((n, length)) < P_KEYWORD, keyword[:, None], out)


def make_samples(
    lang: Language,
    rng: np.random.Generator,
    n: int,
    seq_length: int,
    max_predictions: int,
    short_seq_prob: float = SHORT_SEQ_PROB,
    lengths: np.ndarray | None = None,
):
    """``n`` samples as fixed rows; each sample's length ([CLS] A [SEP] B [SEP]) is ``lengths`` where given (5 to
    ``seq_length``), else create_pretraining_data's: the whole row, or with ``short_seq_prob`` a random shorter one."""
    s = seq_length
    max_tokens = s - 3
    if lengths is not None:
        target = np.asarray(lengths, dtype=np.int64) - 3
    else:
        target = np.where(rng.random(n) < short_seq_prob, rng.integers(2, max_tokens + 1, size=n), max_tokens)
    a_len = 1 + (rng.random(n) * (target - 1)).astype(np.int64)  # 1 .. target-1 tokens in sentence A
    is_random_next = rng.random(n) < 0.5
    topics = rng.integers(NUM_TOPICS, size=n)
    chain_a = lang.chains(rng, topics, s)
    chain_r = lang.chains(rng, rng.integers(NUM_TOPICS, size=n), s)

    j = np.arange(s)[None, :]
    a, t = a_len[:, None], target[:, None]
    from_a = np.take_along_axis(chain_a, np.clip(j - 1, 0, s - 1), 1)
    # B continues chain A (token j is chain_a[j-2]) or, for a random next sentence, starts chain R.
    from_b = np.where(
        is_random_next[:, None],
        np.take_along_axis(chain_r, np.clip(j - a - 2, 0, s - 1), 1),
        np.take_along_axis(chain_a, np.clip(j - 2, 0, s - 1), 1),
    )
    tokens = np.full((n, s), PAD, dtype=np.int64)
    tokens = np.where(j <= a, from_a, tokens)
    tokens = np.where((j >= a + 2) & (j <= t + 1), from_b, tokens)
    tokens[:, 0] = CLS
    tokens = np.where((j == a + 1) | (j == t + 2), SEP, tokens)
    input_mask = (j <= t + 2).astype(np.int64)
    segment_ids = ((j >= a + 2) & (j <= t + 2)).astype(np.int64)

    # Masking: choose num_to_predict candidate positions per sample, as create_pretraining_data does.
    candidate = (j >= 1) & (j <= t + 1) & (j != a + 1)
    num_to_predict = np.minimum(max_predictions, np.maximum(1, np.round((target + 3) * MASKED_LM_PROB))).astype(int)
    scores = np.where(candidate, rng.random((n, s)), np.inf)
    chosen = np.argsort(scores, axis=1)[:, :max_predictions]
    keep = np.arange(max_predictions)[None, :] < num_to_predict[:, None]
    positions = np.sort(np.where(keep, chosen, s), axis=1)  # unused slots sort last...
    valid = positions < s
    positions = np.where(valid, positions, 0)  # ...and are padded with 0 like MLPerf's files
    labels = np.where(valid, np.take_along_axis(tokens, positions, 1), 0)
    u = rng.random((n, max_predictions))
    random_words = rng.integers(len(SPECIALS), lang.vocab_size, size=(n, max_predictions))
    replacement = np.where(u < 0.8, MASK, np.where(u < 0.9, labels, random_words))
    input_ids = tokens.copy()
    rows = np.repeat(np.arange(n)[:, None], max_predictions, 1)
    input_ids[rows[valid], positions[valid]] = replacement[valid]
    return {
        "input_ids": input_ids,
        "input_mask": input_mask,
        "segment_ids": segment_ids,
        "masked_lm_positions": positions,
        "masked_lm_ids": labels,
        "next_sentence_labels": is_random_next.astype(np.int64),
    }


def mlperf_like_lengths(rng: np.random.Generator, n: int, seq_length: int) -> np.ndarray:
    """Sample lengths (special tokens included) mixed like MLPerf's Wikipedia data at 512, where about half the
    positions of fixed rows are padding (Krell et al. 2021, the packing paper): a quarter of the samples fill the row
    (92 to 100 % of it), the rest are uniform from 3 to 72 % of it (16 to 370 tokens at 512); the mean is about 52 %
    of the row. Scaled to ``seq_length``, never shorter than the 5 tokens of [CLS] a [SEP] b [SEP]."""
    full = rng.random(n) < 0.25
    long = rng.integers(int(0.92 * seq_length), seq_length + 1, n)
    short = rng.integers(max(5, int(0.03 * seq_length)), max(6, int(0.72 * seq_length)) + 1, n)
    return np.where(full, long, short)


def md5(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def prepare_synthetic(out: str | Path, spec: SyntheticSpec, progress=None) -> dict:
    """Write train/ shards, eval/ file, vocab.txt and manifest.json into ``out``. Returns the manifest.

    Same spec -> byte-identical files. Each file is written under a temporary name and renamed when
    complete; the manifest is written last, so a folder with a manifest is a finished one.
    """
    out = Path(out)
    (out / "train").mkdir(parents=True, exist_ok=True)
    (out / "eval").mkdir(parents=True, exist_ok=True)
    lang = Language(spec.vocab_size, spec.seed)
    vocab_path = out / "vocab.txt"
    vocab_path.write_text("\n".join(vocabulary(spec.vocab_size)) + "\n")

    files = []  # (path, samples, record: what a run checks the shard against before it starts)
    sizes = np.diff(np.linspace(0, spec.num_train_samples, spec.num_shards + 1).astype(int))
    for index, count in enumerate(sizes):
        path = out / "train" / f"part_{index:05d}_of_{spec.num_shards:05d}.hdf5"
        rng = np.random.default_rng([spec.seed, 1, index])
        arrays = make_samples(lang, rng, int(count), spec.seq_length, spec.max_predictions, spec.short_seq_prob)
        write_shard(path, arrays)
        files.append((path, int(count), shard_record(path, int(count), arrays)))
        if progress:
            progress(index + 1, spec.num_shards + 1)
    eval_path = out / "eval" / "eval.hdf5"
    rng = np.random.default_rng([spec.seed, 2])
    arrays = make_samples(lang, rng, spec.num_eval_samples, spec.seq_length, spec.max_predictions)
    write_shard(eval_path, arrays)
    files.append((eval_path, spec.num_eval_samples, shard_record(eval_path, spec.num_eval_samples, arrays)))
    if progress:
        progress(spec.num_shards + 1, spec.num_shards + 1)

    manifest = {
        "format": "mlperf-bert-hdf5",
        "source": "synthetic",
        "spec": spec.__dict__,
        "train_samples": int(spec.num_train_samples),
        "eval_samples": int(spec.num_eval_samples),
        "files": {str(p.relative_to(out)): {"samples": n, "md5": md5(p)} | record for p, n, record in files}
        | {"vocab.txt": {"md5": md5(vocab_path)}},
    }
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(out / "manifest.json")
    return manifest
