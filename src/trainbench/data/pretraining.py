"""Pretraining instances (sentence pairs with masked tokens) from tokenized documents.

The semantics are those of Google's ``create_pretraining_data.py`` as MLPerf runs it
(max_seq_length 512, max_predictions_per_seq 76, masked_lm_prob 0.15, short_seq_prob 0.1,
dupe_factor 10, random_seed 12345, whole-word masking off). What is exactly theirs and what differs:

Exactly theirs
  * Documents are lists of tokenized sentences; sentences with no tokens and empty documents are dropped,
    and the document list is shuffled before instances are made.
  * For each of ``dupe_factor`` passes and each document: the target length is ``max_seq_length - 3``,
    or with probability ``short_seq_prob`` uniform in [2, max_seq_length - 3]; sentences are gathered until
    the target is reached; segment A takes the first ``a_end`` of them (uniform in [1, n-1]); with
    probability 0.5 (or always when there is one sentence) B is taken from a random *other* document
    (up to 10 draws) starting at a random sentence, and the unused sentences are put back; otherwise B is
    the rest of the gathered sentences. Every draw in this control flow comes from ``random.Random``
    in the same order as theirs.
  * Truncation removes tokens from the longer segment until the pair fits, each from the front or the back
    with probability 0.5.
  * ``num_to_predict = min(max_predictions, max(1, round(len(tokens) * masked_lm_prob)))`` tokens are masked,
    chosen uniformly among all positions except [CLS] and [SEP]; each becomes [MASK] (80 %), itself
    (10 %) or a uniformly random vocabulary entry (10 %); positions are stored in increasing order.
  * Instances are shuffled before they are written.

Different
  * Truncation draws the front/back choices as one binomial draw per segment (same distribution, fewer
    draws), and uses the closed form for how many tokens each segment loses.
  * Masking is vectorised with numpy over a whole chunk, with numpy's generator: the same distribution,
    not the same random stream as Python's ``random``.
  * The random-next document is drawn from the same *chunk* (a few MB of text) as theirs is drawn from the
    same input file (MLPerf's 500 text parts are about 20 MB each).
  * The eval set is made from held-out documents (``eval_fraction``) with one pass (no duplicates), and
    its random-next sentences come from held-out documents only; MLPerf's eval file is a 10,000-sample
    pick from instances of a held-out text part.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class InstanceSpec:
    max_seq_length: int = 512
    max_predictions: int = 76
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1
    dupe_factor: int = 10


@dataclass
class Instances:
    """A batch of variable-length instances, flat.

    ``tokens`` holds all instances' ids end to end ([CLS] A [SEP] B [SEP], already masked); instance i is
    ``tokens[offsets[i]:offsets[i+1]]`` with ``len_a[i]`` tokens of segment A. Its masked positions and
    original ids are ``mask_pos/mask_ids[mask_offsets[i]:mask_offsets[i+1]]``. ``nsp[i]`` is 1 when B is
    a random sentence.
    """

    tokens: np.ndarray
    offsets: np.ndarray
    len_a: np.ndarray
    nsp: np.ndarray
    mask_pos: np.ndarray
    mask_ids: np.ndarray
    mask_offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def _truncated(a0, a1, b0, b1, max_tokens, rng: random.Random):
    """Google's truncate_seq_pair on token ranges [a0, a1) and [b0, b1)."""
    la, lb = a1 - a0, b1 - b0
    excess = la + lb - max_tokens
    if excess <= 0:
        return a0, a1, b0, b1
    # They remove from the longer segment (B on a tie) one token at a time: first down to equal length,
    # then alternately, B first.
    first = min(excess, abs(la - lb))
    rest = excess - first
    cut_a = (first if la > lb else 0) + rest // 2
    cut_b = (first if la <= lb else 0) + rest - rest // 2
    front_a = bin(rng.getrandbits(cut_a)).count("1") if cut_a else 0
    front_b = bin(rng.getrandbits(cut_b)).count("1") if cut_b else 0
    return a0 + front_a, a1 - (cut_a - front_a), b0 + front_b, b1 - (cut_b - front_b)


