"""A lower bound of the step time of splits, and the exact min-max of it over every feasible split.

Every split's step time is at least ``max_k g_k(s_k, s_{k+1})``: per stage ``k``, the paths of the schedule's
dependency graph that run through ``k``'s own serial work (see :func:`_terms`), plus the largest update. Each term
depends on the stage's own segment only, so ``LB* = min over feasible splits of max_k g_k`` is a min-max partition
problem, solved exactly by :func:`minimise` (bisection on the value from checked brackets; each test a
reachability sweep with prefix sums, ``O(pp · n log n)``, one binary search per distinct term).
``LB*`` ≤ the true optimum. :class:`Validity` holds which segments a split may use (requirements, memory cap).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from nanotron_ext.costs.prefix_sums import prefix_sums
from nanotron_ext.errors import PlanningError
from nanotron_ext.partition.feasible import latest_starts, sweep
from nanotron_ext.partition.optimal import MemoryCap, Requirement
from nanotron_ext.partition.step_time_eval import ScheduleProblem
from nanotron_ext.schedule import ZERO_BUBBLE

__all__ = [
    "RTOL",
    "Bound",
    "Validity",
    "feasible_bound",
    "lower_bound",
    "minimise",
    "reconstruct",
    "slowest_stage_optimum",
]

RTOL = 1e-9  # relative tolerance of every comparison of times


def _terms(problem: ScheduleProblem, round_trips: bool = False) -> list[list[tuple[float, ...]]]:
    """Lower-bound terms of each stage ``k``: tuples ``(wf, wb, ww, pf, pb, qf, qb, hops)``. For the segment
    ``[s, e)`` a term is ``wf·F(s,e) + wb·B(s,e) + ww·W(s,e) + U(s,e) + pf·F(0,s) + pb·B(0,s) + qf·F(e,n)
    + qb·B(e,n) + hops · p2p_min``, where ``F``, ``U`` sum forward and update times over blocks, ``B`` the
    time of a backward op (the whole backward under AFAB and 1F1B; the input-gradient part under zb1p) and
    ``W`` zb1p's weight-gradient pass (0 under AFAB and 1F1B, whose ``B`` holds it).

    Each is the length of a path of the schedule's dependency graph, so no split's step time is below it
    (``U``: the stage's own update comes after the pipeline; a transfer takes at least the smallest p2p
    time any cut can have):

    * fill-drain through ``k`` (every engine): micro-batch 0's forwards on stages ``< k``, stage ``k``'s ``m``
      forwards and ``m`` backwards (serial on one rank), then micro-batch ``m-1``'s backwards below ``k``;
    * 1F1B: micro-batch 0 forwards through every stage and backwards down to ``k + 1``; only then can stage
      ``k`` start its first backward, after which its program still holds ``m`` backwards and
      ``m - min(pp - k, m)`` forwards; then the backwards below ``k``. And, when stage ``k``'s last forward
      comes after its first backward (``s = m - (pp - k - 1) >= 2`` steady forwards): micro-batch 0's round
      trip above ``k`` to that first backward, stage ``k``'s program from it to its last forward (``s - 1``
      forwards and ``s - 2`` backwards), micro-batch ``m - 1``'s round trip above ``k``, its backward on ``k``
      and below: where a heavy early stage paces the pipeline, the path its idle wait for the first gradient
      and its steady phase make (``round_trips``: the branch and bound prunes by it; the min-max ``LB*`` and the
      splits that meet it, which seed the search, are the other terms', as they have been);
    * AFAB: micro-batch 0's forwards below ``k``, ``m`` forwards on ``k``, micro-batch ``m-1``'s forwards above
      ``k``; backward 0 from the last stage down to ``k``, ``m`` backwards on ``k``, backward ``m-1`` below.
    * zb1p: the two 1F1B paths, where stage ``k`` has run ``max(0, m - 1 - k)`` of its ``W`` before its last
      ``B`` (it defers its first ``k``, then one after each later ``B``), each also cut at stage ``k``'s
      end, where all ``m`` of its ``W`` are done.
    * zb2p: only the first of zb1p's terms (micro-batch 0's forwards below ``k``, then every F, B and W of stage
      ``k``), which holds for any order of a stage's work.

    Backward chains need every cut to carry a gradient: with a frozen first block they are left out.
    """
    pp, m = problem.pp, problem.n_micro_batches
    grads = bool(problem.grad_after[1])  # block 0 trains, so every cut carries a gradient
    g = 1.0 if grads else 0.0
    out = []
    for k in range(pp):
        if problem.engine == "zb1p":
            out.append(_zb1p_terms(pp, m, k, grads))
            continue
        if problem.engine == "zb2p":  # micro-batch 0's forwards below k, then all of k's work
            out.append([(m, m, m, 1.0, 0.0, 0.0, 0.0, k)])
            continue
        terms = [(m, m, 0.0, 1.0, g, 0.0, 0.0, k + (k if grads else 0))]
        if problem.engine == "1f1b" and grads:
            terms.append((1 + m - min(pp - k, m), m, 0.0, 1.0, 1.0, 1.0, 1.0, 2 * (pp - 1)))
            steady = m - (pp - k - 1)  # forwards of stage k from its last warm-up one on
            if round_trips and steady >= 2:  # its last forward comes after its first backward: two round trips
                terms.append((steady, steady, 0.0, 1.0, 1.0, 2.0, 2.0, 2 * k + 4 * (pp - 1 - k)))
        elif problem.engine == "afab":
            terms.append((m, m * g, 0.0, 1.0, g, 1.0, g, (pp - 1) * (2 if grads else 1)))
        out.append(terms)
    return out


def _zb1p_terms(pp: int, m: int, k: int, grads: bool) -> list[tuple[float, ...]]:
    """Stage ``k``'s terms under zb1p (see :func:`_terms`)."""
    terms = [(m, m, m, 1.0, 0.0, 0.0, 0.0, k)]  # micro-batch 0's forwards below k, then all of k's work
    if grads:
        w_before_last = max(0, m - 1 - k)
        f_after_first_b = 1 + m - min(pp - k, m)
        terms += [
            (m, m, w_before_last, 1.0, 1.0, 0.0, 0.0, 2 * k),
            (f_after_first_b, m, w_before_last, 1.0, 1.0, 1.0, 1.0, 2 * (pp - 1)),
            (f_after_first_b, m, m, 1.0, 0.0, 1.0, 1.0, 2 * (pp - 1) - k),
        ]
    return terms


