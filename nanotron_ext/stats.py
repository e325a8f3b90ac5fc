"""Distribution-free statistics of repeated timings: the one home for a median's interval, and for the fastest
of a block's rounds and how far it could move."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

__all__ = ["fastest", "fastest_spread", "kendall_tau", "mean_spread", "median_interval", "relative_spread"]


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


def fastest(values: Sequence[float]) -> float:
    """The fastest of repeated timings: a block's cost with the least of the machine's interference in it.

    On a shared machine every disturbance (another tenant, a daemon, a page reclaim) only adds time, so the minimum
    is the estimator that moves least between two calibrations (Chen & Revels, "Robust benchmarking in noisy
    environments", 2016). Measured here (docs/machine.md#the-fastest-round): nine calibrations of the SmolLM shape
    over four minutes predicted each layout within 1.050-1.056 (max ÷ min) with it, 1.318-1.330 with the median.

    Raises:
        ValueError: no values.
    """
    if not values:
        raise ValueError("fastest needs at least one value")
    return min(values)


def fastest_spread(values: Sequence[float]) -> float:
    """How far :func:`fastest` could move between two calibrations, as a fraction of it: half the gap between the
    fastest of the first half of ``values`` (in the order taken) and of the second half, ÷ the fastest of all; 0
    with fewer than two values or a fastest of 0. Two halves of one calibration are two shorter calibrations, so a
    drift during it shows here as well as noise."""
    return _split_half(values, fastest)


def mean_spread(values: Sequence[float]) -> float:
    """How far the mean of ``values`` could move between two runs, as a fraction of it: half the gap between the
    mean of the first half (in the order taken) and of the second half, ÷ the mean of all; 0 with fewer than two
    values or a mean of 0. An in-run profile prices an op by its mean (a step adds its ops up, slow ones included)."""
    return _split_half(values, statistics.fmean)


def _split_half(values: Sequence[float], statistic: Callable[[Sequence[float]], float]) -> float:
    """Half the gap between ``statistic`` of the two halves of ``values`` ÷ ``statistic`` of all (0 below two values
    or at 0)."""
    if len(values) < 2:
        return 0.0
    half = len(values) // 2
    first, second = statistic(values[:half]), statistic(values[half:])
    whole = statistic(values)
    return abs(first - second) / 2 / whole if whole > 0 else 0.0


def kendall_tau(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's τ-b of two rankings (ties allowed); NaN with fewer than two distinct values on a side."""
    concordant = discordant = ties_a = ties_b = 0
    for i in range(len(a)):
        for j in range(i + 1, len(a)):
            da, db = (a[i] > a[j]) - (a[i] < a[j]), (b[i] > b[j]) - (b[i] < b[j])
            if da == 0 and db == 0:
                continue
            if da == 0:
                ties_a += 1
            elif db == 0:
                ties_b += 1
            elif da == db:
                concordant += 1
            else:
                discordant += 1
    n = concordant + discordant
    denominator = math.sqrt((n + ties_a) * (n + ties_b))
    return (concordant - discordant) / denominator if denominator else math.nan
