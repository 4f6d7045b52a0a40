"""Sequence packing for BERT: several sequences per fixed-length row, without cross-contamination.

The packing plan is longest-pack-first histogram packing (LPFHP; Krell et al., "Efficient Sequence Packing
without Cross-contamination", 2021): it works on the histogram of sequence lengths, takes lengths from the
longest down, and puts each group of equal-length sequences into the open packs with the least room that
still fits them (best fit), opening new packs when none fits. A pack holds at most ``max_per_pack``
sequences. Working on the histogram makes the plan O(seq_length^2), independent of the number of sequences.

A packed row carries, besides the tokens, ``position_ids`` (restarting at 0 for every sequence) and
``sequence_ids`` (1, 2, ... per sequence, 0 for padding); the model lets a token attend only to tokens of
its own sequence, so a packed row computes exactly what its sequences would compute apart.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from trainbench.data.pretraining import Instances

PACKED_DTYPES = {
    "input_ids": "i4",
    "segment_ids": "i1",
    "position_ids": "i2",
    "sequence_ids": "i1",
    "masked_lm_positions": "i4",
    "masked_lm_ids": "i4",
    "next_sentence_labels": "i1",
    "cls_positions": "i2",
}


def lpfhp(histogram: np.ndarray, max_length: int, max_per_pack: int) -> list[tuple[tuple[int, ...], int]]:
    """Packing plan from a length histogram (histogram[l] = sequences of length l).

    Returns (lengths in the pack, number of such packs) pairs; every sequence is in exactly one pack.
    """
    # open_packs[room] = list of [count, lengths]: packs with `room` tokens free and fewer than max_per_pack
    open_packs: dict[int, list[list]] = defaultdict(list)
    done: dict[tuple[int, ...], int] = defaultdict(int)
    for length in range(max_length, 0, -1):
        left = int(histogram[length]) if length < len(histogram) else 0
        while left > 0:
            room = next((r for r in range(length, max_length + 1) if open_packs.get(r)), None)
            if room is None:
                _place(open_packs, done, (length,), max_length - length, left, max_per_pack)
                left = 0
                continue
            group = open_packs[room][-1]
            take = min(left, group[0])
            group[0] -= take
            if group[0] == 0:
                open_packs[room].pop()
            _place(open_packs, done, group[1] + (length,), room - length, take, max_per_pack)
            left -= take
    for groups in open_packs.values():
        for count, lengths in groups:
            if count:
                done[lengths] += count
    return sorted(done.items(), key=lambda kv: (-sum(kv[0]), kv[0]))


def _place(open_packs, done, lengths: tuple[int, ...], room: int, count: int, max_per_pack: int) -> None:
    if room > 0 and len(lengths) < max_per_pack:
        open_packs[room].append([count, lengths])
    else:
        done[lengths] += count


def packed_predictions(seq_length: int, max_predictions: int, masked_lm_prob: float, max_per_pack: int) -> int:
    """Columns of a packed row's masked_lm arrays: enough for any pack.

    A sequence of length l has min(P, max(1, round(p * l))) <= p * l + 1 predictions, so a pack of at most
    k sequences and seq_length tokens has at most floor(p * seq_length) + k.
    """
    return min(max_per_pack * max_predictions, int(masked_lm_prob * seq_length) + max_per_pack)


def pack(inst: Instances, seq_length: int, max_per_pack: int, max_pred: int, rng: np.random.Generator):
    """Packed rows (the PACKED_KEYS arrays) holding every instance once."""
    lengths = inst.lengths
    histogram = np.bincount(lengths, minlength=seq_length + 1)
    plan = lpfhp(histogram, seq_length, max_per_pack)
    # Instances of each length, in a seeded random order, are dealt out to the packs that ask for that length.
    by_length: dict[int, list[int]] = {}
    order = rng.permutation(len(inst))
    sorted_idx = order[np.argsort(lengths[order], kind="stable")]
    bounds = np.searchsorted(lengths[sorted_idx], np.arange(seq_length + 2))
    for length in np.nonzero(histogram)[0]:
        by_length[int(length)] = sorted_idx[bounds[length] : bounds[length + 1]].tolist()
    members: list[list[int]] = []
    for pack_lengths, count in plan:
        for _ in range(count):
            members.append([by_length[length].pop() for length in pack_lengths])
    rows = len(members)
    members = [members[i] for i in rng.permutation(rows)]  # no long-packs-first order in the file
    out = {
        "input_ids": np.zeros((rows, seq_length), np.int32),
        "segment_ids": np.zeros((rows, seq_length), np.int8),
        "position_ids": np.zeros((rows, seq_length), np.int16),
        "sequence_ids": np.zeros((rows, seq_length), np.int8),
        "masked_lm_positions": np.zeros((rows, max_pred), np.int32),
        "masked_lm_ids": np.zeros((rows, max_pred), np.int32),
        "next_sentence_labels": np.full((rows, max_per_pack), -1, np.int8),
        "cls_positions": np.zeros((rows, max_per_pack), np.int16),
    }
    for row, seqs in enumerate(members):
        col = mcol = 0
        for slot, i in enumerate(seqs):
            lo, hi, n = inst.offsets[i], inst.offsets[i + 1], int(lengths[i])
            out["input_ids"][row, col : col + n] = inst.tokens[lo:hi]
            out["segment_ids"][row, col + inst.len_a[i] + 2 : col + n] = 1
            out["position_ids"][row, col : col + n] = np.arange(n)
            out["sequence_ids"][row, col : col + n] = slot + 1
            mlo, mhi = inst.mask_offsets[i], inst.mask_offsets[i + 1]
            out["masked_lm_positions"][row, mcol : mcol + mhi - mlo] = inst.mask_pos[mlo:mhi] + col
            out["masked_lm_ids"][row, mcol : mcol + mhi - mlo] = inst.mask_ids[mlo:mhi]
            out["next_sentence_labels"][row, slot] = inst.nsp[i]
            out["cls_positions"][row, slot] = col
            col += n
            mcol += mhi - mlo
    return out


def instances_from_fixed(arrays: dict[str, np.ndarray]) -> Instances:
    """The samples of fixed rows (the fixed layout's arrays: one sample per row, padded) as :class:`Instances`,
    ready to :func:`pack`: tokens up to each row's input mask, segment A's length from the segment ids, and
    the masked positions and ids in use (position 0 marks an unused slot, as in MLPerf's files)."""
    lengths = arrays["input_mask"].sum(1)
    counts = (arrays["masked_lm_positions"] > 0).sum(1)
    # [CLS] A [SEP] B [SEP]: B's first token is the first segment id 1; a row without B is [CLS] A [SEP]
    len_a = np.array([int(np.argmax(arrays["segment_ids"][r, :n])) - 2 if arrays["segment_ids"][r, :n].any()
                      else n - 2 for r, n in enumerate(lengths)])  # fmt: skip
    return Instances(
        tokens=np.concatenate([arrays["input_ids"][r, :n] for r, n in enumerate(lengths)]),
        offsets=np.concatenate([[0], np.cumsum(lengths)]),
        len_a=len_a,
        nsp=arrays["next_sentence_labels"],
        mask_pos=np.concatenate([arrays["masked_lm_positions"][r, :c] for r, c in enumerate(counts)]),
        mask_ids=np.concatenate([arrays["masked_lm_ids"][r, :c] for r, c in enumerate(counts)]),
        mask_offsets=np.concatenate([[0], np.cumsum(counts)]),
    )
