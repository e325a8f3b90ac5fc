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

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from nanotron_ext.costs.prefix_sums import prefix_sums
from nanotron_ext.partition.schedule_problem import ScheduleProblem
from nanotron_ext.schedule import ZERO_BUBBLE
from nanotron_ext.schedule.programs import Action, Step, pipeline_programs

__all__ = ["ScheduleProblem", "StepTimeEvaluator", "schedule_graph"]  # ScheduleProblem: re-exported from its module

_CHUNK_FLOATS = 2e7  # most entries of one evaluation's time table (160 MB)


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
    programs = pipeline_programs(engine, pp, m, cuts)  # type: ignore[arg-type]
    nodes, last = _nodes(programs)
    return _levelled(nodes, last, pp, n_actions=sum(len(p) for p in programs))


#: Time codes: ``s + pp * kind`` for the forward (0), backward (1) and zb1p weight pass (2) of stage ``s``.
_KIND = {Action.FORWARD: 0, Action.BACKWARD: 1, Action.WEIGHT: 2}


def _codes(pp: int) -> tuple[int, int]:
    """The codes after the compute ones: the first of one p2p transfer per cut (``3 pp + c`` for cut ``c``), and
    nothing (after the last cut's)."""
    return 3 * pp, 4 * pp


class _Nodes(NamedTuple):
    """The graph's nodes in creation order (node 0: the start), as machine integers (``array('q')``): numpy reads
    them without converting 188k Python ints a field (pp 128, 512 micro-batches: 70 ms of a 0.3 s compile)."""

    pred_rank: array[int]
    pred_msg: array[int]
    code: array[int]
    code2: array[int]
    depth: array[int]


#: Per action's value: (0 compute, 1 send, 2 receive; the compute kind of :data:`_KIND`; carries a gradient; the
#: peer a receive hears from), read from :class:`Action` once, so the replay below reads no enum property per step.
_STEP_INFO = {
    a.value: (0 if a.is_compute else 1 if a.is_send else 2, _KIND.get(a, 0), a.carries_gradient, a.peer) for a in Action
}


def _nodes(programs: Sequence[Sequence[Step]]) -> tuple[_Nodes, list[int]]:
    """Replay the programs as ``simulate`` does, making one node per compute (fused into the receive before it
    when nothing else waits on that receive) and one per receive; returns the nodes and each rank's last."""
    pp = len(programs)
    n_actions = sum(len(p) for p in programs)
    p2p, nothing = _codes(pp)
    pred_rank, pred_msg, code, code2, depth = (array("q", [v]) for v in (0, 0, nothing, nothing, 0))
    info = _STEP_INFO
    # (micro-batch, sender, gradient?) as one int, (j * pp + sender) * 2 + gradient -> the node before the send
    posted: dict[int, int] = {}
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
                    posted[(j * pp + s) * 2 + grad] = node
                    fuse = False
                else:  # receive
                    sent = posted.get((j * pp + s + peer) * 2 + grad)
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
    dep, pr, pm, cd, cd2 = (np.frombuffer(a, dtype=np.int64) for a in (depth, pred_rank, pred_msg, code, code2))
    fused, has_msg = cd2 != nothing, (cd >= p2p) & (cd < nothing)
    order = np.lexsort((~has_msg, ~fused, dep))  # by level; in a level: fused, other receives, the rest
    new = np.empty_like(order)
    new[order] = np.arange(len(order))
    pr, pm, cd, cd2, fused, has_msg = (
        new[pr[order]],
        new[pm[order]],
        cd[order],
        cd2[order],
        fused[order],
        has_msg[order],
    )
    starts = np.flatnonzero(np.diff(dep[order])) + 1
    ends = [*starts[1:].tolist(), len(order)]
    fused_before = prefix_sums(fused, np.int64).tolist()  # a level's count: a difference of two
    msg_before = prefix_sums(has_msg, np.int64).tolist()
    levels = []
    for a, b in zip(starts.tolist(), ends):
        nf, nm = fused_before[b] - fused_before[a], msg_before[b] - msg_before[a]
        levels.append(_Level(a, b, nf, nm, pr[a:b], pm[a : a + nm], cd[a:b], cd2[a : a + nf]))
    return _Graph(levels=tuple(levels), last=new[np.asarray(prev)], n_nodes=len(order), n_actions=n_actions)


#: Each recent problem's simulated splits (bounds as bytes → step time): a plan searches one model and schedule
#: under no cap, then under the device's memory, then under the full estimate, and most splits come up again.
_KNOWN: dict[ScheduleProblem, dict[bytes, float]] = {}
_KNOWN_PROBLEMS = 4


def _known_steps(problem: ScheduleProblem) -> dict[bytes, float]:
    """The simulated splits of problems equal to ``problem`` (the last few problems kept)."""
    known = _KNOWN.pop(problem, None)
    if known is None:
        known = {}
        while len(_KNOWN) >= _KNOWN_PROBLEMS:
            _KNOWN.pop(next(iter(_KNOWN)))
    _KNOWN[problem] = known  # the newest last
    return known


