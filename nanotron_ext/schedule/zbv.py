"""The V placement and its zero-bubble schedule (ZB-V), simulated: the planner's first look at issue 43, before an
engine runs it.

In a V, each of the ``pp`` ranks holds two chunks of the model: the ``2 pp`` virtual stages go down the ranks and
back up, stage ``s`` on rank ``s`` for ``s < pp`` and on rank ``2 pp - 1 - s`` after (:func:`v_rank`). So rank 0
holds the first stage and the last (the embedding and the loss), and the two stages at the V's bottom share rank
``pp - 1``: what crosses there stays on the rank. Qi et al. ("Pipeline Parallelism with Controllable Memory",
arXiv 2405.15362) schedule it with each backward split as zb1p's, ``B`` then a deferred ``W``.

:func:`simulate_zbv` schedules it by list scheduling under the chunks' own times, as zero-bubble's V scheduler
builds its order from profiled times: the rank that is free first runs, among its ops whose input has arrived (a
transfer between ranks takes its cut's p2p time after the op that makes it; none at the V's bottom), a ``B`` first
(the stage before waits for it), then an ``F`` if its activations fit (at most ``cap`` chunk-activations held from
``F`` to ``W``; ``2 pp`` by default, what 1F1B's first rank holds: ``pp`` micro-batches of its whole stage, two
chunks each), then its oldest deferred ``W``. Which chunk's ``B`` goes first, and whether a rank with a deferred
``W`` stops forwards an activation early, change the step by a few percent, and no rule is best for every ratio of
``W`` to ``B``: it keeps the fastest of :data:`POLICIES`. :func:`zbv_order` is the schedule's shape (every op one
unit, no transfer time). No send order is modelled: the engine's program, with its sends, comes with the engine.

Measured against the floor ``(pp - 1) F / 2 + m (F + B + W)`` (a V's first activation reaches the last rank after
``pp - 1`` half-stages; ``F``, ``B``, ``W`` a rank's two chunks) and zb1p on equal stages without p2p
(``docs/zero-bubble.md``): on the floor at ``W = B / 2`` (2.6 % over it at most for ``m >= 2 pp``), faster than zb1p
at the same peak; with ``W`` 0.4 or 0.25 of the backward up to 11 % and 23 % over it, and up to 4.6 % and 6.1 %
slower than zb1p in some cases (pp 2-8, ``m`` from ``pp`` to ``4 pp``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from nanotron_ext.schedule.simulator import (
    Op,
    SimResult,
    StageTimes,
    check_stage_times,
    per_cut_p2p,
    step_record,
)

__all__ = [
    "POLICIES",
    "Policy",
    "VBudget",
    "VOp",
    "VResult",
    "by_rank",
    "simulate_zbv",
    "v_rank",
    "v_result",
    "zbv_order",
]

Kind = Literal["F", "B", "W"]


def v_rank(pp: int, stage: int) -> int:
    """The rank of virtual stage ``stage`` (``0 <= stage < 2 pp``) in a V over ``pp`` ranks.

    Raises:
        ValueError: a stage outside ``0..2 pp - 1``.
    """
    if not 0 <= stage < 2 * pp:
        raise ValueError(f"virtual stage {stage} is outside 0..{2 * pp - 1}; a V over pp={pp} ranks has 2 pp stages")
    return stage if stage < pp else 2 * pp - 1 - stage


class VOp(NamedTuple):
    """One op of a V schedule: ``kind`` of micro-batch ``micro_batch`` on virtual stage ``stage``."""

    kind: Kind
    micro_batch: int
    stage: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}@{self.stage}"


class _Stalled(RuntimeError):
    """Every rank waits and nothing is under way: the rule's memory reserve was too small for these times."""


def _check(pp: int, m: int) -> None:
    for name, value in (("pp", pp), ("micro-batches", m)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} = {value!r}; pass an integer >= 1")


def _ready_after(op: VOp, pp: int) -> VOp | None:
    """The op whose end ``op`` waits for (its input), None for a first stage's forward."""
    kind, j, s = op
    if kind == "F":
        return None if s == 0 else VOp("F", j, s - 1)
    if kind == "B":
        return VOp("F", j, s) if s == 2 * pp - 1 else VOp("B", j, s + 1)
    return VOp("B", j, s)


def zbv_order(pp: int, m: int, cap: int | None = None) -> list[list[VOp]]:
    """Each rank's order of ops in the ZB-V schedule of ``m`` micro-batches with every op taking one unit and no
    transfer time (the schedule's shape; :func:`simulate_zbv` schedules under real times).

    Raises:
        ValueError: ``pp`` or ``m`` below 1, or a cap below 2.
    """
    _check(pp, m)
    return _schedule([StageTimes(1.0, 2.0, weight=1.0)] * (2 * pp), m, [0.0] * (2 * pp - 1), cap)[0]


