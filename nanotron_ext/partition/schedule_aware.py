"""The contiguous split that minimises the *simulated step time* under Nanotron's schedule.

The objective is :func:`nanotron_ext.schedule.simulator.simulate`'s ``step_time`` of the split: the config's
engine (1F1B or AFAB) and micro-batch count, one p2p time per transfer (the largest tensor any stage sends
across its cut, as :func:`nanotron_ext.simulate.simulate_plan` takes it), no gradient across a cut behind a
frozen prefix, and the slowest stage's update after the pipeline. Splits are evaluated many at a time by
:class:`StepTimeEvaluator`, which replays the same per-rank programs (:func:`engine_program`) as a
max-plus recurrence over a fixed dependency graph, levelled so numpy evaluates a whole level for every
candidate at once; it reproduces ``simulate`` (checked in ``tests/test_schedule_aware.py``).

Search (:func:`step_time_partition`), with a proof of how far from the optimum the answer can be:

1. **Lower bound.** Every split's step time is at least ``max_k g_k(s_k, s_{k+1})``: per stage ``k``, the
   paths of the schedule's dependency graph that run through ``k``'s own serial work (see :func:`_terms`),
   plus the largest update. Each term depends on the stage's own segment only, so ``LB* = min over
   feasible splits of max_k g_k`` is a min-max partition problem, solved exactly (bisection on the value;
   each test is a reachability sweep with prefix sums, ``O(pp · n log n)``). ``LB*`` ≤ the true optimum.
2. **Candidates.** Splits that reach ``LB*`` (with several tie-breaks), the FLOP-min-max split and any seeds,
   improved by descent: move one or two cuts at a time, evaluate all neighbours in one batch, keep the best.
3. **Exactness.** Branch and bound over every split whose lower bound is below the best step time found
   (prefix max plus the exact suffix bound prunes the rest), evaluated in batches, within a budget. When it
   finishes, the answer is the exact optimum (``exact=True``); otherwise the result carries the proven bound
   ``step_time ≤ (1 + gap) · optimum`` with ``gap = step_time / LB* − 1``.

Pure numpy, no torch: the planner layer uses it for the ``constrained`` strategy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from nanotron_ext.errors import PlanningError
from nanotron_ext.partition.optimal import MemoryCap, Requirement
from nanotron_ext.schedule import ENGINES, too_few_micro_batches
from nanotron_ext.schedule.simulator import engine_program

__all__ = [
    "ScheduleProblem",
    "StepTimeEvaluator",
    "StepTimeSplit",
    "lower_bound",
    "step_time_partition",
]

_RTOL = 1e-9
_MAX_SIMULATED = 1 << 17  # pp × micro-batches above which splits are not simulated (graph of ~6 · pp · m nodes)
_CHUNK_FLOATS = 2e7  # most entries of one evaluation's time table (160 MB)


@dataclass(frozen=True)
class ScheduleProblem:
    """Per-block times of one model under one schedule; every time in the same unit (seconds, usually).

    Attributes:
        forward / backward / update: each block's forward and backward per micro-batch, and its share of the
            stage's update after the pipeline (optimizer step, gradient sync).
        send: p2p time of the tensors that leave block ``i`` when a cut follows it.
        grad_after: ``n + 1`` flags; entry ``c``: does a gradient cross a cut placed before block ``c``
            (is any of blocks ``0..c-1`` trainable)?
        pp / n_micro_batches / engine: the schedule.
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    update: tuple[float, ...]
    send: tuple[float, ...]
    grad_after: tuple[bool, ...]
    pp: int
    n_micro_batches: int
    engine: str

    def __post_init__(self) -> None:
        n = len(self.forward)
        for name in ("backward", "update", "send"):
            if len(getattr(self, name)) != n:
                raise PlanningError(f"ScheduleProblem.{name} has {len(getattr(self, name))} entries for {n} blocks")
            for i, v in enumerate(getattr(self, name)):
                if not math.isfinite(v) or v < 0:
                    raise PlanningError(f"ScheduleProblem.{name}[{i}] = {v!r}; times must be finite and >= 0")
        for i, v in enumerate(self.forward):
            if not math.isfinite(v) or v < 0:
                raise PlanningError(f"ScheduleProblem.forward[{i}] = {v!r}; times must be finite and >= 0")
        if len(self.grad_after) != n + 1:
            raise PlanningError(f"grad_after has {len(self.grad_after)} entries; pass n + 1 = {n + 1}")
        if self.engine not in ENGINES:
            raise PlanningError(f"engine {self.engine!r} is unknown; use one of {', '.join(ENGINES)}")
        if isinstance(self.pp, bool) or not isinstance(self.pp, int) or not 1 <= self.pp <= max(n, 1):
            raise PlanningError(f"pp={self.pp!r} with {n} blocks; pp must be an integer in 1..{n}")
        shortfall = too_few_micro_batches(self.engine, self.pp, self.n_micro_batches)
        if shortfall is not None:
            raise PlanningError(shortfall)

    @property
    def n(self) -> int:
        return len(self.forward)

    def stage_times(self, bounds: Sequence[int]) -> tuple[list[float], list[float], list[float], float, list[bool]]:
        """(forward, backward, update per stage, the p2p time, gradient per cut) of one split."""
        f, b, u = (np.asarray(x, dtype=np.float64) for x in (self.forward, self.backward, self.update))
        segs = list(zip(bounds[:-1], bounds[1:]))
        p2p = max((self.send[e - 1] for s, e in segs[:-1] if e > s), default=0.0)
        return (
            [float(f[s:e].sum()) for s, e in segs],
            [float(b[s:e].sum()) for s, e in segs],
            [float(u[s:e].sum()) for s, e in segs],
            float(p2p),
            [bool(self.grad_after[e]) for _, e in segs[:-1]],
        )


