"""The list scheduler of a V (ZB-V): one rule's order of every op and its times, under the chunks' times, a count
cap and a byte budget (:mod:`nanotron_ext.schedule.zbv` keeps the fastest of :data:`POLICIES`).

The rank that is free first decides next (ties: the lower rank), among its ops whose input has arrived by then
(a transfer between ranks takes its cut's p2p time after the op that makes it; none at the V's bottom): a ``B``
first, in the rule's order of chunks (the stage before waits for it), then an ``F`` if its activations fit, the
way up's first, then its oldest deferred ``W``. When every rank free at that moment has nothing to run, they all
wait until the next moment anything changes (a rank frees, an input arrives). So each op starts as soon as its
rank and its input allow, and the order replays (``replay_v_order``) to these very times.

Ops are kept as plain tuples and each rank's state in lists indexed by rank and chunk: a plan simulates about a
hundred splits under eight rules, a few hundred ops each, so the per-op work is what a V's search costs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from nanotron_ext.schedule.simulator import StageTimes

__all__ = [
    "POLICIES",
    "ListSchedule",
    "Policy",
    "Stalled",
    "VBudget",
    "check_budget",
    "fastest_schedule",
    "list_schedule",
]


class Stalled(RuntimeError):
    """Every rank waits and nothing is under way: the rule's memory reserve was too small for these times."""


class _Beyond(Exception):
    """The schedule's pipeline is sure to end after its ``stop``: what it would be is not needed."""


class Policy(NamedTuple):
    """A list-scheduling rule: which chunk's ready B goes first; how many activations below the cap a rank with a
    deferred W stops starting forwards (runs its W first); and whether the way down (chunk 0) leaves the last slot
    to the way up (a rank full of first-chunk activations can wait forever for backwards that need its own
    second-chunk forwards: with p2p delays the rules without it can stall, and are then passed over)."""

    b_chunks: tuple[int, int] = (0, 1)
    w_reserve: int = 0
    down_reserve: int = 1


#: The rules :func:`~nanotron_ext.schedule.zbv.simulate_zbv` tries: the earlier stage's B first (what reaches the
#: floor when W is half the backward) or the later one's, each with and without stopping forwards one activation
#: early for a deferred W.
POLICIES = tuple(Policy(b, w, down) for down in (1, 0) for w in (0, 1) for b in ((0, 1), (1, 0)))


class VBudget(NamedTuple):
    """The bytes each rank of a V may hold in activations and deferred weight-gradient state, which the list
    scheduler keeps it under (a cap in bytes; the count cap treats unequal chunks alike).

    A micro-batch holds its activations from its ``F`` to the end of its ``B``, its W state from the start of its
    ``B`` to the end of its ``W``: both only while its ``B`` runs, and one ``B`` runs on a rank at a time. So a
    forward reserves the larger of the two (:meth:`need`) until its ``W``, and every rank keeps room for the
    smaller of the two of one micro-batch (:meth:`overlap`) besides. At every op's start a rank then holds no more
    than :func:`~nanotron_ext.costs.v_memory.v_rank_memory` counts then. (Reserving both from the ``F`` held every
    rank to about half the micro-batches its memory takes, where W state is near the activations' size.)

    Attributes:
        activation: per virtual stage, one micro-batch's activations.
        pending: per virtual stage, one deferred ``W``'s state.
        budget: per rank, the most bytes of both at once.
    """

    activation: tuple[float, ...]
    pending: tuple[float, ...]
    budget: tuple[float, ...]

    def need(self, stage: int) -> float:
        """What one micro-batch of ``stage`` reserves from its F to its W: the larger of what it holds before its
        ``B`` and after."""
        return max(self.activation[stage], self.pending[stage])

    def overlap(self, rank: int) -> float:
        """The room rank ``rank`` keeps for the ``B`` that runs, whose micro-batch holds both at once."""
        pp = len(self.budget)
        return max(min(self.activation[s], self.pending[s]) for s in (rank, 2 * pp - 1 - rank))


def check_budget(budget: VBudget, pp: int) -> None:
    """Raises ``ValueError`` where ``budget`` is not one of a V over ``pp`` ranks, or a rank's is under one
    micro-batch of both its chunks (no order fits)."""
    if len(budget.activation) != 2 * pp or len(budget.pending) != 2 * pp or len(budget.budget) != pp:
        raise ValueError(
            f"the budget has {len(budget.activation)} activations, {len(budget.pending)} W states and "
            f"{len(budget.budget)} ranks; a V over pp={pp} needs {2 * pp}, {2 * pp} and {pp}"
        )
    for r in range(pp):
        least = budget.need(r) + budget.need(2 * pp - 1 - r) + budget.overlap(r)
        if budget.budget[r] < least * (1 - 1e-9):
            raise ValueError(
                f"rank {r}'s budget of {budget.budget[r]:.4g} bytes is under one micro-batch of both its "
                f"chunks ({least:.4g}): no order fits; give it more memory, or move blocks off its chunks"
            )