def make_spans(documents: list[np.ndarray], spec: InstanceSpec, rng: random.Random, dupe_factor: int):
    """The sentence-pair control flow of create_instances_from_document, on sentence boundaries.

    ``documents[d]`` holds the token offsets of document d's sentences in the flat token array
    (len = sentences + 1). Returns an int64 array [n, 5]: a_start, a_end, b_start, b_end, is_random_next.
    """
    max_tokens = spec.max_seq_length - 3
    spans: list[tuple[int, int, int, int, int]] = []
    n_docs = len(documents)
    bounds = [d.tolist() for d in documents]
    rand, randint = rng.random, rng.randint  # bound once: this loop runs per sentence
    for _ in range(dupe_factor):
        for doc_index in range(n_docs):
            doc = bounds[doc_index]
            n_sent = len(doc) - 1
            target = max_tokens
            if rand() < spec.short_seq_prob:
                target = randint(2, max_tokens)
            start = 0  # first sentence of the current chunk
            i = 0
            while i < n_sent:
                length = doc[i + 1] - doc[start]
                if i == n_sent - 1 or length >= target:
                    n_chunk = i + 1 - start
                    a_end = randint(1, n_chunk - 1) if n_chunk >= 2 else 1
                    a0, a1 = doc[start], doc[start + a_end]
                    if n_chunk == 1 or rand() < 0.5:
                        random_next = 1
                        target_b = target - (a1 - a0)
                        for _ in range(10):
                            other = randint(0, n_docs - 1)
                            if other != doc_index:
                                break
                        rdoc = bounds[other]
                        r_start = randint(0, len(rdoc) - 2)
                        j = r_start
                        while j < len(rdoc) - 1:  # extend sentence by sentence until the target is reached
                            if rdoc[j + 1] - rdoc[r_start] >= target_b:
                                break
                            j += 1
                        b0, b1 = rdoc[r_start], rdoc[min(j, len(rdoc) - 2) + 1]
                        i -= n_chunk - a_end  # the unused sentences are taken again
                    else:
                        random_next = 0
                        b0, b1 = a1, doc[i + 1]
                    spans.append((*_truncated(a0, a1, b0, b1, max_tokens, rng), random_next))
                    start = i + 1
                i += 1
    return np.array(spans, dtype=np.int64).reshape(-1, 5)


def assemble(tokens: np.ndarray, spans: np.ndarray, cls_id: int, sep_id: int) -> Instances:
    """[CLS] A [SEP] B [SEP] for every span, as one flat array (vectorised gather)."""
    a0, a1, b0, b1, nsp = spans.T
    la, lb = a1 - a0, b1 - b0
    n = len(spans)
    ext = np.concatenate([tokens, np.array([cls_id, sep_id], dtype=tokens.dtype)])
    cls_src, sep_src = len(tokens), len(tokens) + 1
    # Five pieces per instance: [CLS], A, [SEP], B, [SEP]; each piece copies a source range.
    ones = np.ones(n, np.int64)
    piece_len = np.stack([ones, la, ones, lb, ones], 1).ravel()
    piece_src = np.stack([np.full(n, cls_src), a0, np.full(n, sep_src), b0, np.full(n, sep_src)], 1).ravel()
    index = _ranges(piece_src, piece_len)
    lengths = la + lb + 3
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return Instances(
        tokens=ext[index],
        offsets=offsets,
        len_a=la,
        nsp=nsp,
        mask_pos=np.empty(0, np.int64),
        mask_ids=np.empty(0, np.int64),
        mask_offsets=np.zeros(n + 1, np.int64),
    )


def _choose_positions(lengths, len_a, k, rng: np.random.Generator) -> np.ndarray:
    """For each row, ``k`` distinct positions drawn uniformly among the non-special ones, increasing.

    Rows of random keys (specials and padding get +inf); the ``k`` smallest keys of a row are a uniform
    ``k``-subset. ``argpartition`` at the largest k avoids sorting whole rows.
    """
    n, width, kmax = len(lengths), int(lengths.max()), int(k.max())
    cols = np.arange(width)
    keys = rng.random((n, width), dtype=np.float32)
    keys[(cols >= lengths[:, None] - 1) | (cols == 0) | (cols == len_a[:, None] + 1)] = np.inf
    if kmax < width:
        part = np.argpartition(keys, kmax - 1, axis=1)[:, :kmax]
    else:
        part = np.broadcast_to(cols, (n, width))
    ranked = np.take_along_axis(part, np.argsort(np.take_along_axis(keys, part, 1), axis=1, kind="stable"), 1)
    picked = np.where(np.arange(ranked.shape[1]) < k[:, None], ranked, width)
    picked.sort(axis=1)
    return picked[picked < width]  # row-major: row by row, increasing within a row


