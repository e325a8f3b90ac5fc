"""Discrete-event simulator of Nanotron's two pipeline engines and of zb1p, sends and receives included.

Each PP rank runs its *program* (:func:`~nanotron_ext.schedule.programs.engine_program`: its forwards, backwards,
sends and receives in exactly the order Nanotron's engine code issues them; see :mod:`nanotron_ext.schedule.programs`).

Backwards pop micro-batches first-in-first-out in both engines. A transfer is a rendezvous, as gloo's
(``gloo/transport/tcp/pair.cc``: data moves only once the receiver has posted its receive) and NCCL's
point-to-point are: it starts when the sender has posted the send *and* the receiver has posted the matching
receive, takes the p2p time of its cut (what crosses that cut, over its link: ``p2p_time``, one figure per cut), and
the receiver waits in its receive until it ends. Sends do not block the
sender, as with the CPU runtime's ``CPUP2P`` (Nanotron's own ``P2P`` on GPU syncs the host after its
metadata send, so there a sender also waits until the receiver has posted that receive: not modelled). All
tensors crossing a cut for one micro-batch (``hidden_states`` and ``sequence_mask``, say) are one transfer, and a
cut with nothing trainable at or before it carries no gradient back (``grad_cuts``).

After the pipeline each stage runs its update (``StageTimes.update``). With ``p2p_time = 0`` and no update,
equal stages reproduce ``(p - 1) / (m + p - 1)`` exactly; ``pipeline_bubble_fraction`` is the bubble of the
pipeline part alone, the one to compare with that ideal.
"""

from __future__ import annotations

import contextlib
import gc
import math
import numbers
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from nanotron_ext.schedule import ZERO_BUBBLE, Engine, ideal_bubble_fraction
from nanotron_ext.schedule.programs import Action, Step, check_engine, engine_order, engine_program, pipeline_programs

__all__ = [
    "Action",
    "Op",
    "Step",
    "SimResult",
    "StageTimes",
    "check_stage_times",
    "engine_order",
    "engine_program",
    "format_p2p",
    "ideal_bubble_fraction",
    "per_cut_p2p",
    "simulate",
    "step_record",
]


@dataclass(frozen=True)
class StageTimes:
    """Times of one pipeline stage, in seconds.

    ``backward`` is the whole backward of a micro-batch (input and weight gradients) under every engine, and
    ``weight`` the part of it that computes weight gradients (``0 <= weight <= backward``). AFAB and 1F1B run
    both parts as one ``B`` op of ``backward``; zb1p runs ``B`` (input gradient, ``backward - weight``) and
    later a ``W`` op of ``weight``. So one ``StageTimes`` prices a stage under all three engines, and
    ``weight = 0`` (no split known) makes zb1p time exactly as 1F1B.

    Attributes:
        forward: forward of one micro-batch.
        backward: backward of one micro-batch, weight gradients included.
        weight: the weight-gradient part of ``backward`` (zb1p's deferred ``W``; 0 on a frozen stage).
        update: once per step, after the pipeline: gradient synchronisation (tied weights, data parallel) and
            the optimizer step. Every stage starts it when the last stage has finished its pipeline work: a
            collective over the pipeline lines the ranks up there (the loss broadcast of
            ``nanotron_ext.runtime.train_step``; in Nanotron's trainer the gradient-norm all-reduce of
            clipping or the tied-weight sync; without either, this is an upper bound).
    """

    forward: float
    backward: float
    update: float = 0.0
    weight: float = 0.0

    def duration(self, action: Action, engine: str) -> float:
        """Seconds of one compute ``action`` (F, B or W) of one micro-batch under ``engine``."""
        if action is Action.FORWARD:
            return self.forward
        if engine not in ZERO_BUBBLE:
            return self.backward
        if action is Action.WEIGHT:
            return self.weight
        return max(0.0, self.backward - self.weight)


