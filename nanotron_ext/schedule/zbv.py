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
from nanotron_ext.schedule.v_list import (
    POLICIES,
    ListSchedule,
    Policy,
    VBudget,
    check_budget,
    fastest_schedule,
    list_schedule,
)

__all__ = [
    "POLICIES",
    "Policy",
    "VBudget",
    "VOp",
    "VResult",
    "by_rank",
    "simulate_zbv",
    "simulate_zbv_under",
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


def _schedule(
    chunks: Sequence[StageTimes],
    m: int,
    cuts: Sequence[float],
    cap: int | None,
    policy: Policy = POLICIES[0],
    eager: frozenset[int] = frozenset(),
    budget: VBudget | None = None,
) -> tuple[list[list[VOp]], dict[VOp, tuple[float, float]]]:
    """One rule's list schedule (:func:`~nanotron_ext.schedule.v_list.list_schedule`): each rank's order, and each
    op's start and end.

    Raises:
        Stalled: every rank waits and nothing is under way.
    """
    return _order_and_times(list_schedule(chunks, m, cuts, cap, policy, eager, budget), len(chunks) // 2)


def _order_and_times(found: ListSchedule, pp: int) -> tuple[list[list[VOp]], dict[VOp, tuple[float, float]]]:
    """A list schedule as each rank's order of :class:`VOp` and each op's (start, end), in the order scheduled."""
    order: list[list[VOp]] = [[] for _ in range(pp)]
    times: dict[VOp, tuple[float, float]] = {}
    for kind, j, s, start, end in found.ops:
        op = VOp(kind, j, s)  # type: ignore[arg-type]
        times[op] = (start, end)
        order[s if s < pp else 2 * pp - 1 - s].append(op)
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
    found = simulate_zbv_under(chunks, n_micro_batches, p2p_time, cap, eager, budget)
    if found is None:
        raise ValueError(
            f"no ZB-V order of pp={len(chunks) // 2}, m={n_micro_batches} fits its cap and budget under any rule; "
            f"give the ranks more memory"
        )
    return found


def simulate_zbv_under(
    chunks: Sequence[StageTimes],
    n_micro_batches: int,
    p2p_time: float | Sequence[float] = 0.0,
    cap: int | None = None,
    eager: Collection[int] = (),
    budget: VBudget | None = None,
    *,
    under: float = math.inf,
) -> VResult | None:
    """:func:`simulate_zbv`'s step where its step time is under ``under`` (a search's best so far), else None, as
    where no rule keeps to the cap and budget: a schedule sure to end later is not finished.

    Raises:
        ValueError: as :func:`simulate_zbv`'s bad input.
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
        check_budget(budget, pp)
    update = max(chunks[r].update + chunks[2 * pp - 1 - r].update for r in range(pp))
    # A pipeline past this makes a step past ``under`` (the margin covers the subtraction's rounding).
    stop = under - update + 1e-12 * abs(under) if under < math.inf else math.inf
    # The fastest of a few list-scheduling rules: none is best for every ratio of W to B (module docstring); those
    # with a reserve for the way up never stall (checked on random times, p2p and caps in tests/test_zbv.py).
    best = fastest_schedule(chunks, n_micro_batches, cuts, cap, now, budget, stop)
    if best is None or best.pipeline + update >= under:
        return None
    order, times = _order_and_times(best, pp)
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
