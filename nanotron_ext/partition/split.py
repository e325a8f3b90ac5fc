"""A contiguous split in its two spellings: one PP rank per block, or the stage bounds ``[0, b_1, ..., n]``."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["bounds_from_ranks", "ranks_from_bounds"]


def bounds_from_ranks(ranks: Sequence[int], pp: int) -> list[int]:
    """Stage ``k`` holds blocks ``bounds[k]:bounds[k + 1]``; an empty stage repeats a bound.

    Example:
        >>> bounds_from_ranks([0, 0, 1, 1, 1], 3)
        [0, 2, 5, 5]
    """
    return [0] + [sum(1 for r in ranks if r <= k) for k in range(pp)]


def ranks_from_bounds(bounds: Sequence[int]) -> list[int]:
    """The PP rank of each block of a split given by its bounds.

    Example:
        >>> ranks_from_bounds([0, 2, 5, 5])
        [0, 0, 1, 1, 1]
    """
    return [k for k in range(len(bounds) - 1) for _ in range(bounds[k], bounds[k + 1])]