class Bound:
    """The lower bound ``max_k g_k(s_k, s_{k+1})`` of splits, and reachability sweeps under it."""

    def __init__(
        self, problem: ScheduleProblem, valid: Validity, *, slowest_stage: bool = False, round_trips: bool = False
    ) -> None:
        self.problem, self.valid = problem, valid
        n = problem.n
        # Each block at its least over the stage positions it may land on (one set when nothing prices by position):
        # a path through longer ops is never shorter, so the bound holds wherever a block goes.
        f, b, bop, w = problem.lowest()
        F = prefix_sums(f)
        B = prefix_sums(b)
        U = problem.update_floor()  # a stage holding both ends of a tie saves: never above its update
        p2p_min = float(min(min(row[: n - 1]) for row in problem.send)) if problem.pp > 1 and n > 1 else 0.0
        self.F, self.B, self.U = F, B, U  # B: the whole backward
        Bop, W = B, np.zeros_like(B)  # a backward op, and zb1p's weight pass
        if problem.engine in ZERO_BUBBLE and not slowest_stage:
            Bop = prefix_sums(bop)
            W = prefix_sums(w)
        # Per stage, per term: E(e) (non-decreasing), S(s) (non-decreasing), constant; g = E(e) - S(s) + K.
        self.terms: list[list[tuple[np.ndarray, np.ndarray, float]]] = []
        # slowest_stage: the plain min-max of a stage's forward + backward (the FLOP objective).
        flop_terms = [[(1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)]] * problem.pp
        stage_terms = flop_terms if slowest_stage else _terms(problem, round_trips)
        u_weight = 0.0 if slowest_stage else 1.0
        for per_stage in stage_terms:
            rows = []
            for wf, wb, ww, pf, pb, qf, qb, hops in per_stage:
                e_arr = (wf - qf) * F + (wb - qb) * Bop + ww * W + u_weight * U
                s_arr = (wf - pf) * F + (wb - pb) * Bop + ww * W + u_weight * U
                const = qf * F[-1] + qb * Bop[-1] + hops * p2p_min
                rows.append((e_arr, s_arr, const))
            self.terms.append(rows)
        # The searches windows() runs, each once: stages often share a term (the fill-drain term does whenever
        # p2p is ignored, the FLOP objective always), and then one search per bound serves them all.
        searches: list[tuple[np.ndarray, np.ndarray]] = []  # (E + const, S)
        stage_search: list[list[int]] = []  # each stage's searches
        seen: dict[bytes, int] = {}
        for rows in self.terms:
            ids = []
            for e_arr, s_arr, const in rows:
                e_const = e_arr + const
                key = e_const.tobytes() + s_arr.tobytes()
                if key not in seen:
                    seen[key] = len(searches)
                    searches.append((e_const, s_arr))
                ids.append(seen[key])
            stage_search.append(ids)
        # Searches over the same S (the fill-drain term's, at every stage) run as one, for every stage at once:
        # each group's S and its rows of E + const; a stage reads its searches' rows of the groups' rows in order.
        by_start: dict[bytes, list[int]] = {}
        for i, (_, s_arr) in enumerate(searches):
            by_start.setdefault(s_arr.tobytes(), []).append(i)
        self._groups = [(searches[ids[0]][1], np.stack([searches[i][0] for i in ids])) for ids in by_start.values()]
        row_of = {i: r for r, i in enumerate(i for ids in by_start.values() for i in ids)}
        self._stage_rows = [np.asarray([row_of[i] for i in ids]) for ids in stage_search]
        # The searches under the last bound asked (a row per search, groups in order), and each stage's maximum; in
        # a list that :meth:`under`'s copies share, so a bisection over caps searches its one bound once.
        self._found: list[tuple[float, np.ndarray, dict[int, np.ndarray]]] = [(math.nan, np.empty(0), {})]
        # The same terms stacked (pp, terms, n + 1) for :meth:`values`; a stage with fewer terms repeats its first.
        width = max(len(rows) for rows in self.terms)
        padded = [rows + rows[:1] * (width - len(rows)) for rows in self.terms]
        self._E = np.array([[e_arr for e_arr, _, _ in rows] for rows in padded])
        self._S = np.array([[s_arr for _, s_arr, _ in rows] for rows in padded])
        self._C = np.array([[const for _, _, const in rows] for rows in padded])

    def under(self, valid: Validity) -> Bound:
        """The same bound over the segments ``valid`` allows: the terms, and the searches under the last bound
        asked (by any of the copies), shared."""
        other = copy.copy(self)
        other.valid = valid
        return other

    def value(self, bounds: Sequence[int]) -> float:
        """The lower bound of one split."""
        return max(
            float(e_arr[e] - s_arr[s] + const)
            for k, (s, e) in enumerate(zip(bounds[:-1], bounds[1:]))
            for e_arr, s_arr, const in self.terms[k]
        )

    def values(self, bounds: np.ndarray) -> np.ndarray:
        """:meth:`value` of each split (rows of ``bounds``), with the same arithmetic."""
        stage = np.arange(self.problem.pp)[:, None]
        term = np.arange(self._C.shape[1])
        g = self._E[stage, term, bounds[:, 1:, None]] - self._S[stage, term, bounds[:, :-1, None]] + self._C
        return g.reshape(len(bounds), -1).max(axis=1)

    def stage_value(self, k: int, s: int, e: np.ndarray) -> np.ndarray:
        """Stage ``k``'s bound on segments ``[s, e)``, one start and many ends (the arithmetic of :meth:`value`)."""
        return (self._E[k][:, e] - self._S[k][:, s, None] + self._C[k][:, None]).max(axis=0)

    def windows(self, k: int, x: float) -> tuple[np.ndarray, np.ndarray]:
        """For every end ``e`` (0..n): the starts ``s`` in ``[lo[e], hi[e]]`` give stage ``k`` a valid segment
        ``[s, e)`` whose bound is at most ``x``."""
        if self._found[0][0] != x:
            # g <= x  <=>  S(s) >= E(e) + const - x; S is non-decreasing. The relative slack keeps the optimum's
            # own split feasible against rounding. Every search of the same S at once, for every stage.
            searched = [np.searchsorted(s, e - x - RTOL * abs(x), side="left") for s, e in self._groups]
            self._found[0] = (x, np.concatenate(searched), {})
        _, starts, stages = self._found[0]
        if k not in stages:
            rows = self._stage_rows[k]
            stages[k] = starts[rows[0]] if len(rows) == 1 else starts[rows].max(axis=0)
        lo = stages[k] if self.valid.mem is None else np.maximum(stages[k], self.valid.lo(k))  # both are >= 0
        return lo, self.valid.hi

    def reach(self, x: float) -> list[np.ndarray] | None:
        """Forward reachability under bound ``x``: ``reach[k][s]`` — blocks ``[0, s)`` split into ``k`` stages.
        None when ``[0, n)`` cannot be split into ``pp`` stages."""
        return sweep(self.problem.n, self.problem.pp, lambda k: self.windows(k, x))


