"""A plan's simulated step as ``plan`` prints it: the step and bubble line, what Nanotron's rule and fitting the memory
cost, and the best valid split it is measured against; and the same figures as ``--json`` carries them."""

from __future__ import annotations

from collections.abc import Sequence

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.cli.common import against, best_valid_cell, speed_cell
from nanotron_ext.config import PlannerConfig
from nanotron_ext.costs.analytic import GIB
from nanotron_ext.errors import NanotronExtError
from nanotron_ext.machine import machine_for
from nanotron_ext.plan import Plan, make_plan, plan_with_ranks
from nanotron_ext.plan.engine_choice import predicted_step
from nanotron_ext.report import format_seconds
from nanotron_ext.simulate import SimResult, simulate_plan

__all__ = [
    "best_valid_fields",
    "best_valid_line",
    "best_valid_line_short",
    "gave_up_line",
    "simulated",
    "simulated_fields",
    "step_time_line",
]


def best_valid_line(plan: Plan, best: Plan | None) -> str:
    """``slowest stage vs best valid split: 0.917x (...)``: ``plan``'s slowest stage against the smallest slowest
    stage of a split that can train and fits (:func:`~nanotron_ext.plan.compare.best_valid_split`)."""
    if best is None:
        return "slowest stage vs best valid split: - (no split can train and fit under this config)"
    return (
        f"slowest stage vs best valid split: {best_valid_cell(best, plan)} (train FLOPs/mb: the slowest stage "
        f"of the best split that can train and fits ({best.stage_map()}) ÷ this one's)"
    )


def best_valid_fields(best: Plan | None) -> dict[str, float | None]:
    """What ``--json`` carries of the best valid split: its slowest stage (None when no split is valid)."""
    return {"best_valid_flops": None if best is None else best.slowest_flops}


def simulated(plan: Plan, blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> SimResult | None:
    """One simulated step of ``plan`` on the config's machine under its schedule (what ``simulate`` prints), or
    None when the schedule cannot run it (1F1B with too few micro-batches)."""
    try:
        return simulate_plan(plan, blocks, cfg)
    except NanotronExtError:
        return None


def _step(plan: Plan, blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> float | None:
    """The simulated step of another split, where a line needs only its time: the step-time search's evaluator
    (:func:`~nanotron_ext.plan.engine_choice.predicted_step`, whose schedule graph the plan's search compiled),
    equal to :func:`simulated`'s to rounding (1e-15 relative), not a second replay and record of every op (about
    0.3 s of ``plan``'s 2.3 s on a 1000-layer model). None when the schedule cannot run it."""
    try:
        return predicted_step(cfg, blocks, plan.block_ranks)
    except NanotronExtError:
        return None


def simulated_fields(result: SimResult | None) -> dict[str, float | None]:
    """The simulated step and bubble as every ``--json`` carries them (None where the schedule cannot run)."""
    return {
        "simulated_step_time": None if result is None else result.step_time,
        "bubble_fraction": None if result is None else result.bubble_fraction,
    }


def step_time_line(cfg: PlannerConfig, blocks: Sequence[BlockInfo], plan: Plan, result: SimResult | None) -> str:
    """``simulated step: 1.23 ms, bubble 40.0% (...)``, then ``Nanotron's rule: 1.30 ms, this split is 1.057x as
    fast``, saying in that line when Nanotron's split cannot train or does not fit."""
    if result is None:
        return "simulated step: - (the engine cannot run this many micro-batches)"
    line = (
        f"simulated step: {format_seconds(result.step_time)}, bubble {result.bubble_fraction:.1%} "
        f"({cfg.run.engine}, {cfg.run.n_micro_batches} micro-batches; {machine_for(cfg, blocks).describe()})"
    )
    if plan.strategy != "nanotron":
        try:
            rule_plan = make_plan(blocks, cfg, "nanotron", suggest_fixes=False)
        except NanotronExtError:
            rule_plan = None
        rule = None if rule_plan is None else _step(rule_plan, blocks, cfg)
        if rule is not None:
            caveat = against("Nanotron's split", rule_plan)
            line += (
                f"\nNanotron's rule: {format_seconds(rule)}, this split is "
                f"{speed_cell(rule, result.step_time)} as fast{'; ' + caveat if caveat else ''}"
            )
    return line + gave_up_line(cfg, blocks, plan, result)


def gave_up_line(cfg: PlannerConfig, blocks: Sequence[BlockInfo], plan: Plan, result: SimResult) -> str:
    """What fitting the memory cost: the faster split it ruled out, its step and its largest stage."""
    if plan.over_memory_ranks is None or plan.memory_limit is None:
        return ""
    faster = plan_with_ranks(blocks, cfg, plan.over_memory_ranks, plan.strategy, suggest_fixes=False)
    sim = _step(faster, blocks, cfg)
    worst = max(faster.stages, key=lambda s: s.memory_bytes)
    step = "-" if sim is None else format_seconds(sim)
    slower = "" if sim is None else f", {speed_cell(sim, result.step_time)} as fast as it"
    return (
        f"\nto fit {plan.memory_limit}: the fastest split ({faster.stage_map()}, {step}) needs "
        f"{worst.memory_bytes / GIB:.3g} GiB on stage {worst.stage}; this one fits{slower}"
    )


def best_valid_line_short(best: Plan | None) -> str:
    """What the ``vs best valid`` column of a table compares with."""
    if best is None:
        return "no split can train and fit under this config"
    return f"the best split that can train and fits is {best.stage_map()}"