# --------------------------------------------------------------------------------------------------------
# Evaluator: simulate's recurrence over a fixed, levelled dependency graph.
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Graph:
    """One schedule's dependency graph: node ``i`` ends at ``max(t[pred_rank], t[pred_msg]) + add[code]``."""

    levels: tuple[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], ...]  # (nodes, pred_rank, pred_msg, code)
    last: np.ndarray  # last node of each rank
    n_nodes: int


@lru_cache(maxsize=64)
def _graph(engine: str, pp: int, m: int, cuts: tuple[bool, ...]) -> _Graph:
    """Compile the per-rank programs into a graph, in the order ``simulate`` would process them."""
    programs = [
        engine_program(engine, pp, s, m, grad_in=s == 0 or cuts[s - 1], grad_out=s == pp - 1 or cuts[s])  # type: ignore[arg-type]
        for s in range(pp)
    ]
    zero = sum(len(p) for p in programs)  # the sentinel node: time 0
    pred_rank: list[int] = []
    pred_msg: list[int] = []
    code: list[int] = []  # 0..pp-1: forward of stage; pp..2pp-1: backward; 2pp: p2p; 2pp+1: nothing
    depth: list[int] = []
    posted: dict[tuple[str, int, int], int] = {}
    prev = [zero] * pp
    pos = [0] * pp
    last_depth = [0] * pp
    order_done = 0
    while order_done < zero:
        progressed = False
        for s in range(pp):
            prog = programs[s]
            while pos[s] < len(prog):
                action, j = prog[pos[s]]
                msg, c, d = zero, 2 * pp + 1, last_depth[s]
                if action == "F" or action == "B":
                    c = s if action == "F" else pp + s
                elif action in ("send_act", "send_grad"):
                    posted[(action[5:], s, j)] = len(code)
                else:
                    src = s - 1 if action == "recv_act" else s + 1
                    sent = posted.get((action[5:], src, j))
                    if sent is None:
                        break
                    msg, c, d = sent, 2 * pp, max(d, depth[sent])
                node = len(code)
                pred_rank.append(prev[s])
                pred_msg.append(msg)
                code.append(c)
                depth.append(d + 1)
                last_depth[s] = d + 1
                prev[s] = node
                pos[s] += 1
                order_done += 1
                progressed = True
        if not progressed:  # pragma: no cover - engine programs cannot deadlock
            raise RuntimeError(f"schedule deadlocked at {pos}; this is a bug in engine_program")
    dep = np.asarray(depth)
    pr, pm, cd = np.asarray(pred_rank), np.asarray(pred_msg), np.asarray(code)
    order = np.argsort(dep, kind="stable")
    cuts_at = np.flatnonzero(np.diff(dep[order])) + 1
    levels = tuple(
        (idx, pr[idx], pm[idx], cd[idx]) for idx in np.split(order, cuts_at) if len(idx)
    )
    return _Graph(levels=levels, last=np.asarray(prev), n_nodes=zero)


