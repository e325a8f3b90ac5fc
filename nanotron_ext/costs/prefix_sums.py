"""Prefix sums: the one home for a segment's sum as a difference of two entries."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["prefix_sums"]


def prefix_sums(values: Sequence[float] | Sequence[bool] | np.ndarray, dtype: type = np.float64) -> np.ndarray:
    """``p`` with ``p[0] = 0`` and ``p[i] = values[0] + ... + values[i - 1]``, so that ``sum(values[s:e])`` is
    ``p[e] - p[s]``; summed in ``dtype`` (``np.int64`` for counts and flags)."""
    return np.concatenate([np.zeros(1, dtype=dtype), np.cumsum(np.asarray(values, dtype=dtype))])
