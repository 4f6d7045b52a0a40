"""The speed switches keep the algorithm: length bins, bucket-wise clipping, compiled model and LAMB."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from tests.conftest import only_run_dir, read_metrics, run_cli, tiny_spec
from trainbench.data.bert_hdf5 import TrainBatches, find_shards
from trainbench.data.synthetic_bert import prepare_synthetic
from trainbench.errors import ConfigError
from trainbench.resolve import build_config

QUICK = ["progress=false", "eval_samples=256", "eval.every_samples=320", "schedule.max_samples=640"]
needs_compiler = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None,
    reason="torch.compile on CPU generates C++: no C++ compiler on this machine",
)


@pytest.fixture(scope="module")
def varied_data(tmp_path_factory):
    """Tiny-preset shapes with most samples shorter than 128 tokens, as in real text."""
    out = tmp_path_factory.mktemp("bert-varied")
    prepare_synthetic(out, tiny_spec(short_seq_prob=0.7))
    return out


def _steps(data, world, bins, steps=6):
    shards = find_shards(data / "train", "training data", 128, 20)
    ranks = [iter(TrainBatches(shards, 3, 64, 16, r, world, 0, "fixed", bins)) for r in range(world)]
    return [[next(it) for it in ranks] for _ in range(steps)]


def _rows(micro_batches):
    """The samples of some micro-batches as a sorted list of (input_ids without padding, positions) keys."""
    keys = []
    for mb in micro_batches:
        for ids, mask, pos in zip(mb["input_ids"], mb["input_mask"], mb["masked_lm_positions"], strict=True):
            keys.append((tuple(ids[mask > 0]), tuple(pos)))
    return sorted(keys)


def test_length_bins_keep_each_global_batch_and_balance_the_ranks(varied_data):
    plain, binned = _steps(varied_data, 2, 0), _steps(varied_data, 2, 4)
    cut = 0
    for plain_step, binned_step in zip(plain, binned, strict=True):
        # The same samples in every global batch, only split differently.
        assert _rows(mb for r in plain_step for mb in r) == _rows(mb for r in binned_step for mb in r)
        assert all(r.samples == 64 for r in binned_step)
        for k in range(len(binned_step[0])):
            micro = [r[k] for r in binned_step]  # micro-batch k of every rank
            widths = {mb["input_ids"].shape[1] for mb in micro}
            lengths = [mb["input_mask"].sum(1) for mb in micro]
            for mb, n in zip(micro, lengths, strict=True):
                width = mb["input_ids"].shape[1]
                assert width % 32 == 0 and n.max() <= width < n.max() + 32
                assert all(mb[key].shape[1] == width for key in ("input_mask", "segment_ids"))
                assert (mb["masked_lm_positions"] < width).all()
                cut += width < 128
            # Dealt round-robin from the sorted batch: rank 0 takes the longest of each pair.
            assert len(widths) <= 2 and all(lengths[0] >= lengths[1])
    assert cut > 0, "no micro-batch was shorter than 128: the bins were never used"


@pytest.mark.full
def test_length_bins_give_the_losses_of_the_plain_split(varied_data, tmp_path):
    common = ["run", "bert", "--preset", "tiny", f"data.dir={varied_data}", "log_every_steps=1", "micro_batch_size=16"]
    run_cli(*common, *QUICK, f"output.results_dir={tmp_path / 'plain'}")
    run_cli(*common, *QUICK, f"output.results_dir={tmp_path / 'bins'}", "data.length_bins=4")
    plain, bins = (_losses(tmp_path / n) for n in ("plain", "bins"))
    assert len(plain) == len(bins) == 10
    assert max(abs(a - b) for a, b in zip(plain, bins, strict=True)) <= 1e-5, (plain, bins)


def _losses(results):
    return [r["loss"] for r in read_metrics(only_run_dir(results)) if "loss" in r]


@pytest.mark.full
def test_bucket_clipping_is_global_clipping_when_nothing_is_clipped(small_data, tmp_path):
    """Below the threshold both clip nothing: the same updates. A threshold that bites makes them differ."""
    common = ["run", "bert", "--preset", "tiny", f"data.dir={small_data}", "log_every_steps=1", "--nproc", "2"]
    common += ["micro_batch_size=32", "distributed.bucket_cap_mb=0.5", *QUICK]
    runs = {
        "global": ["optimizer.max_grad_norm=1e6"],
        "bucket": ["optimizer.max_grad_norm=1e6", "optimizer.clip=bucket"],
        "bucket_bites": ["optimizer.max_grad_norm=0.05", "optimizer.clip=bucket"],
        "global_bites": ["optimizer.max_grad_norm=0.05"],
    }
    for name, extra in runs.items():
        run_cli(*common, *extra, f"output.results_dir={tmp_path / name}")  # aborted: stops before the target
    loss = {name: _losses(tmp_path / name) for name in runs}
    assert len(loss["global"]) == 10
    assert max(abs(a - b) for a, b in zip(loss["global"], loss["bucket"], strict=True)) <= 1e-5
    # A bucket over the threshold is scaled down before the all-reduce: another algorithm from then on
    # (LAMB normalises the update, so a uniform scale changes little; the difference is in the mix of scales).
    gap = max(abs(a - b) for a, b in zip(loss["global"], loss["bucket_bites"], strict=True))
    assert gap > 1e-4, loss
    assert max(abs(a - b) for a, b in zip(loss["global_bites"], loss["bucket_bites"], strict=True)) > 1e-4, loss


def test_bucket_clipping_needs_several_ranks(small_data, tmp_path, capsys):
    args = ["run", "bert", f"data.dir={small_data}", "optimizer.clip=bucket", *QUICK]
    assert run_cli(*args, f"output.results_dir={tmp_path}") == 2
    assert "optimizer.clip=bucket clips before the all-reduce: it needs more than one rank" in capsys.readouterr().out


def test_length_bins_refuse_packed_rows(small_data, capsys):
    assert run_cli("run", "bert", f"data.dir={small_data}", "data.layout=packed", "data.length_bins=4") == 2
    assert "error: data.length_bins applies to the fixed layout" in capsys.readouterr().out


def test_cuda_graphs_need_compile(small_data, capsys):
    assert run_cli("run", "bert", f"data.dir={small_data}", "perf.cuda_graphs=true") == 2
    assert (
        "error: perf.cuda_graphs=true replays the compiled step: it needs perf.compile=true" in capsys.readouterr().out
    )


@pytest.mark.full
@needs_compiler
def test_every_switch_on_converges_like_every_switch_off(tiny_data, converged, tmp_path):
    """The tiny preset to its target on 2 ranks: compiled model, fused LAMB, 4 length bins, bucket-wise
    clipping (which bites: the tiny model's early gradients are far above 1.0), against all of it off (the shared
    one-rank run: 1 rank at global batch 64 and 2 ranks at 16 x 2 accumulation train the same samples to 1e-5,
    test_train.py)."""
    common = ["run", "bert", "--preset", "tiny", f"data.dir={tiny_data}", "progress=false", "--nproc", "2"]
    common += ["micro_batch_size=16", "telemetry_hz=0"]
    fast = ["perf.compile=true", "data.length_bins=4", "optimizer.clip=bucket"]
    assert run_cli(*common, *fast, f"output.results_dir={tmp_path / 'on'}") == 0
    evals = {}
    for name, run_dir in (("off", converged), ("on", only_run_dir(tmp_path / "on"))):
        rows = read_metrics(run_dir)
        evals[name] = [(r["samples"], r["masked_lm_accuracy"]) for r in rows if "masked_lm_accuracy" in r]
    (off_samples, off_acc), (on_samples, on_acc) = evals["off"][-1], evals["on"][-1]
    assert off_acc >= 0.72 and on_acc >= 0.72, evals
    assert on_samples == off_samples, evals  # the target is reached at the same eval
    assert abs(on_acc - off_acc) <= 0.01, evals
    assert np.isfinite([a for _, a in evals["on"]]).all()


@pytest.mark.full
def test_scheduled_garbage_collection_gives_the_same_losses_and_restores_automatic_collection(
    small_data, tmp_path, monkeypatch
):
    import gc

    common = ["run", "bert", "--preset", "tiny", f"data.dir={small_data}", "log_every_steps=1", *QUICK]
    run_cli(*common, f"output.results_dir={tmp_path / 'auto'}", "perf.gc_every_steps=0")
    calls, collect = [], gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append((a, gc.isenabled(), gc.get_freeze_count() > 0)) or 0)
    run_cli(*common, f"output.results_dir={tmp_path / 'scheduled'}", "perf.gc_every_steps=3")
    monkeypatch.setattr(gc, "collect", collect)
    # one full collection before freezing; then, with automatic collection off, generation 1 at steps 3, 6, 9 and
    # a full collection after each eval (steps 5 and 10)
    young, full = ((1,), False, True), ((), False, True)
    assert calls == [((), True, False), young, full, young, young, full]
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert _losses(tmp_path / "auto") == _losses(tmp_path / "scheduled")


@pytest.mark.full
@needs_compiler
def test_one_compiled_graph_under_ddp_gives_the_losses_of_the_graph_split_at_buckets(small_data, tmp_path):
    """With buckets small enough to split the tiny model's compiled graph, overlap_compiled=true (split, each bucket
    reduced during backward) and auto (on one node: one graph, every bucket reduced after backward) train to the same
    losses on 2 ranks, and the console says which one ran."""
    common = ["run", "bert", "--preset", "tiny", f"data.dir={small_data}", "log_every_steps=1", "--nproc", "2", *QUICK]
    common += ["micro_batch_size=16", "telemetry_hz=0", "perf.compile=true", "distributed.bucket_cap_mb=2"]
    for overlap in ("true", "auto"):
        out = f"output.results_dir={tmp_path / overlap}"
        assert run_cli(*common, f"distributed.overlap_compiled={overlap}", out) in (0, 1)  # 1: target not reached
    split, one = _losses(tmp_path / "true"), _losses(tmp_path / "auto")
    assert len(split) >= 5
    np.testing.assert_allclose(one, split, rtol=1e-4)
    notes = {o: (only_run_dir(tmp_path / o) / "console.log").read_text() for o in ("true", "auto")}
    assert "the compiled graph split at the DDP buckets" in notes["true"]
    assert "one compiled graph, the DDP buckets all-reduced after backward" in notes["auto"]


@pytest.mark.parametrize(
    ("env", "overlap", "split"),
    [
        ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}, "auto", False),  # torchrun on one node
        ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, "auto", True),  # torchrun, two nodes
        ({"SLURM_NTASKS": "8", "SLURM_NNODES": "1"}, "auto", False),  # srun, one node
        ({"SLURM_NTASKS": "16", "SLURM_NNODES": "2"}, "auto", True),  # srun, two nodes
        ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}, "true", True),
        ({"SLURM_NTASKS": "16", "SLURM_NNODES": "2"}, "false", False),
    ],
)
def test_compiled_ddp_is_one_graph_on_one_node_and_split_across_nodes(env, overlap, split):
    from trainbench.distributed import DistInfo, ranks_on_this_node
    from trainbench.families.data_parallel import split_compiled_graph

    world = int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS")))
    local = ranks_on_this_node(env, world)
    info = DistInfo(rank=0, local_rank=0, world_size=world, device=None, local_world_size=local)
    assert split_compiled_graph(overlap, info) is split


def test_overlap_compiled_takes_yaml_booleans_and_auto(tmp_path):
    path = tmp_path / "o.yaml"
    where = "  nproc: 2\nperf:\n  compile: true\n"  # where it takes effect: compiled, on more than one rank
    path.write_text("distributed:\n  overlap_compiled: false\n" + where)
    assert build_config("bert", "tiny", yaml_files=[str(path)])[1].distributed.overlap_compiled == "false"
    path.write_text("distributed:\n  overlap_compiled: true\n" + where)
    assert build_config("bert", "tiny", yaml_files=[str(path)])[1].distributed.overlap_compiled == "true"
    assert build_config("bert", "tiny")[1].distributed.overlap_compiled == "auto"
    with pytest.raises(ConfigError, match="must be one of auto, true, false"):
        build_config("bert", "tiny", overrides={"distributed.overlap_compiled": "maybe"})
