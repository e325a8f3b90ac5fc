"""Per-stage times of a plan, and one simulated training step of it under Nanotron's engine.

Times come from one of two sources:

* a **FLOP-rate model** (:func:`stage_times_from_plan`): a stage's forward time is its blocks' forward FLOPs
  divided by one throughput, its backward time the rest of its training FLOPs (freeze-aware) divided by the
  same throughput. Real kernels do not all run at one rate, so the numbers compare splits of the same model;
  they do not predict a wall-clock step.
* **measured** block timings (:func:`stage_times_from_timings`, from :mod:`nanotron_ext.costs.measured`):
  a stage's update is its blocks' optimizer steps (gradient sync is not measured). This predicts the step of
  a run on the machine that measured.

Either way, one p2p transfer is the largest activation a stage sends divided by a bandwidth.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.config import PlannerConfig
from nanotron_ext.costs.analytic import trainable_before, training_flops
from nanotron_ext.errors import ConfigError, PlanningError
from nanotron_ext.plan import Plan
from nanotron_ext.schedule.simulator import SimResult, StageTimes, simulate
from nanotron_ext.strategies.step_time import DEFAULT_TFLOPS  # its one home: the planner prices with it too

if TYPE_CHECKING:
    from nanotron_ext.costs.measured import BlockTiming

__all__ = [
    "DEFAULT_TFLOPS",
    "format_seconds",
    "gradient_cuts",
    "simulate_plan",
    "stage_labels",
    "stage_times_from_plan",
    "stage_times_from_timings",
]



def stage_times_from_plan(
    plan: Plan,
    blocks: Sequence[BlockInfo],
    *,
    flops_per_second: float,
    p2p_bytes_per_second: float | None,
) -> tuple[list[StageTimes], float]:
    """Per-stage forward/backward time of one micro-batch, and the p2p time, under a FLOP-rate model.

    * forward of stage ``k`` = Σ ``flops_fwd`` of its blocks ÷ ``flops_per_second``;
    * backward = (Σ ``training_flops(blocks)`` of its blocks − its forward FLOPs) ÷ ``flops_per_second``,
      so frozen blocks pay no weight-gradient work and a frozen prefix no backward at all;
    * p2p = the largest ``output_bytes`` of the last block of a stage that sends (every stage but the last)
      ÷ ``p2p_bytes_per_second``; 0 when the bandwidth is ``None`` or ``pp == 1``. A gradient sent backward
      has the size of the activation sent forward, so one number serves both directions. The simulator
      takes one p2p time for every link, so this is the worst link's: a split that sends vocabulary-sized
      logits across a boundary pays that transfer on every link (an overestimate for the others).

    Args:
        plan: a plan made from ``blocks`` (:func:`nanotron_ext.plan.make_plan`).
        blocks: the inventory, in forward order.
        flops_per_second: one compute throughput for every block, FLOP/s.
        p2p_bytes_per_second: link bandwidth between neighbouring stages, bytes/s; ``None`` ignores p2p.

    Returns:
        (one :class:`~nanotron_ext.schedule.simulator.StageTimes` per stage in seconds, p2p seconds per transfer).

    Raises:
        ConfigError: a throughput or bandwidth that is not a positive finite number.
        PlanningError: ``blocks`` is not the inventory the plan was made from.

    Example:
        Blocks with forward FLOPs 1, 3 | 2, 1 (×10¹²) on 2 stages at 1 TFLOP/s: forwards take 4 s and 3 s.
    """
    _check_rate("flops_per_second", flops_per_second)
    if p2p_bytes_per_second is not None:
        _check_rate("p2p_bytes_per_second", p2p_bytes_per_second)
    _check_blocks(plan, blocks)
    train = training_flops(blocks)
    fwd = [0.0] * plan.pp
    total = [0.0] * plan.pp
    for b, t, r in zip(blocks, train, plan.block_ranks):
        fwd[r] += b.flops_fwd
        total[r] += t
    stages = [
        StageTimes(forward=fwd[k] / flops_per_second, backward=max(0.0, total[k] - fwd[k]) / flops_per_second)
        for k in range(plan.pp)
    ]
    return stages, _p2p_time(plan, blocks, p2p_bytes_per_second)


def stage_times_from_timings(
    plan: Plan,
    blocks: Sequence[BlockInfo],
    timings: Sequence[BlockTiming],
    *,
    p2p_bytes_per_second: float | None,
) -> tuple[list[StageTimes], float]:
    """Per-stage times from measured per-block timings (:func:`nanotron_ext.costs.measured.block_timings`).

    A stage's forward, backward and update are the sums of its blocks' forward, backward and optimizer-step
    times; p2p as in :func:`stage_times_from_plan`.

    Raises:
        ConfigError: a bandwidth that is not a positive finite number.
        PlanningError: ``blocks`` or ``timings`` do not match the plan's blocks.
    """
    if p2p_bytes_per_second is not None:
        _check_rate("p2p_bytes_per_second", p2p_bytes_per_second)
    _check_blocks(plan, blocks)
    if len(timings) != len(blocks):
        raise PlanningError(f"{len(timings)} block timings for {len(blocks)} blocks; pass one per block")
    sums = [[0.0, 0.0, 0.0] for _ in range(plan.pp)]
    for t, r in zip(timings, plan.block_ranks):
        sums[r][0] += t.forward
        sums[r][1] += t.backward
        sums[r][2] += t.optimizer
    return [StageTimes(*values) for values in sums], _p2p_time(plan, blocks, p2p_bytes_per_second)


def _check_blocks(plan: Plan, blocks: Sequence[BlockInfo]) -> None:
    if len(blocks) != len(plan.block_ranks) or tuple(b.name for b in blocks) != tuple(plan.block_names):
        raise PlanningError(
            f"the plan covers {len(plan.block_ranks)} blocks but {len(blocks)} were given (or their names "
            f"differ); pass the inventory the plan was made from"
        )


def _p2p_time(plan: Plan, blocks: Sequence[BlockInfo], p2p_bytes_per_second: float | None) -> float:
    if p2p_bytes_per_second is None or plan.pp == 1:
        return 0.0
    last: dict[int, BlockInfo] = {}
    for b, r in zip(blocks, plan.block_ranks):
        last[r] = b
    # An empty stage sends nothing of its own.
    sent = max((last[k].output_bytes for k in range(plan.pp - 1) if k in last), default=0.0)
    return float(sent) / p2p_bytes_per_second


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
        flops_per_second: FLOP-rate model (:func:`stage_times_from_plan`); or
        timings: measured per-block timings (:func:`stage_times_from_timings`); exactly one of the two.
        p2p_bytes_per_second: link bandwidth, or None to ignore p2p.
        engine: overrides the config's ``pp_engine``.

    Raises:
        ConfigError: bad rates, both or neither of ``flops_per_second`` and ``timings``, or 1F1B with fewer
            than ``pp − 1`` micro-batches (Nanotron asserts this).
    """
    if (flops_per_second is None) == (timings is None):
        raise ConfigError("simulate_plan needs exactly one of flops_per_second= (FLOP-rate model) and timings=")
    if timings is not None:
        stages, p2p = stage_times_from_timings(plan, blocks, timings, p2p_bytes_per_second=p2p_bytes_per_second)
    else:
        stages, p2p = stage_times_from_plan(
            plan, blocks, flops_per_second=float(flops_per_second), p2p_bytes_per_second=p2p_bytes_per_second
        )
    try:
        return simulate(
            stages, cfg.run.n_micro_batches, engine or cfg.run.engine, p2p, grad_cuts=gradient_cuts(plan, blocks)
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def gradient_cuts(plan: Plan, blocks: Sequence[BlockInfo]) -> list[bool]:
    """Per cut between stages ``k`` and ``k + 1``: does a gradient cross it back (is anything on stages ``0..k``
    trainable)? Nanotron sends no gradient across a cut behind a frozen prefix."""
    before = trainable_before(blocks)
    # Ranks never decrease along the blocks, so the blocks of stages 0..k are the first "count ≤ k" ones.
    return [before[sum(r <= k for r in plan.block_ranks)] for k in range(plan.pp - 1)]


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
