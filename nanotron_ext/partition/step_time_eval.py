"""Step time of many splits at once: the planner's evaluator of Nanotron's schedule.

:class:`ScheduleProblem` holds per-block times of one model under one schedule (the one pricing, made by
:func:`nanotron_ext.strategies.step_time.schedule_problem`); :class:`StepTimeEvaluator` gives the step time of
any number of contiguous splits of it, equal to :func:`nanotron_ext.schedule.simulator.simulate`'s. It replays the
per-rank programs (:func:`~nanotron_ext.schedule.simulator.engine_program`) as a max-plus recurrence over a fixed
dependency graph (a send is its sender's previous node, a receive and the compute right after it are one node),
levelled so numpy evaluates a whole level for every candidate at once, additions in ``simulate``'s order (checked
in ``tests/test_schedule_aware.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import NamedTuple

import numpy as np

from nanotron_ext.errors import PlanningError
from nanotron_ext.schedule import ENGINES, ZERO_BUBBLE, too_few_micro_batches
from nanotron_ext.schedule.programs import Action, Step, engine_program
from nanotron_ext.schedule.simulator import StageTimes

__all__ = ["ScheduleProblem", "StepTimeEvaluator", "schedule_graph"]

_CHUNK_FLOATS = 2e7  # most entries of one evaluation's time table (160 MB)


@dataclass(frozen=True)
class ScheduleProblem:
    """Per-block times of one model under one schedule; every time in the same unit (seconds, usually).

    Attributes:
        forward / backward / update: each block's forward and backward per micro-batch, and its share of the
            stage's update after the pipeline (optimizer step, gradient sync). ``backward`` is the whole
            backward (input and weight gradients) under every engine.
        send: ``send[c][i]``: p2p time of the tensors that leave block ``i`` across cut ``c`` (between stages ``c``
            and ``c + 1``, over that cut's link), one row per cut; one row of ``n`` floats (or a flat tuple of
            them) stands for every cut alike.
        grad_after: ``n + 1`` flags; entry ``c``: does a gradient cross a cut placed before block ``c``
            (is any of blocks ``0..c-1`` trainable)?
        pp / n_micro_batches / engine: the schedule.
        weight: each block's weight-gradient part of ``backward`` (``0 <= weight <= backward``): zb1p's
            deferred ``W``; zb1p's ``B`` is the rest. Ignored by AFAB and 1F1B. Empty: all zero (no split).
        tied_pair / tied_saving: a tied model's embedding and lm_head indices, and per block the update a stage
            holding both saves (one tensor: :func:`nanotron_ext.blocks.tied_pair`); None / empty: none.
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    update: tuple[float, ...]
    send: tuple[tuple[float, ...], ...] | tuple[float, ...]
    grad_after: tuple[bool, ...]
    pp: int
    n_micro_batches: int
    engine: str
    weight: tuple[float, ...] = ()
    tied_pair: tuple[int, int] | None = None
    tied_saving: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.forward)
        if not self.weight:
            object.__setattr__(self, "weight", (0.0,) * n)
        if not self.tied_saving:
            object.__setattr__(self, "tied_saving", (0.0,) * n)
        if self.tied_pair is not None and not 0 <= self.tied_pair[0] < self.tied_pair[1] < n:
            raise PlanningError(f"ScheduleProblem.tied_pair = {self.tied_pair!r}; pass (embedding, lm_head) block "
                                f"indices, embedding first, both in 0..{n - 1}")
        object.__setattr__(self, "send", self._send_rows(n))
        for c, row in enumerate(self.send):
            for i, v in enumerate(row):
                if not math.isfinite(v) or v < 0:
                    raise PlanningError(f"ScheduleProblem.send[{c}][{i}] = {v!r}; times must be finite and >= 0")
        for name in ("backward", "update", "weight", "tied_saving"):
            if len(getattr(self, name)) != n:
                raise PlanningError(f"ScheduleProblem.{name} has {len(getattr(self, name))} entries for {n} blocks")
            for i, v in enumerate(getattr(self, name)):
                if not math.isfinite(v) or v < 0:
                    raise PlanningError(f"ScheduleProblem.{name}[{i}] = {v!r}; times must be finite and >= 0")
        for i, v in enumerate(self.forward):
            if not math.isfinite(v) or v < 0:
                raise PlanningError(f"ScheduleProblem.forward[{i}] = {v!r}; times must be finite and >= 0")
        for i, (saved, u) in enumerate(zip(self.tied_saving, self.update)):
            if saved > u * (1 + 1e-12):
                raise PlanningError(f"ScheduleProblem.tied_saving[{i}] = {saved!r} exceeds update[{i}] = {u!r}; a "
                                    "stage holding both ends of a tie saves part of its blocks' updates")
        for i, (w, b) in enumerate(zip(self.weight, self.backward)):
            if w > b * (1 + 1e-12):
                raise PlanningError(f"ScheduleProblem.weight[{i}] = {w!r} exceeds backward[{i}] = {b!r}; weight is "
                                    "the weight-gradient part of the whole backward")
        if len(self.grad_after) != n + 1:
            raise PlanningError(f"grad_after has {len(self.grad_after)} entries; pass n + 1 = {n + 1}")
        if self.engine not in ENGINES:
            raise PlanningError(f"engine {self.engine!r} is unknown; use one of {', '.join(ENGINES)}")
        if isinstance(self.pp, bool) or not isinstance(self.pp, int) or not 1 <= self.pp <= max(n, 1):
            raise PlanningError(f"pp={self.pp!r} with {n} blocks; pp must be an integer in 1..{n}")
        shortfall = too_few_micro_batches(self.engine, self.pp, self.n_micro_batches)
        if shortfall is not None:
            raise PlanningError(shortfall)

    def _send_rows(self, n: int) -> tuple[tuple[float, ...], ...]:
        """``send`` as one row of ``n`` per cut (``pp - 1``, at least one), a flat or single row repeated."""
        rows = self.send
        if len(rows) == 0 or not isinstance(rows[0], Sequence):
            rows = (tuple(rows),)  # type: ignore[arg-type]
        cuts = max(self.pp - 1, 1) if isinstance(self.pp, int) else 1
        if len(rows) == 1:
            rows = rows * cuts
        if len(rows) != cuts or any(len(r) != n for r in rows):
            raise PlanningError(f"ScheduleProblem.send has {len(rows)} rows of {[len(r) for r in rows]} entries; pass "
                                f"one row of {n} per cut ({cuts}), or one row for every cut")
        return tuple(tuple(float(v) for v in r) for r in rows)

    @property
    def n(self) -> int:
        return len(self.forward)

    def cut_times(self, bounds: Sequence[int]) -> list[float]:
        """One transfer across each cut of a split: what the last block before the cut sends, over that cut's link
        (an empty stage passes on what the block before it sent)."""
        return [float(self.send[c][max(e, 1) - 1]) for c, e in enumerate(bounds[1:-1])]

    @cached_property
    def _update_prefix(self) -> np.ndarray:
        return np.concatenate([[0.0], np.cumsum(self.update)])

    def segment_updates(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """The update of stages holding blocks ``[lo, hi)`` (arrays of one shape): their blocks' updates summed,
        less ``tied_saving`` where a stage holds both ends of the tie."""
        u = self._update_prefix  # the evaluator asks for every chunk of splits: summed once
        out = u[hi] - u[lo]
        if self.tied_pair is not None:
            first, last = self.tied_pair
            both = (lo <= first) & (hi > last)
            out = out - np.where(both, self.tied_saving[first] + self.tied_saving[last], 0.0)
        return out

    def update_floor(self) -> np.ndarray:
        """Prefix sums ``U`` with ``U[e] - U[s] <=`` :meth:`segment_updates` of ``[s, e)`` for every segment, and
        non-decreasing: the updates less every tie saving (a lower bound's term)."""
        return np.concatenate([[0.0], np.cumsum(np.subtract(self.update, self.tied_saving))])

    def stage_times(self, bounds: Sequence[int]) -> tuple[list[float], list[float], list[float], list[float],
                                                           list[bool]]:
        """(forward, backward, update per stage, the p2p time per cut, gradient per cut) of one split."""
        f, b = (np.asarray(x, dtype=np.float64) for x in (self.forward, self.backward))
        segs = list(zip(bounds[:-1], bounds[1:]))
        lo, hi = np.asarray(bounds[:-1], dtype=np.int64), np.asarray(bounds[1:], dtype=np.int64)
        return (
            [float(f[s:e].sum()) for s, e in segs],
            [float(b[s:e].sum()) for s, e in segs],
            [float(x) for x in self.segment_updates(lo, hi)],
            self.cut_times(bounds),
            [bool(self.grad_after[e]) for _, e in segs[:-1]],
        )

    def simulator_inputs(self, bounds: Sequence[int]) -> tuple[list[StageTimes], list[float], list[bool]]:
        """(stage times, the p2p time per cut, gradient per cut) of one split, as :func:`simulate` takes them."""
        f, b, u, p2p, cuts = self.stage_times(bounds)
        w = np.asarray(self.weight, dtype=np.float64)
        weights = [float(w[s:e].sum()) for s, e in zip(bounds[:-1], bounds[1:])]
        return [StageTimes(*t) for t in zip(f, b, u, weights)], p2p, cuts




class _Level(NamedTuple):
    """Nodes ``[start, end)`` of one level: the first ``n_fused`` are fused receive+compute nodes, the first
    ``n_msg`` wait on a message; per node its rank predecessor, message predecessor and time codes."""

    start: int
    end: int
    n_fused: int
    n_msg: int
    pred_rank: np.ndarray
    pred_msg: np.ndarray  # [:n_msg]
    code: np.ndarray
    code2: np.ndarray  # [:n_fused]


@dataclass(frozen=True)
class _Graph:
    """One schedule's dependency graph, numbered level by level (node 0: the start, time 0).

    Node ``i`` of level ``[a, b)`` ends at ``max(t[pred_rank], t[pred_msg]) + add[code]``, and the first
    ``n_fused`` nodes of the level then add ``add[code2]`` too: a receive and the forward or backward right
    after it on the same rank (nothing else waits on the receive alone), in ``simulate``'s order of additions.
    Sends are not nodes: a receive waits on the sender's last node before the send (``simulate`` posts a send
    at the sender's clock). Nodes without a message come last in a level (``n_msg`` have one)."""

    levels: tuple[_Level, ...]
    last: np.ndarray  # last node of each rank
    n_nodes: int  # nodes, the start included
    n_actions: int  # actions of the per-rank programs: the unit of the search's work budget


@lru_cache(maxsize=64)
def schedule_graph(engine: str, pp: int, m: int, cuts: tuple[bool, ...]) -> _Graph:
    """Compile the per-rank programs into a graph, in the order ``simulate`` would process them."""
    programs = [
        engine_program(engine, pp, s, m, grad_in=s == 0 or cuts[s - 1], grad_out=s == pp - 1 or cuts[s])  # type: ignore[arg-type]
        for s in range(pp)
    ]
    nodes, last = _nodes(programs)
    return _levelled(nodes, last, pp, n_actions=sum(len(p) for p in programs))


#: Time codes: ``s + pp * kind`` for the forward (0), backward (1) and zb1p weight pass (2) of stage ``s``.
_KIND = {Action.FORWARD: 0, Action.BACKWARD: 1, Action.WEIGHT: 2}


def _codes(pp: int) -> tuple[int, int]:
    """The codes after the compute ones: the first of one p2p transfer per cut (``3 pp + c`` for cut ``c``), and
    nothing (after the last cut's)."""
    return 3 * pp, 4 * pp


class _Nodes(NamedTuple):
    """The graph's nodes in creation order (node 0: the start)."""

    pred_rank: list[int]
    pred_msg: list[int]
    code: list[int]
    code2: list[int]
    depth: list[int]


#: Per action's value: (0 compute, 1 send, 2 receive; the compute kind of :data:`_KIND`; carries a gradient; the
#: peer a receive hears from), read from :class:`Action` once, so the replay below reads no enum property per step.
_STEP_INFO = {a.value: (0 if a.is_compute else 1 if a.is_send else 2, _KIND.get(a, 0), a.carries_gradient, a.peer)
              for a in Action}


def _nodes(programs: list[list[Step]]) -> tuple[_Nodes, list[int]]:
    """Replay the programs as ``simulate`` does, making one node per compute (fused into the receive before it
    when nothing else waits on that receive) and one per receive; returns the nodes and each rank's last."""
    pp = len(programs)
    n_actions = sum(len(p) for p in programs)
    p2p, nothing = _codes(pp)
    pred_rank, pred_msg, code, code2, depth = [0], [0], [nothing], [nothing], [0]
    info = _STEP_INFO
    posted: dict[tuple[bool, int, int], int] = {}  # (gradient?, sender, micro-batch) -> node before the send
    prev = [0] * pp
    fusable = [False] * pp  # prev[s] is a receive that nothing else waits on yet
    pos = [0] * pp
    done = 0
    last = 0  # the newest node
    while done < n_actions:
        progressed = False
        for s in range(pp):
            prog, i, node, fuse = programs[s], pos[s], prev[s], fusable[s]
            start, end = i, len(prog)
            while i < end:
                action, j = prog[i]
                op, kind, grad, peer = info[action._value_]
                if op == 0:  # compute
                    c = s + pp * kind
                    if fuse:
                        code2[node] = c
                        fuse = False
                    else:
                        pred_rank.append(node)
                        pred_msg.append(0)
                        code.append(c)
                        code2.append(nothing)
                        depth.append(depth[node] + 1)
                        last += 1
                        node = last
                elif op == 1:  # send
                    posted[(grad, s, j)] = node
                    fuse = False
                else:  # receive
                    sent = posted.get((grad, s + peer, j))
                    if sent is None:
                        break
                    pred_rank.append(node)
                    pred_msg.append(sent)
                    code.append(p2p + min(s, s + peer))  # the cut the message crosses
                    code2.append(nothing)
                    d, d_sent = depth[node], depth[sent]
                    depth.append((d if d > d_sent else d_sent) + 1)
                    last += 1
                    node = last
                    fuse = True
                i += 1
            if i > start:
                done += i - start
                progressed = True
            pos[s], prev[s], fusable[s] = i, node, fuse
        if not progressed:  # pragma: no cover - engine programs cannot deadlock
            raise RuntimeError(f"schedule deadlocked at {pos}; this is a bug in engine_program")
    return _Nodes(pred_rank, pred_msg, code, code2, depth), prev


def _levelled(nodes: _Nodes, prev: list[int], pp: int, n_actions: int) -> _Graph:
    """Number the nodes level by level (a node's level: its longest path from the start), receives first."""
    p2p, nothing = _codes(pp)
    depth, pred_rank, pred_msg, code, code2 = nodes.depth, nodes.pred_rank, nodes.pred_msg, nodes.code, nodes.code2
    dep, pr, pm = np.asarray(depth), np.asarray(pred_rank), np.asarray(pred_msg)
    cd, cd2 = np.asarray(code), np.asarray(code2)
    fused, has_msg = cd2 != nothing, (cd >= p2p) & (cd < nothing)
    order = np.lexsort((~has_msg, ~fused, dep))  # by level; in a level: fused, other receives, the rest
    new = np.empty_like(order)
    new[order] = np.arange(len(order))
    pr, pm, cd, cd2, fused, has_msg = new[pr[order]], new[pm[order]], cd[order], cd2[order], fused[order], has_msg[order]
    starts = np.flatnonzero(np.diff(dep[order])) + 1
    levels = []
    for a, b in zip(starts, [*starts[1:], len(order)]):
        a, b = int(a), int(b)
        nf, nm = int(fused[a:b].sum()), int(has_msg[a:b].sum())
        levels.append(_Level(a, b, nf, nm, pr[a:b], pm[a : a + nm], cd[a:b], cd2[a : a + nf]))
    return _Graph(levels=tuple(levels), last=new[np.asarray(prev)], n_nodes=len(order), n_actions=n_actions)


class StepTimeEvaluator:
    """Step time of many splits of one :class:`ScheduleProblem` at once (equal to ``simulate``'s)."""

    def __init__(self, problem: ScheduleProblem) -> None:
        self.problem = problem
        self.evaluated = 0
        self.work = 0.0  # program actions replayed (the graph's n_actions), summed over splits
        self._f = np.concatenate([[0.0], np.cumsum(problem.forward)])
        self._b = np.concatenate([[0.0], np.cumsum(problem.backward)])
        self._w = np.concatenate([[0.0], np.cumsum(problem.weight)])
        self._send = np.asarray(problem.send, dtype=np.float64)  # (cuts, n)
        self._grad = np.asarray(problem.grad_after, dtype=bool)
        self._table = np.empty(0)

    def __call__(self, splits: Sequence[Sequence[int]]) -> np.ndarray:
        """Step time of each split (``bounds``: ``pp + 1`` increasing cut positions from 0 to n)."""
        if len(splits) == 0:
            return np.zeros(0)
        bounds = np.asarray(splits, dtype=np.int64).reshape(len(splits), -1)
        pp = self.problem.pp
        out = np.empty(len(bounds))
        for key, rows in self._by_cuts(bounds):
            cuts_key = tuple(bool(x) for x in key)
            graph = schedule_graph(self.problem.engine, pp, self.problem.n_micro_batches, cuts_key)
            chunk = max(1, int(_CHUNK_FLOATS // graph.n_nodes))  # bounds the (nodes × splits) time table
            for i in range(0, len(rows), chunk):
                out[rows[i : i + chunk]] = self._run(bounds[rows[i : i + chunk]], cuts_key)
            self.work += graph.n_actions * len(rows)
        self.evaluated += len(bounds)
        return out

    def charge(self, splits: Sequence[Sequence[int]] | np.ndarray) -> None:
        """Count ``splits`` as evaluated without simulating them (the search ruled them out by their lower bound),
        so that every budget read from :attr:`evaluated` and :attr:`work` is spent as if they were."""
        if len(splits) == 0:
            return
        bounds = np.asarray(splits, dtype=np.int64).reshape(len(splits), -1)
        for key, rows in self._by_cuts(bounds):
            graph = schedule_graph(self.problem.engine, self.problem.pp, self.problem.n_micro_batches,
                                   tuple(bool(x) for x in key))
            self.work += graph.n_actions * len(rows)
        self.evaluated += len(bounds)

    def _by_cuts(self, bounds: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """The splits (rows of ``bounds``) grouped by which cuts carry a gradient (one schedule graph each):
        ``(flags, rows)``, in the flags' order."""
        pp = self.problem.pp
        cuts = self._grad[bounds[:, 1:-1]] if pp > 1 else np.zeros((len(bounds), 0), dtype=bool)
        if cuts.all():  # every cut carries a gradient (nothing frozen up front): one graph, no sort
            return [(cuts[0], np.arange(len(bounds)))]
        keys, inverse = np.unique(cuts, axis=0, return_inverse=True)
        return [(key, np.flatnonzero(inverse.reshape(-1) == g)) for g, key in enumerate(keys)]

    def _run(self, bounds: np.ndarray, cuts: tuple[bool, ...]) -> np.ndarray:
        p = self.problem
        pp, k = p.pp, len(bounds)
        graph = schedule_graph(p.engine, pp, p.n_micro_batches, cuts)
        lo, hi = bounds[:, :-1], bounds[:, 1:]
        add = np.zeros((4 * pp + 1, k))
        add[:pp] = (self._f[hi] - self._f[lo]).T
        add[pp : 2 * pp] = (self._b[hi] - self._b[lo]).T
        if p.engine in ZERO_BUBBLE:  # B is the backward less its weight-gradient part, W that part (as simulate)
            add[2 * pp : 3 * pp] = (self._w[hi] - self._w[lo]).T
            np.maximum(add[pp : 2 * pp] - add[2 * pp : 3 * pp], 0.0, out=add[pp : 2 * pp])
        if pp > 1:  # cut c: what the last block before it sends (as ScheduleProblem.cut_times)
            last = np.maximum(hi[:, :-1], 1) - 1
            add[3 * pp : 4 * pp - 1] = self._send[np.arange(pp - 1)[None, :], last].T
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
        update = p.segment_updates(lo, hi).max(axis=1)
        return t[graph.last].max(axis=0) + update