class StepTimeEvaluator:
    """Step time of many splits of one :class:`ScheduleProblem` at once (equal to ``simulate``'s)."""

    def __init__(self, problem: ScheduleProblem) -> None:
        self.problem = problem
        self.evaluated = 0
        self.work = 0.0  # graph nodes evaluated, summed over splits
        self._f = np.concatenate([[0.0], np.cumsum(problem.forward)])
        self._b = np.concatenate([[0.0], np.cumsum(problem.backward)])
        self._u = np.concatenate([[0.0], np.cumsum(problem.update)])
        self._send = np.concatenate([np.asarray(problem.send, dtype=np.float64), [0.0]])
        self._grad = np.asarray(problem.grad_after, dtype=bool)

    def __call__(self, splits: Sequence[Sequence[int]]) -> np.ndarray:
        """Step time of each split (``bounds``: ``pp + 1`` increasing cut positions from 0 to n)."""
        if len(splits) == 0:
            return np.zeros(0)
        bounds = np.asarray(splits, dtype=np.int64).reshape(len(splits), -1)
        pp = self.problem.pp
        out = np.empty(len(bounds))
        cuts = self._grad[bounds[:, 1:-1]] if pp > 1 else np.zeros((len(bounds), 0), dtype=bool)
        keys, inverse = np.unique(cuts, axis=0, return_inverse=True)
        for g, key in enumerate(keys):
            rows = np.flatnonzero(inverse.reshape(-1) == g)
            cuts_key = tuple(bool(x) for x in key)
            nodes = _graph(self.problem.engine, pp, self.problem.n_micro_batches, cuts_key).n_nodes
            chunk = max(1, int(_CHUNK_FLOATS // (nodes + 1)))  # bounds the (nodes × splits) time table
            for i in range(0, len(rows), chunk):
                out[rows[i : i + chunk]] = self._run(bounds[rows[i : i + chunk]], cuts_key)
            self.work += nodes * len(rows)
        self.evaluated += len(bounds)
        return out

    def _run(self, bounds: np.ndarray, cuts: tuple[bool, ...]) -> np.ndarray:
        p = self.problem
        pp, k = p.pp, len(bounds)
        graph = _graph(p.engine, pp, p.n_micro_batches, cuts)
        lo, hi = bounds[:, :-1], bounds[:, 1:]
        add = np.zeros((2 * pp + 2, k))
        add[:pp] = (self._f[hi] - self._f[lo]).T
        add[pp : 2 * pp] = (self._b[hi] - self._b[lo]).T
        if pp > 1:
            nonempty = hi[:, :-1] > lo[:, :-1]
            add[2 * pp] = np.where(nonempty, self._send[hi[:, :-1] - 1], 0.0).max(axis=1)
        t = np.zeros((graph.n_nodes + 1, k))
        for nodes, pr, pm, cd in graph.levels:
            t[nodes] = np.maximum(t[pr], t[pm]) + add[cd]
        update = (self._u[hi] - self._u[lo]).max(axis=1)
        return t[graph.last].max(axis=0) + update


# --------------------------------------------------------------------------------------------------------
# Lower bound: per-stage critical-path terms, and the exact min-max over splits.
# --------------------------------------------------------------------------------------------------------


def _terms(problem: ScheduleProblem) -> list[list[tuple[float, ...]]]:
    """Lower-bound terms of each stage ``k``: tuples ``(wf, wb, pf, pb, qf, qb, hops)``. For the segment
    ``[s, e)`` a term is ``wf·F(s,e) + wb·B(s,e) + U(s,e) + pf·F(0,s) + pb·B(0,s) + qf·F(e,n) + qb·B(e,n)
    + hops · p2p_min``, where ``F``, ``B``, ``U`` sum forward, backward and update times over blocks.

    Each is the length of a path of the schedule's dependency graph, so no split's step time is below it
    (``U``: the stage's own update comes after the pipeline; a transfer takes at least the smallest p2p
    time any cut can have):

    * fill-drain through ``k`` (both engines): micro-batch 0's forwards on stages ``< k``, stage ``k``'s ``m``
      forwards and ``m`` backwards (serial on one rank), then micro-batch ``m-1``'s backwards below ``k``;
    * 1F1B: micro-batch 0 forwards through every stage and backwards down to ``k + 1``; only then can stage
      ``k`` start its first backward, after which its program still holds ``m`` backwards and
      ``m - min(pp - k, m)`` forwards; then the backwards below ``k``;
    * AFAB: micro-batch 0's forwards below ``k``, ``m`` forwards on ``k``, micro-batch ``m-1``'s forwards above
      ``k``; backward 0 from the last stage down to ``k``, ``m`` backwards on ``k``, backward ``m-1`` below.

    Backward chains need every cut to carry a gradient: with a frozen first block they are left out.
    """
    pp, m = problem.pp, problem.n_micro_batches
    grads = bool(problem.grad_after[1])  # block 0 trains, so every cut carries a gradient
    g = 1.0 if grads else 0.0
    out = []
    for k in range(pp):
        terms = [(m, m, 1.0, g, 0.0, 0.0, k + (k if grads else 0))]
        if problem.engine == "1f1b" and grads:
            terms.append((1 + m - min(pp - k, m), m, 1.0, 1.0, 1.0, 1.0, 2 * (pp - 1)))
        elif problem.engine == "afab":
            terms.append((m, m * g, 1.0, g, 1.0, g, (pp - 1) * (2 if grads else 1)))
        out.append(terms)
    return out


class _Bound:
    """The lower bound ``max_k g_k(s_k, s_{k+1})`` of splits, and reachability sweeps under it."""

    def __init__(self, problem: ScheduleProblem, valid: _Validity, *, slowest_stage: bool = False) -> None:
        self.problem, self.valid = problem, valid
        n = problem.n
        F = np.concatenate([[0.0], np.cumsum(problem.forward)])
        B = np.concatenate([[0.0], np.cumsum(problem.backward)])
        U = np.concatenate([[0.0], np.cumsum(problem.update)])
        p2p_min = float(min(problem.send[: n - 1])) if problem.pp > 1 and n > 1 else 0.0
        self.F, self.B, self.U = F, B, U
        # Per stage, per term: E(e) (non-decreasing), S(s) (non-decreasing), constant; g = E(e) - S(s) + K.
        self.terms: list[list[tuple[np.ndarray, np.ndarray, float]]] = []
        # slowest_stage: the plain min-max of a stage's forward + backward (the FLOP objective).
        stage_terms = [[(1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0)]] * problem.pp if slowest_stage else _terms(problem)
        u_weight = 0.0 if slowest_stage else 1.0
        for per_stage in stage_terms:
            rows = []
            for wf, wb, pf, pb, qf, qb, hops in per_stage:
                e_arr = (wf - qf) * F + (wb - qb) * B + u_weight * U
                s_arr = (wf - pf) * F + (wb - pb) * B + u_weight * U
                const = qf * F[-1] + qb * B[-1] + hops * p2p_min
                rows.append((e_arr, s_arr, const))
            self.terms.append(rows)

    def value(self, bounds: Sequence[int]) -> float:
        """The lower bound of one split."""
        return max(
            float(e_arr[e] - s_arr[s] + const)
            for k, (s, e) in enumerate(zip(bounds[:-1], bounds[1:]))
            for e_arr, s_arr, const in self.terms[k]
        )

    def stage_value(self, k: int, s: np.ndarray | int, e: np.ndarray | int) -> np.ndarray:
        return np.max([e_arr[e] - s_arr[s] + const for e_arr, s_arr, const in self.terms[k]], axis=0)

    def windows(self, k: int, x: float) -> tuple[np.ndarray, np.ndarray]:
        """For every end ``e`` (0..n): the starts ``s`` in ``[lo[e], hi[e]]`` give stage ``k`` a valid segment
        ``[s, e)`` whose bound is at most ``x``."""
        lo = self.valid.lo(k).copy()
        for e_arr, s_arr, const in self.terms[k]:
            # g <= x  <=>  S(s) >= E(e) + const - x; S is non-decreasing. The relative slack keeps the
            # optimum's own split feasible against rounding.
            need = e_arr + const - x - _RTOL * abs(x)
            lo = np.maximum(lo, np.searchsorted(s_arr, need, side="left"))
        return lo, self.valid.hi

    def reach(self, x: float) -> list[np.ndarray] | None:
        """Forward reachability under bound ``x``: ``reach[k][s]`` — blocks ``[0, s)`` split into ``k`` stages.
        None when ``[0, n)`` cannot be split into ``pp`` stages."""
        n, pp = self.problem.n, self.problem.pp
        cur = np.zeros(n + 1, dtype=bool)
        cur[0] = True
        out = [cur]
        for k in range(pp):
            lo, hi = self.windows(k, x)
            cnt = np.concatenate([[0], np.cumsum(cur)])
            ok = (hi >= lo) & (cnt[np.clip(hi + 1, 0, n + 1)] - cnt[np.clip(lo, 0, n + 1)] > 0)
            cur = ok
            out.append(cur)
        return out if out[-1][n] else None


@dataclass
class _Validity:
    """Which segments may form stage ``k``: ``s`` in ``[lo(k)[e], hi[e]]`` (non-empty, every requirement met,
    memory under the cap)."""

    n: int
    hi: np.ndarray
    mem: tuple[np.ndarray, np.ndarray, tuple[int, ...], float] | None = None
    _lo: dict[int, np.ndarray] = field(default_factory=dict)

    @staticmethod
    def build(n: int, requirements: Sequence[Requirement], memory: MemoryCap | None) -> _Validity:
        hi = np.arange(n + 1) - 1  # non-empty: s <= e - 1
        for req in requirements:
            flags = np.asarray(req.flags, dtype=bool)
            idx = np.where(flags, np.arange(n), -1)
            last = np.concatenate([[-1], np.maximum.accumulate(idx)]) if n else np.array([-1])
            hi = np.minimum(hi, last)  # s <= the last flagged block before e
        mem = None
        if memory is not None:
            sp = np.concatenate([[0.0], np.cumsum(memory.static)])
            ap = np.concatenate([[0.0], np.cumsum(memory.activation)])
            mem = (sp, ap, tuple(memory.in_flight), memory.cap * (1 + _RTOL))
        return _Validity(n=n, hi=hi, mem=mem)

    def lo(self, k: int) -> np.ndarray:
        if k not in self._lo:
            if self.mem is None:
                self._lo[k] = np.zeros(self.n + 1, dtype=np.int64)
            else:
                sp, ap, flight, cap = self.mem
                q = sp + flight[k] * ap  # memory of [s, e) = q[e] - q[s] <= cap
                self._lo[k] = np.searchsorted(q, q - cap, side="left").astype(np.int64)
        return self._lo[k]


def _minimise(bound: _Bound, hi: float) -> tuple[float, list[np.ndarray]]:
    """The smallest bound any feasible split reaches (bisection to ``_RTOL``), with its reachability sweep."""
    reach = bound.reach(hi)
    if reach is None:
        raise PlanningError("no split satisfies the constraints")  # callers check feasibility first
    lo = 0.0
    while hi - lo > _RTOL * hi:
        mid = 0.5 * (lo + hi)
        r = bound.reach(mid)
        if r is None:
            lo = mid
        else:
            hi, reach = mid, r
    return hi, reach


def _reconstruct(bound: _Bound, x: float, reach: list[np.ndarray], latest: bool) -> list[int]:
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
        return [k for k in range(len(self.bounds) - 1) for _ in range(self.bounds[k], self.bounds[k + 1])]


def lower_bound(problem: ScheduleProblem, bounds: Sequence[int]) -> float:
    """The path lower bound of one split's step time (see :func:`_terms`); never above ``simulate``'s."""
    return _Bound(problem, _Validity.build(problem.n, (), None)).value(bounds)


def step_time_partition(
    problem: ScheduleProblem,
    *,
    requirements: Sequence[Requirement] = (),
    memory: MemoryCap | None = None,
    seeds: Sequence[Sequence[int]] = (),
    budget: int = 20000,
    work: float = 6e7,
) -> StepTimeSplit:
    """The contiguous split with the smallest simulated step time, under the constraints.

    Args:
        problem: per-block times and the schedule.
        requirements: every stage holds a flagged block of each (as :func:`~nanotron_ext.partition.partition`).
        memory: optional per-stage memory cap.
        seeds: extra splits (``bounds``) to start from; infeasible ones are ignored.
        budget: most splits the exact search may simulate before it settles for the proven bound.
        work: the same limit in graph nodes evaluated (splits × nodes of the schedule's graph, about
            ``6 · pp · m``); whichever is smaller applies. The default keeps a search near a second here.

    Returns:
        The best split found, its step time, the lower bound and whether it is proven optimal. Ties go to
        the smaller lower bound, then the lexicographically smallest bounds (deterministic on every rank).

    Raises:
        PlanningError: no split satisfies the constraints.
    """
    n, pp = problem.n, problem.pp
    valid = _Validity.build(n, requirements, memory)
    bound = _Bound(problem, valid)
    evaluate = StepTimeEvaluator(problem)
    big = (problem.n_micro_batches + pp) * (bound.F[-1] + bound.B[-1]) + bound.U[-1]
    big += 2 * pp * (max(problem.send) if n else 0.0) + 1.0
    if bound.reach(big) is None:
        raise PlanningError("no contiguous split satisfies the constraints")
    lb, reach = _minimise(bound, big)
    flop_bound = _Bound(problem, valid, slowest_stage=True)
    flop_x, flop_reach = _minimise(flop_bound, big)

    if pp * problem.n_micro_batches > _MAX_SIMULATED:
        # Too large to simulate within a planning budget: the bound's own split, unsimulated (step = nan).
        split = tuple(_reconstruct(bound, lb, reach, True))
        return StepTimeSplit(split, math.nan, lb, False, 0)
    candidates = {tuple(_reconstruct(bound, lb, reach, latest)) for latest in (True, False)}
    candidates |= {tuple(_reconstruct(flop_bound, flop_x, flop_reach, latest)) for latest in (True, False)}
    candidates |= {tuple(int(x) for x in s) for s in seeds if _feasible(valid, problem, s)}
    scored = _score(evaluate, bound, sorted(candidates))
    best = min(scored)
    best = _descend(evaluate, bound, valid, best, work)
    if best[0] <= lb * (1 + _RTOL):
        return StepTimeSplit(best[2], best[0], lb, True, evaluate.evaluated)
    nodes = _graph(problem.engine, pp, problem.n_micro_batches, _cuts_of(problem, best[2])).n_nodes
    left = max(0.0, work - evaluate.work)
    best, complete = _branch_and_bound(evaluate, bound, best, min(budget, max(64, int(left / max(nodes, 1)))))
    return StepTimeSplit(best[2], best[0], lb, complete, evaluate.evaluated)


_Scored = tuple[float, float, tuple[int, ...]]  # (step time, lower bound, bounds): min() is the tie-break


def _score(evaluate: StepTimeEvaluator, bound: _Bound, splits: Sequence[tuple[int, ...]]) -> list[_Scored]:
    times = evaluate(splits)
    return [(float(t), bound.value(s), s) for t, s in zip(times, splits)]


def _cuts_of(problem: ScheduleProblem, bounds: Sequence[int]) -> tuple[bool, ...]:
    return tuple(bool(problem.grad_after[e]) for e in bounds[1:-1])


def _feasible(valid: _Validity, problem: ScheduleProblem, bounds: Sequence[int]) -> bool:
    if len(bounds) != problem.pp + 1 or bounds[0] != 0 or bounds[-1] != problem.n:
        return False
    if any(not 0 <= x <= problem.n for x in bounds):
        return False
    return all(valid.lo(k)[e] <= s <= valid.hi[e] for k, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])))


