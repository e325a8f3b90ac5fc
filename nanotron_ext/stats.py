"""Distribution-free statistics of repeated timings: the one home for a median's interval."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = ["median_interval", "relative_spread"]


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """Distribution-free interval of the median from order statistics: ``(low, high, coverage)``.

    ``[x_(k), x_(n−k+1)]`` with the largest ``k`` whose binomial tail ``P(B ≤ k − 1) ≤ (1 − confidence) / 2``,
    ``B ~ Bin(n, ½)``; its coverage is ``1 − 2 P(B ≤ k − 1)`` (≥ ``confidence``). Below 6 values no such ``k``
    exists: the range, with its smaller coverage ``1 − 2^(1−n)``.

    Raises:
        ValueError: no values.
    """
    if not values:
        raise ValueError("median_interval needs at least one value")
    xs, n = sorted(values), len(values)
    tail, k = 0.0, 0
    while tail + math.comb(n, k) / 2**n <= (1 - confidence) / 2:
        tail += math.comb(n, k) / 2**n
        k += 1
    if k == 0:
        return xs[0], xs[-1], 1 - 2 / 2**n
    return xs[k - 1], xs[n - k], 1 - 2 * tail


def relative_spread(values: Sequence[float], confidence: float = 0.95) -> float:
    """Half the width of :func:`median_interval` ÷ the median (0 when the median is 0): how far the median of
    ``values`` could move, as a fraction of it."""
    median = statistics.median(values)
    if median <= 0:
        return 0.0
    low, high, _ = median_interval(values, confidence)
    return (high - low) / 2 / median
