"""Make a plan: run one strategy over the inventory, price its stages, and validate the result."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from nanotron_ext.blocks import BlockInfo, held_parameters
from nanotron_ext.config import PlannerConfig
from nanotron_ext.costs.analytic import training_flops
from nanotron_ext.costs.memory_estimate import config_stage_memory
from nanotron_ext.errors import ConfigError, PlanningError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.machine.memory_limit import MemoryLimit, memory_limit
from nanotron_ext.partition.feasible import least_cap
from nanotron_ext.plan.fit import MemoryFix, fix_candidates
from nanotron_ext.plan.types import Plan, StagePlan
from nanotron_ext.plan.validate import validate_plan
from nanotron_ext.report import compact_names
from nanotron_ext.schedule import AUTO_UNRESOLVED, ENGINE_AUTO, V_ENGINE, V_NOT_CONTIGUOUS
from nanotron_ext.strategies import get_strategy
from nanotron_ext.strategies.builtin import stage_memory_terms
from nanotron_ext.strategies.memory_fit import only_whether_it_fits
from nanotron_ext.strategies.registry import Assignment

__all__ = ["least_any_split_needs", "make_plan", "plan_with_ranks"]


def make_plan(
    blocks: Sequence[BlockInfo], cfg: PlannerConfig, strategy: str | None = None, *, suggest_fixes: bool = True
) -> Plan:
    """Plan the split of ``blocks`` into ``cfg.run.pp`` stages with one strategy, and validate it.

    Args:
        blocks: the inventory (:mod:`nanotron_ext.inventory`).
        cfg: config; ``cfg.ext.cost_strategy`` is used unless ``strategy`` is given.
        strategy: a registered name or ``package.module:attr``.
        suggest_fixes: when a stage does not fit its memory, plan the fixes again to price them.

    Returns:
        The :class:`Plan`, findings included (check ``plan.ok``).

    Raises:
        ConfigError: unknown strategy or bad option; ``pp_engine: auto`` not yet resolved
            (:func:`nanotron_ext.plan.resolve_engine`); ``pp_engine: zbv`` (a V: :func:`nanotron_ext.plan.plan_for`).
        PlanningError: no split satisfies the strategy's constraints.
    """
    _check_contiguous_engine(cfg)
    name = strategy or cfg.ext.cost_strategy
    return _plan(blocks, cfg, name, get_strategy(name).assign(blocks, cfg), suggest_fixes)


def plan_with_ranks(
    blocks: Sequence[BlockInfo], cfg: PlannerConfig, ranks: Sequence[int], strategy: str, *, suggest_fixes: bool = True
) -> Plan:
    """The plan of a split given block by block (a checkpoint's recorded split), priced and validated as
    :func:`make_plan` does; ``strategy`` names what chose it.

    Raises:
        PlanningError: the ranks do not fit the blocks and ``cfg.run.pp``, or go backwards.
    """
    _check_contiguous_engine(cfg)
    return _plan(blocks, cfg, strategy, Assignment(list(ranks), training_flops(blocks), "FLOPs"), suggest_fixes)


def _check_contiguous_engine(cfg: PlannerConfig) -> None:
    """Refuse an engine this module cannot plan: ``auto`` (not yet chosen) and ``zbv`` (a V, not pp stages)."""
    if cfg.run.engine == ENGINE_AUTO:
        raise ConfigError(AUTO_UNRESOLVED)
    if cfg.run.engine == V_ENGINE:
        raise ConfigError(V_NOT_CONTIGUOUS)


def _plan(
    blocks: Sequence[BlockInfo], cfg: PlannerConfig, name: str, assignment: Assignment, suggest_fixes: bool = True
) -> Plan:
    pp = cfg.run.pp
    ranks = list(assignment.ranks)
    if len(ranks) != len(blocks) or any(not (0 <= r < pp) for r in ranks):
        raise PlanningError(f"strategy {name!r} returned ranks {ranks} for {len(blocks)} blocks and pp={pp}")
    if any(b < a for a, b in zip(ranks, ranks[1:])):
        raise PlanningError(f"strategy {name!r} returned non-contiguous stages {ranks}")
    flops = training_flops(blocks)
    total_cost = sum(assignment.costs) or 1.0
    stages = []
    held: list[list[int]] = [[] for _ in range(pp)]  # each stage's blocks, in order: one pass, not one per stage
    for i, r in enumerate(ranks):
        held[r].append(i)
    for k in range(pp):
        members = [blocks[i] for i in held[k]]
        cost = sum(assignment.costs[i] for i in held[k])
        memory = config_stage_memory(members, cfg, k)
        params, trainable = held_parameters(members, cfg.model.tie_word_embeddings)
        stages.append(
            StagePlan(
                stage=k,
                blocks=tuple(b.name for b in members),
                label=compact_names([b.short for b in members]),
                params=params,
                trainable=trainable,
                cost=cost,
                share=cost / total_cost,
                flops=sum(flops[i] for i in held[k]),
                memory_bytes=memory.peak,
                memory=memory,
            )
        )
    plan = Plan(
        strategy=name,
        pp=pp,
        engine=cfg.run.engine,
        n_micro_batches=cfg.run.n_micro_batches,
        unit=assignment.unit,
        block_names=tuple(b.name for b in blocks),
        block_ranks=tuple(ranks),
        block_costs=tuple(assignment.costs),
        stages=tuple(stages),
        block_flops=tuple(flops),
    )
    limit = memory_limit(cfg)
    findings = validate_plan(plan, blocks, cfg, limit=limit)
    if suggest_fixes and limit is not None and any(f.code == "memory" for f in findings):
        findings = validate_plan(plan, blocks, cfg, limit=limit, memory_fixes=_priced_fixes(blocks, cfg, name, limit))
    over = None if assignment.over_memory is None else tuple(assignment.over_memory)
    return replace(plan, findings=tuple(findings), memory_limit=limit, over_memory_ranks=over)


def least_any_split_needs(blocks: Sequence[BlockInfo], cfg: PlannerConfig, limit: MemoryLimit) -> float | None:
    """When no split of ``blocks`` into ``cfg``'s pp stages fits ``limit``, the least memory any split's largest
    stage needs (a lower bound, by the estimate's additive part); None when one may fit. A change that cannot fit
    is priced by it instead of planned: its plan would run the step-time search (seconds on a large model) only to
    be over the limit with whatever split it picked. No requirement: a bound over every non-empty split, whatever
    the strategy's constraints."""
    return least_cap(len(blocks), cfg.run.pp, [], stage_memory_terms(blocks, cfg, cap=limit.bytes))


def _priced_fixes(
    blocks: Sequence[BlockInfo], cfg: PlannerConfig, strategy: str, limit: MemoryLimit
) -> list[MemoryFix]:
    """Each of :func:`~nanotron_ext.plan.fit.fix_candidates` priced: planned, with its largest stage peak, when
    some split of it may fit the limit; else the least memory any split's largest stage needs, which says so
    without a search. A change that cannot be planned (too few blocks for the pp, heads the tp does not divide)
    is left out."""
    fixes = []
    for change, changed, how in fix_candidates(cfg, strategy, limit):
        try:
            new_blocks = blocks if changed.run.tp == cfg.run.tp else inventory_from_config(changed)
            if len(new_blocks) < changed.run.pp:
                continue
            least = least_any_split_needs(new_blocks, changed, limit)
            if least is not None:
                if changed.run != cfg.run:  # a change of the split alone, when no split fits, is no fix
                    fixes.append(MemoryFix(change, least, fits=False, any_split=True))
                continue
            with only_whether_it_fits():
                plan = make_plan(new_blocks, changed, how, suggest_fixes=False)
            peak = max(s.memory_bytes for s in plan.stages)
        except (ConfigError, PlanningError):
            continue
        fixes.append(MemoryFix(change, peak, peak <= limit.bytes))
    return fixes