@dataclass(slots=True)
class Op:
    """One forward (``F``), backward (``B``) or, under zb1p, deferred weight-gradient pass (``W``) of one
    micro-batch on one stage, or the stage's update (``U``, micro-batch ``-1``), with its simulated start and
    end (s). Under zb1p ``B`` is the input-gradient part of the backward alone."""

    stage: int
    kind: Literal["F", "B", "W", "U"]
    micro_batch: int
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class SimResult:
    """Outcome of :func:`simulate`; times in seconds, per-stage lists indexed by PP rank.

    ``ops`` is grouped by stage, each stage's ops in execution order. ``p2p_times[c]`` is one transfer across the cut
    between stages ``c`` and ``c + 1`` (an activation forward or its gradient back). ``pipeline_time`` is when the last
    of the stages to finish is done with its forwards, backwards and receives; ``step_time`` adds the slowest stage's
    update. ``bubble_fraction`` is Σ idle ÷ (pp × step time); ``pipeline_bubble_fraction`` the same over the
    pipeline part alone (updates left out), comparable with :func:`ideal_bubble_fraction`.
    """

    engine: str
    n_micro_batches: int
    ops: list[Op]
    step_time: float
    busy: list[float]
    idle: list[float]
    bubble_fraction: float
    peak_in_flight: list[int]
    p2p_times: list[float] = field(default_factory=list)
    stages: list[StageTimes] = field(default_factory=list)
    pipeline_time: float = 0.0
    pipeline_bubble_fraction: float = 0.0

    @property
    def pp(self) -> int:
        return len(self.busy)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable dict (ops and stages as lists of dicts; a stage's ``weight`` only under zb1p,
        the one engine that reads it)."""
        out = asdict(self)
        out["pp"] = self.pp
        if self.engine not in ZERO_BUBBLE:
            for stage in out["stages"]:
                stage.pop("weight")
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
        lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in [header, *rows]]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def __str__(self) -> str:
        head = (
            f"{self.engine}: pp={self.pp}, micro-batches={self.n_micro_batches}, "
            f"p2p={format_p2p(self.p2p_times)}, step={self.step_time * 1e3:.3f} ms"
            + (f" (pipeline {self.pipeline_time * 1e3:.3f} ms + update)" if self.step_time > self.pipeline_time else "")
            + f", bubble={self.bubble_fraction:.1%} "
            + (f"(pipeline part {self.pipeline_bubble_fraction:.1%}, " if self.step_time > self.pipeline_time else "(")
            + f"ideal {ideal_bubble_fraction(self.pp, self.n_micro_batches):.1%})"
        )
        return f"{head}\n{self.table()}"


def simulate(
    stages: Sequence[StageTimes],
    n_micro_batches: int,
    engine: Engine,
    p2p_time: float | Sequence[float] = 0.0,
    grad_cuts: Sequence[bool] | None = None,
) -> SimResult:
    """Simulate one training step (all micro-batches) under Nanotron's engine order, sends and receives included.

    Args:
        stages: per-stage forward/backward time of one micro-batch, PP rank 0 first (``weight``: the part of
            ``backward`` zb1p defers as ``W``; ignored by AFAB and 1F1B).
        n_micro_batches: micro-batches per step (Nanotron's ``batch_accumulation_per_replica``).
        engine: ``"1f1b"`` or ``"afab"`` (the values of Nanotron's ``pp_engine``), or ``"zb1p"``.
        p2p_time: seconds one transfer of a micro-batch's activation or gradient takes across each cut once both
            sides are ready (see the module docstring): one figure per cut (``pp - 1``), or one for every cut.
        grad_cuts: per cut (``pp - 1`` of them), whether a gradient crosses it back; False where nothing at or
            before the cut trains (a frozen prefix). Default: every cut.

    Returns:
        The schedule, step time, per-stage busy/idle time, bubble fraction and peak in-flight micro-batches.

    Raises:
        ValueError: on empty ``stages``, a negative/NaN/infinite time, a ``weight`` above its ``backward``,
            ``n_micro_batches < 1``, an unknown engine, or 1F1B or zb1p with fewer than ``pp - 1``
            micro-batches (Nanotron rejects it too).
    """
    stages = _validate(stages, n_micro_batches, engine)
    pp, m = len(stages), int(n_micro_batches)
    p2p = per_cut_p2p(p2p_time, pp)
    cuts = [True] * (pp - 1) if grad_cuts is None else [bool(c) for c in grad_cuts]
    if len(cuts) != pp - 1:
        raise ValueError(f"grad_cuts has {len(cuts)} entries for {pp} stages; pass one per cut (pp - 1)")
    with _no_cycle_collection():
        per_stage, clock = _replay(pipeline_programs(engine, pp, m, tuple(cuts)), stages, p2p, engine)
        return step_record(engine, m, stages, per_stage, max(clock), p2p)


@contextlib.contextmanager
def _no_cycle_collection() -> Iterator[None]:
    """Python's cycle collector paused while a step's ops are made: they form no cycles, and with many objects alive
    (a plan's earlier results) each of the collector's passes walks them all, up to half a large step's time (pp
    128 with 512 micro-batches: 131k ops)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def per_cut_p2p(p2p_time: float | Sequence[float], pp: int) -> list[float]:
    """One transfer time per cut (``pp - 1``), from one figure for every cut or one per cut.

    Raises:
        ValueError: a time is negative, NaN or infinite, or the sequence has another length than ``pp - 1``.
    """
    scalar = isinstance(p2p_time, numbers.Real)
    times = [p2p_time] if scalar else list(p2p_time)  # a scalar is checked even where there is no cut
    for c, t in enumerate(times):
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t < 0:
            where = "" if scalar else f" of cut {c}"
            raise ValueError(f"p2p_time{where} = {t!r}; pass finite, non-negative seconds (0 to ignore p2p)")
    if scalar:
        times = times * (pp - 1)
    if len(times) != pp - 1:
        raise ValueError(
            f"p2p_time has {len(times)} entries for {pp} stages; pass one per cut (pp - 1) or one number for every cut"
        )
    return [float(t) for t in times]


def format_p2p(p2p_times: Sequence[float]) -> str:
    """``p2p_times`` in ms for a header: one figure when every cut is alike, else one per cut."""
    if not p2p_times:
        return "-"
    if len(set(p2p_times)) == 1:
        return f"{p2p_times[0] * 1e3:.3f} ms"
    return "|".join(f"{t * 1e3:.3f}" for t in p2p_times) + " ms per cut"


def step_record(
    engine: Engine,
    m: int,
    stages: list[StageTimes],
    per_stage: list[list[Op]],
    pipeline_time: float,
    p2p_times: list[float],
) -> SimResult:
    """The step's record: the updates after the pipeline, busy and idle time per stage, bubble fractions."""
    pp = len(stages)
    for s in range(pp):
        if stages[s].update > 0:
            per_stage[s].append(Op(s, "U", -1, pipeline_time, pipeline_time + stages[s].update))
    step_time = pipeline_time + max(st.update for st in stages)
    # Each op's duration read once, as ``Op.duration`` computes it (a large step has 131k ops).
    durations = [[op.end - op.start for op in ops] for ops in per_stage]
    busy = [math.fsum(d) for d in durations]
    # max: float sums of a stage that never waits can round a hair above the step; idle is never negative.
    idle = [max(0.0, step_time - b) for b in busy]
    return SimResult(
        engine=engine,
        n_micro_batches=m,
        ops=[op for ops in per_stage for op in ops],
        step_time=step_time,
        busy=busy,
        idle=idle,
        bubble_fraction=_ratio(math.fsum(idle), pp * step_time),
        pipeline_bubble_fraction=_ratio(
            # max, as for idle above.
            math.fsum(
                max(0.0, pipeline_time - math.fsum(d for op, d in zip(ops, took) if op.kind != "U"))
                for ops, took in zip(per_stage, durations)
            ),
            pp * pipeline_time,
        ),
        peak_in_flight=[_peak_in_flight(ops) for ops in per_stage],
        p2p_times=p2p_times,
        stages=stages,
        pipeline_time=pipeline_time,
    )


def _replay(
    programs: Sequence[Sequence[Step]], stages: Sequence[StageTimes], p2p_times: Sequence[float], engine: str = "1f1b"
) -> tuple[list[list[Op]], list[float]]:
    """Run every rank's program: the compute ops of each stage and each rank's clock at its end.

    A send is posted at its sender's clock; a receive completes its cut's ``p2p_times`` entry after both sides are
    there (rendezvous). Ranks advance in turn until each is blocked on a receive whose send is not yet posted.
    """
    pp = len(programs)
    # (micro-batch, sender, gradient?) as one int, (j * pp + sender) * 2 + gradient -> when the send was posted
    posted: dict[int, float] = {}
    per_stage: list[list[Op]] = [[] for _ in range(pp)]
    clock = [0.0] * pp
    pos = [0] * pp
    # What each action is, and each stage's compute times, read once: enum properties and ``duration`` per step
    # were most of a large pipeline's replay (pp 128, 512 micro-batches: 262k steps).
    # (0 compute, 1 send, 2 receive; carries a gradient; the peer a receive hears from; its cut, from this stage)
    info = {
        a.value: (0 if a.is_compute else 1 if a.is_send else 2, a.carries_gradient, a.peer, min(0, a.peer))
        for a in Action
    }
    times = [{a.value: st.duration(a, engine) for a in Action if a.is_compute} for st in stages]
    while any(pos[s] < len(programs[s]) for s in range(pp)):
        progressed = False
        for s in range(pp):
            program, i, now, ops, took = programs[s], pos[s], clock[s], per_stage[s], times[s]
            start, stop = i, len(program)
            while i < stop:
                action, j = program[i]
                value = action._value_  # the enum's own hash is a Python call: look its value up
                what, gradient, peer, cut = info[value]
                if what == 0:  # compute
                    end = now + took[value]
                    ops.append(Op(s, value, j, now, end))
                    now = end
                elif what == 1:  # send
                    posted[(j * pp + s) * 2 + gradient] = now
                else:
                    sent = posted.get((j * pp + s + peer) * 2 + gradient)
                    if sent is None:
                        break  # the sender has not got there yet
                    now = (now if now >= sent else sent) + p2p_times[s + cut]  # max(now, sent); cut min(s, s + peer)
                i += 1
            progressed = progressed or i > start
            pos[s], clock[s] = i, now
        if not progressed:  # pragma: no cover - Nanotron's engine orders cannot deadlock
            raise RuntimeError(f"schedule deadlocked at positions {pos}; this is a bug in engine_program")
    return per_stage, clock


def _peak_in_flight(ops: list[Op]) -> int:
    # A stage's ops never overlap, so walking them in order sees every change of the count.
    count = peak = 0
    for op in ops:
        count += _IN_FLIGHT.get(op.kind, 0)
        peak = max(peak, count)
    return peak


#: How an op changes the micro-batches a stage holds.
_IN_FLIGHT = {"F": 1, "B": -1}


def _ratio(num: float, den: float) -> float:
    # An all-zero-time pipeline has no bubble rather than 0/0.
    return num / den if den > 0 else 0.0


def check_stage_times(stages: Sequence[StageTimes], what: str = "stages") -> list[StageTimes]:
    """``stages`` as a list, each a :class:`StageTimes` of finite, non-negative seconds with ``weight`` within its
    ``backward`` (``what`` names them in the message: ``stages``, a V's ``chunks``).

    Raises:
        ValueError: naming the entry, its value and what to pass.
    """
    stages = list(stages)
    for s, st in enumerate(stages):
        if not isinstance(st, StageTimes):
            raise ValueError(f"{what}[{s}] is {st!r}; pass StageTimes(forward=..., backward=..., update=0.0) objects")
        for name in ("forward", "backward", "update", "weight"):
            value = getattr(st, name)
            if not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{what}[{s}].{name} = {value!r}; times must be finite, non-negative seconds")
        if st.weight > st.backward * (1 + 1e-12):
            raise ValueError(
                f"{what}[{s}].weight = {st.weight!r} exceeds its backward {st.backward!r}; backward is the whole "
                "backward (input and weight gradients) and weight the weight-gradient part of it"
            )
    return stages


def _validate(stages: Sequence[StageTimes], n_micro_batches: int, engine: str) -> list[StageTimes]:
    check_engine(engine)
    stages = list(stages)
    if not stages:
        raise ValueError("stages is empty; pass one StageTimes(forward, backward) per pipeline stage")
    check_stage_times(stages)
    if isinstance(n_micro_batches, bool) or not isinstance(n_micro_batches, numbers.Integral) or n_micro_batches < 1:
        raise ValueError(f"n_micro_batches = {n_micro_batches!r}; pass an integer >= 1")
    return stages