class Policy(NamedTuple):
    """A list-scheduling rule: which chunk's ready B goes first; how many activations below the cap a rank with a
    deferred W stops starting forwards (runs its W first); and whether the way down (chunk 0) leaves the last slot
    to the way up (a rank full of first-chunk activations can wait forever for backwards that need its own
    second-chunk forwards: with p2p delays the rules without it can stall, and are then passed over)."""

    b_chunks: tuple[int, int] = (0, 1)
    w_reserve: int = 0
    down_reserve: int = 1


#: The rules :func:`simulate_zbv` tries: the earlier stage's B first (what reaches the floor when W is half the
#: backward) or the later one's, each with and without stopping forwards one activation early for a deferred W.
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


def _check_budget(budget: VBudget, pp: int) -> None:
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


def _schedule(
    chunks: Sequence[StageTimes],
    m: int,
    cuts: Sequence[float],
    cap: int | None,
    policy: Policy = POLICIES[0],
    eager: frozenset[int] = frozenset(),
    budget: VBudget | None = None,
) -> tuple[list[list[VOp]], dict[VOp, tuple[float, float]]]:
    """List scheduling of the V (see the module docstring): each rank's order, and each op's start and end.

    The rank that is free first decides next (ties: the lower rank), among its ops whose input has arrived by then;
    when every rank free at that moment has none, they all wait until the next moment anything changes (a rank
    frees, an input arrives). So each op starts as soon as its rank and its input allow, and the order replays
    (``replay_v_order``) to these very times.
    """
    pp = len(chunks) // 2
    if cap is None:
        # The count cap is 1F1B's memory only where the chunks are equal; under a budget in bytes the bytes bound a
        # rank, and the count is one no rank reaches (every micro-batch of both chunks, and the way up's reserve).
        cap = 2 * pp if budget is None else 2 * m + 1
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 2:
        raise ValueError(f"cap = {cap!r}; a rank holds both chunks of a micro-batch at once: pass 2 or more")
    stages = 2 * pp
    times: dict[VOp, tuple[float, float]] = {}
    next_op = [[[0, 0], [0, 0]] for _ in range(pp)]  # per rank, kind (F, B), chunk: the next micro-batch
    deferred: list[list[VOp]] = [[] for _ in range(pp)]
    held = [0] * pp
    used = [0.0] * pp  # bytes reserved under the budget
    free = [0.0] * pp

    def fits(r: int, c: int) -> bool:
        """Whether rank ``r``'s budget takes a forward of its chunk ``c`` (the way down keeps room for one of the
        way up, as the count cap's reserve does)."""
        if budget is None:
            return True
        up = stages - 1 - r
        need = budget.need(r if c == 0 else up) + (budget.need(up) if c == 0 and policy.down_reserve else 0.0)
        return used[r] + need + budget.overlap(r) <= budget.budget[r] * (1 + 1e-9)

    order: list[list[VOp]] = [[] for _ in range(pp)]
    total = 3 * stages * m

    def arrival(op: VOp) -> float | None:
        """When ``op``'s input is on its rank: None while the op making it is not scheduled."""
        before = _ready_after(op, pp)
        if before is None:
            return 0.0
        if before not in times:
            return None
        crossing = v_rank(pp, before.stage) != v_rank(pp, op.stage)
        return times[before][1] + (cuts[min(op.stage, before.stage)] if crossing else 0.0)

    known: dict[int, list[tuple[VOp, float | None]]] = {}  # each rank's candidates since the last op scheduled

    def candidates(r: int) -> list[tuple[VOp, float | None]]:
        """Rank ``r``'s next ops in the policy's preference, each with its input's arrival (what they depend on
        changes only when an op is scheduled: kept until then)."""
        if r not in known:
            known[r] = _candidates(r)
        return known[r]

    def _candidates(r: int) -> list[tuple[VOp, float | None]]:
        chunk_of = (r, stages - 1 - r)
        ops = [VOp("B", next_op[r][1][c], chunk_of[c]) for c in policy.b_chunks if next_op[r][1][c] < m]
        room = cap - held[r] - (policy.w_reserve if deferred[r] else 0)
        # The way up (chunk 1) may take the last slot, the way down (chunk 0) not: a rank full of first-chunk
        # activations waits for backwards that need its own second-chunk forwards (a deadlock under p2p delays).
        ops += [
            VOp("F", next_op[r][0][c], chunk_of[c])
            for c in (1, 0)
            if next_op[r][0][c] < m and room > (policy.down_reserve if c == 0 else 0) and fits(r, c)
        ]
        return [(op, arrival(op)) for op in ops]

    waiting: set[int] = set()  # ranks that found nothing to do at their time, while another may still act then
    while len(times) < total:
        r = min(range(pp), key=lambda q: (free[q], q in waiting, q))
        now = free[r]
        if r in waiting:
            # Every rank free now found nothing to do: all of them move to the next moment anything changes (a
            # rank frees, an input of theirs arrives). Moving one rank alone could skip an arrival that another,
            # free at the same moment, was about to make.
            idle = [q for q in range(pp) if free[q] == now]
            later = [f for f in free if f > now] + [
                a for q in idle for _, a in candidates(q) if a is not None and a > now
            ]
            if not later:  # nothing is under way
                raise _Stalled(f"ZB-V list scheduling stalled at t={now} (pp={pp}, m={m}, cap={cap}, {policy})")
            for q in idle:
                free[q] = min(later)
            waiting.clear()
            continue
        op = next((o for o, a in candidates(r) if a is not None and a <= now), None)
        if op is None and deferred[r]:
            op = deferred[r].pop(0)
        if op is None:
            waiting.add(r)
            continue
        waiting.clear()
        known.clear()
        st = chunks[op.stage]
        duration = {"F": st.forward, "B": st.backward - st.weight, "W": st.weight}[op.kind]
        times[op] = (now, now + duration)
        free[r] = now + duration
        order[r].append(op)
        c = 0 if op.stage < pp else 1
        if op.kind == "W":
            held[r] -= 1
            used[r] -= budget.need(op.stage) if budget else 0.0
            continue
        next_op[r][0 if op.kind == "F" else 1][c] += 1
        if op.kind == "F":
            held[r] += 1
            used[r] += budget.need(op.stage) if budget else 0.0
            continue
        if op.stage in eager:  # its W runs at once: nothing of it waits in the store
            w = VOp("W", op.micro_batch, op.stage)
            times[w] = (free[r], free[r] + st.weight)
            free[r] += st.weight
            order[r].append(w)
            held[r] -= 1
            used[r] -= budget.need(op.stage) if budget else 0.0
        else:
            deferred[r].append(VOp("W", op.micro_batch, op.stage))
    return order, times