@dataclass
class Validity:
    """Which segments may form stage ``k``: ``s`` in ``[lo(k)[e], hi[e]]`` (non-empty, every requirement met,
    memory under the cap)."""

    n: int
    hi: np.ndarray
    mem: tuple[MemoryCap, float] | None = None
    _lo: dict[int, np.ndarray] = field(default_factory=dict)

    @staticmethod
    def build(
        n: int, requirements: Sequence[Requirement], memory: MemoryCap | None, room: float | None = None
    ) -> Validity:
        """The valid segments under ``requirements`` and ``memory`` (its additive part within ``room`` bytes a
        stage, default :attr:`MemoryCap.slack_room`; its ``cap`` and ``overhead`` are read only for that)."""
        hi = latest_starts(n, requirements)  # non-empty, every requirement met
        mem = None
        if memory is not None:
            mem = (memory, memory.slack_room if room is None else room)
        return Validity(n=n, hi=hi, mem=mem)

    def any_split(self, pp: int) -> bool:
        """Whether ``[0, n)`` splits into ``pp`` stages every one of which is valid."""
        return sweep(self.n, pp, lambda k: (self.lo(k), self.hi)) is not None

    def lo(self, k: int) -> np.ndarray:
        if k not in self._lo:
            if self.mem is None:
                self._lo[k] = np.zeros(self.n + 1, dtype=np.int64)
            elif self.mem[0].exact is not None:
                self._lo[k] = _earliest_start(self.mem[0].fits(k, self.n))
            else:
                memory, cap = self.mem
                q = memory.prefix(k)  # memory of [s, e) = q[e] - q[s] <= cap
                self._lo[k] = np.searchsorted(q, q - cap, side="left").astype(np.int64)
        return self._lo[k]


