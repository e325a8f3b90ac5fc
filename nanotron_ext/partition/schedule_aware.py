"""The contiguous split that minimises the *simulated step time* under Nanotron's schedule.

The objective is :func:`nanotron_ext.schedule.simulator.simulate`'s ``step_time`` of the split: the config's
engine (1F1B or AFAB) and micro-batch count, one p2p time per cut (what the cut's last block sends, over that
cut's link, as :func:`nanotron_ext.simulate.simulate_plan` takes it), no gradient across a cut behind a
frozen prefix, and the slowest stage's update after the pipeline. Splits are evaluated many at a time by
:class:`~nanotron_ext.partition.step_time_eval.StepTimeEvaluator` (``step_time_eval.py``); the lower bound is
``step_time_bound.py``'s.

Search (:func:`step_time_partition`), with a proof of how far from the optimum the answer can be:

1. **Lower bound.** Every split's step time is at least ``max_k g_k(s_k, s_{k+1})``: per stage ``k``, the
   paths of the schedule's dependency graph that run through ``k``'s own serial work (see :func:`_terms`),
   plus the largest update. Each term depends on the stage's own segment only, so ``LB* = min over
   feasible splits of max_k g_k`` is a min-max partition problem, solved exactly (bisection on the value,
   started from checked brackets; each test is a reachability sweep with prefix sums, ``O(pp · n log n)``,
   one binary search per distinct term). ``LB*`` ≤ the true optimum.
2. **Candidates.** Splits that reach ``LB*`` (with several tie-breaks), the FLOP-min-max split and any seeds,
   improved by descent: move one or two cuts at a time, evaluate all neighbours in one batch, keep the best.
3. **Exactness.** Branch and bound over every split whose lower bound is below the best step time found
   (prefix max plus the exact suffix bound prunes the rest), evaluated in batches, within a budget. When it
   finishes, the answer is the exact optimum (``exact=True``); otherwise the result carries the proven bound
   ``step_time ≤ (1 + gap) · optimum`` with ``gap = step_time / LB* − 1`` (``branch_bound.py``; it prunes by the
   bound with 1F1B's round trips added, :func:`~nanotron_ext.partition.step_time_bound._terms`).

Pure numpy, no torch: the planner layer uses it for the ``constrained`` strategy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from nanotron_ext.errors import PlanningError
from nanotron_ext.partition.branch_bound import Scored, branch_and_bound, score
from nanotron_ext.partition.optimal import MemoryCap, Requirement
from nanotron_ext.partition.split import ranks_from_bounds
from nanotron_ext.partition.stage_ends import splits_within
from nanotron_ext.partition.step_time_bound import (
    RTOL,
    Bound,
    Validity,
    feasible_bound,
    lower_bound,
    minimise,
    reconstruct,
    slowest_stage_optimum,
)
from nanotron_ext.partition.step_time_eval import ScheduleProblem, StepTimeEvaluator, schedule_graph

__all__ = [
    "ScheduleProblem",
    "split_memory",
    "StepTimeEvaluator",
    "StepTimeSplit",
    "lower_bound",
    "slowest_stage_optimum",
    "step_time_partition",
]

_MAX_SIMULATED = 1 << 17  # pp × micro-batches above which splits are not searched by simulation (~6 · pp · m actions)
_PRUNE_FROM = 1024  # splits the enumerations may simulate, from which they prune by 1F1B's round trips
_TIE_BUDGET = 4096  # most splits simulated to break a tie in step time by memory (a few tenths of a second)
_MAX_SIMULATED_ONCE = 1 << 20  # ... and above which not even the chosen split is simulated (3 s at pp·m = 2^19 here)


@dataclass(frozen=True)
class StepTimeSplit:
    """Outcome of :func:`step_time_partition`.

    Attributes:
        bounds: stage ``k`` holds blocks ``bounds[k]:bounds[k+1]``.
        step_time: its simulated step time.
        lower_bound: no feasible split's step time is below this (``LB*``).
        exact: True when the search proved ``step_time`` optimal (every split that could beat it was
            evaluated, or it meets the lower bound).
        evaluated: splits simulated.
    """

    bounds: tuple[int, ...]
    step_time: float
    lower_bound: float
    exact: bool
    evaluated: int

    @property
    def gap(self) -> float:
        """Proven bound: ``step_time ≤ (1 + gap) · optimum`` (0 when exact)."""
        if self.exact or self.lower_bound <= 0:
            return 0.0
        return max(0.0, self.step_time / self.lower_bound - 1.0)

    def ranks(self) -> list[int]:
        return ranks_from_bounds(self.bounds)


def step_time_partition(
    problem: ScheduleProblem,
    *,
    requirements: Sequence[Requirement] = (),
    memory: MemoryCap | None = None,
    seeds: Sequence[Sequence[int]] = (),
    budget: int = 20000,
    work: float = 6e7,
    least_memory: MemoryCap | None = None,
) -> StepTimeSplit:
    """The contiguous split with the smallest simulated step time, under the constraints.

    Args:
        problem: per-block times and the schedule.
        requirements: every stage holds a flagged block of each (as :func:`~nanotron_ext.partition.partition`).
        memory: optional per-stage memory cap.
        seeds: extra splits (``bounds``) to start from; infeasible ones are ignored.
        budget: most splits the exact search may simulate before it settles for the proven bound.
        work: the same limit in program actions replayed (splits × actions of the schedule's per-rank
            programs, about ``6 · pp · m``); whichever is smaller applies.
        least_memory: memory terms (its ``cap`` ignored) that break ties: among the splits whose step time is
            the best one's (within ``RTOL``), the one whose largest stage uses the least memory under them
            (:func:`_least_memory_among_fastest`).

    Returns:
        The best split found, its step time, the lower bound and whether it is proven optimal. Ties go to
        the smaller stage memory under ``least_memory`` when given, then the smaller lower bound, then the
        lexicographically smallest bounds (deterministic on every rank).

    Raises:
        PlanningError: no split satisfies the constraints.
    """
    pp = problem.pp
    valid = Validity.build(problem.n, requirements, memory)
    bound = Bound(problem, valid)
    evaluate = StepTimeEvaluator(problem)
    lb, reach, flop_splits = _bound_and_flop_splits(problem, valid, bound)
    if pp * problem.n_micro_batches > _MAX_SIMULATED:
        # Too large to search by simulation: the bound's own split, simulated once (while that stays within a
        # few seconds) so that the answer still carries a proven gap, step ≤ (1 + gap) · optimum.
        split = tuple(reconstruct(bound, lb, reach, True))
        if pp * problem.n_micro_batches > _MAX_SIMULATED_ONCE:
            return StepTimeSplit(split, math.nan, lb, False, 0)
        step = float(evaluate([split])[0])
        return StepTimeSplit(split, step, lb, step <= lb * (1 + RTOL), evaluate.evaluated)
    candidates = {tuple(reconstruct(bound, lb, reach, latest)) for latest in (True, False)}
    candidates |= flop_splits
    candidates |= {tuple(int(x) for x in s) for s in seeds if _feasible(valid, problem, s)}
    scored = score(evaluate, bound, sorted(candidates))
    best = min(scored)
    best = _descend(evaluate, bound, valid, best, work)
    nodes = schedule_graph(problem.engine, pp, problem.n_micro_batches, _cuts_of(problem, best[2])).n_actions
    complete = best[0] <= lb * (1 + RTOL)
    # The enumerations below prune by the tighter bound of 1F1B's round trips (they score and break ties by
    # ``bound``, as the rest does). Building it costs about as much as simulating a few dozen splits of the
    # schedule: it is built where they may simulate thousands.
    prune = bound
    splits_left = min(budget, int(max(0.0, work - evaluate.work) / max(nodes, 1)))
    if problem.engine == "1f1b" and splits_left >= _PRUNE_FROM and (not complete or least_memory is not None):
        prune = Bound(problem, valid, round_trips=True)
    if not complete:
        left = max(0.0, work - evaluate.work)
        best, complete = branch_and_bound(
            evaluate, bound, best, min(budget, max(64, int(left / max(nodes, 1)))), prune=prune
        )
    if least_memory is not None:
        left = max(0.0, work - evaluate.work)
        best = _least_memory_among_fastest(
            evaluate,
            bound,
            requirements,
            memory,
            best,
            least_memory,
            min(budget, _TIE_BUDGET, max(64, int(left / max(nodes, 1)))),
            prune=prune,
        )
    return StepTimeSplit(best[2], best[0], lb, complete, evaluate.evaluated)


def _bound_and_flop_splits(
    problem: ScheduleProblem, valid: Validity, bound: Bound
) -> tuple[float, list[np.ndarray], set[tuple[int, ...]]]:
    """Step 1: ``LB*`` with its reachability sweep, and the FLOP min-max splits (candidates of step 2).

    Raises:
        PlanningError: no split satisfies the constraints.
    """
    n, pp = problem.n, problem.pp
    # Every block at its most over the stage positions: big enough that any split meets it.
    most = max(float(np.sum(t[0]) + np.sum(t[1])) for t in (problem.at(k) for k in {0, min(1, pp - 1), pp - 1}))
    big = (problem.n_micro_batches + pp) * most + bound.U[-1]
    big += 2 * pp * (max(max(row) for row in problem.send) if n else 0.0) + 1.0
    if bound.reach(big) is None:
        raise PlanningError("no contiguous split satisfies the constraints")
    # Brackets that save bisection steps (each is checked): the FLOP min-max lies between the larger of the
    # mean stage and the largest block, and their sum (when the constraints allow it); every stage's
    # fill-drain term is at least m × its forward + backward, and the FLOP split meets its own bound.
    flop_bound = Bound(problem, valid, slowest_stage=True)
    least_f, least_b, _, _ = problem.lowest()  # the bound's block times: each at its least over stage positions
    work_per_block = least_f + least_b
    floor = max((flop_bound.F[-1] + flop_bound.B[-1]) / pp, float(work_per_block.max(initial=0.0)))
    ceiling = (flop_bound.F[-1] + flop_bound.B[-1]) / pp + float(work_per_block.max(initial=0.0))
    flop_x, flop_reach = minimise(flop_bound, feasible_bound(flop_bound, ceiling, big), floor)
    flop_splits = {tuple(reconstruct(flop_bound, flop_x, flop_reach, latest)) for latest in (True, False)}
    ceiling = min(bound.value(s) for s in flop_splits)
    lb, reach = minimise(bound, feasible_bound(bound, ceiling, big), problem.n_micro_batches * flop_x)
    return lb, reach, flop_splits


#: Splits :func:`_fastest` simulates first, those of the smallest lower bound: their best step rules out the rest.
_FIRST_BATCH = 32
#: A split whose lower bound is above the best step found by more than this is slower (the bound never exceeds a
#: split's step time; the margin covers rounding).
_BOUND_MARGIN = 1e-6


def _fastest(evaluate: StepTimeEvaluator, bound: Bound, splits: np.ndarray) -> Scored:
    """``min(score(evaluate, bound, splits))`` (rows of ``splits``), simulating only the splits whose lower bound
    is not above the best step time found: those of the smallest bound first, then the rest that their best does
    not rule out. The others are charged to the evaluator as if simulated, so the budgets run as before."""
    values = bound.values(splits)
    order = np.argsort(values, kind="stable")
    first, rest = splits[order[:_FIRST_BATCH]], splits[order[_FIRST_BATCH:]]
    best = min(score(evaluate, bound, [tuple(int(x) for x in row) for row in first]))
    keep = values[order[_FIRST_BATCH:]] <= best[0] * (1 + _BOUND_MARGIN)
    evaluate.charge(rest[~keep])
    kept = [tuple(int(x) for x in row) for row in rest[keep]]
    return min(best, *score(evaluate, bound, kept)) if kept else best


def _cuts_of(problem: ScheduleProblem, bounds: Sequence[int]) -> tuple[bool, ...]:
    return tuple(bool(problem.grad_after[e]) for e in bounds[1:-1])


def _feasible(valid: Validity, problem: ScheduleProblem, bounds: Sequence[int]) -> bool:
    if len(bounds) != problem.pp + 1 or bounds[0] != 0 or bounds[-1] != problem.n:
        return False
    return bool(_feasible_rows(valid, np.asarray([bounds], dtype=np.int64))[0])


def _feasible_rows(valid: Validity, bounds: np.ndarray) -> np.ndarray:
    """Which rows of ``bounds`` (each ``0, ..., n``) are splits every stage of which is valid."""
    inside = ((bounds >= 0) & (bounds <= valid.n)).all(axis=1)
    b = np.clip(bounds, 0, valid.n)
    s, e = b[:, :-1], b[:, 1:]
    lo = np.stack([valid.lo(k) for k in range(s.shape[1])])
    return inside & ((lo[np.arange(s.shape[1]), e] <= s) & (s <= valid.hi[e])).all(axis=1)


def _descend(evaluate: StepTimeEvaluator, bound: Bound, valid: Validity, best: Scored, work: float) -> Scored:
    """Move one cut by up to 2 blocks, or two neighbouring cuts together, while the step time drops (and half
    the work budget lasts)."""
    pp = evaluate.problem.pp
    if pp < 2:
        return best
    # Every move: cut k alone, or cuts k and k + 1 together, by d.
    moves = []
    for k in range(1, pp):
        for d in (-2, -1, 1, 2):
            single = np.zeros(pp + 1, dtype=np.int64)
            single[k] = d
            moves.append(single)
            if k + 1 < pp:
                pair = single.copy()
                pair[k + 1] = d
                moves.append(pair)
    moves_arr = np.asarray(moves)
    for _ in range(200):
        if evaluate.work > work / 2:
            return best
        neighbours = np.asarray(best[2], dtype=np.int64) + moves_arr
        neighbours = np.unique(neighbours[_feasible_rows(valid, neighbours)], axis=0)
        if not len(neighbours):
            return best
        cand = _fastest(evaluate, bound, neighbours)
        if cand[0] >= best[0] * (1 - 1e-12):
            return min(best, cand) if cand[0] <= best[0] else best
        best = cand
    return best


def split_memory(terms: MemoryCap | Sequence[np.ndarray], bounds: Sequence[int]) -> float:
    """The largest stage's memory of a split under ``terms`` (the overhead left out: every stage pays it); or
    under each stage's prefix sums of them (:meth:`MemoryCap.prefix`), when many splits are measured."""
    pp = len(bounds) - 1
    prefixes = [terms.prefix(k) for k in range(pp)] if isinstance(terms, MemoryCap) else terms
    return float(_largest_stages(np.stack(prefixes[:pp]), np.asarray([bounds], dtype=np.int64))[0])


