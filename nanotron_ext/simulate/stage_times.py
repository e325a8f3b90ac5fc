"""Per-stage times of a plan, and one simulated training step of it under Nanotron's engine.

A plan is priced exactly as the planner's step-time objective prices a split: by
:func:`nanotron_ext.strategies.step_time.schedule_problem` on the config's machine
(:func:`nanotron_ext.machine.machine_for`: a calibrated profile, or the analytic H100 model) and
:meth:`~nanotron_ext.partition.schedule_aware.ScheduleProblem.stage_times` (their sums per stage, and one p2p time
per cut: what the cut's last block sends, over that cut's link).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.config import PlannerConfig
from nanotron_ext.errors import ConfigError, PlanningError
from nanotron_ext.machine import MachineProfile, key_for, machine_for
from nanotron_ext.partition import bounds_from_ranks
from nanotron_ext.plan import Plan
from nanotron_ext.report import format_seconds
from nanotron_ext.schedule import ZERO_BUBBLE
from nanotron_ext.schedule.simulator import SimResult, StageTimes, simulate
from nanotron_ext.strategies.step_time import schedule_problem

__all__ = [
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
        p2p: per cut (between stages ``c`` and ``c + 1``), seconds of one transfer across it.
        grad_cuts: per cut between stages ``k`` and ``k + 1``, whether a gradient crosses it back (is anything on
            stages ``0..k`` trainable?); Nanotron sends none across a cut behind a frozen prefix.
    """

    stages: list[StageTimes]
    p2p: list[float]
    grad_cuts: list[bool]


def plan_stage_times(
    plan: Plan, blocks: Sequence[BlockInfo], cfg: PlannerConfig, *, machine: MachineProfile | None = None
) -> PlanTimes:
    """Per-stage forward/backward/update time of one micro-batch, the p2p time of one transfer per cut, and which cuts
    carry a gradient back. Under zb1p each stage's ``weight`` is the weight-gradient part of its backward (its
    deferred ``W``); under AFAB and 1F1B, which run the whole backward as one op, it is 0.

    Args:
        plan: a plan made from ``blocks`` (:func:`nanotron_ext.plan.make_plan`).
        blocks: the inventory, in forward order.
        cfg: the config (the schedule, the shapes that size what a block sends, the machine).
        machine: overrides the config's machine (:func:`nanotron_ext.machine.machine_for`).

    Returns:
        The :class:`PlanTimes`.

    Raises:
        ConfigError: the schedule cannot run (1F1B with too few micro-batches), or the machine is refused.
        PlanningError: ``blocks`` do not match the plan's blocks.

    Example:
        Blocks with forward FLOPs 1, 3 | 2, 1 (×10¹²) on 2 stages at 1 TFLOP/s: forwards take 4 s and 3 s.
    """
    _check_blocks(plan, blocks)
    run = dataclasses.replace(cfg.run, pp=plan.pp)
    try:
        problem = schedule_problem(blocks, dataclasses.replace(cfg, run=run), machine)
    except PlanningError as exc:  # the schedule itself cannot run (1F1B with too few micro-batches)
        raise ConfigError(str(exc)) from exc
    stages, p2p, cuts = problem.simulator_inputs(bounds_from_ranks(plan.block_ranks, plan.pp))
    if run.engine not in ZERO_BUBBLE:  # the whole backward is one op: no split to carry (results as before zb1p)
        stages = [dataclasses.replace(st, weight=0.0) for st in stages]
    return PlanTimes(stages, p2p, cuts)


def _check_blocks(plan: Plan, blocks: Sequence[BlockInfo]) -> None:
    if len(blocks) != len(plan.block_ranks) or tuple(b.name for b in blocks) != tuple(plan.block_names):
        raise PlanningError(
            f"the plan covers {len(plan.block_ranks)} blocks but {len(blocks)} were given (or their names "
            f"differ); pass the inventory the plan was made from"
        )


def simulate_plan(
    plan: Plan,
    blocks: Sequence[BlockInfo],
    cfg: PlannerConfig,
    *,
    machine: MachineProfile | None = None,
    engine: str | None = None,
    device: str | None = None,
    backend: str | None = None,
) -> SimResult:
    """Simulate one training step of ``plan`` under the config's engine and micro-batch count, on the config's
    machine (or ``machine``).

    ``device`` and ``backend``: the run this step stands for (``cpu``/``cuda``, ``gloo``/``nccl``), where known; a
    profile measured on another device or backend is refused, naming both.

    Raises:
        ConfigError: the machine is refused, or 1F1B with fewer than ``pp − 1`` micro-batches (Nanotron asserts
            this).
    """
    if machine is not None and (device is not None or backend is not None):
        machine.check_key(key_for(cfg, device=device, backend=backend), origin=repr(machine.name))
    elif device is not None or backend is not None:
        machine_for(cfg, device=device, backend=backend)  # the config's profile, checked against the run
    if engine is not None:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, engine=engine))
    times = plan_stage_times(plan, blocks, cfg, machine=machine)
    try:
        return simulate(times.stages, cfg.run.n_micro_batches, cfg.run.engine, times.p2p, grad_cuts=times.grad_cuts)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def stage_labels(plan: Plan) -> list[str]:
    """``stage 0: embedding, decoder.0-2`` per stage, whole (the timeline wraps a long one, never cuts it)."""
    return [f"stage {s.stage}: {s.label}" for s in plan.stages]
