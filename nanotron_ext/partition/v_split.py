"""Where to cut the blocks into a V's ``2 pp`` chunks, for the simulated ZB-V step (issue 43's third item, first
part): a descent from a seed split, and what the split search reads of a split (its simulated step, each rank's
memory, its byte budget). The search itself is :mod:`nanotron_ext.partition.v_search`.

The chunks are priced as the stages of a ``2 pp``-stage :class:`ScheduleProblem` (forward, backward and its W part,
update, what each cut sends), and each split is timed by :func:`nanotron_ext.schedule.zbv.simulate_zbv`: rank
``r`` runs chunks ``r`` and ``2 pp - 1 - r``, and the cut at the V's bottom stays on its rank. From the seed
(the FLOP-balanced split, say), :func:`descend_v_split` moves one cut at a time by one or two blocks, keeps any
move that shortens the step, and stops when none does, or at ``max_evals`` splits timed. On the public shapes at
PP 4 and 8 (``benchmarks/zbv_simulated.py``) this turns the FLOP-balanced chunks' 0.975-1.309 x zb1p's step into
0.923-1.130 x (``docs/zbv.md``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.config import PlannerConfig
from nanotron_ext.costs.v_memory import VRankMemory, v_rank_at, v_rank_terms
from nanotron_ext.errors import PlanningError
from nanotron_ext.partition.schedule_problem import ScheduleProblem
from nanotron_ext.schedule.v_moments import v_moments
from nanotron_ext.schedule.zbv import VBudget, VResult, simulate_zbv, simulate_zbv_under

__all__ = [
    "Budgets",
    "VMemory",
    "VSplit",
    "descend_v_split",
    "simulate_within",
    "v_budget",
    "v_floors",
    "v_peaks",
    "v_simulate",
    "v_step",
]

#: The cut moves a descent tries, in blocks.
MOVES = (-1, 1, -2, 2)


@dataclass(frozen=True)
class VSplit:
    """A split of the blocks into ``2 pp`` chunks (``bounds``: ``2 pp + 1`` positions from 0 to n), its simulated
    ZB-V step, the seed's, and how many splits were timed."""

    bounds: tuple[int, ...]
    step: float
    seed_step: float
    evaluated: int


def v_simulate(
    problem: ScheduleProblem, bounds: Sequence[int], eager: Collection[int] = (), budget: VBudget | None = None
) -> VResult:
    """The simulated ZB-V step of the chunks ``bounds`` (``problem.pp`` is the number of chunks, ``2 pp``); the
    chunks ``eager`` run each ``W`` right after its ``B``, every rank under ``budget``
    (:func:`~nanotron_ext.schedule.zbv.simulate_zbv`).

    Raises:
        ValueError: no order keeps every rank under the budget.
    """
    stages, p2p, _ = problem.simulator_inputs(bounds)
    return simulate_zbv(stages, problem.n_micro_batches, p2p, eager=eager, budget=budget)


#: Each split's byte budget, for the scheduler (:func:`v_budget` of the split under a cap, say).
Budgets = Callable[[Sequence[int]], VBudget]


def simulate_within(
    problem: ScheduleProblem,
    bounds: Sequence[int],
    eager: Collection[int] = (),
    budgets: Budgets | None = None,
    *,
    under: float = math.inf,
) -> VResult | None:
    """:func:`v_simulate` of ``bounds`` under its budget, None where no order keeps a rank under it or where its
    step is not under ``under`` (a search's best so far: such a schedule is not finished)."""
    try:
        stages, p2p, _ = problem.simulator_inputs(bounds)
        budget = None if budgets is None else budgets(bounds)
        return simulate_zbv_under(stages, problem.n_micro_batches, p2p, eager=eager, budget=budget, under=under)
    except ValueError:
        return None


