"""The experts placed over the ranks by their load (families/decoder/expert_placement.py,
``distributed.expert_rebalance_every``): the deal, and the layer on 2 gloo ranks trained with its experts moved
between steps against the layer on one rank."""

from __future__ import annotations

import pytest
import torch
from conftest import spawned
from test_moe import _EXPERT_TENSORS, _expert_parallel_case, _on_gloo_ranks

from trainbench.errors import ConfigError
from trainbench.families.decoder.expert_placement import ExpertPlacer, balanced
from trainbench.families.node_costs import busiest_over_mean
from trainbench.resolve import build_config


def test_the_deal_gives_each_rank_its_share_of_experts_and_evens_their_tokens():
    # block 3 of gpt_oss_20b's reference block at initialisation on one H200 (2026-12-01's bench.json): the
    # contiguous halves take 1.36x and 0.64x the mean
    loads = [200, 35, 73, 33, 45, 3666, 315, 654, 1, 2271, 450, 113, 43, 2095, 458, 13, 0, 80, 116, 4303, 3263, 127,
             6721, 263, 4085, 0, 12, 1961, 678, 0, 679, 15]  # fmt: skip
    contiguous = list(range(32))
    assert busiest_over_mean(loads, contiguous, 2) == pytest.approx(1.36, abs=0.01)
    for ranks, most in ((2, 1.001), (4, 1.03), (8, 1.7)):
        slot_of = balanced(loads, ranks)
        assert sorted(slot_of) == contiguous  # each slot holds one expert
        share = 32 // ranks
        assert [sum(1 for s in slot_of if s // share == r) for r in range(ranks)] == [share] * ranks
        assert busiest_over_mean(loads, slot_of, ranks) <= min(most, busiest_over_mean(loads, contiguous, ranks))
    # the busiest expert alone is above the mean of 8 ranks: no deal takes the busiest rank below it
    assert busiest_over_mean(loads, balanced(loads, 8), 8) >= 6721 / (sum(loads) / 8)
    assert busiest_over_mean([1.0] * 6, balanced([1.0] * 6, 2), 2) == 1.0


def _placed_worker(rank: int, world: int, port: int, out: str) -> None:
    """3 AdamW steps of the layer of test_moe's expert-parallel case on 2 gloo ranks, each rank half the tokens, the
    experts dealt out again after each step (``gain=-1``: whenever the deal differs); then a forward, and the
    weights and AdamW's moments gathered after the experts went back to the contiguous order; rank 0 writes them."""
    import torch.distributed as dist

    def body(layer, x, direction):
        placer = ExpertPlacer(torch.nn.Sequential(layer), every=1, gain=-1.0)
        optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2, foreach=False)
        mine, toward = x.chunk(world)[rank], direction.chunk(world)[rank]
        orders = []
        for _ in range(3):
            result, _ = layer(mine)
            ((result * toward).sum() * world).backward()  # the loop scales each rank's loss by the ranks
            for p in layer.router.parameters():  # replicated: FSDP would average them
                dist.all_reduce(p.grad)
                p.grad /= world
            optimizer.step()
            placer.rearrange(optimizer)
            optimizer.zero_grad()
            orders.append(layer.slot_of.tolist())
        with torch.no_grad():
            result, _ = layer(mine)

        def gathered(t):
            local = t.to_local() if hasattr(t, "to_local") else t
            parts = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(parts, local.contiguous())
            return torch.cat(parts)

        output = gathered(result)
        placer.rearrange(optimizer, canonical=True)
        weights = [gathered(layer.get_parameter(n)) for n in _EXPERT_TENSORS]
        moments = [gathered(optimizer.state[layer.get_parameter(n)][k]) for n in _EXPERT_TENSORS
                   for k in ("exp_avg", "exp_avg_sq")]  # fmt: skip
        if rank == 0:
            torch.save({"orders": orders, "moves": placer.moves, "output": output, "weights": weights,
                        "moments": moments, "back": layer.slot_of.tolist()}, out)  # fmt: skip

    _on_gloo_ranks(rank, world, port, body)


def test_experts_moved_between_steps_train_as_the_layer_on_one_rank(tmp_path):
    """The experts dealt out by their load after each of 3 AdamW steps on 2 gloo ranks (3 of 6 a rank, float64): the
    deal moved them, and the layer's outputs after the steps, its weights and AdamW's moments back in the contiguous
    order are the one-rank layer's to 1e-12."""
    layer, x, direction = _expert_parallel_case()
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2, foreach=False)
    for _ in range(3):
        result, _ = layer(x)
        (result * direction).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        want, _ = layer(x)
    out = tmp_path / "placed.pt"
    spawned(_placed_worker, 2, str(out))
    got = torch.load(out)
    assert got["moves"] >= 1 and any(order != list(range(6)) for order in got["orders"]), got["orders"]
    assert got["back"] == list(range(6))
    assert torch.allclose(got["output"], want, rtol=1e-12, atol=1e-12)
    for name, g in zip(_EXPERT_TENSORS, got["weights"], strict=True):
        assert torch.allclose(g, layer.get_parameter(name), rtol=1e-12, atol=1e-12), name
    for i, g in enumerate(got["moments"]):
        w = optimizer.state[layer.get_parameter(_EXPERT_TENSORS[i // 2])]["exp_avg" if i % 2 == 0 else "exp_avg_sq"]
        assert torch.allclose(g, w, rtol=1e-12, atol=1e-12), i


@pytest.mark.parametrize(
    "overrides, says",
    [
        ({"distributed.expert_rebalance_every": "4"}, "set distributed.ep to the run's ranks"),
        ({"distributed.expert_rebalance_every": "4", "distributed.nproc": "2"}, "set distributed.ep"),
        ({"distributed.expert_rebalance_every": "-1"}, "expert_rebalance_every"),
    ],
)
def test_the_rebalance_without_expert_parallelism_is_refused_in_one_sentence(overrides, says):
    with pytest.raises(ConfigError, match=says):
        build_config("gpt_oss_20b", "tiny", None, overrides)
