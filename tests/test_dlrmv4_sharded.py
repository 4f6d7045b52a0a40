"""dlrmv4's tables sharded row-wise over the ranks (``perf.sharded_tables``): RowWiseAdagrad's update of the touched
rows against the dense update on the same gradients, and whole runs where 1 rank = 2 ranks = accumulation: one rank
sharded against one rank holding every table, two gloo ranks sharded and one rank of two micro-batches sharded
against one rank; an id past its table refused in one sentence; a checkpoint of 2 sharded ranks resumed on 1.

Tolerances: the sharded path sums a row's gradients in another order than the dense embedding backward (and over 2
ranks, or 2 micro-batches, in two parts), so the losses agree to float32 sums' rounding, carried through 10 steps of
Adam: 1e-5, the replicated 2-rank test's bound."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from trainbench.benchmarks.dlrmv4 import Dlrmv4Benchmark
from trainbench.distributed import DistInfo
from trainbench.errors import DataError
from trainbench.optim.rowwise_adagrad import rowwise_adagrad_, rowwise_adagrad_rows_

BENCH = Dlrmv4Benchmark()
CPU = DistInfo(0, 0, 1, torch.device("cpu"))


def test_the_update_of_the_touched_rows_is_the_dense_rowwise_adagrad_on_the_same_gradients():
    """The touched rows' update (each unique row's lookups summed, then index ops) against ``rowwise_adagrad_`` on the
    dense gradient those lookups make (zero in untouched rows): bit for bit on the CPU over three steps."""
    torch.manual_seed(0)
    rows, dim = 50, 8
    sparse_weight = torch.randn(rows, dim)
    dense_weight = sparse_weight.clone()
    sparse_acc, dense_acc = torch.zeros(rows), torch.zeros(rows)
    for _ in range(3):
        lookups = torch.randint(0, rows, (40,))  # repeats: some rows summed over several lookups
        grads = torch.randn(40, dim)
        dense_grad = torch.zeros(rows, dim).index_add_(0, lookups, grads)
        rowwise_adagrad_(dense_weight, dense_grad, dense_acc, 0.05, 1e-8)
        rowwise_adagrad_rows_(sparse_weight, lookups, grads, sparse_acc, 0.05, 1e-8)
        assert torch.equal(sparse_weight, dense_weight) and torch.equal(sparse_acc, dense_acc)


@pytest.fixture(autouse=True)
def _leave_the_process_group():
    """One rank's sharded tables make a process group of this process alone: left after each test."""
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _sharded_tiny(seed: int = 0):
    cfg = BENCH.config("tiny")
    cfg.perf.sharded_tables = True
    torch.manual_seed(seed)
    placed = BENCH.family.place(BENCH.family.build_model(cfg), cfg, CPU, False)
    return cfg, placed


def _batch(cfg, n: int = 8) -> dict[str, torch.Tensor]:
    data = BENCH.bench_data(cfg, 0, 1)
    return {k: torch.as_tensor(v[:n]) for k, v in data.eval[0].items()}


def test_an_id_past_its_table_is_refused_in_one_sentence_where_it_enters_the_exchange():
    cfg, placed = _sharded_tiny()
    batch = _batch(cfg)
    batch["hist_album"][3, 5] = cfg.model.album_rows  # one past the last row
    with pytest.raises(DataError, match=r"1 looked-up ids lie outside their table, e.g. id 240 of the album table, "
                       r"which has 240 rows \(model.album_rows\)"):  # fmt: skip
        placed.model(batch)
    batch["hist_album"][3, 5] = -1
    with pytest.raises(DataError, match="id -1 of the album table"):
        placed.model(batch)


def test_a_sharded_tables_step_leaves_no_gradient_on_the_tables_and_moves_only_the_looked_up_rows():
    cfg, placed = _sharded_tiny()
    optimizer = BENCH.build_optimizer(cfg, placed.module)
    before = {n: t.weight.to_local().clone() for n, t in placed.module.tables.items()}
    batch = _batch(cfg)
    BENCH.loss(placed.model, batch, BENCH.loss_weights(batch)).backward()
    assert all(t.weight.grad is None for t in placed.module.tables.values())
    optimizer.step()
    moved = (placed.module.tables["album"].weight.to_local() != before["album"]).any(dim=1)
    looked_up = torch.zeros(cfg.model.album_rows, dtype=torch.bool)
    looked_up[torch.cat([batch["hist_album"].flatten(), batch["cand_album"]])] = True
    assert moved.any() and not (moved & ~looked_up).any()  # (a padded history position's row has no gradient)
    assert all(optimizer.state[t.weight]["accumulator"].shape == (t.num_embeddings,)
               for t in placed.module.tables.values())  # fmt: skip


