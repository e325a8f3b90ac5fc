"""The contiguous split that minimises the *simulated step time* under Nanotron's schedule.

The objective is :func:`nanotron_ext.schedule.simulator.simulate`'s ``step_time`` of the split: the config's
engine (1F1B or AFAB) and micro-batch count, one p2p time per transfer (the largest tensor any stage sends
across its cut, as :func:`nanotron_ext.simulate.simulate_plan` takes it), no gradient across a cut behind a
frozen prefix, and the slowest stage's update after the pipeline. Splits are evaluated many at a time by
:class:`StepTimeEvaluator`, which replays the same per-rank programs (:func:`engine_program`) as a
max-plus recurrence over a fixed dependency graph (a send is its sender's previous node, a receive and the
compute right after it are one node), levelled so numpy evaluates a whole level for every candidate at once;
it reproduces ``simulate``, additions in the same order (checked in ``tests/test_schedule_aware.py``).

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
from nanotron_ext.partition.split import ranks_from_bounds
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
_MAX_SIMULATED = 1 << 17  # pp × micro-batches above which splits are not searched by simulation (~6 · pp · m actions)
_MAX_SIMULATED_ONCE = 1 << 20  # ... and above which not even the chosen split is simulated (3 s at pp·m = 2^19 here)
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
    """One schedule's dependency graph, numbered level by level (node 0: the start, time 0).

    Node ``i`` of level ``[a, b)`` ends at ``max(t[pred_rank], t[pred_msg]) + add[code]``, and the first
    ``n_fused`` nodes of the level then add ``add[code2]`` too: a receive and the forward or backward right
    after it on the same rank (nothing else waits on the receive alone), in ``simulate``'s order of additions.
    Sends are not nodes: a receive waits on the sender's last node before the send (``simulate`` posts a send
    at the sender's clock). Nodes without a message come last in a level (``n_msg`` have one)."""

    levels: tuple[tuple[int, int, int, int, np.ndarray, np.ndarray, np.ndarray, np.ndarray], ...]
    # (a, b, n_fused, n_msg, pred_rank, pred_msg[:n_msg], code, code2[:n_fused])
    last: np.ndarray  # last node of each rank
    n_nodes: int  # nodes, the start included
    n_actions: int  # actions of the per-rank programs: the unit of the search's work budget


@lru_cache(maxsize=64)
def _graph(engine: str, pp: int, m: int, cuts: tuple[bool, ...]) -> _Graph:
    """Compile the per-rank programs into a graph, in the order ``simulate`` would process them."""
    programs = [
        engine_program(engine, pp, s, m, grad_in=s == 0 or cuts[s - 1], grad_out=s == pp - 1 or cuts[s])  # type: ignore[arg-type]
        for s in range(pp)
    ]
    n_actions = sum(len(p) for p in programs)
    p2p, nothing = 2 * pp, 2 * pp + 1  # codes: 0..pp-1 forward of stage; pp..2pp-1 backward; p2p; nothing
    pred_rank, pred_msg, code, code2, depth = [0], [0], [nothing], [nothing], [0]
    # Per action: 0 compute, 1 send, 2 receive; and the message's key part (1 activation, 2 gradient) with the
    # sender's offset from the receiver.
    kinds = {"F": (0, 0, 0), "B": (0, 0, 0), "send_act": (1, 1, 0), "send_grad": (1, 2, 0),
             "recv_act": (2, 1, -1), "recv_grad": (2, 2, 1)}
    posted: dict[tuple[int, int, int], int] = {}
    prev = [0] * pp
    fusable = [False] * pp  # prev[s] is a receive that nothing else waits on yet
    pos = [0] * pp
    done = 0
    while done < n_actions:
        progressed = False
        for s in range(pp):
            prog, i, node, fuse = programs[s], pos[s], prev[s], fusable[s]
            start = i
            while i < len(prog):
                action, j = prog[i]
                kind, msg, offset = kinds[action]
                if kind == 0:
                    c = s if action == "F" else pp + s
                    if fuse:
                        code2[node] = c
                        fuse = False
                    else:
                        pred_rank.append(node)
                        pred_msg.append(0)
                        code.append(c)
                        code2.append(nothing)
                        depth.append(depth[node] + 1)
                        node = len(code) - 1
                elif kind == 1:
                    posted[(msg, s, j)] = node
                    fuse = False
                else:
                    sent = posted.get((msg, s + offset, j))
                    if sent is None:
                        break
                    pred_rank.append(node)
                    pred_msg.append(sent)
                    code.append(p2p)
                    code2.append(nothing)
                    depth.append(max(depth[node], depth[sent]) + 1)
                    node = len(code) - 1
                    fuse = True
                i += 1
            if i > start:
                done += i - start
                progressed = True
            pos[s], prev[s], fusable[s] = i, node, fuse
        if not progressed:  # pragma: no cover - engine programs cannot deadlock
            raise RuntimeError(f"schedule deadlocked at {pos}; this is a bug in engine_program")
    dep, pr, pm = np.asarray(depth), np.asarray(pred_rank), np.asarray(pred_msg)
    cd, cd2 = np.asarray(code), np.asarray(code2)
    fused, has_msg = cd2 != nothing, cd == p2p
    order = np.lexsort((~has_msg, ~fused, dep))  # by level; in a level: fused, other receives, the rest
    new = np.empty_like(order)
    new[order] = np.arange(len(order))
    pr, pm, cd, cd2, fused, has_msg = new[pr[order]], new[pm[order]], cd[order], cd2[order], fused[order], has_msg[order]
    starts = np.flatnonzero(np.diff(dep[order])) + 1
    levels = []
    for a, b in zip(starts, [*starts[1:], len(order)]):
        a, b = int(a), int(b)
        nf, nm = int(fused[a:b].sum()), int(has_msg[a:b].sum())
        levels.append((a, b, nf, nm, pr[a:b], pm[a : a + nm], cd[a:b], cd2[a : a + nf]))
    return _Graph(levels=tuple(levels), last=new[np.asarray(prev)], n_nodes=len(order), n_actions=n_actions)