def mask(inst: Instances, spec: InstanceSpec, vocab_size: int, mask_id: int, rng: np.random.Generator) -> Instances:
    """Choose and apply the masked-LM predictions for every instance (in blocks of rows, vectorised)."""
    n = len(inst)
    lengths = inst.lengths
    # Python's round() and np.round both round half to even.
    k = np.minimum(spec.max_predictions, np.maximum(1, np.round(lengths * spec.masked_lm_prob).astype(np.int64)))
    block = 4096
    local = np.concatenate(
        [
            _choose_positions(lengths[i : i + block], inst.len_a[i : i + block], k[i : i + block], rng)
            for i in range(0, n, block)
        ]
    )
    chosen = local + np.repeat(inst.offsets[:-1], k)
    original = inst.tokens[chosen].copy()
    u = rng.random(len(chosen))
    tokens = inst.tokens.copy()
    tokens[chosen[u < 0.8]] = mask_id
    random_words = u >= 0.9  # 0.8 <= u < 0.9 keeps the original token
    tokens[chosen[random_words]] = rng.integers(0, vocab_size, int(random_words.sum()))
    return Instances(
        tokens=tokens,
        offsets=inst.offsets,
        len_a=inst.len_a,
        nsp=inst.nsp,
        mask_pos=local,
        mask_ids=original,
        mask_offsets=np.concatenate([[0], np.cumsum(k)]),
    )


def permute(inst: Instances, order: np.ndarray) -> Instances:
    """The instances in ``order`` (e.g. a shuffle, or a selection)."""
    lengths = inst.lengths[order]
    counts = np.diff(inst.mask_offsets)[order]
    return Instances(
        tokens=inst.tokens[_ranges(inst.offsets[order], lengths)],
        offsets=np.concatenate([[0], np.cumsum(lengths)]),
        len_a=inst.len_a[order],
        nsp=inst.nsp[order],
        mask_pos=inst.mask_pos[_ranges(inst.mask_offsets[order], counts)],
        mask_ids=inst.mask_ids[_ranges(inst.mask_offsets[order], counts)],
        mask_offsets=np.concatenate([[0], np.cumsum(counts)]),
    )


def concat(parts: list[Instances]) -> Instances:
    parts = [p for p in parts if len(p)] or parts[:1]

    def joined(key):
        """Each part's offsets past its leading 0, shifted by the totals of the parts before it."""
        pieces = [getattr(p, key) for p in parts]
        bases = np.cumsum([0] + [int(x[-1]) for x in pieces[:-1]])
        return np.concatenate([x[1:] + base for x, base in zip(pieces, bases, strict=True)])

    return Instances(
        tokens=np.concatenate([p.tokens for p in parts]),
        offsets=np.concatenate([[0], joined("offsets")]),
        len_a=np.concatenate([p.len_a for p in parts]),
        nsp=np.concatenate([p.nsp for p in parts]),
        mask_pos=np.concatenate([p.mask_pos for p in parts]),
        mask_ids=np.concatenate([p.mask_ids for p in parts]),
        mask_offsets=np.concatenate([[0], joined("mask_offsets")]),
    )


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + l) for each (s, l), as one cumulative sum of steps (no np.repeat)."""
    keep = lengths > 0
    starts, lengths = starts[keep].astype(np.int64), lengths[keep].astype(np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.empty(0, np.int64)
    step = np.ones(total, np.int64)
    step[0] = starts[0]
    # At each range's first element, jump from the previous range's last element to this range's start.
    step[np.cumsum(lengths)[:-1]] = starts[1:] - (starts[:-1] + lengths[:-1] - 1)
    return np.cumsum(step)


def create_instances(
    documents: list[list[list[int]]],
    spec: InstanceSpec,
    vocab_size: int,
    special_ids: dict[str, int],
    py_rng: random.Random,
    np_rng: np.random.Generator,
    dupe_factor: int | None = None,
    shuffle: bool = True,
) -> Instances:
    """Masked instances from documents (lists of tokenized sentences), shuffled unless ``shuffle`` is off
    (for a caller that reorders them anyway: one gather instead of two)."""
    documents = [[s for s in doc if s] for doc in documents]
    documents = [doc for doc in documents if doc]
    if not documents:
        return _empty()
    py_rng.shuffle(documents)
    flat: list[int] = []
    bounds = []
    for doc in documents:
        starts = [len(flat)]
        for sentence in doc:
            flat.extend(sentence)
            starts.append(len(flat))
        bounds.append(np.array(starts, dtype=np.int64))
    tokens = np.array(flat, dtype=np.int32)
    spans = make_spans(bounds, spec, py_rng, spec.dupe_factor if dupe_factor is None else dupe_factor)
    if not len(spans):
        return _empty()
    inst = assemble(tokens, spans, special_ids["[CLS]"], special_ids["[SEP]"])
    inst = mask(inst, spec, vocab_size, special_ids["[MASK]"], np_rng)
    return permute(inst, np_rng.permutation(len(inst))) if shuffle else inst


def _empty() -> Instances:
    z = np.zeros(1, np.int64)
    e = np.empty(0, np.int64)
    return Instances(np.empty(0, np.int32), z, e, e, e, e, z.copy())
