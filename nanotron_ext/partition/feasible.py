"""Whether any split exists under the constraints, without searching for the best one.

A stage ``k`` may hold blocks ``[s, e)`` for every start ``s`` in a window ``[lo_k(e), hi(e)]``: ``hi`` from the
requirements (a flagged block in ``[s, e)``, and ``s < e``), ``lo_k`` from the memory cap (the additive part of a
stage's memory grows with its segment, so the starts that fit are those from some ``lo`` on). One forward sweep
over the stages with prefix counts (:func:`sweep`) then says which ends ``[0, e)`` can be split into ``k``
stages: ``O(pp · n)`` once the windows are known, where the partitioner's dynamic programme fills ``pp`` tables of
``(n + 1)²``.

:func:`any_split_fits` answers with the very comparisons of :func:`~nanotron_ext.partition.partition`'s
programme (``q[e] - q[s] <= room`` on :meth:`MemoryCap.prefix`), so it says False exactly when ``partition``
would raise that no split fits: callers that only ask whether a split fits skip the programme and its
least-memory search when none does.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence

import numpy as np

from nanotron_ext.partition.optimal import MemoryCap, Requirement

__all__ = ["any_split_fits", "latest_starts", "least_cap", "sweep"]

#: A stage with more blocks than this too large alone for it may split the reachable ends into as many runs:
#: :meth:`_Runs.reach` then leaves the question to the array sweep, whose cost does not grow with them.
_MAX_MISFITS = 16


def latest_starts(n: int, requirements: Sequence[Requirement]) -> np.ndarray:
    """Per end ``e`` (0..n), the latest start of a stage ``[s, e)``: non-empty (``s <= e - 1``) and holding a
    flagged block of every requirement (``s <=`` the last flagged block before ``e``); -1: none."""
    hi = np.arange(n + 1) - 1
    for req in requirements:
        flags = np.asarray(req.flags, dtype=bool)
        idx = np.where(flags, np.arange(n), -1)
        last = np.concatenate([[-1], np.maximum.accumulate(idx)]) if n else np.array([-1])
        hi = np.minimum(hi, last)
    return hi


def sweep(n: int, pp: int, windows: Callable[[int], tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray] | None:
    """Forward reachability: ``out[k][e]`` — blocks ``[0, e)`` split into ``k`` stages, stage ``j`` starting in
    ``windows(j)`` (``lo``, ``hi`` per end); None when ``[0, n)`` cannot be split into ``pp`` stages."""
    cur = np.zeros(n + 1, dtype=bool)
    cur[0] = True
    out = [cur]
    cnt = np.zeros(n + 2, dtype=np.int64)  # cnt[i]: reachable starts below i
    hi, above = None, np.empty(0, dtype=np.int64)
    for k in range(pp):
        lo, hi_k = windows(k)  # lo in 0..n + 1, hi in -1..n
        if hi_k is not hi:  # windows mostly share one hi
            hi, above = hi_k, hi_k + 1
        np.cumsum(cur, out=cnt[1:])
        cur = cnt[above] > cnt[lo]  # some reachable start in [lo, hi]; cnt never falls, so none when lo > hi
        if not cur.any():
            return None
        out.append(cur)
    return out if cur[n] else None


def any_split_fits(n: int, pp: int, requirements: Sequence[Requirement], memory: MemoryCap | None) -> bool:
    """Whether :func:`~nanotron_ext.partition.partition` finds a split of ``n`` blocks into ``pp`` non-empty
    stages, each with a flagged block of every requirement and within ``memory``'s additive part (the same
    comparisons as its programme; ``memory.exact`` is not read)."""
    if not 1 <= pp <= n or any(len(r.flags) != n for r in requirements):
        return False
    hi = latest_starts(n, requirements)
    if memory is None:
        return sweep(n, pp, lambda k: (np.zeros(n + 1, dtype=np.int64), hi)) is not None
    prefixes = [memory.prefix(k) for k in range(pp)]
    if not all(np.all(q[1:] >= q[:-1]) for q in prefixes):  # a negative term: the starts that fit have gaps
        return _dense(n, pp, hi, prefixes, memory.slack_room)
    return sweep(n, pp, lambda k: (_earliest_fitting(prefixes[k], memory.slack_room), hi)) is not None


def least_cap(
    n: int, pp: int, requirements: Sequence[Requirement], memory: MemoryCap, *, rtol: float = 2e-3
) -> float | None:
    """A lower bound, within ``rtol`` of the exact value, of the least cap under which some split fits
    ``memory``'s additive part: no split's largest stage, by its full estimate, is below it. None when some split
    already fits ``memory.cap``, or when the requirements leave no split at all.

    A bisection on the cap, each step a reachability test: by runs of ends with no requirement (:class:`_Runs`,
    ``O(pp · log n)``), else :func:`sweep` (``O(pp · n)``). The partitioner's programme answers the same question
    in ``pp`` tables of ``(n + 1)²``, which a large model cannot afford once per fix it prices."""
    if not any_split_fits(n, pp, requirements, None):
        return None
    hi = latest_starts(n, requirements)
    prefixes = [memory.prefix(k) for k in range(pp)]
    if not all(np.all(q[1:] >= q[:-1]) for q in prefixes):  # a negative term: the dense test

        def fits(room: float) -> bool:
            return _dense(n, pp, hi, prefixes, room)
    else:
        runs = _Runs(prefixes) if not requirements else None

        def fits(room: float) -> bool:
            by_runs = None if runs is None else runs.reach(room)
            if by_runs is not None:
                return by_runs
            return sweep(n, pp, lambda k: (_earliest_fitting(prefixes[k], room), hi)) is not None

    if fits(memory.slack_room):  # any_split_fits's question, asked as the bisection asks
        return None
    low = memory.room  # nothing fits this room
    high = max(max(float(q[-1] - q.min()) for q in prefixes), low + 1.0)  # any non-empty segment fits this one
    while not fits(high):  # rounding, or a stage's terms summing below their parts
        high = 2 * high + 1.0
    while high - low > rtol * max(abs(high), 1.0):
        mid = math.sqrt(low * high) if low > 0 else (low + high) / 2  # geometric: the bracket spans magnitudes
        low, high = (low, mid) if fits(mid) else (mid, high)
    return low + memory.overhead


class _Runs:
    """:func:`sweep`'s answer with no requirement, for prefix sums that never fall, in ``O(pp · log n)`` scalar
    steps: the ends reachable after ``k`` stages kept as runs ``[a, b]`` (numpy calls, ~18 a stage, are most of
    the array sweep's cost at a few thousand blocks, and the fixes' bisections make hundreds of sweeps).

    End ``e`` is reachable after stage ``k`` when some reachable ``s <= e - 1`` has ``[s, e)`` within the room; the
    starts that fit are ``lo..e - 1``, so it is enough that the latest one, ``P(e)``, does. Past run ``[a, b]``,
    ``P(e) = e - 1`` for ``e`` in ``[a + 1, b + 1]`` (block ``e - 1`` alone must fit) and ``P(e) = b`` up to the
    next run (``[b, e)`` must fit: ends up to a bisection's). The comparisons are the array sweep's,
    ``q[e] - q[s] <= room`` in the same floating point."""

    def __init__(self, prefixes: Sequence[np.ndarray]) -> None:
        stacked = np.array(prefixes)
        self.n = stacked.shape[1] - 1
        self.qs = list(stacked)  # rows: a probe reads a few entries of each
        self.blocks = np.diff(stacked, axis=1)  # what each block alone uses on each stage
        self.largest = self.blocks.max(axis=1, initial=-math.inf).tolist()

    def reach(self, room: float) -> bool | None:
        """Whether some split fits ``room``; None when a stage has more than :data:`_MAX_MISFITS` blocks too large
        alone for it."""
        n, runs = self.n, [(0, 0)]
        for q, blocks, largest in zip(self.qs, self.blocks, self.largest):
            misfits: list[int] = []
            if largest > room:
                misfits = np.flatnonzero(blocks > room).tolist()
                if len(misfits) > _MAX_MISFITS:
                    return None
            ends: list[tuple[int, int]] = []
            for j, (a, b) in enumerate(runs):
                start = a + 1  # ends [a + 1, b + 1]: from e - 1, block e - 1 alone
                for m in misfits[bisect_left(misfits, a) : bisect_right(misfits, b)]:
                    _add(ends, start, m)
                    start = m + 2
                _add(ends, start, min(b + 1, n))
                last = runs[j + 1][0] if j + 1 < len(runs) else n  # ends [b + 2, last]: from b
                if b + 2 <= last:
                    qb = q[b]
                    _add(ends, b + 2, bisect_right(q, room, b + 2, last + 1, key=lambda v: v - qb) - 1)
            if not ends:
                return False
            runs = ends
        return runs[-1][1] == n


def _add(runs: list[tuple[int, int]], a: int, b: int) -> None:
    """Append the ends ``[a, b]`` (nothing when empty) to ``runs``, joined to the last run when they touch."""
    if a > b:
        return
    if runs and runs[-1][1] + 1 >= a:
        runs[-1] = (runs[-1][0], b)
    else:
        runs.append((a, b))


def _earliest_fitting(q: np.ndarray, room: float) -> np.ndarray:
    """Per end ``e``, the smallest ``s`` with ``q[e] - q[s] <= room`` as numpy computes it (``e + 1``: none).

    ``q`` never decreases (prefix sums of non-negative terms), and neither does the rounded difference as ``s``
    falls: the starts that fit are ``lo..e``. A binary search finds ``lo`` to within rounding; the comparison
    itself then settles it."""
    n = len(q) - 1
    ends = np.arange(n + 1)
    lo = np.minimum(np.searchsorted(q, q - room, side="left"), ends)
    while True:  # earlier starts that fit after all
        back = (lo > 0) & ((q - q[np.maximum(lo - 1, 0)]) <= room)
        if not back.any():
            break
        lo = lo - back
    while True:  # starts that do not fit after all (e + 1 when not even [e, e) does)
        ahead = (lo <= ends) & ~((q - q[np.minimum(lo, n)]) <= room)
        if not ahead.any():
            break
        lo = lo + ahead
    return lo


def _dense(n: int, pp: int, hi: np.ndarray, prefixes: Sequence[np.ndarray], room: float) -> bool:
    """:func:`any_split_fits` segment by segment, for prefix sums that decrease somewhere."""
    starts = np.arange(n + 1)[:, None]
    cur = starts[:, 0] == 0
    for q in prefixes:
        ok = (starts <= hi[None, :]) & ((q[None, :] - q[:, None]) <= room)
        cur = (cur[:, None] & ok).any(axis=0)
    return bool(cur[n])
