"""Nanotron's own split: greedy thresholds over cumulative block costs (``nanotron/models/base.py``,
``build_model``), reproduced block for block so that it can be compared and explained."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from nanotron_ext.errors import PlanningError

__all__ = ["nanotron_greedy_ranks"]


def nanotron_greedy_ranks(costs: Sequence[float], pp: int) -> list[int]:
    """Nanotron's ``build_model`` rule, step for step.

    Each block is assigned *before* the cumulative cost is compared with ``total·(r+1)/pp``, so one block
    heavier than a stage's share drags everything before it onto the same rank.

    Example:
        >>> nanotron_greedy_ranks([1, 1, 8, 0, 0], 2)
        [0, 0, 0, 1, 1]
    """
    cumulative = np.cumsum(costs)
    thresholds = [cumulative[-1] * ((rank + 1) / pp) for rank in range(pp)]
    ranks, idx = [], 0
    for c in cumulative:
        if idx >= pp:
            raise PlanningError("Nanotron's rule ran past the last stage (it would assert here)")
        ranks.append(idx)
        if c > thresholds[idx]:
            idx += 1
    return ranks
