"""Per-stage times of a plan, and one simulated training step of it under Nanotron's engine.

A plan is priced exactly as the planner's step-time objective prices a split: by
:func:`nanotron_ext.strategies.step_time.schedule_problem` (per-block forward, backward, update and send times)
and :meth:`~nanotron_ext.partition.schedule_aware.ScheduleProblem.stage_times` (their sums per stage, one p2p
time for every link: the largest tensor a stage sends across its cut). Times come from one of two sources:

* a **FLOP-rate model** (``flops_per_second``): a block's forward time is its forward FLOPs divided by one
  throughput, its backward time the rest of its training FLOPs (freeze-aware). Real kernels do not all run at
  one rate, so the numbers compare splits of the same model; they do not predict a wall-clock step.
* **measured** block timings (``timings``, from :mod:`nanotron_ext.costs.profiled`): a stage's update is its
  blocks' optimizer steps (gradient sync is not measured). This predicts the step of a run on the machine that
  measured.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.config import PlannerConfig
from nanotron_ext.errors import ConfigError, PlanningError
from nanotron_ext.partition import bounds_from_ranks
from nanotron_ext.plan import Plan
from nanotron_ext.schedule.simulator import SimResult, StageTimes, simulate
from nanotron_ext.strategies.step_time import DEFAULT_TFLOPS, schedule_problem

if TYPE_CHECKING:
    from nanotron_ext.costs.profiled import BlockTiming

__all__ = [
    "DEFAULT_TFLOPS",
    "format_seconds",
    "PlanTimes",
    "plan_stage_times",
    "simulate_plan",
    "stage_labels",
]


class PlanTimes(NamedTuple):
    """A plan priced for the simulator.

    Attributes:
        stages: one :class:`~nanotron_ext.schedule.simulator.StageTimes` per stage, seconds.
        p2p: seconds of one transfer between neighbouring stages.
        grad_cuts: per cut between stages ``k`` and ``k + 1``, whether a gradient crosses it back (is anything on
            stages ``0..k`` trainable?); Nanotron sends none across a cut behind a frozen prefix.
    """

    stages: list[StageTimes]
    p2p: float
    grad_cuts: list[bool]


def plan_stage_times(
    plan: Plan,
    blocks: Sequence[BlockInfo],
    cfg: PlannerConfig,
    *,
    flops_per_second: float | None = None,
    timings: Sequence[BlockTiming] | None = None,
    p2p_bytes_per_second: float | None = None,
) -> PlanTimes:
    """Per-stage forward/backward/update time of one micro-batch, the p2p time of one transfer, and which cuts
    carry a gradient back.

    Args:
        plan: a plan made from ``blocks`` (:func:`nanotron_ext.plan.make_plan`).
        blocks: the inventory, in forward order.
        cfg: the config (the schedule, and the shapes that size what a block sends).
        flops_per_second: the FLOP-rate model's throughput; or
        timings: measured per-block timings; exactly one of the two.
        p2p_bytes_per_second: link bandwidth between neighbouring stages, bytes/s; ``None`` ignores p2p.

    Returns:
        The :class:`PlanTimes`.

    Raises:
        ConfigError: a throughput or bandwidth that is not a positive finite number; both or neither of
            ``flops_per_second`` and ``timings``.
        PlanningError: ``blocks`` or ``timings`` do not match the plan's blocks.

    Example:
        Blocks with forward FLOPs 1, 3 | 2, 1 (×10¹²) on 2 stages at 1 TFLOP/s: forwards take 4 s and 3 s.
    """
    if (flops_per_second is None) == (timings is None):
        raise ConfigError("pricing a plan needs exactly one of flops_per_second= (FLOP-rate model) and timings=")
    if flops_per_second is not None:
        _check_rate("flops_per_second", flops_per_second)
    if p2p_bytes_per_second is not None:
        _check_rate("p2p_bytes_per_second", p2p_bytes_per_second)
    _check_blocks(plan, blocks)
    if timings is not None and len(timings) != len(blocks):
        raise PlanningError(f"{len(timings)} block timings for {len(blocks)} blocks; pass one per block")
    run = dataclasses.replace(cfg.run, pp=plan.pp)
    try:
        problem = schedule_problem(blocks, dataclasses.replace(cfg, run=run), timings=timings,
                                   flops_per_second=flops_per_second, p2p_bytes_per_second=p2p_bytes_per_second)
    except PlanningError as exc:  # the schedule itself cannot run (1F1B with too few micro-batches)
        raise ConfigError(str(exc)) from exc
    fwd, bwd, upd, p2p, cuts = problem.stage_times(bounds_from_ranks(plan.block_ranks, plan.pp))
    return PlanTimes([StageTimes(f, b, u) for f, b, u in zip(fwd, bwd, upd)], p2p, cuts)


def _check_blocks(plan: Plan, blocks: Sequence[BlockInfo]) -> None:
    if len(blocks) != len(plan.block_ranks) or tuple(b.name for b in blocks) != tuple(plan.block_names):
        raise PlanningError(
            f"the plan covers {len(plan.block_ranks)} blocks but {len(blocks)} were given (or their names "
            f"differ); pass the inventory the plan was made from"
        )


def _check_rate(name: str, value: float) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(f"{name}={value!r} must be a positive, finite number")


def simulate_plan(
    plan: Plan,
    blocks: Sequence[BlockInfo],
    cfg: PlannerConfig,
    *,
    flops_per_second: float | None = None,
    timings: Sequence[BlockTiming] | None = None,
    p2p_bytes_per_second: float | None = None,
    engine: str | None = None,
) -> SimResult:
    """Simulate one training step of ``plan`` under the config's engine and micro-batch count.

    Args:
        plan, blocks, cfg: the plan, the inventory it was made from, and the config.
        flops_per_second / timings / p2p_bytes_per_second: the pricing, as in :func:`plan_stage_times`.
        engine: overrides the config's ``pp_engine``.

    Raises:
        ConfigError: bad rates, both or neither of ``flops_per_second`` and ``timings``, or 1F1B with fewer
            than ``pp − 1`` micro-batches (Nanotron asserts this).
    """
    if engine is not None:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, engine=engine))
    times = plan_stage_times(plan, blocks, cfg, flops_per_second=flops_per_second, timings=timings,
                             p2p_bytes_per_second=p2p_bytes_per_second)
    try:
        return simulate(times.stages, cfg.run.n_micro_batches, cfg.run.engine, times.p2p, grad_cuts=times.grad_cuts)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def format_seconds(seconds: float) -> str:
    """``0.0123`` → ``12.3 ms``: three significant digits in s, ms or µs."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns" if seconds else "0 s"


def stage_labels(plan: Plan, width: int = 34) -> list[str]:
    """``stage 0: embedding, decoder.0-2`` per stage, cut to ``width`` characters for plots."""
    out = []
    for s in plan.stages:
        text = f"stage {s.stage}: {s.label}"
        out.append(text if len(text) <= width else text[: width - 1] + "…")
    return out
