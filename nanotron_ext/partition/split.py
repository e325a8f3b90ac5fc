"""A contiguous split in its two spellings: one PP rank per block, or the stage bounds ``[0, b_1, ..., n]``."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

__all__ = ["bounds_from_ranks", "ranks_from_bounds"]


def bounds_from_ranks(ranks: Sequence[int], pp: int) -> list[int]:
    """Stage ``k`` holds blocks ``bounds[k]:bounds[k + 1]``; an empty stage repeats a bound.

    Example:
        >>> bounds_from_ranks([0, 0, 1, 1, 1], 3)
        [0, 2, 5, 5]
    """
    at = [0] * (pp + 1)  # at[k + 1]: the ranks counted from stage k on (a rank below 0 from stage 0)
    for r in ranks:
        if r < pp:
            at[max(r, 0) + 1] += 1
    return list(accumulate(at))  # bounds[k + 1]: the ranks <= k


def ranks_from_bounds(bounds: Sequence[int]) -> list[int]:
    """The PP rank of each block of a split given by its bounds.

    Example:
        >>> ranks_from_bounds([0, 2, 5, 5])
        [0, 0, 1, 1, 1]
    """
    return [k for k in range(len(bounds) - 1) for _ in range(bounds[k], bounds[k + 1])]