def _keys(bounds: np.ndarray) -> list[bytes]:
    """Each row's bytes (``row.tobytes()``), read in one go: the key a simulated split is remembered by."""
    rows = np.ascontiguousarray(bounds, dtype=np.int64)
    return rows.view(np.dtype((np.void, rows.shape[1] * rows.itemsize))).ravel().tolist()


class StepTimeEvaluator:
    """Step time of many splits of one :class:`ScheduleProblem` at once (equal to ``simulate``'s)."""

    def __init__(self, problem: ScheduleProblem) -> None:
        self.problem = problem
        self.evaluated = 0
        self.work = 0.0  # program actions replayed (the graph's n_actions), summed over splits
        # Prefix sums of the blocks' forward, backward and weight part, and the stages that take them: one set for
        # every stage, or one per stage position where the machine prices blocks by position.
        groups: dict[int, tuple[tuple[np.ndarray, ...], list[int]]] = {}
        for k in range(problem.pp):
            times = problem.at(k)
            if id(times[0]) not in groups:
                groups[id(times[0])] = (tuple(prefix_sums(t) for t in times), [])
            groups[id(times[0])][1].append(k)
        self._stage_sums = [(sums, np.asarray(stages)) for sums, stages in groups.values()]
        self._send = np.asarray(problem.send, dtype=np.float64)  # (cuts, n)
        self._grad = np.asarray(problem.grad_after, dtype=bool)
        self._table = np.empty(0)
        self._known = _known_steps(problem)

    def __call__(self, splits: Sequence[Sequence[int]]) -> np.ndarray:
        """Step time of each split (``bounds``: ``pp + 1`` increasing cut positions from 0 to n). A split already
        simulated for an equal problem (the same model and schedule searched again under a memory cap, say) is
        not simulated again, but counts as evaluated, as the work budgets have always counted it."""
        if len(splits) == 0:
            return np.zeros(0)
        bounds = np.asarray(splits, dtype=np.int64).reshape(len(splits), -1)
        known = self._known
        out = np.array([known[key] for key in self._remember(bounds)])
        self.work += sum(self._actions(key) * len(rows) for key, rows in self._by_cuts(bounds))
        self.evaluated += len(bounds)
        return out

    def prefetch(self, splits: Sequence[Sequence[int]]) -> None:
        """Simulate the ``splits`` not simulated yet, together, and remember them, without counting them: a search
        that then scores them a batch at a time (its budgets counting each as before) gets them at the price of
        one large batch, whose replay costs little more than a small one's."""
        if len(splits):
            self._remember(np.asarray(splits, dtype=np.int64).reshape(len(splits), -1))

    def _remember(self, bounds: np.ndarray) -> list[bytes]:
        """Simulate the rows of ``bounds`` not simulated yet and remember their step times; the rows' keys."""
        keys = _keys(bounds)
        todo = [i for i, key in enumerate(keys) if key not in self._known]
        if todo:
            self._known.update(zip((keys[i] for i in todo), self._simulate(bounds[todo]).tolist()))
        return keys

    def _actions(self, cuts: np.ndarray) -> int:
        """Program actions of the schedule graph of these cut flags."""
        problem = self.problem
        return schedule_graph(
            problem.engine, problem.pp, problem.n_micro_batches, tuple(bool(x) for x in cuts)
        ).n_actions

    def _simulate(self, bounds: np.ndarray) -> np.ndarray:
        """Step time of each row of ``bounds``, simulated."""
        pp = self.problem.pp
        out = np.empty(len(bounds))
        for key, rows in self._by_cuts(bounds):
            cuts_key = tuple(bool(x) for x in key)
            graph = schedule_graph(self.problem.engine, pp, self.problem.n_micro_batches, cuts_key)
            chunk = max(1, int(_CHUNK_FLOATS // graph.n_nodes))  # bounds the (nodes × splits) time table
            for i in range(0, len(rows), chunk):
                out[rows[i : i + chunk]] = self._run(bounds[rows[i : i + chunk]], cuts_key)
        return out

    def charge(self, splits: Sequence[Sequence[int]] | np.ndarray) -> None:
        """Count ``splits`` as evaluated without simulating them (the search ruled them out by their lower bound),
        so that every budget read from :attr:`evaluated` and :attr:`work` is spent as if they were."""
        if len(splits) == 0:
            return
        bounds = np.asarray(splits, dtype=np.int64).reshape(len(splits), -1)
        for key, rows in self._by_cuts(bounds):
            graph = schedule_graph(
                self.problem.engine, self.problem.pp, self.problem.n_micro_batches, tuple(bool(x) for x in key)
            )
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
        zero_bubble = p.engine in ZERO_BUBBLE
        for (f, b, w), stages in self._stage_sums:
            end, start = hi[:, stages], lo[:, stages]
            add[stages] = (f[end] - f[start]).T
            add[pp + stages] = (b[end] - b[start]).T
            if zero_bubble:
                add[2 * pp + stages] = (w[end] - w[start]).T
        if zero_bubble:  # B is the backward less its weight-gradient part, W that part (as simulate)
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
