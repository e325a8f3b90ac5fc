"""Every comparable strategy's plan for one inventory, side by side (``plan --compare``, ``simulate --compare``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.config import PlannerConfig
from nanotron_ext.errors import NanotronExtError
from nanotron_ext.plan.make import make_plan
from nanotron_ext.plan.types import Plan
from nanotron_ext.strategies import comparable_strategies

__all__ = ["Attempt", "plan_every_strategy"]


@dataclass(frozen=True)
class Attempt:
    """One strategy's outcome: its plan, or the error that stopped it (``plan`` is None then)."""

    strategy: str
    plan: Plan | None
    error: str = ""


def plan_every_strategy(blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> list[Attempt]:
    """Plan with every analytic strategy, plus the config's own if it measures (``profiled``).

    A strategy that cannot plan is kept, with its error, so tables show why.
    """
    out = []
    for name in comparable_strategies(cfg.ext.cost_strategy):
        try:
            out.append(Attempt(name, make_plan(blocks, cfg, name)))
        except NanotronExtError as exc:
            out.append(Attempt(name, None, str(exc)))
    return out
