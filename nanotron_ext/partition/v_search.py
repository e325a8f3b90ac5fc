"""The best split of the blocks into a V's ``2 pp`` chunks for the simulated ZB-V step, under each rank's memory
(issue 43's third item): branch and bound, exact where it finishes within its budget.

Every split's step is at least :func:`v_lower_bound`'s: a rank cannot start before the first micro-batch's forward
reaches it down the V (the chunks above it and their cuts' p2p), then runs ``m`` forwards and backwards of both its
chunks, and the step adds the slowest rank's update. The bound only grows as chunks are closed from the first, so a
depth-first walk over the cuts drops every partial split whose bound already reaches the best step found. The splits
left are simulated (:func:`~nanotron_ext.partition.v_split.v_simulate`) in the order of their bounds; once the next
bound reaches the best step, no split is better: the result is proven. Memory is checked on the simulated schedule
(``fits``: both chunks' terms at the moments they coincide, :func:`~nanotron_ext.partition.v_split.v_peaks`).

The search starts from the best of a descent (:func:`~nanotron_ext.partition.v_split.descend_v_split`) when the seed
is valid and fits, else from the seed's simulated step as a first threshold, raised while no split under it fits.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import numpy as np

from nanotron_ext.costs.prefix_sums import prefix_sums
from nanotron_ext.errors import PlanningError
from nanotron_ext.partition.schedule_problem import ScheduleProblem
from nanotron_ext.partition.v_split import Budgets, descend_v_split, simulate_within, v_simulate
from nanotron_ext.schedule.zbv import VResult

__all__ = ["VSearch", "search_v_split", "v_lower_bound"]

Valid = Callable[[Sequence[int]], bool]
Fits = Callable[[Sequence[int], VResult], bool]

#: How much a threshold grows, and how many times, while no split under it fits.
THRESHOLD_GROWTH, THRESHOLD_TRIES = 1.25, 4


@dataclass(frozen=True)
class VSearch:
    """The best split found and what is proven about it.

    Attributes:
        bounds: the split (``2 pp + 1`` positions), None where none that is valid and fits was found.
        step: its simulated ZB-V step (``inf`` where none).
        bound: no valid split that fits has a step below this (``step`` itself when ``proven``).
        proven: the search finished: ``bounds`` is the best split.
        evaluated: splits simulated.
        enumerated: splits whose lower bound was under the threshold.
    """

    bounds: tuple[int, ...] | None
    step: float
    bound: float
    proven: bool
    evaluated: int
    enumerated: int

    @property
    def gap(self) -> float:
        """How far the step may be above the best: ``step / bound - 1`` (0 when proven)."""
        return 0.0 if self.proven or self.bound <= 0 else self.step / self.bound - 1.0


class _Prices:
    """Prefix sums of each chunk's forward and whole backward by its position (first, middle, last of the ``2 pp``
    stages), the p2p of each cut position, and the updates: every chunk's times in O(1), as Python floats (the walk
    asks tens of thousands of times; a float's difference is numpy's)."""

    def __init__(self, problem: ScheduleProblem) -> None:
        self.problem = problem
        chunks, n = problem.pp, problem.n
        self.forward: list[list[float]] = []
        self.work: list[list[float]] = []
        for c in range(chunks):
            f, b, _ = problem.at(c)
            self.forward.append(prefix_sums(f).tolist())
            self.work.append(prefix_sums(np.add(f, b)).tolist())
        lowest = np.min([np.add(*problem.at(c)[:2]) for c in range(chunks)], axis=0)
        self._least = prefix_sums(lowest).tolist()
        ends = np.arange(n + 1)
        self._updates = problem.segment_updates(ends[:, None], ends[None, :]).tolist()  # [s][e], each as alone

    def least_work(self, s: int, e: int) -> float:
        """The least forward + backward of blocks ``[s, e)`` wherever they land."""
        return self._least[e] - self._least[s]

    def chunk(self, c: int, s: int, e: int) -> tuple[float, float, float]:
        """(forward, forward + backward, update) of blocks ``[s, e)`` as chunk ``c``."""
        return (self.forward[c][e] - self.forward[c][s], self.work[c][e] - self.work[c][s], self._updates[s][e])

    def cut(self, c: int, e: int) -> float:
        """The p2p of the cut after chunk ``c`` ending before block ``e``."""
        return float(self.problem.send[c][e - 1])


def v_lower_bound(problem: ScheduleProblem, bounds: Sequence[int]) -> float:
    """A lower bound of the simulated ZB-V step of the split ``bounds`` (module docstring)."""
    prices = _Prices(problem)
    times = [prices.chunk(c, s, e) for c, (s, e) in enumerate(zip(bounds, bounds[1:]))]
    cuts = [prices.cut(c, e) for c, e in enumerate(bounds[1:-1])]
    return _terms(times, cuts, len(times), problem.n_micro_batches, math.inf)[0]


def _terms(
    times: Sequence[tuple[float, float, float]], cuts: Sequence[float], closed: int, m: int, threshold: float
) -> tuple[float, float]:
    """With chunks ``0..closed - 1`` placed (``times``: each chunk's forward, forward + backward and update): the
    bound's terms known, and the work the ranks with a chunk still open may take before their term reaches
    ``threshold``. A rank's term is its head (the forwards and cuts above it; at least the last one known) plus
    ``m`` times its work (at least its placed chunks'); the step adds the slowest rank's update."""
    chunks = len(times)
    pp = chunks // 2
    head, worst, update = 0.0, 0.0, 0.0
    open_ranks = []
    for r in range(pp):
        down = times[r] if r < closed else None
        up = times[chunks - 1 - r] if chunks - 1 - r < closed else None
        work = (down[1] if down else 0.0) + (up[1] if up else 0.0)
        worst = max(worst, head + m * work)
        if down:
            update = max(update, down[2] + (up[2] if up else 0.0))
        if up is None:
            open_ranks.append(head / m + work)
        if down:  # the cut at the V's bottom (r = pp - 1) is under no rank's head
            head += down[0] + cuts[r]
    return worst + update, sum(max(0.0, (threshold - update) / m - x) for x in open_ranks)


def search_v_split(
    problem: ScheduleProblem,
    seed: Sequence[int],
    *,
    valid: Valid | None = None,
    fits: Fits | None = None,
    max_evals: int = 300,
    max_leaves: int = 20_000,
    max_nodes: int = 200_000,
    eager: Collection[int] = (),
    budgets: Budgets | None = None,
) -> VSearch:
    """The split of the blocks into ``problem.pp`` chunks (a V over ``problem.pp / 2`` ranks) with the least
    simulated ZB-V step among those ``valid`` accepts whose schedule ``fits``.

    Args:
        problem: the blocks priced as ``2 pp`` stages.
        seed: a split to start from, ``2 pp + 1`` increasing positions from 0 to ``problem.n`` (the FLOP-balanced
            one, say); it need not fit.
        valid: which splits may be taken, before simulating (a block with weights on every chunk, say).
        fits: whether a simulated split's memory fits (each rank's :func:`v_peaks` under its cap, say).
        max_evals: the most splits simulated.
        max_leaves: the most splits kept to simulate (those of the least bounds).
        max_nodes: the most partial splits the walk looks at; past it, the bound falls back to the ranks' average
            work (``m`` times a rank's share of the least work of all blocks).
        eager: chunks whose ``W`` runs right after its ``B`` (the bound holds either way: it counts work, not
            order).
        budgets: each split's byte budget for the scheduler (:func:`~nanotron_ext.partition.v_split.v_budget`);
            a split no order keeps under it does not fit.

    Raises:
        PlanningError: an odd number of chunks, or a seed that is not a split.
    """
    chunks, n = problem.pp, problem.n
    seed = tuple(int(b) for b in seed)
    if chunks % 2:
        raise PlanningError(f"{chunks} chunks; a V has two per rank: price the blocks as 2 pp stages")
    if len(seed) != chunks + 1 or seed[0] != 0 or seed[-1] != n or any(b <= a for a, b in zip(seed, seed[1:])):
        raise PlanningError(
            f"seed split {list(seed)} is not {chunks} non-empty chunks of {n} blocks; start from a "
            f"split (the FLOP-balanced one)"
        )
    ok: Valid = valid or (lambda bounds: True)
    fit: Fits = fits or (lambda bounds, result: True)
    best: tuple[int, ...] | None = None
    best_step, evaluated = math.inf, 0
    seeded = simulate_within(problem, seed, eager, budgets)
    evaluated += 1
    if seeded is not None and ok(seed) and fit(seed, seeded):
        descent = descend_v_split(
            problem, seed, valid=ok, fits=fit, max_evals=max(1, max_evals // 4), eager=eager, budgets=budgets
        )
        best, best_step, evaluated = descent.bounds, descent.step, descent.evaluated
    # Without a split that fits, the seed's step as it would run without the budget is the first threshold.
    threshold = best_step if best is not None else v_simulate(problem, seed, eager).step_time
    prices = _Prices(problem)
    enumerated = 0
    for _ in range(THRESHOLD_TRIES):
        leaves, dropped = _leaves(prices, problem.n_micro_batches, n, threshold, max_leaves, max_nodes)
        enumerated += len(leaves)
        rest = math.inf
        for lb, bounds in leaves:
            if lb >= best_step * (1 - 1e-12):
                rest = lb
                break
            if evaluated >= max_evals:
                rest = lb
                break
            if bounds == best or not ok(bounds):
                continue
            result = simulate_within(problem, bounds, eager, budgets, under=best_step)
            evaluated += 1
            if result is not None and result.step_time < best_step and fit(bounds, result):
                best, best_step = bounds, result.step_time
        bound = min(rest, dropped, threshold if best is None else math.inf)
        if best is not None or evaluated >= max_evals:
            break
        threshold *= THRESHOLD_GROWTH
    proven = best is not None and bound >= best_step * (1 - 1e-12)
    return VSearch(best, best_step, best_step if proven else min(bound, best_step), proven, evaluated, enumerated)


class _Cut(Exception):
    """The walk reached its node budget."""


def _leaves(
    prices: _Prices, m: int, n: int, threshold: float, max_leaves: int, max_nodes: int
) -> tuple[list[tuple[float, tuple[int, ...]]], float]:
    """Every split whose lower bound is under ``threshold``, by bound (at most ``max_leaves``, the least), and the
    least bound of those left out (``inf`` if none).

    Chunks are placed from the first. A partial split is dropped when its bound's known terms reach the threshold
    (they only grow: a longer chunk does more work), or when the blocks left cannot fit under it: the ranks' room
    left before the threshold, their heads at least the one known, is less than the least work of those blocks.
    """
    chunks = len(prices.forward)
    pp = chunks // 2
    tied = prices.problem.tied_pair
    heap: list[tuple[float, tuple[int, ...]]] = []  # the kept leaves as a max-heap (negated bounds)
    dropped = math.inf
    bounds = [0] * (chunks + 1)
    bounds[-1] = n
    times: list[tuple[float, float, float]] = [(0.0, 0.0, 0.0)] * chunks
    cuts = [0.0] * (chunks - 1)
    nodes = 0

    def partial(closed: int) -> tuple[float, float]:
        nonlocal nodes
        nodes += 1
        if nodes > max_nodes:
            raise _Cut
        return _terms(times, cuts, closed, m, threshold)

    def walk(c: int) -> None:
        nonlocal dropped
        s = bounds[c]
        if c == chunks - 1:
            times[c] = prices.chunk(c, s, n)
            lb = partial(chunks)[0]
            if lb >= threshold:
                return
            leaf = (-lb, tuple(bounds))
            if len(heap) < max_leaves:
                heapq.heappush(heap, leaf)
            else:
                out = heapq.heappushpop(heap, leaf)
                dropped = min(dropped, -out[0])
            return
        # Without a tie in the chunk, its update too only grows with e: past the threshold, stop.
        monotone = tied is None or s > tied[0]
        for e in range(s + 1, n - (chunks - 1 - c) + 1):
            bounds[c + 1] = e
            times[c] = prices.chunk(c, s, e)
            cuts[c] = prices.cut(c, e)
            lb, room = partial(c + 1)
            if lb >= threshold:
                if monotone:
                    break
                continue
            if room * (1 + 1e-9) < prices.least_work(e, n):
                continue  # too much left for the open chunks: a longer chunk leaves less
            walk(c + 1)

    try:
        walk(0)
    except _Cut:  # what was not walked is bounded only by the ranks' average work
        dropped = min(dropped, m * prices.least_work(0, n) / pp)
    return sorted((-lb, b) for lb, b in heap), dropped
