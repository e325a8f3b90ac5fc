"""Simulate: replay Nanotron's 1F1B/AFAB program rank by rank (re-exported from
:mod:`nanotron_ext.schedule.simulator`, where the planner can use it too), turn a plan into stage times
(``stage_times``), and draw the result (``timeline``, imported on demand: it needs matplotlib)."""

from nanotron_ext.schedule.simulator import (
    Op,
    SimResult,
    StageTimes,
    engine_order,
    engine_program,
    ideal_bubble_fraction,
    simulate,
)
from nanotron_ext.simulate.stage_times import (
    PlanTimes,
    format_seconds,
    plan_stage_times,
    simulate_plan,
    stage_labels,
)

__all__ = [
    "Op",
    "SimResult",
    "StageTimes",
    "engine_order",
    "engine_program",
    "format_seconds",
    "ideal_bubble_fraction",
    "simulate",
    "simulate_plan",
    "stage_labels",
    "PlanTimes",
    "plan_stage_times",
]
