"""The schedule problem: per-block times of one model under one schedule, the one pricing every split is judged by
(made by :func:`nanotron_ext.strategies.step_time.schedule_problem`; its step time of many splits at once:
:class:`~nanotron_ext.partition.step_time_eval.StepTimeEvaluator`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from nanotron_ext.costs.prefix_sums import prefix_sums
from nanotron_ext.errors import PlanningError
from nanotron_ext.machine import POSITIONS, stage_position
from nanotron_ext.schedule import ENGINES, too_few_micro_batches
from nanotron_ext.schedule.simulator import StageTimes

__all__ = ["ScheduleProblem"]


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
        positions: ``(position, forward, backward, weight)`` for each stage position (``first``, ``middle``,
            ``last``: :func:`~nanotron_ext.machine.stage_position`) where the machine prices blocks by the position
            they run at (an in-run profile): a stage of that position takes them instead of ``forward``,
            ``backward`` and ``weight``, which every stage takes otherwise (and the one stage of pp = 1).
        v_chunks: the ``pp`` stages are a V's chunks, run by zbv on ``pp / 2`` ranks, which takes any micro-batch
            count: the 1F1B family's rule on ``n_micro_batches`` (checked otherwise) does not apply.
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
    positions: tuple[tuple[str, tuple[float, ...], tuple[float, ...], tuple[float, ...]], ...] = ()
    v_chunks: bool = False

    def __post_init__(self) -> None:
        n = len(self.forward)
        for position, *times in self.positions:
            if position not in POSITIONS or any(len(t) != n for t in times):
                raise PlanningError(
                    f"ScheduleProblem.positions[{position!r}]: a position is one of "
                    f"{', '.join(POSITIONS)}, with a forward, backward and weight for each of {n} blocks"
                )
            for name, t in zip(("forward", "backward", "weight"), times):
                if any(not math.isfinite(v) or v < 0 for v in t):
                    raise PlanningError(
                        f"ScheduleProblem.positions[{position!r}].{name}: times must be finite and >= 0"
                    )
            if any(w > b * (1 + 1e-12) for w, b in zip(times[2], times[1])):
                raise PlanningError(f"ScheduleProblem.positions[{position!r}]: a weight exceeds its backward")
        if not self.weight:
            object.__setattr__(self, "weight", (0.0,) * n)
        if not self.tied_saving:
            object.__setattr__(self, "tied_saving", (0.0,) * n)
        if self.tied_pair is not None and not 0 <= self.tied_pair[0] < self.tied_pair[1] < n:
            raise PlanningError(
                f"ScheduleProblem.tied_pair = {self.tied_pair!r}; pass (embedding, lm_head) block "
                f"indices, embedding first, both in 0..{n - 1}"
            )
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
                raise PlanningError(
                    f"ScheduleProblem.tied_saving[{i}] = {saved!r} exceeds update[{i}] = {u!r}; a "
                    "stage holding both ends of a tie saves part of its blocks' updates"
                )
        for i, (w, b) in enumerate(zip(self.weight, self.backward)):
            if w > b * (1 + 1e-12):
                raise PlanningError(
                    f"ScheduleProblem.weight[{i}] = {w!r} exceeds backward[{i}] = {b!r}; weight is "
                    "the weight-gradient part of the whole backward"
                )
        if len(self.grad_after) != n + 1:
            raise PlanningError(f"grad_after has {len(self.grad_after)} entries; pass n + 1 = {n + 1}")
        if self.engine not in ENGINES:
            raise PlanningError(f"engine {self.engine!r} is unknown; use one of {', '.join(ENGINES)}")
        if isinstance(self.pp, bool) or not isinstance(self.pp, int) or not 1 <= self.pp <= max(n, 1):
            raise PlanningError(f"pp={self.pp!r} with {n} blocks; pp must be an integer in 1..{n}")
        shortfall = None if self.v_chunks else too_few_micro_batches(self.engine, self.pp, self.n_micro_batches)
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
            raise PlanningError(
                f"ScheduleProblem.send has {len(rows)} rows of {[len(r) for r in rows]} entries; pass "
                f"one row of {n} per cut ({cuts}), or one row for every cut"
            )
        return tuple(tuple(float(v) for v in r) for r in rows)

    @property
    def n(self) -> int:
        return len(self.forward)

    def at(self, stage: int) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
        """``(forward, backward, weight)`` of every block on stage ``stage`` of this pipeline (by its position where
        the machine prices by position)."""
        position = stage_position(stage, self.pp)
        found = next((times for p, *times in self.positions if p == position), None)
        return (self.forward, self.backward, self.weight) if found is None else tuple(found)  # type: ignore[return-value]

    def lowest(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per block, the least forward, backward, backward less its weight part, and weight part of any stage of
        this pipeline: what a lower bound may charge a block wherever it lands."""
        per_stage = [self.at(s) for s in sorted({0, min(1, self.pp - 1), self.pp - 1})]  # first, a middle, last
        f, b, w = (np.min([np.asarray(t[k], dtype=np.float64) for t in per_stage], axis=0) for k in range(3))
        bop = np.min([np.maximum(np.asarray(t[1]) - np.asarray(t[2]), 0.0) for t in per_stage], axis=0)
        return f, b, bop, w

    def cut_times(self, bounds: Sequence[int]) -> list[float]:
        """One transfer across each cut of a split: what the last block before the cut sends, over that cut's link
        (an empty stage passes on what the block before it sent)."""
        return [float(self.send[c][max(e, 1) - 1]) for c, e in enumerate(bounds[1:-1])]

    @cached_property
    def _update_prefix(self) -> np.ndarray:
        return prefix_sums(self.update)

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
        return prefix_sums(np.subtract(self.update, self.tied_saving))

    def stage_times(
        self, bounds: Sequence[int]
    ) -> tuple[list[float], list[float], list[float], list[float], list[bool]]:
        """(forward, backward, update per stage, the p2p time per cut, gradient per cut) of one split."""
        segs = list(zip(bounds[:-1], bounds[1:]))
        lo, hi = np.asarray(bounds[:-1], dtype=np.int64), np.asarray(bounds[1:], dtype=np.int64)
        times = [self.at(k) for k in range(len(segs))]
        return (
            [float(np.sum(t[0][s:e])) for t, (s, e) in zip(times, segs)],
            [float(np.sum(t[1][s:e])) for t, (s, e) in zip(times, segs)],
            [float(x) for x in self.segment_updates(lo, hi)],
            self.cut_times(bounds),
            [bool(self.grad_after[e]) for _, e in segs[:-1]],
        )

    def simulator_inputs(self, bounds: Sequence[int]) -> tuple[list[StageTimes], list[float], list[bool]]:
        """(stage times, the p2p time per cut, gradient per cut) of one split, as :func:`simulate` takes them."""
        f, b, u, p2p, cuts = self.stage_times(bounds)
        weights = [float(np.sum(self.at(k)[2][s:e])) for k, (s, e) in enumerate(zip(bounds[:-1], bounds[1:]))]
        return [StageTimes(*t) for t in zip(f, b, u, weights)], p2p, cuts