def _largest_stages(prefixes: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Each split's (a row of ``rows``) largest stage memory, under each stage's prefix sums (a row of
    ``prefixes`` per stage): :func:`split_memory` of many splits at once."""
    stage = np.arange(rows.shape[1] - 1)
    return (prefixes[stage, rows[:, 1:]] - prefixes[stage, rows[:, :-1]]).max(axis=1)


def _least_memory_among_fastest(
    evaluate: StepTimeEvaluator,
    base: Bound,
    requirements: Sequence[Requirement],
    memory: MemoryCap | None,
    best: Scored,
    terms: MemoryCap,
    budget: int,
    *,
    prune: Bound | None = None,
) -> Scored:
    """Among the splits as fast as ``best`` (within ``RTOL``), the one whose largest stage uses the least memory
    under ``terms`` (within ``budget`` simulated splits; past it, the least found so far). The splits are found
    under ``prune`` (a tighter bound than ``base``: default ``base``) and scored by ``base``.

    Memory first: the least memory ``c0`` at which some split's lower bound still meets the time (bisection; no
    split below it can be as fast), then every split under caps that halve the distance from ``best``'s own memory
    down to ``c0`` (from the lowest up), each level simulated (the ones not seen yet) until one meets the time; the
    least memory among those is the answer, since every split under the level before was simulated and none met
    it.
    """
    problem = evaluate.problem
    limit = best[0] * (1 + RTOL)
    stacked = np.stack([terms.prefix(k) for k in range(problem.pp)])
    ceiling = split_memory(stacked, best[2])

    prune = base if prune is None else prune

    def bound_at(cap: float) -> Bound:
        room = cap if memory is None else min(cap, memory.room)  # the user's cap still holds
        # ``terms`` under a cap of ``room`` and no overhead: their prefix sums are the same at any cap.
        return prune.under(Validity.build(problem.n, requirements, terms, room + room * RTOL))

    lo, hi = 0.0, ceiling
    while hi - lo > 1e-3 * hi:
        mid = 0.5 * (lo + hi)
        if bound_at(mid).reach(limit) is None:
            lo = mid
        else:
            hi = mid
    seen: set[tuple[int, ...]] = {best[2]}
    chosen = (ceiling, best[1], best[2])
    step = best[0]
    left = budget
    for j in range(6, -1, -1):
        # The last level: every split under ``best``'s own memory (one that equals it cannot beat ``best``).
        cap = ceiling - (ceiling - hi) * (1 - 2.0**-j) if j else ceiling * (1 - 2 * RTOL)
        splits = [x for x in splits_within(bound_at(cap * (1 + RTOL)), limit, left + 1) if x not in seen]
        seen.update(splits)
        left -= len(splits)
        if splits:
            used = _largest_stages(stacked, np.asarray(splits, dtype=np.int64))
            for (t, v, split), mem in zip(score(evaluate, base, splits), used.tolist()):
                key = (mem, v, split)
                if t <= limit and key < chosen:
                    chosen, step = key, t
        if chosen[0] <= cap * (1 + RTOL) or left <= 0:
            break
    return step, chosen[1], chosen[2]
