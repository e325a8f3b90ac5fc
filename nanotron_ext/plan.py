"""A plan: which blocks each pipeline stage holds, what that costs, and whether it can train.

Plans are plain data: they print as a table, compare with ``==`` on the block→stage map, and serialise to
JSON.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from nanotron_ext.config import PlannerConfig
from nanotron_ext.costs import stage_memory_bytes, training_flops
from nanotron_ext.errors import PlanningError
from nanotron_ext.inventory import BlockInfo
from nanotron_ext.partition import partition
from nanotron_ext.report import compact_names, human_bytes, human_count, table
from nanotron_ext.strategies import get_strategy
from nanotron_ext.validate import Finding, validate_plan


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage of a plan.

    Attributes:
        stage: PP rank.
        blocks: module paths of its blocks, in forward order.
        label: compact form, e.g. ``embedding, decoder.0-11``.
        params / trainable: parameter counts.
        cost: the strategy's cost of the stage (``Plan.unit``).
        share: the stage's fraction of the strategy's total cost.
        flops: training FLOPs per micro-batch (the yardstick every strategy is compared on).
        memory_bytes: estimated peak memory.
    """

    stage: int
    blocks: tuple[str, ...]
    label: str
    params: int
    trainable: int
    cost: float
    share: float
    flops: float
    memory_bytes: float


@dataclass(frozen=True)
class Plan:
    """The block→stage assignment of one strategy, with its stages and findings."""

    strategy: str
    pp: int
    engine: str
    n_micro_batches: int
    unit: str
    block_names: tuple[str, ...]
    block_ranks: tuple[int, ...]
    block_costs: tuple[float, ...] = field(compare=False)
    stages: tuple[StagePlan, ...] = field(compare=False)
    findings: tuple[Finding, ...] = field(compare=False, default=())
    optimum_flops: float = field(compare=False, default=0.0)

    @property
    def ok(self) -> bool:
        """True when no finding is an error."""
        return not any(f.severity == "error" for f in self.findings)

    @property
    def slowest_flops(self) -> float:
        return max(s.flops for s in self.stages)

    @property
    def vs_optimum(self) -> float:
        """Slowest stage ÷ the best any contiguous split can do (1.0 is optimal)."""
        return self.slowest_flops / self.optimum_flops if self.optimum_flops else float("nan")

    @property
    def spread(self) -> float:
        """(slowest − fastest) ÷ mean stage, in training FLOPs."""
        loads = [s.flops for s in self.stages]
        mean = sum(loads) / len(loads)
        return (max(loads) - min(loads)) / mean if mean else 0.0

    @property
    def bubble_estimate(self) -> float:
        """Idle fraction of a step: ``1 − m·Σt / (p·((m−1)·max t + Σt))``.

        With equal stages this is ``(p−1)/(m+p−1)`` (Narayanan et al. 2021); an unbalanced split stretches
        the steady state to the slowest stage.
        """
        loads = [s.flops for s in self.stages]
        m, p, total = self.n_micro_batches, self.pp, sum(loads)
        step = (m - 1) * max(loads) + total
        return 1.0 - m * total / (p * step) if step else 0.0

    def stage_map(self) -> str:
        """``0-4|5-6``: the block index range of each stage (``-`` for an empty one)."""
        parts = []
        for k in range(self.pp):
            idx = [i for i, r in enumerate(self.block_ranks) if r == k]
            parts.append("-" if not idx else (f"{idx[0]}" if len(idx) == 1 else f"{idx[0]}-{idx[-1]}"))
        return "|".join(parts)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(ok=self.ok, slowest_flops=self.slowest_flops, vs_optimum=self.vs_optimum,
                 spread=self.spread, bubble_estimate=self.bubble_estimate)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def table(self) -> str:
        """Per-stage table: blocks, parameters, trainable, share of cost, memory, verdict."""
        errors = {f.stage for f in self.findings if f.severity == "error"}
        rows = [
            [s.stage, s.label, human_count(s.params), human_count(s.trainable), f"{100 * s.share:.1f}%",
             human_count(s.flops), human_bytes(s.memory_bytes), "ERROR" if s.stage in errors else "ok"]
            for s in self.stages
        ]
        head = ["stage", "blocks", "params", "trainable", f"share ({self.unit})", "train FLOPs/mb",
                "memory", "verdict"]
        return table(head, rows)


def make_plan(blocks: Sequence[BlockInfo], cfg: PlannerConfig, strategy: str | None = None) -> Plan:
    """Plan the split of ``blocks`` into ``cfg.run.pp`` stages with one strategy, and validate it.

    Args:
        blocks: the inventory (:mod:`nanotron_ext.inventory`).
        cfg: config; ``cfg.ext.cost_strategy`` is used unless ``strategy`` is given.
        strategy: a registered name or ``package.module:attr``.

    Returns:
        The :class:`Plan`, findings included (check ``plan.ok``).

    Raises:
        ConfigError: unknown strategy or bad option.
        PlanningError: no split satisfies the strategy's constraints.
    """
    name = strategy or cfg.ext.cost_strategy
    assignment = get_strategy(name).assign(blocks, cfg)
    pp = cfg.run.pp
    ranks = list(assignment.ranks)
    if len(ranks) != len(blocks) or any(not (0 <= r < pp) for r in ranks):
        raise PlanningError(f"strategy {name!r} returned ranks {ranks} for {len(blocks)} blocks and pp={pp}")
    if any(b < a for a, b in zip(ranks, ranks[1:])):
        raise PlanningError(f"strategy {name!r} returned non-contiguous stages {ranks}")
    flops = training_flops(blocks)
    total_cost = sum(assignment.costs) or 1.0
    stages = []
    for k in range(pp):
        members = [b for b, r in zip(blocks, ranks) if r == k]
        cost = sum(c for c, r in zip(assignment.costs, ranks) if r == k)
        stages.append(
            StagePlan(
                stage=k,
                blocks=tuple(b.name for b in members),
                label=compact_names([b.short for b in members]),
                params=sum(b.params for b in members),
                trainable=sum(b.trainable for b in members),
                cost=cost,
                share=cost / total_cost,
                flops=sum(f for f, r in zip(flops, ranks) if r == k),
                memory_bytes=stage_memory_bytes(members, cfg.run, k),
            )
        )
    optimum = partition(flops, pp).max_cost if pp <= len(blocks) else 0.0
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
        optimum_flops=optimum,
    )
    return replace(plan, findings=tuple(validate_plan(plan, blocks, cfg)))