class VMemory:
    """Each rank's memory of the Vs that cut ``blocks`` under ``cfg``: its terms estimated once for each pair of
    chunks it can hold (:func:`~nanotron_ext.costs.v_memory.v_rank_terms`), then read by the floors, budgets and
    peaks of every split a search tries (a descent moves one cut: the other ranks keep theirs)."""

    def __init__(self, blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> None:
        self.blocks = blocks
        self.cfg = cfg if cfg.run.engine == "zb1p" else cfg.with_overrides(engine="zb1p")
        self._terms: dict[tuple[int, int, int, int, int], VRankMemory] = {}

    def terms(self, bounds: Sequence[int]) -> list[VRankMemory]:
        """Each rank's terms (their ``worst`` the first backward) of the V that cuts the blocks at ``bounds``: rank
        ``r`` holds chunk ``r`` (the way down) and chunk ``2 pp - 1 - r`` (the way up)."""
        chunks, out = len(bounds) - 1, []
        for r in range(chunks // 2):
            up = chunks - 1 - r
            key = (r, bounds[r], bounds[r + 1], bounds[up], bounds[up + 1])
            found = self._terms.get(key)
            if found is None:
                pair = (self.blocks[key[1] : key[2]], self.blocks[key[3] : key[4]])
                found = self._terms[key] = v_rank_terms(pair, self.cfg, r)
            out.append(found)
        return out

    def floors(self, bounds: Sequence[int]) -> list[float]:
        """Each rank's least peak (:func:`~nanotron_ext.costs.v_memory.v_rank_floor`), whatever the schedule."""
        return [x.peak for x in self.terms(bounds)]

    def budget(self, bounds: Sequence[int], cap: float) -> VBudget:
        """The bytes each rank may hold in activations and W state, for its estimated peak to stay under ``cap``:
        the cap less what the rank holds throughout and its chunks' largest temporaries (a negative budget no
        order fits)."""
        chunks = len(bounds) - 1
        mems = self.terms(bounds)
        activation, pending = [0.0] * chunks, [0.0] * chunks
        for r, mem in enumerate(mems):
            for c, stage in enumerate((r, chunks - 1 - r)):
                activation[stage], pending[stage] = mem.activations[c], mem.weight_pending[c]
        room = [cap - mem.throughout - max(mem.temporaries) for mem in mems]
        return VBudget(tuple(activation), tuple(pending), tuple(room))

    def peaks(self, bounds: Sequence[int], result: VResult) -> list[VRankMemory]:
        """Each rank's peak, scheduled as ``result`` (:func:`v_simulate` of the same bounds).

        Raises:
            PlanningError: bounds that are not ``2 pp`` chunks of the blocks for ``result``'s ``pp``.
        """
        pp, n = result.pp, len(self.blocks)
        if len(bounds) != 2 * pp + 1 or bounds[0] != 0 or bounds[-1] != n:
            raise PlanningError(f"bounds {list(bounds)} are not {2 * pp} chunks of {n} blocks (pp={pp})")
        return [v_rank_at(terms, v_moments(result, r)) for r, terms in enumerate(self.terms(bounds))]


def v_budget(blocks: Sequence[BlockInfo], cfg: PlannerConfig, bounds: Sequence[int], cap: float) -> VBudget:
    """The bytes each rank of the V that cuts ``blocks`` at ``bounds`` may hold in activations and W state, for its
    estimated peak to stay under ``cap`` (:meth:`VMemory.budget`)."""
    return VMemory(blocks, cfg).budget(bounds, cap)


def v_step(problem: ScheduleProblem, bounds: Sequence[int]) -> float:
    """:func:`v_simulate`'s step time."""
    return v_simulate(problem, bounds).step_time


def v_peaks(
    blocks: Sequence[BlockInfo], cfg: PlannerConfig, bounds: Sequence[int], result: VResult
) -> list[VRankMemory]:
    """Each rank's peak memory of the V that cuts ``blocks`` at ``bounds`` (``2 pp + 1`` positions), scheduled as
    ``result`` (:func:`v_simulate` of the same bounds; :meth:`VMemory.peaks`).

    Raises:
        PlanningError: bounds that are not ``2 pp`` chunks of the blocks for ``result``'s ``pp``.
    """
    return VMemory(blocks, cfg).peaks(bounds, result)


def v_floors(blocks: Sequence[BlockInfo], cfg: PlannerConfig, bounds: Sequence[int]) -> list[float]:
    """Each rank's least peak (:func:`~nanotron_ext.costs.v_memory.v_rank_floor`) for the V that cuts ``blocks`` at
    ``bounds``, whatever its schedule: no simulation."""
    return VMemory(blocks, cfg).floors(bounds)


def descend_v_split(
    problem: ScheduleProblem,
    seed: Sequence[int],
    *,
    valid: Callable[[Sequence[int]], bool] | None = None,
    fits: Callable[[Sequence[int], VResult], bool] | None = None,
    max_evals: int = 400,
    eager: Collection[int] = (),
    budgets: Budgets | None = None,
) -> VSplit:
    """From ``seed``, the split a descent over single cut moves (:data:`MOVES`) reaches.

    Args:
        problem: the blocks priced as ``2 pp`` stages.
        seed: the starting split, ``2 pp + 1`` increasing positions from 0 to ``problem.n``.
        valid: which splits may be taken (a block with weights on every chunk, say); every non-empty one if None.
        fits: whether a simulated split's memory fits (:func:`v_peaks` under a cap, say); every one if None.
        eager: chunks whose ``W`` runs right after its ``B`` (:func:`v_simulate`).
        budgets: each split's byte budget for the scheduler; a split no order keeps under it is not taken.
        max_evals: the most splits timed; the best found so far is returned then.

    Raises:
        PlanningError: an odd number of chunks, or a seed that is not a valid split that fits.
    """
    chunks, n = problem.pp, problem.n
    seed = tuple(int(b) for b in seed)
    if chunks % 2:
        raise PlanningError(f"{chunks} chunks; a V has two per rank: price the blocks as 2 pp stages")
    ok = valid or (lambda bounds: True)
    fit = fits or (lambda bounds, result: True)
    if (
        len(seed) != chunks + 1
        or seed[0] != 0
        or seed[-1] != n
        or any(b <= a for a, b in zip(seed, seed[1:]))
        or not ok(seed)
    ):
        raise PlanningError(
            f"seed split {list(seed)} is not {chunks} non-empty chunks of {n} blocks that the "
            f"constraints accept; start from a valid split (the FLOP-balanced one)"
        )
    seeded = simulate_within(problem, seed, eager, budgets)
    if seeded is None or not fit(seed, seeded):
        raise PlanningError(f"seed split {list(seed)} does not fit the memory; start from one that does")
    best, best_step = seed, seeded.step_time
    seed_step, evaluated, improved = best_step, 1, True
    while improved and evaluated < max_evals:
        improved = False
        for cut in range(1, chunks):
            for move in MOVES:
                trial = list(best)
                trial[cut] += move
                if not trial[cut - 1] < trial[cut] < trial[cut + 1] or not ok(trial):
                    continue
                # A split slower than the best is not finished, but for the last one the budget allows: there a
                # split no order fits skips the budget's check (the descent's walk as it always was).
                under = best_step * (1 - 1e-12) if evaluated + 1 < max_evals else math.inf
                result = simulate_within(problem, trial, eager, budgets, under=under)
                evaluated += 1
                if result is None:
                    continue
                step = result.step_time
                if step < best_step * (1 - 1e-12) and fit(trial, result):
                    best, best_step, improved = tuple(trial), step, True
                if evaluated >= max_evals:
                    break
            if evaluated >= max_evals:
                break
    return VSplit(best, best_step, seed_step, evaluated)
