"""Plans side by side (``plan --compare``, ``simulate --compare``), and what every comparison says of a plan:
the best valid split it is measured against, and in a few words why a plan it is measured against cannot train."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.config import PlannerConfig
from nanotron_ext.errors import NanotronExtError
from nanotron_ext.plan.make import make_plan
from nanotron_ext.plan.types import Plan
from nanotron_ext.report import human_bytes, int_ranges
from nanotron_ext.strategies import comparable_strategies

__all__ = ["Attempt", "best_valid_split", "plan_every_strategy", "why_invalid"]


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


def best_valid_split(blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> Plan | None:
    """The split whose slowest stage (training FLOPs per micro-batch) is the smallest among the splits valid under
    the config's own constraints: parameters on every stage, a trainable block on every stage (unless
    ``allow_frozen_stages``), every stage within the memory limit. None when no split is valid.

    It is ``constrained`` under the FLOP min-max (``objective: slowest_stage``, ``base_strategy: flops``), which
    searches exactly those splits; a plan-wide finding (too few micro-batches for the engine) is no fault of a
    split, so it does not disqualify one.
    """
    flop_min_max = cfg.with_overrides(objective="slowest_stage", base_strategy="flops")
    try:
        plan = make_plan(blocks, flop_min_max, "constrained", suggest_fixes=False)
    except NanotronExtError:  # no split meets the constraints
        return None
    return None if any(f.severity == "error" and f.stage is not None for f in plan.findings) else plan


#: What each error finding means in a few words, for a line that compares with the plan.
_CANNOT_TRAIN = {"no-params": "no parameters", "no-trainable": "nothing to train", "empty-stage": "no block"}


def why_invalid(plan: Plan) -> str | None:
    """Why ``plan`` cannot train, in a few words (``does not fit: stage 0 needs 94.7 GiB, over 79.18 GiB per GPU
    (H100 SXM (analytic))``, ``cannot train: no parameters on stage 1``); None when it can."""
    stages: dict[str, list[int]] = {}
    for f in plan.findings:
        if f.severity == "error":
            stages.setdefault(f.code, []).extend([] if f.stage is None else [f.stage])
    reasons = []
    for code, where in stages.items():
        on = f" on stage{'s' if len(where) > 1 else ''} {int_ranges(where)}" if where else ""
        if code == "memory" and where and plan.memory_limit is not None:
            worst = max((plan.stages[k] for k in where), key=lambda s: s.memory_bytes)
            more = f" ({len(where)} stages over)" if len(where) > 1 else ""
            reasons.append(
                f"does not fit: stage {worst.stage} needs {human_bytes(worst.memory_bytes)}, over "
                f"{plan.memory_limit}{more}"
            )
        elif code == "few-micro-batches":
            reasons.append(f"cannot run: too few micro-batches for {plan.engine} ({plan.n_micro_batches})")
        else:
            reasons.append(f"cannot train: {_CANNOT_TRAIN.get(code, code)}{on}")
    return "; ".join(sorted(reasons, key=lambda r: r.startswith("does not fit"))) or None