@dataclass(frozen=True)
class VResult:
    """A simulated ZB-V step. Times in seconds; per-rank lists indexed by rank.

    Attributes:
        pp, n_micro_batches: the pipeline.
        ops: every op with its start and end, ``Op.stage`` the virtual stage.
        step_time: the pipeline and the slowest rank's update after it.
        pipeline_time: the pipeline alone.
        busy: each rank's compute time in the pipeline.
        pipeline_bubble_fraction: idle share of ``pp × pipeline_time``.
        peak_in_flight: per rank, the most chunk-activations held from an ``F`` to its ``B``.
        peak_held: per rank, the most held from an ``F`` to its ``W`` (what the schedule's cap bounds).
        order: each rank's ops in the order it runs them: the program ``pp_engine: zbv`` runs.
    """

    pp: int
    n_micro_batches: int
    ops: tuple[Op, ...]
    step_time: float
    pipeline_time: float
    busy: tuple[float, ...]
    pipeline_bubble_fraction: float
    peak_in_flight: tuple[int, ...]
    peak_held: tuple[int, ...]
    order: tuple[tuple[VOp, ...], ...] = ()

    def __str__(self) -> str:
        return (
            f"zbv: pp={self.pp}, micro-batches={self.n_micro_batches}, step={self.step_time * 1e3:.3f} ms, "
            f"pipeline bubble={self.pipeline_bubble_fraction:.1%}, peak in flight (chunks, F to B) "
            f"{max(self.peak_in_flight)}, held to W {max(self.peak_held)}"
        )