# -- whole runs: 1 rank = 2 ranks = accumulation ---------------------------------------------------------------------
# 1,025 eval samples: two ranks' shares (512 and 513) take one and two batches of 512, so the first rank ends each eval
# on an empty batch to join the second's last exchange.
COMMON = ["run", "dlrmv4", "--preset", "tiny", "progress=false", "log_every_steps=1", "telemetry_hz=0",
          "schedule.max_samples=1280", "eval.every_samples=640", "eval_samples=1025"]  # fmt: skip


def test_every_rank_passes_as_many_eval_batches_the_shorter_shares_ending_on_an_empty_one():
    """The eval's batches of each rank's share, the ranks' shares uneven: as many batches on every rank (the sharded
    lookups are an exchange each batch), the added ones empty and after the share's end, every sample in one batch."""
    from trainbench.data.yambda import YambdaEval

    for total, batch, world in [(1025, 512, 2), (10, 4, 3), (3, 8, 4), (2048, 512, 4)]:
        ranks = [YambdaEval(None, np.zeros((total, 3)), total, batch, r, world).batches for r in range(world)]
        assert len({len(b) for b in ranks}) == 1, (total, batch, world)
        covered = [i for b in ranks for r in b for i in r]
        assert sorted(covered) == list(range(total))
        assert all(len(r) <= batch for b in ranks for r in b)
    uneven = [YambdaEval(None, np.zeros((1025, 3)), 1025, 512, r, 2).batches for r in range(2)]
    assert [len(r) for r in uneven[0]] == [512, 0] and [len(r) for r in uneven[1]] == [512, 1]


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    from conftest import run_cli

    out = tmp_path_factory.mktemp("dlrmv4_sharded") / "tiny"
    assert run_cli("prepare", "dlrmv4", "--synthetic", "--preset", "tiny", "--out", out, "--no-progress") == 0
    return out


@pytest.fixture(scope="module")
def replicated(tiny_data, tmp_path_factory):
    """One rank holding every table: 10 steps' losses and 2 evals' AUCs."""
    from conftest import losses_and_evals

    results = tmp_path_factory.mktemp("replicated")
    losses, evals = losses_and_evals([*COMMON, f"data.dir={tiny_data}"], {"one": ["--nproc", "1"]}, results, "auc")
    assert len(losses["one"]) == 10 and len(evals["one"]) == 2 and losses["one"][0] > losses["one"][-1]
    return losses["one"], evals["one"]


def _agree(ours, theirs, tolerance: float) -> None:
    assert len(ours) == len(theirs) and max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) <= tolerance, (
        ours,
        theirs,
    )


@pytest.mark.full
@pytest.mark.parametrize(
    "case, keys",
    [("one_rank", ["--nproc", "1"]), ("two_gloo_ranks", ["--nproc", "2", "micro_batch_size=64"]),
     ("two_micro_batches", ["--nproc", "1", "micro_batch_size=64"]),
     ("two_ranks_looked_up_once_a_step", ["--nproc", "2", "micro_batch_size=32", "perf.lookup_once_a_step=true"])],
    ids=["one_rank", "two_gloo_ranks", "two_micro_batches", "two_ranks_looked_up_once_a_step"],
)  # fmt: skip
def test_sharded_tables_train_the_losses_and_evals_of_one_rank_holding_every_table(replicated, tiny_data, tmp_path,
                                                                                   case, keys):  # fmt: skip
    """One rank sharded, two gloo ranks sharded (each owning half of every table's rows, the lookups and gradients
    through all-to-all), one rank of two micro-batches sharded, and two ranks of two micro-batches each looked up once
    a step (perf.lookup_once_a_step) train the losses and AUCs of one rank holding every table, within 1e-5."""
    from conftest import losses_and_evals

    losses, evals = losses_and_evals([*COMMON, f"data.dir={tiny_data}", "perf.sharded_tables=true"], {case: keys},
                                     tmp_path, "auc")  # fmt: skip
    _agree(losses[case], replicated[0], 1e-5)
    _agree(evals[case], replicated[1], 1e-5)