def _earliest_start(fits: np.ndarray) -> np.ndarray:
    """Per end ``e``, the smallest ``s`` from which every start up to ``e - 1`` fits (``e`` when ``[e - 1, e)``
    does not): the window a stage may start in. A start before a gap that does not fit is left out, so a
    segment estimate that is not monotone in its start can only lose splits, never admit one over the cap."""
    n = fits.shape[0] - 1
    lo = np.arange(n + 1, dtype=np.int64)
    for e in range(1, n + 1):
        s = e - 1
        while s >= 0 and fits[s, e]:
            s -= 1
        lo[e] = s + 1
    return lo


def minimise(bound: Bound, hi: float, lo: float = 0.0) -> tuple[float, list[np.ndarray]]:
    """The smallest bound any feasible split reaches (bisection to ``RTOL``), with its reachability sweep.

    ``hi``: a bound some feasible split meets (else PlanningError). ``lo``: a hint below the answer; it is
    tested first and dropped (for 0) if some split meets it, so it only saves bisection steps.

    A sweep that finds a split also says, without sweeping, what later steps would: the split's own bound
    (``met``) is met under every value from it on (the windows' slack, ``RTOL``, is far above the rounding
    between the two ways of computing it), so those steps move ``hi`` as a sweep would. Same steps, same answer
    and sweep; a quarter fewer sweeps on ``plan_speed``'s commands."""
    reach = bound.reach(hi)
    if reach is None:
        raise PlanningError("no split satisfies the constraints")  # callers check feasibility first
    if not 0.0 < lo < hi or bound.reach(lo) is not None:
        lo = 0.0
    swept, met = hi, bound.value(reconstruct(bound, hi, reach, latest=True))
    while hi - lo > RTOL * hi:
        mid = 0.5 * (lo + hi)
        if mid >= met:
            hi = mid
            continue
        r = bound.reach(mid)
        if r is None:
            lo = mid
        else:
            hi, reach, swept = mid, r, mid
            met = bound.value(reconstruct(bound, mid, reach, latest=True))
    # The windows' slack makes values just below every split's own bound feasible, so the last step is one swept
    # (so in 20,000 random bisections); this keeps the sweep under ``hi`` exact at a tie of floats too.
    if swept != hi:
        reach = bound.reach(hi)
    return hi, reach  # type: ignore[return-value]  # some split meets hi


