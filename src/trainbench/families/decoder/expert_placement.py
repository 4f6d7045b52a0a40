"""Experts placed over the ranks by the tokens they take (``distributed.expert_rebalance_every``).

Under expert parallelism (``distributed.ep``) rank j holds the j-th contiguous share of each block's experts, and
every rank's exchange waits for the rank whose experts the router sent the most tokens: with random weights the
busiest of 32 experts takes 5-7x the mean, and the busier of 2 ranks a third more than the other
(docs/notes/node.md). Which expert sits in which slot changes nothing in the model's function: a token's expert is
found by its slot (:attr:`MoE.slot_of`, logical expert to slot), and the slot holds that expert's weights. So every
N steps, after the optimizer's step, each block's experts are dealt out again by the tokens they took over those
steps (the largest first, each to the rank with the fewest tokens that has a slot left), and each expert's weights,
optimizer state and gradient move to their new slot by one all-to-all a tensor. Before a checkpoint is saved they go
back to the contiguous order, so that a checkpoint is the same whatever the placement."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from trainbench.families.decoder.moe import MoE
from trainbench.families.node_costs import busiest_over_mean


def balanced(loads: list[float], ranks: int) -> list[int]:
    """Each expert's slot (logical expert to slot; rank r holds slots r * share to (r + 1) * share - 1) with every
    rank ``len(loads) / ranks`` experts and the tokens of the most loaded rank as few as this greedy deal gives:
    the experts by their ``loads``, the largest first (ties by expert), each to the rank with the fewest tokens so far
    that has a slot left (ties by rank); within a rank, its experts in their own order. The same on every rank."""
    share = len(loads) // ranks
    held: list[list[int]] = [[] for _ in range(ranks)]
    tokens = [0.0] * ranks
    for expert in sorted(range(len(loads)), key=lambda e: (-loads[e], e)):
        rank = min((r for r in range(ranks) if len(held[r]) < share), key=lambda r: (tokens[r], r))
        held[rank].append(expert)
        tokens[rank] += loads[expert]
    slot_of = [0] * len(loads)
    for rank, experts in enumerate(held):
        for i, expert in enumerate(sorted(experts)):
            slot_of[expert] = rank * share + i
    return slot_of


class ExpertPlacer:
    """Re-places the experts of ``model``'s mixtures (spread by expert parallelism) every ``every`` optimizer steps
    by the tokens each took since the last time (:meth:`rearrange`, after the optimizer's step; with ``canonical``,
    back to the contiguous order before a checkpoint's save). A block whose busiest rank would not come down by at
    least ``gain`` of the mean stays where it is (moving weights costs a copy of them and their state)."""

    def __init__(self, model: nn.Module, every: int, gain: float = 0.02):
        self.moes = [m for m in model.modules() if isinstance(m, MoE) and m.ep_group is not None]
        self.every, self.gain, self.steps, self.moves = every, gain, 0, 0
        for moe in self.moes:
            device = moe.gate_up_proj.device
            moe.slot_of = torch.arange(moe.shape.experts, device=device)
            moe.slot_loads = torch.zeros(moe.shape.experts, dtype=torch.float64, device=device)

    @torch.no_grad()
    def rearrange(self, optimizer: torch.optim.Optimizer, canonical: bool = False) -> None:
        if not canonical:
            self.steps += 1
            if self.steps % self.every:
                return
        for moe in self.moes:
            now = moe.slot_of.tolist()
            if canonical:
                new = list(range(moe.shape.experts))
            else:
                by_slot = moe.slot_loads.clone()
                dist.all_reduce(by_slot, group=moe.ep_group)  # each rank counted the rows it sent to each slot
                counted = by_slot.tolist()
                loads = [counted[slot] for slot in now]  # by expert
                moe.slot_loads.zero_()
                ranks = dist.get_world_size(moe.ep_group)
                new = balanced(loads, ranks)
                if busiest_over_mean(loads, new, ranks) > busiest_over_mean(loads, now, ranks) - self.gain:
                    continue
            if new != now:
                self._move(moe, now, new, optimizer)
                moe.slot_of.copy_(torch.tensor(new, device=moe.slot_of.device))
                self.moves += 1

    @staticmethod
    def _move(moe: MoE, now: list[int], new: list[int], optimizer: torch.optim.Optimizer) -> None:
        """Each expert's weights, their optimizer state and gradient from its slot in ``now`` to its slot in ``new``
        (both logical expert to slot), one all-to-all a tensor over the experts' ranks."""
        group = moe.ep_group
        ranks, me = dist.get_world_size(group), dist.get_rank(group)
        share = moe.shape.experts // ranks
        expert_in = [0] * len(new)  # the expert each new slot holds
        for expert, slot in enumerate(new):
            expert_in[slot] = expert
        # What this rank sends, for each rank in turn by its new slots in order; what it receives, by the sender's
        # rank and then its new slots in order, as the senders send them.
        sends = [(slot // share, now[expert_in[slot]] % share) for slot in range(len(new))
                 if now[expert_in[slot]] // share == me]  # fmt: skip
        receives = sorted((now[expert_in[slot]] // share, slot) for slot in range(me * share, (me + 1) * share))
        device = moe.slot_of.device
        send_rows = torch.tensor([row for _, row in sends], dtype=torch.long, device=device)
        send_counts = [sum(1 for rank, _ in sends if rank == r) for r in range(ranks)]
        recv_counts = [sum(1 for rank, _ in receives if rank == r) for r in range(ranks)]
        recv_rows = torch.tensor([slot - me * share for _, slot in receives], dtype=torch.long, device=device)
        for name in MoE.EXPERT_TENSORS:
            weight = getattr(moe, name)
            if weight is None:
                continue
            state = optimizer.state.get(weight, {})
            moments = [v for v in state.values() if torch.is_tensor(v) and v.shape == weight.shape]
            for t in (weight, weight.grad, *moments):
                if t is None:
                    continue
                local = t.to_local() if hasattr(t, "to_local") else t
                arrived = torch.empty_like(local)  # (every slot of this rank receives its expert)
                # the rows sent are gathered into a tensor of their own first, so they may be overwritten after
                dist.all_to_all_single(arrived, local[send_rows], recv_counts, send_counts, group=group)
                local.index_copy_(0, recv_rows, arrived)