def _two_ranks_save(rank: int, world: int, port: int, out: str) -> None:
    """Rank ``rank`` of 2 gloo ranks: the tiny model sharded, two steps, a checkpoint into ``out``; rank 0 writes the
    whole tables and accumulators (gathered) beside it."""
    import os

    from trainbench.distributed import init_distributed, shutdown
    from trainbench.train import checkpoint

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")  # fmt: skip
    info = init_distributed("cpu", "gloo")
    cfg = BENCH.config("tiny")
    cfg.perf.sharded_tables = True
    torch.manual_seed(0)
    placed = BENCH.family.place(BENCH.family.build_model(cfg), cfg, info, False)
    optimizer = BENCH.build_optimizer(cfg, placed.module)
    batch = _batch(cfg, 16)
    share = {k: v[8 * rank : 8 * (rank + 1)] for k, v in batch.items()}
    for _ in range(2):
        (BENCH.loss(placed.model, share, BENCH.loss_weights(batch)) * world).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    from pathlib import Path

    checkpoint.save(Path(out).parent, 0, placed.module, optimizer, checkpoint.LoopState(step=2), info)
    whole = {n: (t.weight.full_tensor(), optimizer.state[t.weight]["accumulator"].full_tensor())
             for n, t in placed.module.tables.items()}  # fmt: skip
    if rank == 0:
        torch.save(whole, Path(out).parent / "whole.pt")
    shutdown(drain=True)


@pytest.mark.full
def test_a_checkpoint_of_two_sharded_ranks_resumes_on_one_with_every_row_and_accumulator(tmp_path):
    """Each rank saves its blocks of rows and their accumulators once (DTensors sharded on the rows, through torch
    distributed checkpoint); one rank resuming reads them back whole, re-sharded."""
    from conftest import spawned

    from trainbench.train import checkpoint

    spawned(_two_ranks_save, 2, str(tmp_path / "out"))
    cfg, placed = _sharded_tiny(seed=5)  # other initial rows: the checkpoint must overwrite them
    optimizer = BENCH.build_optimizer(cfg, placed.module)
    state = checkpoint.load(checkpoint.checkpoint_dir(tmp_path, 0), placed.module, optimizer, CPU)
    assert state.step == 2
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    for name, table in placed.module.tables.items():
        assert torch.equal(table.weight.full_tensor(), whole[name][0]), name
        assert torch.equal(optimizer.state[table.weight]["accumulator"].full_tensor(), whole[name][1]), name
    assert json.loads((checkpoint.checkpoint_dir(tmp_path, 0) / "meta.json").read_text())["world_size"] == 2


def test_a_tables_rows_are_drawn_the_same_whatever_block_of_it_a_rank_holds(monkeypatch):
    """init_table_rows: a table drawn whole equals its blocks drawn apart (cuts inside and across the draw's chunks,
    an empty block), within TorchRec's bound; another seed or another table draws other rows."""
    from trainbench.families.hstu import model

    monkeypatch.setattr(model, "INIT_CHUNK_ROWS", 7)
    rows, dim = 40, 3
    whole = torch.empty(rows, dim)
    model.init_table_rows(whole, 0, rows, 5, 2)
    assert whole.abs().max() <= (1 / rows) ** 0.5 and whole.std() > 0
    for cuts in ([0, 13, 27, 40], [0, 7, 14, 40], [0, 1, 39, 40], [0, 20, 20, 40]):
        parts = []
        for start, stop in zip(cuts, cuts[1:], strict=False):
            block = torch.empty(stop - start, dim)
            model.init_table_rows(block, start, rows, 5, 2)
            parts.append(block)
        assert torch.equal(torch.cat(parts), whole), cuts
    other_seed, other_table = torch.empty(rows, dim), torch.empty(rows, dim)
    model.init_table_rows(other_seed, 0, rows, 6, 2)
    model.init_table_rows(other_table, 0, rows, 5, 3)
    assert not torch.equal(other_seed, whole) and not torch.equal(other_table, whole)


def test_a_sharded_rank_builds_no_whole_table():
    """With perf.sharded_tables the family builds the tables on the meta device and each rank draws its own blocks:
    no rank ever holds a whole table (the reference's 559 GiB would not fit a host); its rows equal the whole ones."""
    cfg = BENCH.config("tiny")
    built = BENCH.family.build_model(dataclasses.replace(cfg, perf=dataclasses.replace(cfg.perf, sharded_tables=True)))
    assert all(t.weight.is_meta for t in built.tables.values())
    whole = BENCH.family.build_model(cfg)
    _, placed = _sharded_tiny(cfg.seed)
    for name, table in placed.module.tables.items():
        assert torch.equal(table.weight.full_tensor(), whole.tables[name].weight.detach()), name


