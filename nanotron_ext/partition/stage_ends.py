"""Enumerating the splits a step-time bound allows: per stage and start, the ends whose stage stays within the
bound and whose rest can still be split (:class:`StageEnds`), for the branch and bound and the memory tie-break of
:mod:`nanotron_ext.partition.schedule_aware`."""

from __future__ import annotations

import numpy as np

from nanotron_ext.partition.step_time_bound import Bound

__all__ = ["StageEnds", "splits_within", "windows_and_coreach"]


class StageEnds:
    """For a depth-first search over splits under bound ``x``: per stage ``k`` and start ``s``, the ends ``e`` of
    ``[s, e)`` with ``s`` in its window and the rest completable, and the stage's bound at each; worked out once
    per ``(k, s)``, which the search reaches again under every different prefix."""

    def __init__(self, bound: Bound, x: float) -> None:
        self.bound, self.n = bound, bound.problem.n
        self.windows, self.coreach = windows_and_coreach(bound, x)
        self._known: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def __call__(self, k: int, s: int) -> tuple[np.ndarray, np.ndarray]:
        known = self._known.get((k, s))
        if known is None:
            ends = np.arange(s + 1, self.n + 1)
            lo, hi = self.windows[k]
            ends = ends[(lo[ends] <= s) & (hi[ends] >= s) & self.coreach[k + 1][ends]]
            known = (ends, self.bound.stage_value(k, s, ends) if len(ends) else np.zeros(0))
            self._known[(k, s)] = known
        return known


def windows_and_coreach(bound: Bound, x: float) -> tuple[list[tuple[np.ndarray, np.ndarray]], list[np.ndarray]]:
    """Each stage's windows under bound ``x``, and backward reachability under it: ``coreach[k][s]`` — can
    ``[s, n)`` be split into stages ``k..pp-1``?"""
    n, pp = bound.problem.n, bound.problem.pp
    windows = [bound.windows(k, x) for k in range(pp)]
    coreach = [np.zeros(n + 1, dtype=bool) for _ in range(pp + 1)]
    coreach[pp][n] = True
    for k in range(pp - 1, -1, -1):
        lo, hi = windows[k]
        ends = np.flatnonzero(coreach[k + 1])
        ends = ends[hi[ends] >= lo[ends]]
        # Mark every start in [lo[e], hi[e]] of those ends: +1 where a window opens, -1 after it closes.
        opened = np.bincount(lo[ends], minlength=n + 2) - np.bincount(hi[ends] + 1, minlength=n + 2)
        coreach[k] = np.cumsum(opened)[: n + 1] > 0
    return windows, coreach


def splits_within(bound: Bound, limit: float, most: int) -> list[tuple[int, ...]]:
    """Up to ``most`` valid splits whose every stage's lower bound is within ``limit`` (depth first)."""
    problem = bound.problem
    n, pp = problem.n, problem.pp
    stage_ends = StageEnds(bound, limit)
    within: dict[tuple[int, int], list[int]] = {}  # the ends to push, last first, per (stage, start)
    out: list[tuple[int, ...]] = []
    stack: list[tuple[int, tuple[int, ...], int]] = [(0, (), 0)]
    while stack and len(out) < most:
        k, head, s = stack.pop()
        prefix = (*head, s)
        if k == pp:
            if s == n:
                out.append(prefix)
            continue
        pushed = within.get((k, s))
        if pushed is None:
            ends, values = stage_ends(k, s)
            pushed = within[(k, s)] = ends[values <= limit][::-1].tolist() if len(ends) else []
        stack.extend([(k + 1, prefix, e) for e in pushed])
    return out
