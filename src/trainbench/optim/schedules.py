"""Learning-rate schedules: a function of the optimizer step (0-based) alone, so a resumed run continues them."""

from __future__ import annotations

import math


def poly_warmup_lr(
    step: int, base_lr: float, warmup_steps: int, total_steps: int, power: float, start_warmup_step: int = 0
) -> float:
    """Linear warmup, then polynomial decay to 0 (MLPerf BERT).

    Warmup counts from ``start_warmup_step`` (MLPerf's knob; negative values start warmup before step 0).
    During warmup the rate is ``base_lr * (s + 1) / warmup_steps`` with ``s = step - start_warmup_step``;
    afterwards ``base_lr * (1 - progress) ** power`` with progress running from 0 at the end of warmup to
    1 at ``total_steps``, then held at 0.
    """
    s = step - start_warmup_step
    if s < warmup_steps:
        return base_lr * max(0, s + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps - start_warmup_step)
    progress = min(1.0, max(0.0, (s - warmup_steps) / decay_steps))
    return base_lr * (1.0 - progress) ** power


def cosine_warmup_lr(step: int, base_lr: float, end_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Linear warmup to ``base_lr`` over ``warmup_steps``, then cosine decay to ``end_lr`` at ``total_steps``,
    then held there (the MLPerf LLM benchmarks)."""
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return end_lr + 0.5 * (base_lr - end_lr) * (1 + math.cos(math.pi * progress))
