"""The optimal contiguous split of blocks into pipeline stages, under constraints.

Objective, in order: minimise the slowest stage (the pipeline's pace), then among those splits minimise the
sum of squared stage costs (the most even one). Both are exact dynamic programmes over split points,
``O(pp · n²)`` vectorised with numpy (the linear-partition problem; cf. torchgpipe's ``balance``, which
uses the same block-partition objective).

A stage's cost may depend on its position: ``cost + in_flight[stage] · per_in_flight`` prices activation
memory under 1F1B, where stage ``k`` holds ``pp − k`` micro-batches.

Constraints: no empty stage; every stage holds at least one block flagged by each :class:`Requirement`;
optionally, every stage's memory stays under a cap. Ties are broken towards the smallest split index, so the
result is deterministic: every rank computes the same plan from the same input.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import numpy as np

from nanotron_ext.costs.prefix_sums import prefix_sums
from nanotron_ext.errors import PlanningError
from nanotron_ext.partition.split import bounds_from_ranks, ranks_from_bounds
from nanotron_ext.report import compact_names

__all__ = ["MemoryCap", "Partition", "Requirement", "SegmentEstimate", "partition"]

_RTOL = 1e-9


@dataclass(frozen=True)
class Requirement:
    """Every stage must hold at least one block whose flag is true.

    Attributes:
        what: plural noun for messages, e.g. ``"blocks with parameters"``.
        flags: one flag per block.
        fix: what the user can change when too few blocks are flagged.
    """

    what: str
    flags: tuple[bool, ...]
    fix: str = ""


class SegmentEstimate(Protocol):
    """The full estimate of blocks ``[s, e)`` on stage ``k`` (bytes, overhead included): of one segment, or of
    the segments ``[s[j], e[j])`` at once (``many``)."""

    def __call__(self, k: int, s: int, e: int) -> float: ...

    def many(self, k: int, s: np.ndarray, e: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class MemoryCap:
    """Per-stage memory ceiling: ``overhead + sum(static) + in_flight[stage] · sum(activation)
    + deferred[stage] · sum(pending) <= cap`` (bytes; ``pending``/``deferred``: zb1p's deferred weight-gradient
    passes, empty for none).

    That additive part is a lower bound of a stage's full estimate (which adds temporaries and held tensors, a
    maximum over the stage's blocks). ``exact(k, s, e)``, when given, is the full estimate of blocks ``[s, e)``
    on stage ``k``, overhead included: the cap then holds on it (:meth:`fits`), at the price of an estimate of
    every segment that the additive part lets fit (all of a stage's at once, ``exact.many``).
    """

    static: tuple[float, ...]
    activation: tuple[float, ...]
    in_flight: tuple[int, ...]
    cap: float
    overhead: float = 0.0  # per stage, whatever it holds (runtime overhead allowance)
    pending: tuple[float, ...] = ()
    deferred: tuple[int, ...] = ()
    fix: str = ""  # what the config could change when no split fits (the caller knows the config; empty: generic)
    exact: SegmentEstimate | None = field(default=None, compare=False, repr=False)
    _tables: dict[tuple[int, bool], np.ndarray] = field(default_factory=dict, init=False, compare=False, repr=False)
    _prefixes: dict[int, np.ndarray] = field(default_factory=dict, init=False, compare=False, repr=False)

    @property
    def room(self) -> float:
        """What the blocks of one stage may use: the cap less the overhead."""
        return self.cap - self.overhead

    @property
    def slack_room(self) -> float:
        """:attr:`room` with the relative slack every comparison with the cap allows (rounding)."""
        return self.room + self.cap * _RTOL

    def table(self, k: int, n: int, *, only_fitting: bool = False) -> np.ndarray:
        """``(n + 1) × (n + 1)`` bytes of blocks ``[s, e)`` on stage ``k`` (``inf`` where ``s >= e``): the full
        estimate when ``exact`` is given, else the additive part plus the overhead. ``only_fitting``: the full
        estimate only where the additive part fits (``inf`` elsewhere, which cannot fit either): far fewer
        estimates under a tight cap."""
        key = (k, only_fitting and self.exact is not None)
        if key not in self._tables:
            q = self.prefix(k)
            upper = np.triu(np.ones((n + 1, n + 1), dtype=bool), 1)
            additive = np.where(upper, q[None, :] - q[:, None] + self.overhead, np.inf)
            if self.exact is None:
                out = additive
            else:
                out = np.full((n + 1, n + 1), np.inf)
                todo = upper & (additive <= self.cap * (1 + _RTOL)) if only_fitting else upper
                starts, ends = np.nonzero(todo)
                out[starts, ends] = self.exact.many(k, starts, ends)
            self._tables[key] = out
        return self._tables[key]

    def fits(self, k: int, n: int) -> np.ndarray:
        """``(n + 1) × (n + 1)`` booleans: blocks ``[s, e)`` fit on stage ``k`` (:meth:`table` within the cap)."""
        return self.table(k, n, only_fitting=True) <= self.cap * (1 + _RTOL)

    @cached_property
    def _term_sums(self) -> tuple[np.ndarray, ...]:
        """Prefix sums of ``static``, ``activation`` and ``pending``: the same for every stage, summed once."""
        return tuple(prefix_sums(t) for t in (self.static, self.activation, self.pending))

    def prefix(self, k: int) -> np.ndarray:
        """Prefix sums of stage ``k``'s memory per block: blocks ``[s, e)`` on stage ``k`` use ``q[e] - q[s]``
        (read-only: computed once per stage, searches ask for it again and again)."""
        if k not in self._prefixes:
            static, activation, pending = self._term_sums
            q = static + self.in_flight[k] * activation
            if self.pending and self.deferred and self.deferred[k]:
                q = q + self.deferred[k] * pending
            q.flags.writeable = False
            self._prefixes[k] = q
        return self._prefixes[k]


@dataclass(frozen=True)
class Partition:
    """A contiguous split: stage ``k`` holds blocks ``bounds[k]:bounds[k+1]``."""

    bounds: tuple[int, ...]
    stage_costs: tuple[float, ...] = field(compare=False)

    @property
    def pp(self) -> int:
        return len(self.bounds) - 1

    @property
    def max_cost(self) -> float:
        return max(self.stage_costs)

    def ranks(self) -> list[int]:
        """Stage of each block, in block order."""
        return ranks_from_bounds(self.bounds)

    @staticmethod
    def from_ranks(ranks: Sequence[int], costs: Sequence[float]) -> Partition:
        """The partition of a block→stage map; raises if the map is not contiguous and ordered."""
        pp = max(ranks) + 1 if ranks else 0
        if any(b < a for a, b in zip(ranks, ranks[1:])):
            raise PlanningError(f"block→stage map {list(ranks)} is not in forward order; stages must be contiguous")
        bounds = bounds_from_ranks(ranks, pp)
        stage_costs = tuple(float(sum(costs[bounds[k] : bounds[k + 1]])) for k in range(pp))
        return Partition(tuple(bounds), stage_costs)


def partition(
    costs: Sequence[float],
    pp: int,
    *,
    per_in_flight: Sequence[float] | None = None,
    in_flight: Sequence[int] | None = None,
    requirements: Sequence[Requirement] = (),
    memory: MemoryCap | None = None,
    names: Sequence[str] | None = None,
) -> Partition:
    """Split blocks into ``pp`` contiguous, non-empty stages, minimising the slowest stage.

    Args:
        costs: cost of each block, in forward order; finite and non-negative.
        pp: number of stages.
        per_in_flight: extra cost per micro-batch in flight (activation memory), per block.
        in_flight: micro-batches in flight per stage; required with ``per_in_flight`` or ``memory``.
        requirements: every stage must hold a flagged block of each requirement.
        memory: optional per-stage memory cap.
        names: block names, for error messages.

    Returns:
        The optimal :class:`Partition` (ties: most even, then earliest split points).

    Raises:
        PlanningError: bad costs, or no split satisfies the constraints (saying which, and what to change).

    Example:
        >>> partition([1, 1, 1, 3], 2).bounds
        (0, 3, 4)
    """
    n = len(costs)
    names = list(names) if names is not None else [f"block {i}" for i in range(n)]
    c = _check_costs("cost", costs, names)
    a = _check_costs("per-in-flight cost", per_in_flight, names) if per_in_flight is not None else np.zeros(n)
    _check_pp(pp, n)
    mult = _stage_multipliers(in_flight, pp)
    for req in requirements:
        _check_requirement(req, pp, names)

    flag_prefix = [prefix_sums(r.flags, np.int64) for r in requirements]
    valid = _segment_validity(n, flag_prefix, memory)

    # Normalise so that tolerances are relative and squares stay in range.
    scale = float(c.sum() + a.sum() * max(mult)) or 1.0
    cp = prefix_sums(c / scale)
    ap = prefix_sums(a / scale)

    def seg(k: int, s: np.ndarray, e: np.ndarray) -> np.ndarray:
        return (cp[e] - cp[s]) + mult[k] * (ap[e] - ap[s])

    def width(limit: float) -> int:
        return _longest_stage(n, lambda s, e: seg(int(np.argmin(mult)), s, e), limit)

    best = _least_slowest_stage(
        pp, n, seg, valid, width, start=2.0 * max(1.0 / pp, float(np.max(c + a * max(mult)) / scale))
    )
    if not math.isfinite(best):
        raise _infeasible(costs, pp, requirements, memory, names, in_flight)
    bound = best * (1 + _RTOL) + 1e-15
    _, bounds = _dp(pp, n, seg, valid, combine="sumsq", cap=bound, width=width(bound))
    stage_costs = tuple(
        float(c[bounds[k] : bounds[k + 1]].sum() + mult[k] * a[bounds[k] : bounds[k + 1]].sum()) for k in range(pp)
    )
    return Partition(tuple(bounds), stage_costs)


#: ``seg(k, s, e)``, ``valid(k, s, e)``: a stage ``k`` of blocks ``[s, e)`` (arrays of starts and ends, broadcast).
Segments = Callable[[int, np.ndarray, np.ndarray], np.ndarray]


def _least_slowest_stage(
    pp: int, n: int, seg: Segments, valid: Segments, width: Callable[[float], int], start: float
) -> float:
    """The least slowest stage of any valid split (``inf``: none), by the programme over stages of cost at most a
    trial ``t``, doubled from ``start`` until a split is found: exact, since every split whose slowest stage is at
    most ``t`` is among those, and the others are slower than the one found (once ``t`` admits every stage, the
    programme over all of them)."""
    t = start
    while True:
        w = width(t)
        if w >= n:
            return _dp(pp, n, seg, valid, combine="max")[0]
        best = _dp(pp, n, seg, valid, combine="max", cap=t, width=w)[0]
        if math.isfinite(best):
            return best
        t *= 2


def _longest_stage(n: int, seg: Callable[[np.ndarray, np.ndarray], np.ndarray], limit: float) -> int:
    """The most blocks a stage of cost at most ``limit`` holds, by ``seg`` (non-increasing in the start: costs are
    not negative), found per end by bisection on the very comparison the programme makes; at least 1."""
    ends = np.arange(n + 1)
    lo, hi = np.zeros(n + 1, dtype=np.int64), ends.copy()  # the first start within the limit is in [lo, hi]
    while np.any(lo < hi):
        mid = (lo + hi) // 2
        within = seg(mid, ends) <= limit
        active = lo < hi
        hi = np.where(active & within, mid, hi)
        lo = np.where(active & ~within, mid + 1, lo)
    return max(1, int(np.max(ends - lo)))


def _dp(
    pp: int, n: int, seg: Segments, valid: Segments, combine: str, cap: float | None = None, width: int | None = None
) -> tuple[float, list[int]]:
    """The programme over stages: per end ``e``, the best of its starts ``e - width .. e - 1`` (every start by
    default; callers narrow it only where the stages left out cost more than ``cap``, so none of them is chosen).
    Ties go to the smallest start."""
    inf = math.inf
    width = n if width is None else max(1, min(width, n))
    ends = np.arange(n + 1)
    starts = ends[:, None] - width + np.arange(width)[None, :]  # increasing: the first minimum is the earliest
    inside = starts >= 0
    starts = np.where(inside, starts, 0)
    ends = ends[:, None]
    rows = np.arange(n + 1)
    value = np.full(n + 1, inf)
    value[0] = 0.0
    choices = []
    for k in range(pp):
        s = seg(k, starts, ends)
        ok = inside & valid(k, starts, ends)
        if cap is not None:
            ok = ok & (s <= cap)
        cand = np.maximum(value[starts], s) if combine == "max" else value[starts] + s * s
        cand = np.where(ok, cand, inf)
        pick = np.argmin(cand, axis=1)  # first minimum: deterministic tie-break
        choices.append(starts[rows, pick])
        value = cand[rows, pick]
    total = float(value[n])
    if not math.isfinite(total):
        return total, []
    bounds = [n]
    for k in range(pp - 1, -1, -1):
        bounds.append(int(choices[k][bounds[-1]]))
    return total, bounds[::-1]


def _segment_validity(n: int, flag_prefix: list[np.ndarray], memory: MemoryCap | None) -> Segments:
    """``valid(k, s, e)``: blocks ``[s, e)`` (``s < e``) hold a flagged block of every requirement and fit the
    memory on stage ``k``."""

    def flagged(s: np.ndarray, e: np.ndarray) -> np.ndarray:
        out = np.ones(np.broadcast(s, e).shape, dtype=bool)
        for fp in flag_prefix:
            out = out & ((fp[e] - fp[s]) >= 1)
        return out

    if memory is None:
        return lambda k, s, e: flagged(s, e)
    if memory.exact is not None:
        return lambda k, s, e: flagged(s, e) & memory.fits(k, n)[s, e]
    limit = memory.slack_room

    def valid(k: int, s: np.ndarray, e: np.ndarray) -> np.ndarray:
        q = memory.prefix(k)
        return flagged(s, e) & ((q[e] - q[s]) <= limit)

    return valid


def _check_costs(what: str, values: Sequence[float] | None, names: Sequence[str]) -> np.ndarray:
    arr = np.asarray(list(values if values is not None else []), dtype=np.float64)
    if len(arr) != len(names):
        raise PlanningError(f"got {len(arr)} {what}s for {len(names)} blocks; give one per block")
    for i, v in enumerate(arr):
        if not math.isfinite(v) or v < 0:
            raise PlanningError(
                f"{what} of {names[i]} is {v!r}; costs must be finite and non-negative — check the strategy "
                f"that produced it"
            )
    return arr


def _check_pp(pp: int, n: int) -> None:
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise PlanningError(f"pp={pp!r} must be a positive integer")
    if pp > n:
        raise PlanningError(f"pp={pp} stages but the model has only {n} blocks; use pp <= {n}")


def _check_requirement(req: Requirement, pp: int, names: Sequence[str]) -> None:
    if len(req.flags) != len(names):
        raise PlanningError(f"requirement '{req.what}' has {len(req.flags)} flags for {len(names)} blocks")
    flagged = [names[i] for i, f in enumerate(req.flags) if f]
    if len(flagged) < pp:
        listed = compact_names(flagged) if flagged else "none"
        raise PlanningError(
            f"pp={pp} needs {pp} {req.what} (one per stage) but the model has {len(flagged)} ({listed}); "
            f"the largest pp that works is {len(flagged)}" + (f"; {req.fix}" if req.fix else "")
        )


def _stage_multipliers(in_flight: Sequence[int] | None, pp: int) -> list[float]:
    if in_flight is None:
        return [1.0] * pp
    if len(in_flight) != pp:
        raise PlanningError(f"in_flight has {len(in_flight)} entries for pp={pp}")
    return [float(x) for x in in_flight]


def _infeasible(costs, pp, requirements, memory, names, in_flight) -> PlanningError:
    whats = " and ".join(r.what for r in requirements) or "non-empty stages"
    no_split = PlanningError(f"no contiguous split into {pp} stages gives every stage {whats}; lower pp")
    if memory is None:
        return no_split
    # Which peak memory is reachable at all under the other constraints?
    n = len(names)
    flag_prefix = [prefix_sums(r.flags, np.int64) for r in requirements]
    valid = _segment_validity(n, flag_prefix, None)
    # The full estimate of every segment when the cap holds on it (exact), else the additive part's.
    least, bounds = _dp(
        pp, n, lambda k, s, e: np.where(np.isinf(memory.table(k, n)), 0.0, memory.table(k, n))[s, e], valid, "max"
    )
    if not bounds:  # the requirements alone leave no split, whatever the memory
        return no_split
    worst = int(np.argmax([memory.table(k, n)[bounds[k], bounds[k + 1]] for k in range(pp)]))
    gib = float(1 << 30)
    return PlanningError(
        f"no split fits memory_cap_gib={memory.cap / gib:.3g}: the least memory any valid split needs is "
        f"{least / gib:.4g} GiB on stage {worst} ({(least - memory.cap) / gib:.3g} GiB over); "
        + (
            memory.fix
            or "raise the cap, use a larger pp, optimizer.zero_stage: 1, or the 1f1b engine (fewer "
            "micro-batches in flight)"
        )
    )