def feasible_bound(bound: Bound, hint: float, fallback: float) -> float:
    """``hint`` when some feasible split meets it (and it is below ``fallback``), else ``fallback``."""
    return hint if hint < fallback and bound.reach(hint) is not None else fallback


def reconstruct(bound: Bound, x: float, reach: list[np.ndarray], latest: bool) -> list[int]:
    """A split whose every stage stays within ``x``: from the end, each stage starts as late (or early) as
    the earlier stages allow."""
    n, pp = bound.problem.n, bound.problem.pp
    bounds, e = [n], n
    for k in range(pp - 1, -1, -1):
        lo, hi = bound.windows(k, x)
        ok = np.flatnonzero(reach[k][max(lo[e], 0) : hi[e] + 1]) + max(lo[e], 0)
        e = int(ok[-1] if latest else ok[0])
        bounds.append(e)
    return bounds[::-1]


def lower_bound(problem: ScheduleProblem, bounds: Sequence[int]) -> float:
    """The path lower bound of one split's step time (see :func:`_terms`); never above ``simulate``'s."""
    return Bound(problem, Validity.build(problem.n, (), None)).value(bounds)


def slowest_stage_optimum(costs: Sequence[float], pp: int) -> float:
    """The smallest slowest-stage cost any contiguous split of ``costs`` into ``pp`` non-empty stages has.

    Same value as ``partition(costs, pp).max_cost`` (to ``1e-9`` relative) in ``O(pp · n log n)``: bisection
    on the value, each test a reachability sweep.
    """
    n = len(costs)
    if not 1 <= pp <= n:
        raise PlanningError(f"pp={pp} stages for {n} blocks; pp must be in 1..{n}")
    zeros = (0.0,) * n
    problem = ScheduleProblem(
        tuple(map(float, costs)), zeros, zeros, zeros, (True,) * (n + 1), pp, max(pp - 1, 1), "1f1b"
    )
    bound = Bound(problem, Validity.build(n, (), None), slowest_stage=True)
    return minimise(bound, float(sum(costs)) + 1.0)[0] if sum(costs) > 0 else 0.0
