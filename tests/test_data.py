"""The MLPerf BERT HDF5 reader/writer, the sample order, and the synthetic generator."""

import h5py
import numpy as np
import pytest
from conftest import tiny_spec

from trainbench.data.bert_hdf5 import KEYS, GlobalSampleOrder, TrainBatches, eval_batches, find_shards, validate_shard
from trainbench.data.synthetic_bert import CLS, MASK, PAD, SEP, prepare_synthetic
from trainbench.errors import DataError


def test_shards_have_the_mlperf_keys_and_shapes(small_data):
    shards = find_shards(small_data / "train", "training data", 128, 20)
    assert len(shards) == 3 and sum(s.num_samples for s in shards) == 2048
    with h5py.File(shards[0].path) as f:
        assert set(f.keys()) == set(KEYS)
        assert f["input_ids"].shape[1] == 128 and f["masked_lm_positions"].shape[1] == 20


def test_synthetic_samples_are_well_formed(small_data):
    with h5py.File(next((small_data / "train").iterdir())) as f:
        d = {k: f[k][()].astype(np.int64) for k in KEYS}
    for i in range(len(d["input_ids"])):
        ids, mask, seg = d["input_ids"][i], d["input_mask"][i], d["segment_ids"][i]
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any() and (ids[n:] == PAD).all()
        assert ids[0] == CLS and ids[n - 1] == SEP
        pos = d["masked_lm_positions"][i]
        valid = pos > 0
        k = int(valid.sum())
        assert valid[:k].all() and not valid[k:].any(), "real positions first, then 0 padding"
        assert (np.diff(pos[:k]) > 0).all() and (pos[:k] < n).all()
        assert 1 <= k <= 20 and k == min(20, max(1, round(n * 0.15)))
        labels = d["masked_lm_ids"][i][:k]
        assert (labels > SEP).all() and (labels != MASK).all(), "only words are masked, never [CLS]/[SEP]"
        unmasked = np.setdiff1d(np.arange(n), pos[:k])
        assert not np.isin(ids[unmasked], [MASK]).any()
        first_b = np.argmax(seg)  # segment B is contiguous and ends at the last [SEP]
        assert seg[first_b:n].all() and ids[first_b - 1] == SEP
    # the 80/10/10 rule: most masked positions show [MASK]
    shown = d["input_ids"][np.arange(len(d["input_ids"]))[:, None], d["masked_lm_positions"]][
        d["masked_lm_positions"] > 0
    ]
    assert 0.75 < (shown == MASK).mean() < 0.85
    assert 0.4 < d["next_sentence_labels"].mean() < 0.6


def test_synthetic_data_is_byte_identical_for_a_seed(tmp_path):
    a = prepare_synthetic(tmp_path / "a", tiny_spec(num_train_samples=300, num_eval_samples=50))
    b = prepare_synthetic(tmp_path / "b", tiny_spec(num_train_samples=300, num_eval_samples=50))
    c = prepare_synthetic(tmp_path / "c", tiny_spec(num_train_samples=300, num_eval_samples=50, seed=8))
    assert a["files"] == b["files"]
    assert a["files"]["train/part_00000_of_00003.hdf5"]["md5"] != c["files"]["train/part_00000_of_00003.hdf5"]["md5"]


def test_sample_order_is_independent_of_rank_count(small_data):
    shards = find_shards(small_data / "train", "training data", 128, 20)
    one = iter(TrainBatches(shards, seed=3, global_batch_size=32, micro_batch_size=16, rank=0, world_size=1))
    r0 = iter(TrainBatches(shards, seed=3, global_batch_size=32, micro_batch_size=8, rank=0, world_size=2))
    r1 = iter(TrainBatches(shards, seed=3, global_batch_size=32, micro_batch_size=8, rank=1, world_size=2))
    for _ in range(70):  # past one epoch (2048 samples / 32 = 64 steps)
        whole = np.concatenate([mb["input_ids"] for mb in next(one)])
        split = np.concatenate([mb["input_ids"] for mb in next(r0)] + [mb["input_ids"] for mb in next(r1)])
        np.testing.assert_array_equal(whole, split)


def test_sample_order_covers_each_epoch_once_and_reshuffles(small_data):
    shards = find_shards(small_data / "train", "training data", 128, 20)
    order = GlobalSampleOrder(shards, seed=1)
    stream = order.stream()
    epoch0 = [next(stream) for _ in range(order.epoch_size)]
    epoch1 = [next(stream) for _ in range(order.epoch_size)]
    assert len(set(epoch0)) == order.epoch_size and set(epoch0) == set(epoch1) and epoch0 != epoch1
    resumed = order.stream(start_sample=order.epoch_size + 100)
    assert [next(resumed) for _ in range(50)] == epoch1[100:150]


def test_eval_set_is_split_across_ranks(small_data):
    shards = find_shards(small_data / "eval", "eval data", 128, 20)
    whole = np.concatenate([b["input_ids"] for b in eval_batches(shards, 250, 64, 0, 1)])
    parts = [np.concatenate([b["input_ids"] for b in eval_batches(shards, 250, 64, r, 2)]) for r in range(2)]
    np.testing.assert_array_equal(whole, np.concatenate(parts))
    with pytest.raises(DataError, match="hold only 256 samples"):
        eval_batches(shards, 10_000, 64, 0, 1)


def _copy_shard(src, dst, drop=None, reshape=None):
    with h5py.File(src) as f, h5py.File(dst, "w") as g:
        for k in KEYS:
            if k == drop:
                continue
            data = f[k][()]
            g.create_dataset(k, data=data[:, :64] if k == reshape else data)


def test_shard_missing_a_key_names_file_and_key(small_data, tmp_path):
    src = next((small_data / "train").iterdir())
    bad = tmp_path / "bad.hdf5"
    _copy_shard(src, bad, drop="masked_lm_ids")
    with pytest.raises(DataError, match=r"bad\.hdf5: key 'masked_lm_ids' is missing"):
        validate_shard(bad, 128, 20)


def test_shard_with_wrong_shape_names_file_and_key(small_data, tmp_path):
    src = next((small_data / "train").iterdir())
    bad = tmp_path / "short.hdf5"
    _copy_shard(src, bad, reshape="segment_ids")
    with pytest.raises(DataError, match=r"short\.hdf5: key 'segment_ids' has shape \(\d+, 64\), expected \(\d+, 128\)"):
        validate_shard(bad, 128, 20)


def test_not_an_hdf5_file(tmp_path):
    bad = tmp_path / "junk.hdf5"
    bad.write_text("not hdf5")
    with pytest.raises(DataError, match="not a readable HDF5 file"):
        validate_shard(bad, 128, 20)


def test_one_splitter_for_every_benchmark_covers_each_global_batch_and_eval_set_once():
    import numpy as np

    from trainbench.data.steps import Step, batched, eval_share, rank_share

    shares = [rank_share(64, r, 4) for r in range(4)]
    assert [list(s) for s in shares] == [list(range(16 * r, 16 * (r + 1))) for r in range(4)]
    evals = [eval_share(10, r, 3) for r in range(3)]
    assert sum((list(e) for e in evals), []) == list(range(10)) and [len(e) for e in evals] == [3, 3, 4]
    assert [list(b) for b in batched(range(3, 10), 3)] == [[3, 4, 5], [6, 7, 8], [9]]
    step = Step.split({"a": np.arange(8), "b": np.arange(8) * 2}, 4, samples=32)
    assert step.samples == 32 and [m["a"].tolist() for m in step] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert step[1]["b"].tolist() == [8, 10, 12, 14]