def simulate_zbv(
    chunks: Sequence[StageTimes],
    n_micro_batches: int,
    p2p_time: float | Sequence[float] = 0.0,
    cap: int | None = None,
    eager: Collection[int] = (),
    budget: VBudget | None = None,
) -> VResult:
    """Replay :func:`zbv_order` under real times.

    Args:
        chunks: the ``2 pp`` virtual stages' times, stage 0 first (``weight``: the W part of ``backward``;
            ``update``: a stage's share of its rank's update after the pipeline).
        n_micro_batches: micro-batches per step.
        p2p_time: one transfer between two ranks, per cut between virtual stages (``2 pp - 1`` figures; the cut at
            the V's bottom stays on its rank and costs nothing whatever is given), or one figure for every cut.
        cap: as :func:`zbv_order`'s; with a ``budget`` and no cap, the budget alone bounds a rank.
        eager: virtual stages whose ``W`` runs right after its ``B`` instead of waiting for idle time (a chunk whose
            deferred state is large: the loss chunk's keeps the logits' gradient).
        budget: bytes each rank may hold (:class:`VBudget`), besides a count cap if one is given.

    Raises:
        ValueError: an odd number of chunks, a time or p2p figure that is negative or not finite, ``weight`` above
            ``backward``, a cut count other than ``2 pp - 1``.
    """
    chunks = check_stage_times(chunks, "chunks")
    if not chunks or len(chunks) % 2:
        raise ValueError(f"{len(chunks)} chunks; a V needs two per rank (2 pp), stage 0 first")
    pp = len(chunks) // 2
    cuts = per_cut_p2p(p2p_time, 2 * pp)
    _check(pp, n_micro_batches)
    now = frozenset(eager)
    if not now <= set(range(2 * pp)):
        raise ValueError(f"eager stages {sorted(now)} are not all virtual stages of 0..{2 * pp - 1}")
    if budget is not None:
        _check_budget(budget, pp)
    # The fastest of a few list-scheduling rules: none is best for every ratio of W to B (module docstring); those
    # with a reserve for the way up never stall (checked on random times, p2p and caps in tests/test_zbv.py).
    found = []
    for policy in POLICIES:
        with contextlib.suppress(_Stalled):
            found.append(_schedule(chunks, n_micro_batches, cuts, cap, policy, now, budget))
    if not found:
        raise ValueError(
            f"no ZB-V order of pp={pp}, m={n_micro_batches} fits its cap and budget under any rule; "
            f"give the ranks more memory"
        )
    order, times = min(found, key=lambda found: max(end for _, end in found[1].values()))
    return v_result(chunks, n_micro_batches, times, order)


def v_result(
    chunks: Sequence[StageTimes],
    n_micro_batches: int,
    times: dict[VOp, tuple[float, float]],
    order: Sequence[Sequence[VOp]],
) -> VResult:
    """The :class:`VResult` of a V step whose ops ran at ``times`` (start, end) in ``order`` (one home for what a
    simulated step and a replayed order report)."""
    pp = len(chunks) // 2
    ops = [Op(op.stage, op.kind, op.micro_batch, start, end) for op, (start, end) in times.items()]
    pipeline = max(end for _, end in times.values())
    updates = [chunks[r].update + chunks[2 * pp - 1 - r].update for r in range(pp)]
    busy = tuple(math.fsum(o.duration for o in ops if v_rank(pp, o.stage) == r) for r in range(pp))
    idle = math.fsum(max(0.0, pipeline - b) for b in busy)
    return VResult(
        pp=pp,
        n_micro_batches=n_micro_batches,
        ops=tuple(ops),
        step_time=pipeline + max(updates),
        pipeline_time=pipeline,
        busy=busy,
        pipeline_bubble_fraction=idle / (pp * pipeline) if pipeline > 0 else 0.0,
        peak_in_flight=tuple(_peak(ops, pp, r, "B") for r in range(pp)),
        peak_held=tuple(_peak(ops, pp, r, "W") for r in range(pp)),
        order=tuple(map(tuple, order)),
    )


def by_rank(result: VResult, chunks: Sequence[StageTimes], p2p: Sequence[float] = ()) -> SimResult:
    """The V step with one row per rank, both of its chunks' ops in it and both chunks' update after the
    pipeline: what the timeline draws and the simulator's table prints."""
    pp = result.pp
    per_rank: list[list[Op]] = [[] for _ in range(pp)]
    for op in sorted(result.ops, key=lambda o: (o.start, o.end)):
        rank = v_rank(pp, op.stage)
        per_rank[rank].append(Op(rank, op.kind, op.micro_batch, op.start, op.end))
    ranks = [
        StageTimes(
            *(
                getattr(chunks[r], f) + getattr(chunks[2 * pp - 1 - r], f)
                for f in ("forward", "backward", "update", "weight")
            )
        )
        for r in range(pp)
    ]
    return step_record(
        "zbv",
        result.n_micro_batches,
        ranks,
        per_rank,
        result.pipeline_time,  # type: ignore[arg-type]
        list(p2p),
    )


def _peak(ops: Sequence[Op], pp: int, rank: int, until: str) -> int:
    """The most chunk-activations rank ``rank`` holds at once, each from its ``F`` to its ``until`` op."""
    count = peak = 0
    for o in sorted((o for o in ops if v_rank(pp, o.stage) == rank), key=lambda o: o.start):
        count += 1 if o.kind == "F" else -1 if o.kind == until else 0
        peak = max(peak, count)
    return peak