def _descend(evaluate: StepTimeEvaluator, bound: _Bound, valid: _Validity, best: _Scored, work: float) -> _Scored:
    """Move one cut by up to 2 blocks, or two neighbouring cuts together, while the step time drops (and half
    the work budget lasts)."""
    problem = evaluate.problem
    for _ in range(200):
        if evaluate.work > work / 2:
            return best
        cur = list(best[2])
        neighbours = set()
        for k in range(1, problem.pp):
            for d in (-2, -1, 1, 2):
                nb = cur.copy()
                nb[k] += d
                if _feasible(valid, problem, nb):
                    neighbours.add(tuple(nb))
                if k + 1 < problem.pp:
                    nb2 = cur.copy()
                    nb2[k] += d
                    nb2[k + 1] += d
                    if _feasible(valid, problem, nb2):
                        neighbours.add(tuple(nb2))
        if not neighbours:
            return best
        cand = min(_score(evaluate, bound, sorted(neighbours)))
        if cand[0] >= best[0] * (1 - 1e-12):
            return min(best, cand) if cand[0] <= best[0] else best
        best = cand
    return best


def _branch_and_bound(
    evaluate: StepTimeEvaluator, bound: _Bound, best: _Scored, budget: int
) -> tuple[_Scored, bool]:
    """Evaluate every split whose lower bound is below the best step time; False if the budget ran out."""
    problem = evaluate.problem
    n, pp = problem.n, problem.pp
    threshold = best[0]
    # Backward reachability under the threshold: can [s, n) be split into stages k..pp-1?
    windows = [bound.windows(k, threshold) for k in range(pp)]
    coreach = [np.zeros(n + 1, dtype=bool) for _ in range(pp + 1)]
    coreach[pp][n] = True
    for k in range(pp - 1, -1, -1):
        lo, hi = windows[k]
        ends = np.flatnonzero(coreach[k + 1])
        for e in ends:
            if hi[e] >= lo[e]:
                coreach[k][max(lo[e], 0) : hi[e] + 1] = True
    pending: list[tuple[int, ...]] = []
    seen = 0
    stack: list[tuple[int, tuple[int, ...]]] = [(0, (0,))]
    while stack:
        k, prefix = stack.pop()
        s = prefix[-1]
        if k == pp:
            if s == n:
                pending.append(prefix)
                seen += 1
                if len(pending) >= 512:
                    best = min(best, *_score(evaluate, bound, pending))
                    pending = []
                if seen > budget:
                    return best, False
            continue
        # Stage k = [s, e): e with s in its window, the stage's bound below the best, the rest completable.
        ends = np.arange(s + 1, n + 1)
        lo, hi = windows[k]
        ok = (lo[ends] <= s) & (hi[ends] >= s) & coreach[k + 1][ends]
        ends = ends[ok]
        if len(ends):
            ends = ends[bound.stage_value(k, s, ends) < best[0] * (1 - _RTOL)]
        stack.extend((k + 1, (*prefix, int(e))) for e in ends[::-1])
    if pending:
        best = min(best, *_score(evaluate, bound, pending))
    return best, True


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
    bound = _Bound(problem, _Validity.build(n, (), None), slowest_stage=True)
    return _minimise(bound, float(sum(costs)) + 1.0)[0] if sum(costs) > 0 else 0.0
