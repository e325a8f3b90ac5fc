"""The step-time search's exact step (:mod:`~nanotron_ext.partition.schedule_aware`, step 3): a branch and bound
over every split whose lower bound is below the best step time found, walked depth first, simulated in batches.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from nanotron_ext.partition.stage_ends import StageEnds
from nanotron_ext.partition.step_time_bound import RTOL, Bound
from nanotron_ext.partition.step_time_eval import StepTimeEvaluator

__all__ = ["Scored", "branch_and_bound", "score"]

Scored = tuple[float, float, tuple[int, ...]]  # (step time, lower bound, bounds): min() is the tie-break


def score(evaluate: StepTimeEvaluator, bound: Bound, splits: Sequence[tuple[int, ...]]) -> list[Scored]:
    """Each split simulated, as ``(step time, lower bound, split)``: ``min`` of them is the fastest, ties to the
    smaller bound, then the smaller split (the same on every rank)."""
    rows = np.asarray(splits, dtype=np.int64).reshape(len(splits), -1)  # once: a list of tuples is slow to convert
    times = evaluate(rows)
    values = bound.values(rows)
    return [(float(t), float(v), s) for t, v, s in zip(times, values, splits)]


#: Splits the branch and bound scores at once (its best, and the bound it prunes by, move between batches).
_BATCH = 512
#: Batches it walks ahead and simulates together (a batch of 512 costs as much as one of 1024: the replay's
#: per-level steps dominate); those past a batch that lowers the best are walked again under the new bound.
_AHEAD = 8


def branch_and_bound(
    evaluate: StepTimeEvaluator, bound: Bound, best: Scored, budget: int, *, prune: Bound | None = None
) -> tuple[Scored, bool]:
    """Evaluate every split whose lower bound is below the best step time; False if the budget ran out. The walk
    prunes by ``prune`` (a tighter bound: default ``bound``); the splits are scored by ``bound``.

    The splits are walked depth first and scored :data:`_BATCH` at a time, the bound lowered after each batch
    that finds a faster split. The walk runs up to :data:`_AHEAD` batches ahead of the scoring, which simulates
    them in one go (:meth:`StepTimeEvaluator.prefetch`); when a batch lowers the bound, the walk resumes from
    where that batch ended, as if it had never run ahead."""
    problem = evaluate.problem
    stage_ends = StageEnds(bound if prune is None else prune, best[0])
    walk = _Walk(stage_ends, problem.n, problem.pp, best[0] * (1 - RTOL))  # a stage's bound must stay below it
    seen = 0
    while True:
        batches = []  # (splits, the walk's stack after them): those that will be scored unless the bound moves
        ahead, stop = seen, False
        for _ in range(_AHEAD):
            splits = walk.splits(_BATCH)
            if not _scored(len(splits), ahead, budget):
                stop = True  # the budget runs out inside this batch: it is not scored, and the search stops
                break
            batches.append((splits, list(walk.stack)))
            ahead += len(splits)
            if len(splits) < _BATCH or ahead > budget:
                break
        evaluate.prefetch([split for splits, _ in batches for split in splits])
        for splits, stack in batches:
            seen += len(splits)
            if splits:
                best = min(best, *score(evaluate, bound, splits))
            if seen > budget:  # a full batch that ends one split past the budget is scored, then the search stops
                return best, False
            if len(splits) < _BATCH:  # the walk is over
                return best, True
            if best[0] * (1 - RTOL) != walk.below:  # walk again from here under the lower bound
                walk.lower(best[0] * (1 - RTOL), stack)
                break
        else:
            if stop:
                return best, False


def _scored(size: int, seen: int, budget: int) -> bool:
    """Whether the branch and bound scores the walk's next ``size`` splits after ``seen``: a full batch that ends
    within the budget or one split past it (the search then stops), a last, shorter one within it (as the search
    first written, which checked the budget after each split and scored every full batch)."""
    return seen + size <= budget + (size == _BATCH)


class _Walk:
    """The branch and bound's depth-first walk over splits whose every stage's bound is below ``below``: per
    stage and start, the ends to push (last first) are worked out once under the current ``below``."""

    def __init__(self, stage_ends: StageEnds, n: int, pp: int, below: float) -> None:
        self.stage_ends, self.n, self.pp, self.below = stage_ends, n, pp, below
        self.pushed: dict[tuple[int, int], list[int]] = {}
        self.stack: list[tuple[int, tuple[int, ...], int]] = [(0, (), 0)]  # (stage, cuts before the last, last cut)

    def splits(self, most: int) -> list[tuple[int, ...]]:
        """The next ``most`` splits of the walk (fewer when it ends)."""
        out: list[tuple[int, ...]] = []
        stack, pp, pushed, n = self.stack, self.pp, self.pushed, self.n
        while stack and len(out) < most:
            k, head, s = stack.pop()
            prefix = (*head, s)
            ends = pushed.get((k, s))
            if ends is None:
                ends = self._ends(k, s)
            if k < pp - 2:
                stack.extend([(k + 1, prefix, e) for e in ends])
            elif k == pp - 2:  # the next stage is the last: a split for each end it may start at, in walk order
                for i in range(len(ends) - 1, -1, -1):
                    if len(out) == most:  # the rest is walked later, as if each had been pushed
                        stack.extend([(k + 1, prefix, e) for e in ends[: i + 1]])
                        break
                    last = pushed.get((k + 1, ends[i]))
                    if last is None:
                        last = self._ends(k + 1, ends[i])
                    if last:
                        out.append((*prefix, ends[i], n))
            elif ends:  # the last stage ends at n, or nowhere
                out.append((*prefix, n))
        return out

    def _ends(self, k: int, s: int) -> list[int]:
        """Stage ``k`` = ``[s, e)``: the ends ``e`` with ``s`` in its window, the stage's bound below ``below``, the
        rest completable; last first, as the walk pushes them."""
        ends = self.pushed.get((k, s))
        if ends is None:
            at, values = self.stage_ends(k, s)
            ends = self.pushed[(k, s)] = at[values < self.below][::-1].tolist() if len(at) else []
        return ends

    def lower(self, below: float, stack: list[tuple[int, tuple[int, ...], int]]) -> None:
        """Resume from ``stack`` under the lower ``below``."""
        self.below, self.stack = below, stack
        self.pushed.clear()