class StepTimeEvaluator:
    """Step time of many splits of one :class:`ScheduleProblem` at once (equal to ``simulate``'s)."""

    def __init__(self, problem: ScheduleProblem) -> None:
        self.problem = problem
        self.evaluated = 0
        self.work = 0.0  # program actions replayed (the graph's n_actions), summed over splits
        self._f = np.concatenate([[0.0], np.cumsum(problem.forward)])
        self._b = np.concatenate([[0.0], np.cumsum(problem.backward)])
        self._u = np.concatenate([[0.0], np.cumsum(problem.update)])
        self._send = np.concatenate([np.asarray(problem.send, dtype=np.float64), [0.0]])
        self._grad = np.asarray(problem.grad_after, dtype=bool)
        self._table = np.empty(0)

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
            graph = _graph(self.problem.engine, pp, self.problem.n_micro_batches, cuts_key)
            chunk = max(1, int(_CHUNK_FLOATS // graph.n_nodes))  # bounds the (nodes × splits) time table
            for i in range(0, len(rows), chunk):
                out[rows[i : i + chunk]] = self._run(bounds[rows[i : i + chunk]], cuts_key)
            self.work += graph.n_actions * len(rows)
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
        if self._table.size < graph.n_nodes * k:  # one table reused: fresh pages cost as much as the work
            self._table = np.empty(graph.n_nodes * k)
        t = self._table[: graph.n_nodes * k].reshape(graph.n_nodes, k)
        t[0] = 0.0
        for a, b, nf, nm, pr, pm, cd, cd2 in graph.levels:
            out = t[a:b]
            np.take(t, pr, axis=0, out=out, mode="clip")
            if nm:
                np.maximum(out[:nm], t[pm], out=out[:nm])
            out += add[cd]
            if nf:
                out[:nf] += add[cd2]
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
        # The searches windows() runs, each once: stages often share a term (the fill-drain term does whenever
        # p2p is ignored, the FLOP objective always), and then one search per bound serves them all.
        self._search: list[tuple[np.ndarray, np.ndarray]] = []
        self._stage_search: list[list[int]] = []
        seen: dict[bytes, int] = {}
        for rows in self.terms:
            ids = []
            for e_arr, s_arr, const in rows:
                e_const = e_arr + const
                key = e_const.tobytes() + s_arr.tobytes()
                if key not in seen:
                    seen[key] = len(self._search)
                    self._search.append((e_const, s_arr))
                ids.append(seen[key])
            self._stage_search.append(ids)
        self._found: tuple[float, dict[int, np.ndarray]] = (math.nan, {})  # the searches under the last bound
        # The same terms stacked (pp, terms, n + 1) for :meth:`values`; a stage with fewer terms repeats its first.
        width = max(len(rows) for rows in self.terms)
        padded = [rows + rows[:1] * (width - len(rows)) for rows in self.terms]
        self._E = np.array([[e_arr for e_arr, _, _ in rows] for rows in padded])
        self._S = np.array([[s_arr for _, s_arr, _ in rows] for rows in padded])
        self._C = np.array([[const for _, _, const in rows] for rows in padded])

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

    def stage_value(self, k: int, s: np.ndarray | int, e: np.ndarray | int) -> np.ndarray:
        return np.max([e_arr[e] - s_arr[s] + const for e_arr, s_arr, const in self.terms[k]], axis=0)

    def windows(self, k: int, x: float) -> tuple[np.ndarray, np.ndarray]:
        """For every end ``e`` (0..n): the starts ``s`` in ``[lo[e], hi[e]]`` give stage ``k`` a valid segment
        ``[s, e)`` whose bound is at most ``x``."""
        lo = self.valid.lo(k)
        if self._found[0] != x:
            self._found = (x, {})
        found = self._found[1]
        for i in self._stage_search[k]:
            if i not in found:
                # g <= x  <=>  S(s) >= E(e) + const - x; S is non-decreasing. The relative slack keeps the
                # optimum's own split feasible against rounding.
                e_const, s_arr = self._search[i]
                found[i] = np.searchsorted(s_arr, e_const - x - _RTOL * abs(x), side="left")
            lo = np.maximum(lo, found[i])
        return lo, self.valid.hi

    def reach(self, x: float) -> list[np.ndarray] | None:
        """Forward reachability under bound ``x``: ``reach[k][s]`` — blocks ``[0, s)`` split into ``k`` stages.
        None when ``[0, n)`` cannot be split into ``pp`` stages."""
        n, pp = self.problem.n, self.problem.pp
        cur = np.zeros(n + 1, dtype=bool)
        cur[0] = True
        out = [cur]
        cnt = np.zeros(n + 2, dtype=np.int64)  # cnt[i]: reachable starts below i
        hi_next = self.valid.hi + 1  # hi >= -1
        for k in range(pp):
            lo, hi = self.windows(k, x)  # lo in 0..n + 1
            np.cumsum(cur, out=cnt[1:])
            cur = (hi >= lo) & (cnt[hi_next] > cnt[lo])
            if not cur.any():
                return None
            out.append(cur)
        return out if cur[n] else None


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
            mem = (sp, ap, tuple(memory.in_flight), memory.room + memory.cap * _RTOL)
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


def _minimise(bound: _Bound, hi: float, lo: float = 0.0) -> tuple[float, list[np.ndarray]]:
    """The smallest bound any feasible split reaches (bisection to ``_RTOL``), with its reachability sweep.

    ``hi``: a bound some feasible split meets (else PlanningError). ``lo``: a hint below the answer; it is
    tested first and dropped (for 0) if some split meets it, so it only saves bisection steps."""
    reach = bound.reach(hi)
    if reach is None:
        raise PlanningError("no split satisfies the constraints")  # callers check feasibility first
    if not 0.0 < lo < hi or bound.reach(lo) is not None:
        lo = 0.0
    while hi - lo > _RTOL * hi:
        mid = 0.5 * (lo + hi)
        r = bound.reach(mid)
        if r is None:
            lo = mid
        else:
            hi, reach = mid, r
    return hi, reach


def _feasible_bound(bound: _Bound, hint: float, fallback: float) -> float:
    """``hint`` when some feasible split meets it (and it is below ``fallback``), else ``fallback``."""
    return hint if hint < fallback and bound.reach(hint) is not None else fallback


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
        return ranks_from_bounds(self.bounds)


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
        work: the same limit in program actions replayed (splits × actions of the schedule's per-rank
            programs, about ``6 · pp · m``); whichever is smaller applies.

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
    # Brackets that save bisection steps (each is checked): the FLOP min-max lies between the larger of the
    # mean stage and the largest block, and their sum (when the constraints allow it); every stage's
    # fill-drain term is at least m × its forward + backward, and the FLOP split meets its own bound.
    flop_bound = _Bound(problem, valid, slowest_stage=True)
    work_per_block = np.asarray(problem.forward) + np.asarray(problem.backward)
    floor = max((bound.F[-1] + bound.B[-1]) / pp, float(work_per_block.max(initial=0.0)))
    ceiling = (bound.F[-1] + bound.B[-1]) / pp + float(work_per_block.max(initial=0.0))
    flop_x, flop_reach = _minimise(flop_bound, _feasible_bound(flop_bound, ceiling, big), floor)
    flop_splits = {tuple(_reconstruct(flop_bound, flop_x, flop_reach, latest)) for latest in (True, False)}
    ceiling = min(bound.value(s) for s in flop_splits)
    lb, reach = _minimise(bound, _feasible_bound(bound, ceiling, big), problem.n_micro_batches * flop_x)

    if pp * problem.n_micro_batches > _MAX_SIMULATED:
        # Too large to search by simulation: the bound's own split, simulated once (while that stays within a
        # few seconds) so that the answer still carries a proven gap, step ≤ (1 + gap) · optimum.
        split = tuple(_reconstruct(bound, lb, reach, True))
        if pp * problem.n_micro_batches > _MAX_SIMULATED_ONCE:
            return StepTimeSplit(split, math.nan, lb, False, 0)
        step = float(evaluate([split])[0])
        return StepTimeSplit(split, step, lb, step <= lb * (1 + _RTOL), evaluate.evaluated)
    candidates = {tuple(_reconstruct(bound, lb, reach, latest)) for latest in (True, False)}
    candidates |= flop_splits
    candidates |= {tuple(int(x) for x in s) for s in seeds if _feasible(valid, problem, s)}
    scored = _score(evaluate, bound, sorted(candidates))
    best = min(scored)
    best = _descend(evaluate, bound, valid, best, work)
    if best[0] <= lb * (1 + _RTOL):
        return StepTimeSplit(best[2], best[0], lb, True, evaluate.evaluated)
    nodes = _graph(problem.engine, pp, problem.n_micro_batches, _cuts_of(problem, best[2])).n_actions
    left = max(0.0, work - evaluate.work)
    best, complete = _branch_and_bound(evaluate, bound, best, min(budget, max(64, int(left / max(nodes, 1)))))
    return StepTimeSplit(best[2], best[0], lb, complete, evaluate.evaluated)


_Scored = tuple[float, float, tuple[int, ...]]  # (step time, lower bound, bounds): min() is the tie-break


def _score(evaluate: StepTimeEvaluator, bound: _Bound, splits: Sequence[tuple[int, ...]]) -> list[_Scored]:
    times = evaluate(splits)
    values = bound.values(np.asarray(splits, dtype=np.int64).reshape(len(splits), -1))
    return [(float(t), float(v), s) for t, v, s in zip(times, values, splits)]


def _cuts_of(problem: ScheduleProblem, bounds: Sequence[int]) -> tuple[bool, ...]:
    return tuple(bool(problem.grad_after[e]) for e in bounds[1:-1])


def _feasible(valid: _Validity, problem: ScheduleProblem, bounds: Sequence[int]) -> bool:
    if len(bounds) != problem.pp + 1 or bounds[0] != 0 or bounds[-1] != problem.n:
        return False
    return bool(_feasible_rows(valid, np.asarray([bounds], dtype=np.int64))[0])


def _feasible_rows(valid: _Validity, bounds: np.ndarray) -> np.ndarray:
    """Which rows of ``bounds`` (each ``0, ..., n``) are splits every stage of which is valid."""
    inside = ((bounds >= 0) & (bounds <= valid.n)).all(axis=1)
    b = np.clip(bounds, 0, valid.n)
    s, e = b[:, :-1], b[:, 1:]
    lo = np.stack([valid.lo(k) for k in range(s.shape[1])])
    return inside & ((lo[np.arange(s.shape[1]), e] <= s) & (s <= valid.hi[e])).all(axis=1)


def _descend(evaluate: StepTimeEvaluator, bound: _Bound, valid: _Validity, best: _Scored, work: float) -> _Scored:
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
        cand = min(_score(evaluate, bound, [tuple(int(x) for x in row) for row in neighbours]))
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
        ends = ends[hi[ends] >= lo[ends]]
        # Mark every start in [lo[e], hi[e]] of those ends: +1 where a window opens, -1 after it closes.
        opened = np.bincount(lo[ends], minlength=n + 2) - np.bincount(hi[ends] + 1, minlength=n + 2)
        coreach[k] = np.cumsum(opened)[: n + 1] > 0
    pending: list[tuple[int, ...]] = []
    seen = 0
    stack: list[tuple[int, tuple[int, ...], int]] = [(0, (), 0)]  # (stage, cuts before the last, last cut)
    while stack:
        k, head, s = stack.pop()
        prefix = (*head, s)
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
        stack.extend((k + 1, prefix, e) for e in ends[::-1].tolist())
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