class ListSchedule(NamedTuple):
    """One rule's schedule: ``ops`` as ``(kind, micro-batch, stage, start, end)`` in the order they were scheduled
    (each rank's order is its own ops in this order), and the last op's end."""

    ops: list[tuple[str, int, int, float, float]]
    pipeline: float


def list_schedule(
    chunks: Sequence[StageTimes],
    m: int,
    cuts: Sequence[float],
    cap: int | None,
    policy: Policy = POLICIES[0],
    eager: frozenset[int] = frozenset(),
    budget: VBudget | None = None,
) -> ListSchedule:
    """List scheduling of the V (module docstring) under ``policy``; ``cap``: the most chunk-activations a rank
    holds from ``F`` to ``W`` (``2 pp`` by default; with a ``budget`` and no cap, the budget alone bounds a rank).

    Raises:
        ValueError: a cap below 2.
        Stalled: every rank waits and nothing is under way.
    """
    return _State(chunks, m, cuts, _cap(cap, len(chunks) // 2, m, budget), policy, eager, budget).run()


def fastest_schedule(
    chunks: Sequence[StageTimes],
    m: int,
    cuts: Sequence[float],
    cap: int | None,
    eager: frozenset[int] = frozenset(),
    budget: VBudget | None = None,
    stop: float = math.inf,
) -> ListSchedule | None:
    """The fastest of :data:`POLICIES`' list schedules (the earlier rule of equals), None where every rule stalls
    or ends after ``stop``.

    A rule is scheduled only where no earlier one made its every decision: while two rules agree at every choice
    (the same forwards let in, at most one ``B`` ready when their orders of chunks differ) their schedules are one.
    A rule stops once its pipeline is sure to end after ``stop`` or after the fastest rule's so far: a rank's clock
    is its work done and its idle time, so its end is at least its idle time so far plus all its work.

    Raises:
        ValueError: a cap below 2.
    """
    cap = _cap(cap, len(chunks) // 2, m, budget)
    best: ListSchedule | None = None
    known: dict[Policy, ListSchedule | None] = {}
    for k, policy in enumerate(POLICIES):
        if policy not in known:
            state = _State(chunks, m, cuts, cap, policy, eager, budget, twins=POLICIES[k + 1 :])
            try:
                found: ListSchedule | None = state.run(stop if best is None else min(stop, best.pipeline))
            except (Stalled, _Beyond):
                found = None
            known.update(dict.fromkeys(state.twins, found))
        else:
            found = known[policy]
        if found is not None and (best is None or found.pipeline < best.pipeline):
            best = found
    return best


def _cap(cap: int | None, pp: int, m: int, budget: VBudget | None) -> int:
    """The count cap: as given, else ``2 pp`` (1F1B's first rank), else under a budget one no rank reaches."""
    if cap is None:
        # The count cap is 1F1B's memory only where the chunks are equal; under a budget in bytes the bytes bound a
        # rank, and the count is one no rank reaches (every micro-batch of both chunks, and the way up's reserve).
        cap = 2 * pp if budget is None else 2 * m + 1
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 2:
        raise ValueError(f"cap = {cap!r}; a rank holds both chunks of a micro-batch at once: pass 2 or more")
    return cap


class _State:
    """The list scheduler's state: per stage, when each micro-batch's ``F`` and ``B`` ended (None: not yet); per
    rank, its next micro-batch of each kind and chunk, its deferred ``W``, what it holds and when it is free."""

    def __init__(
        self,
        chunks: Sequence[StageTimes],
        m: int,
        cuts: Sequence[float],
        cap: int,
        policy: Policy,
        eager: frozenset[int],
        budget: VBudget | None,
        twins: Sequence[Policy] = (),
    ) -> None:
        pp = len(chunks) // 2
        last = 2 * pp - 1
        self.pp, self.m, self.cap, self.policy, self.eager, self.budget = pp, m, cap, policy, eager, budget
        self.duration = {
            "F": [st.forward for st in chunks],
            "B": [st.backward - st.weight for st in chunks],
            "W": [st.weight for st in chunks],
        }
        # What an input's transfer adds to its maker's end: its cut's p2p between ranks, nothing at the V's bottom
        # (stages pp - 1 and pp share a rank) or from a stage to itself (the last stage's F to its B).
        self.f_in = [0.0] + [0.0 if s == pp else float(cuts[s - 1]) for s in range(1, last + 1)]
        self.b_in = [0.0 if s in (pp - 1, last) else float(cuts[s]) for s in range(last + 1)]
        self.end_f: list[list[float | None]] = [[None] * m for _ in range(last + 1)]
        self.end_b: list[list[float | None]] = [[None] * m for _ in range(last + 1)]
        self.stage_of = [(r, last - r) for r in range(pp)]  # per rank, its chunks' stages
        self.next_f = [[0, 0] for _ in range(pp)]
        self.next_b = [[0, 0] for _ in range(pp)]
        self.deferred: list[list[tuple[int, int]]] = [[] for _ in range(pp)]  # (stage, micro-batch) of each W
        self.held = [0] * pp
        self.used = [0.0] * pp  # bytes reserved under the budget
        self.free = [0.0] * pp
        self.idle = [0.0] * pp  # each rank's time waiting so far
        self.work = [m * sum(d[s] for d in self.duration.values() for s in self.stage_of[r]) for r in range(pp)]
        self.known: list[list[tuple[tuple[str, int, int], float | None]] | None] = [None] * pp
        self.reserve = (policy.down_reserve, 0)  # per chunk: the slots a forward leaves free
        #: The rules whose every decision so far was this one's: their schedules are this one.
        self.twins = [t for t in twins if t != policy]
        if budget is not None:
            self.need = [budget.need(s) for s in range(last + 1)]
            self.overlap = [budget.overlap(r) for r in range(pp)]
            self.limit = [budget.budget[r] * (1 + 1e-9) for r in range(pp)]
            # The way down keeps room for one of the way up, as the count cap's reserve does: per down_reserve.
            self.need_f = [
                [(self.need[r] + (self.need[last - r] if down else 0.0), self.need[last - r] + 0.0) for r in range(pp)]
                for down in (0, 1)
            ]

    def fits(self, r: int, c: int, down: int) -> bool:
        """Whether rank ``r``'s budget takes a forward of its chunk ``c`` (``down``: the way down's reserve)."""
        if self.budget is None:
            return True
        return self.used[r] + self.need_f[down][r][c] + self.overlap[r] <= self.limit[r]

    def forwards(self, r: int, w_reserve: int, down_reserve: int) -> tuple[bool, bool]:
        """Whether rank ``r`` may start a forward of its chunk 1 and of its chunk 0 under a rule's reserves (the
        way up may take the last slot, the way down not: a rank full of first-chunk activations waits for
        backwards that need its own second-chunk forwards, a deadlock under p2p delays)."""
        room = self.cap - self.held[r] - (w_reserve if self.deferred[r] else 0)
        nf, m = self.next_f[r], self.m
        return (
            nf[1] < m and room > 0 and self.fits(r, 1, down_reserve),
            nf[0] < m and room > down_reserve and self.fits(r, 0, down_reserve),
        )

    def candidates(self, r: int) -> list[tuple[tuple[str, int, int], float | None]]:
        """Rank ``r``'s next ops in the rule's preference, each with its input's arrival: its ``B``s, then the
        ``F``s its room and budget take. What they depend on changes only when an op of this rank or one making
        their input is scheduled (:meth:`start` drops them then): kept until then."""
        known = self.known[r]
        if known is not None:
            return known
        m, stage_of, last = self.m, self.stage_of[r], 2 * self.pp - 1
        end_f, end_b = self.end_f, self.end_b
        known = []
        for c in self.policy.b_chunks:
            j = self.next_b[r][c]
            if j < m:
                s = stage_of[c]
                end = end_f[s][j] if s == last else end_b[s + 1][j]
                known.append((("B", j, s), None if end is None else end + self.b_in[s]))
        policy = self.policy
        allowed = self.forwards(r, policy.w_reserve, policy.down_reserve)
        if self.twins:  # a rule whose room lets in other forwards decides otherwise from here
            self.twins = [t for t in self.twins if self.forwards(r, t.w_reserve, t.down_reserve) == allowed]
        for c in (1, 0):
            if allowed[1 - c]:
                j, s = self.next_f[r][c], stage_of[c]
                end = 0.0 if s == 0 else end_f[s - 1][j]
                known.append((("F", j, s), None if end is None else 0.0 if s == 0 else end + self.f_in[s]))
        self.known[r] = known
        return known

    def next_op(self, r: int, now: float) -> tuple[str, int, int] | None:
        """What rank ``r`` runs at ``now``: its first candidate whose input is there, else its oldest deferred
        ``W``, else nothing."""
        known = self.candidates(r)
        for i, (op, a) in enumerate(known):
            if a is not None and a <= now:
                if self.twins and op[0] == "B" and i + 1 < len(known) and known[i + 1][0][0] == "B":
                    b = known[i + 1][1]
                    if b is not None and b <= now:  # both Bs are ready: the rules that take the other B part
                        self.twins = [t for t in self.twins if t.b_chunks == self.policy.b_chunks]
                return op
        if self.deferred[r]:
            s, j = self.deferred[r].pop(0)
            return ("W", j, s)
        return None

    def next_moment(self, idle: Sequence[int], now: float) -> float | None:
        """The next moment after ``now`` anything changes for the ``idle`` ranks: a rank frees, an input of theirs
        arrives (None: nothing is under way)."""
        later = [f for f in self.free if f > now]
        for q in idle:
            later += [a for _, a in self.candidates(q) if a is not None and a > now]
        return min(later) if later else None

    def run(self, stop: float = math.inf) -> ListSchedule:
        """Schedule every op (module docstring).

        Raises:
            _Beyond: the pipeline is sure to end after ``stop`` (:func:`fastest_schedule`).
        """
        pp, free = self.pp, self.free
        self.beyond(range(pp), stop)
        total = 3 * 2 * pp * self.m
        ops: list[tuple[str, int, int, float, float]] = []
        waiting = [False] * pp  # ranks that found nothing to do at their time, while another may still act then
        pipeline = 0.0
        while len(ops) < total:
            now = min(free)
            for r in range(pp):
                if free[r] == now and not waiting[r]:
                    break
            else:
                # Every rank free now found nothing to do: all of them move to the next moment anything changes.
                # Moving one rank alone could skip an arrival that another, free at the same moment, was about to
                # make.
                idle = [q for q in range(pp) if free[q] == now]
                moment = self.next_moment(idle, now)
                if moment is None:
                    raise Stalled(
                        f"ZB-V list scheduling stalled at t={now} (pp={pp}, m={self.m}, cap={self.cap}, {self.policy})"
                    )
                for q in idle:
                    free[q] = moment
                    self.idle[q] += moment - now
                self.beyond(idle, stop)
                waiting = [False] * pp
                continue
            op = self.next_op(r, now)
            if op is None:
                waiting[r] = True
                continue
            waiting = [False] * pp
            pipeline = max(pipeline, self.start(r, op, now, ops))
        return ListSchedule(ops, pipeline)

    def beyond(self, ranks: Iterable[int], stop: float) -> None:
        """Raises :class:`_Beyond` where one of ``ranks`` is sure to end after ``stop``: its idle time so far and all
        its work (with room for the float sums' rounding, far under 1e-9 of a step)."""
        if stop < math.inf and any((self.idle[q] + self.work[q]) * (1 - 1e-9) > stop for q in ranks):
            raise _Beyond

    def start(
        self, r: int, op: tuple[str, int, int], now: float, ops: list[tuple[str, int, int, float, float]]
    ) -> float:
        """Run ``op`` on rank ``r`` from ``now`` (an eager chunk's ``W`` right after its ``B``): the rank's end.
        Drops the candidates of this rank and of the one whose op takes this op's output."""
        kind, j, s = op
        known, last = self.known, 2 * self.pp - 1
        known[r] = None
        if kind == "F" and s < last:
            known[s + 1 if s + 1 < self.pp else last - s - 1] = None
        elif kind == "B" and s > 0:
            known[s - 1 if s - 1 < self.pp else last - s + 1] = None
        end = now + self.duration[kind][s]
        ops.append((kind, j, s, now, end))
        self.free[r] = end
        c = 0 if s < self.pp else 1
        need = self.need[s] if self.budget is not None else 0.0
        if kind == "W":
            self.held[r] -= 1
            self.used[r] -= need
            return end
        if kind == "F":
            self.next_f[r][c] += 1
            self.end_f[s][j] = end
            self.held[r] += 1
            self.used[r] += need
            return end
        self.next_b[r][c] += 1
        self.end_b[s][j] = end
        if s in self.eager:  # its W runs at once: nothing of it waits in the store
            weight = self.duration["W"][s]
            ops.append(("W", j, s, self.free[r], self.free[r] + weight))
            self.free[r] += weight
            self.held[r] -= 1
            self.used[r] -= need
        else:
            self.deferred[r].append((s, j))
        return self.free[r]