def _two_micro_batches(cfg) -> list[dict[str, torch.Tensor]]:
    whole = _batch(cfg, 16)
    return [{k: v[:8] for k, v in whole.items()}, {k: v[8:] for k, v in whole.items()}]


def test_a_step_looked_up_at_once_gives_each_micro_batch_the_rows_of_its_own_lookup():
    """``perf.lookup_once_a_step``: the rows each training forward takes from the step's one exchange are, bit for
    bit, those its own lookup gives (a lookup without a gradient, as an eval's, looks up on its own)."""
    cfg, placed = _sharded_tiny()
    cfg.perf.lookup_once_a_step = True
    placed = BENCH.family.place(BENCH.family.build_model(cfg), cfg, CPU, False)
    lookup, model = placed.module.lookup, placed.module
    batches = _two_micro_batches(cfg)
    placed.before_step(batches)
    for b in batches:
        with torch.no_grad():
            own = lookup(model.tables, model.requests(b))
        assert lookup.step is not None
        taken = lookup(model.tables, model.requests(b))
        assert len(taken) == len(own) and all(torch.equal(t, o) for t, o in zip(taken, own, strict=True))
        assert all(t.requires_grad for t in taken)
    assert lookup.step is None  # every micro-batch has taken its rows


def test_a_step_looked_up_at_once_sends_its_gradients_once_and_updates_the_tables_the_same():
    """``perf.lookup_once_a_step`` on one rank, a step of 2 micro-batches: the step's gradients are sent once (one
    ``ROW_GRADS`` entry a table, not one a micro-batch), and after the optimizer's step every table and dense weight
    equals the per-micro-batch lookups' within float32 sums' rounding."""
    from trainbench.optim.rowwise_adagrad import ROW_GRADS

    after = {}
    for once in (False, True):
        cfg, placed = _sharded_tiny()
        cfg.perf.lookup_once_a_step = once
        placed = BENCH.family.place(BENCH.family.build_model(cfg), cfg, CPU, False)
        assert (placed.before_step is not None) == once
        optimizer = BENCH.build_optimizer(cfg, placed.module)
        batches = _two_micro_batches(cfg)
        weights = sum(BENCH.loss_weights(b) for b in batches)
        if once:
            placed.before_step(batches)
        for b in batches:
            BENCH.loss(placed.model, b, weights).backward()
        entries = {n: len(getattr(t.weight, ROW_GRADS)) for n, t in placed.module.tables.items()}
        assert set(entries.values()) == {1 if once else 2}, entries
        optimizer.step()
        after[once] = {n: p.detach().clone() for n, p in placed.module.named_parameters() if "tables" not in n}
        after[once] |= {n: t.weight.to_local().clone() for n, t in placed.module.tables.items()}
    moved = [n for n in placed.module.tables if not torch.equal(after[True][n], _sharded_tiny()[1].module.tables[
        n].weight.to_local())]  # fmt: skip
    assert moved  # (the step moved table rows: the comparison below is not of untouched tables)
    for name, tensor in after[False].items():
        torch.testing.assert_close(after[True][name], tensor, rtol=0, atol=1e-6, msg=name)


def test_a_step_looked_up_at_once_refuses_a_micro_batch_out_of_its_order():
    cfg, placed = _sharded_tiny()
    cfg.perf.lookup_once_a_step = True
    placed = BENCH.family.place(BENCH.family.build_model(cfg), cfg, CPU, False)
    whole = _batch(cfg, 12)
    first, second = {k: v[:8] for k, v in whole.items()}, {k: v[8:] for k, v in whole.items()}
    placed.before_step([first, second])
    with pytest.raises(RuntimeError, match="micro-batch 0 of the step asked for other lookups than were made for it"):
        placed.model(second)


def test_lookup_once_a_step_without_sharded_tables_is_refused_in_one_sentence():
    from trainbench.errors import ConfigError
    from trainbench.resolve import build_config

    with pytest.raises(ConfigError, match="perf.lookup_once_a_step looks up the sharded tables' rows once a step: it "
                       "needs perf.sharded_tables=true"):  # fmt: skip
        build_config("dlrmv4", "tiny", overrides={"perf.lookup_once_a_step": "true"})
    with pytest.raises(ConfigError, match="lookup_once_a_step"):
        build_config("bert", "tiny", overrides={"perf.lookup_once_a_step": "true"})
