"""Discrete-event simulator of Nanotron 0.2's two pipeline engines.

Each stage runs its forwards (``F``) and backwards (``B``) strictly in the order Nanotron's engine issues
them (``nanotron.parallel.pipeline_parallel.engine``):

* ``afab`` (``AllForwardAllBackwardPipelineEngine``): every forward, then every backward.
* ``1f1b`` (``OneForwardOneBackwardPipelineEngine``): ``pp - rank - 1`` warm-up forwards, then one
  forward and one backward per remaining micro-batch, then the left-over backwards.

Backwards pop micro-batches first-in-first-out in both engines, so backward ``j`` always follows backward
``j - 1``. Forward ``j`` on stage ``s`` waits for forward ``j`` on stage ``s - 1`` plus one p2p transfer
(the receiving rank blocks on ``recv``); backward ``j`` on stage ``s`` waits likewise for backward ``j`` on
stage ``s + 1``. Transfers are modelled as starting the moment the producer's op ends and as costing no
compute time on either side.

With ``p2p_time = 0`` this reproduces Nanotron's timing. With ``p2p_time > 0`` it is optimistic for 1F1B:
Nanotron's steady phase defers a rank's gradient send until that rank has received the activation of
its next forward (``PipelineTrainBatchState.run_communication`` runs send-act, recv-act, send-grad,
recv-grad in that order), so a gradient can arrive up to one extra transfer later than modelled here.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Engine = Literal["1f1b", "afab"]
ENGINES: tuple[str, ...] = ("1f1b", "afab")


@dataclass(frozen=True)
class StageTimes:
    """Compute time of one pipeline stage for one micro-batch, in seconds."""

    forward: float
    backward: float


@dataclass
class Op:
    """One forward or backward of one micro-batch on one stage, with its simulated start and end (s)."""

    stage: int
    kind: Literal["F", "B"]
    micro_batch: int
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class SimResult:
    """Outcome of :func:`simulate`; times in seconds, per-stage lists indexed by PP rank.

    ``ops`` is grouped by stage, each stage's ops in execution order.
    """

    engine: str
    n_micro_batches: int
    ops: list[Op]
    step_time: float
    busy: list[float]
    idle: list[float]
    bubble_fraction: float
    peak_in_flight: list[int]
    p2p_time: float = 0.0
    stages: list[StageTimes] = field(default_factory=list)

    @property
    def pp(self) -> int:
        return len(self.busy)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable dict (ops and stages as lists of dicts)."""
        out = asdict(self)
        out["pp"] = self.pp
        return out

    def table(self) -> str:
        """Per-stage busy/idle/in-flight table with aligned columns (times in ms)."""
        header = ("stage", "busy ms", "idle ms", "idle %", "peak in flight")
        rows = [
            (
                str(s),
                f"{self.busy[s] * 1e3:.3f}",
                f"{self.idle[s] * 1e3:.3f}",
                f"{_ratio(self.idle[s], self.step_time):.1%}",
                str(self.peak_in_flight[s]),
            )
            for s in range(self.pp)
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = [
            "  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in [header, *rows]
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def __str__(self) -> str:
        head = (
            f"{self.engine}: pp={self.pp}, micro-batches={self.n_micro_batches}, "
            f"p2p={self.p2p_time * 1e3:.3f} ms, step={self.step_time * 1e3:.3f} ms, "
            f"bubble={self.bubble_fraction:.1%} "
            f"(ideal {ideal_bubble_fraction(self.pp, self.n_micro_batches):.1%})"
        )
        return f"{head}\n{self.table()}"


def ideal_bubble_fraction(pp: int, m: int) -> float:
    """Bubble fraction ``(pp - 1) / (m + pp - 1)`` of ``pp`` equal stages and ``m`` micro-batches.

    Raises:
        ValueError: if ``pp`` or ``m`` is below 1.
    """
    if pp < 1 or m < 1:
        raise ValueError(f"ideal_bubble_fraction needs pp >= 1 and m >= 1, got pp={pp}, m={m}")
    return (pp - 1) / (m + pp - 1)


def engine_order(engine: Engine, pp: int, stage: int, n_micro_batches: int) -> list[tuple[str, int]]:
    """The ``(kind, micro_batch)`` sequence that Nanotron's engine runs on PP rank ``stage``.

    Raises:
        ValueError: for a stage outside ``0..pp-1``, an unknown engine, or under 1F1B with fewer than
            ``pp - 1`` micro-batches.
    """
    m = n_micro_batches
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} is outside 0..{pp - 1}; pass a PP rank of the {pp}-stage pipeline")
    if engine == "afab":
        return [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
    if engine != "1f1b":
        raise ValueError(f"unknown engine {engine!r}; use one of {', '.join(map(repr, ENGINES))}")
    if m < pp - 1:
        # Nanotron asserts nb_microbatches >= pg.size() - 1; m == pp - 1 runs (rank 0 has no steady phase).
        raise ValueError(
            f"1f1b needs at least pp - 1 = {pp - 1} micro-batches, got {m} (Nanotron's engine asserts this); "
            f"raise the number of micro-batches (batch_accumulation_per_replica) or use engine='afab'"
        )
    warmup = pp - stage - 1
    order = [("F", j) for j in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", j) for j in range(m - warmup, m)]
    return order


def simulate(
    stages: Sequence[StageTimes],
    n_micro_batches: int,
    engine: Engine,
    p2p_time: float = 0.0,
) -> SimResult:
    """Simulate one training step (all micro-batches) of a pipeline under Nanotron's engine order.

    Args:
        stages: per-stage forward/backward time of one micro-batch, PP rank 0 first.
        n_micro_batches: micro-batches per step (Nanotron's ``batch_accumulation_per_replica``).
        engine: ``"1f1b"`` or ``"afab"`` (the values of Nanotron's ``pp_engine``).
        p2p_time: seconds to move one activation or gradient between neighbouring stages.

    Returns:
        The schedule, step time, per-stage busy/idle time, bubble fraction and peak in-flight micro-batches.

    Raises:
        ValueError: on empty ``stages``, a negative/NaN/infinite time, ``n_micro_batches < 1``, an unknown
            engine, or 1F1B with fewer than ``pp - 1`` micro-batches (Nanotron rejects it too).
    """
    stages = _validate(stages, n_micro_batches, engine, p2p_time)
    pp, m = len(stages), int(n_micro_batches)
    orders = [engine_order(engine, pp, s, m) for s in range(pp)]

    end: dict[tuple[str, int, int], float] = {}
    per_stage: list[list[Op]] = [[] for _ in range(pp)]
    free_at = [0.0] * pp
    pos = [0] * pp
    while any(pos[s] < len(orders[s]) for s in range(pp)):
        progressed = False
        for s in range(pp):
            while pos[s] < len(orders[s]):
                kind, j = orders[s][pos[s]]
                # Upstream producer of this op's input: previous stage for F, next stage for B.
                src = s - 1 if kind == "F" else s + 1
                ready = 0.0
                if 0 <= src < pp:
                    if (kind, src, j) not in end:
                        break
                    ready = end[(kind, src, j)] + p2p_time
                start = max(free_at[s], ready)
                dur = stages[s].forward if kind == "F" else stages[s].backward
                op = Op(stage=s, kind=kind, micro_batch=j, start=start, end=start + dur)
                per_stage[s].append(op)
                end[(kind, s, j)] = free_at[s] = op.end
                pos[s] += 1
                progressed = True
        if not progressed:  # pragma: no cover - the two engine orders cannot deadlock
            raise RuntimeError(f"schedule deadlocked at positions {pos}; this is a bug in engine_order")

    step_time = max(free_at)
    busy = [math.fsum(op.duration for op in ops) for ops in per_stage]
    idle = [step_time - b for b in busy]
    return SimResult(
        engine=engine,
        n_micro_batches=m,
        ops=[op for ops in per_stage for op in ops],
        step_time=step_time,
        busy=busy,
        idle=idle,
        bubble_fraction=_ratio(math.fsum(idle), pp * step_time),
        peak_in_flight=[_peak_in_flight(ops) for ops in per_stage],
        p2p_time=p2p_time,
        stages=stages,
    )


def _peak_in_flight(ops: list[Op]) -> int:
    # A stage's ops never overlap, so walking them in order sees every change of the count.
    count = peak = 0
    for op in ops:
        count += 1 if op.kind == "F" else -1
        peak = max(peak, count)
    return peak


def _ratio(num: float, den: float) -> float:
    # An all-zero-time pipeline has no bubble rather than 0/0.
    return num / den if den > 0 else 0.0


def _validate(
    stages: Sequence[StageTimes], n_micro_batches: int, engine: str, p2p_time: float
) -> list[StageTimes]:
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; use one of {', '.join(map(repr, ENGINES))}")
    stages = list(stages)
    if not stages:
        raise ValueError("stages is empty; pass one StageTimes(forward, backward) per pipeline stage")
    for s, st in enumerate(stages):
        if not isinstance(st, StageTimes):
            raise ValueError(f"stages[{s}] is {st!r}; pass StageTimes(forward=..., backward=...) objects")
        for name in ("forward", "backward"):
            value = getattr(st, name)
            if not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
                raise ValueError(
                    f"stages[{s}].{name} = {value!r}; times must be finite, non-negative seconds"
                )
    if (
        isinstance(n_micro_batches, bool)
        or not isinstance(n_micro_batches, numbers.Integral)
        or n_micro_batches < 1
    ):
        raise ValueError(f"n_micro_batches = {n_micro_batches!r}; pass an integer >= 1")
    if not isinstance(p2p_time, numbers.Real) or not math.isfinite(p2p_time) or p2p_time < 0:
        raise ValueError(f"p2p_time = {p2p_time!r}; pass finite, non-negative seconds (0 to ignore p2p)")
    return stages
