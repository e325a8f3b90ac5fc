"""Static validation of a plan, before any weight is allocated.

Each finding says what is wrong, why (in the model's own numbers) and what to change.
"""

from __future__ import annotations

from collections.abc import Sequence

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.config import PlannerConfig
from nanotron_ext.machine.memory_limit import MemoryLimit
from nanotron_ext.partition import nanotron_greedy_ranks
from nanotron_ext.plan.fit import MemoryFix, fix_text, overrun
from nanotron_ext.plan.types import Finding, Plan, Severity, StagePlan
from nanotron_ext.report import compact_names
from nanotron_ext.schedule import micro_batch_shortfall
from nanotron_ext.strategies.fixes import frozen_stage_fix, memory_cap_fix, or_list, strategy_fix

__all__ = ["cannot_train_message", "validate_plan"]


def validate_plan(
    plan: Plan,
    blocks: Sequence[BlockInfo],
    cfg: PlannerConfig,
    *,
    limit: MemoryLimit | None = None,
    memory_fixes: Sequence[MemoryFix] = (),
) -> list[Finding]:
    """Check a plan statically.

    Checks: empty stage, stage without parameters, stage without trainable parameters, memory over
    ``memory_cap_gib`` or the device's (:mod:`nanotron_ext.plan.fit`), fewer micro-batches than stages under 1F1B
    (warning).

    Args:
        plan: the plan to check.
        blocks: the inventory it was made from.
        cfg: the config (engine, micro-batches, our options).
        limit: the memory each stage must fit in (:func:`nanotron_ext.machine.memory_limit` of ``cfg``); None:
            none is checked.
        memory_fixes: the fixes of a stage over its memory, priced (:func:`nanotron_ext.plan.make.make_plan`
            prices them); empty: the ways out are named unpriced.

    Returns:
        Findings, errors first; an empty list means the plan can train.
    """
    any_trainable = any(b.trainable for b in blocks)
    n_trainable = sum(b.trainable > 0 for b in blocks)
    findings = [f for s in plan.stages if (f := _stage_finding(s, plan, blocks, cfg, any_trainable, n_trainable))]
    over = [o for s in plan.stages if s.memory is not None and (o := overrun(s.stage, s.memory, limit, cfg))]
    if over and limit is not None:
        fix = fix_text(limit, memory_fixes, memory_cap_fix(cfg, plan.strategy, len(blocks)))
        first = over[0].stage
        findings += [
            Finding(o.severity, "memory", o.stage, o.message(), fix if o.stage == first else f"as for stage {first}")
            for o in over
        ]
    shortfall = micro_batch_shortfall(cfg.run.engine, plan.pp, cfg.run.n_micro_batches)
    if shortfall is not None:
        findings.append(
            Finding(
                "error" if shortfall.fatal else "warning", "few-micro-batches", None, shortfall.reason, shortfall.fix
            )
        )
    return sorted(findings, key=lambda f: (f.severity != "error", f.stage if f.stage is not None else -1))


def _stage_finding(
    s: StagePlan, plan: Plan, blocks: Sequence[BlockInfo], cfg: PlannerConfig, any_trainable: bool, n_trainable: int
) -> Finding | None:
    """What keeps stage ``s`` from training: no block, no parameter, or (while some block trains) nothing to train."""
    if not s.blocks:
        return Finding(
            "error",
            "empty-stage",
            s.stage,
            f"stage {s.stage} holds no block",
            or_list([*strategy_fix(plan.strategy), "lower pp"]),
        )
    if s.params == 0:
        return Finding(
            "error",
            "no-params",
            s.stage,
            f"stage {s.stage} holds no parameters ({s.label}), so it has no gradient: Nanotron stops with "
            f'"Can\'t use DDP because model in PP={s.stage} has no gradient" (dp>1) or "optimizer got an '
            f'empty parameter list" (dp=1). Cause: {_cause(plan, blocks, cfg)}',
            "; or ".join(
                [f"{w} — every stage then gets a block with parameters" for w in strategy_fix(plan.strategy)]
                + [f"lower pp to {_largest_working_pp(plan, blocks)}"]
            ),
        )
    if s.trainable == 0 and any_trainable:
        severity: Severity = "warning" if cfg.ext.allow_frozen_stages else "error"
        return Finding(
            severity,
            "no-trainable",
            s.stage,
            f"stage {s.stage} holds only frozen parameters ({s.label}); it has nothing to optimise"
            + (" (allowed: it runs without optimizer and DDP)" if cfg.ext.allow_frozen_stages else ""),
            frozen_stage_fix(cfg, plan.strategy, n_trainable),
        )
    return None


def _cause(plan: Plan, blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> str:
    """Why a stage ended up weightless, in the strategy's own numbers."""
    costs = plan.block_costs
    total = sum(costs)
    if not total:
        return f"strategy {plan.strategy!r} gives every block zero cost"
    heavy = max(range(len(costs)), key=lambda i: costs[i])
    share = costs[heavy] / total
    b = blocks[heavy]
    text = f"{b.short} is {100 * share:.0f} % of the cost under {plan.strategy!r}"
    decoders = [i for i, x in enumerate(blocks) if x.role == "decoder"]
    dec_cost = sum(costs[i] for i in decoders)
    if b.role == "lm_head" and costs[heavy] > dec_cost and decoders:
        many = "both" if len(decoders) == 2 else f"all {len(decoders)}"
        text += (
            f"; vocabulary {cfg.model.vocab_size} × hidden {cfg.model.hidden_size} outweighs {many} decoder layers "
            f"({len(decoders)} × {costs[decoders[0]]:g})"
        )
    if share > 1 / plan.pp:
        text += (
            f", more than one stage's share (1/{plan.pp}), so the greedy thresholds put it and every "
            f"block before it on one stage"
        )
    free = [x.short for x, c in zip(blocks, costs) if x.params and c == 0]
    if free:
        text += f"; blocks with weights priced at zero: {compact_names(free)}"
    return text


def _largest_working_pp(plan: Plan, blocks: Sequence[BlockInfo]) -> int:
    """Largest pp below the current one at which this strategy gives every stage weights."""
    if plan.strategy == "nanotron":
        for pp in range(plan.pp - 1, 0, -1):
            ranks = nanotron_greedy_ranks(list(plan.block_costs), pp)
            if all(any(b.params for b, r in zip(blocks, ranks) if r == k) for k in range(pp)):
                return pp
        return 1
    return min(plan.pp - 1, sum(b.params > 0 for b in blocks)) or 1


def cannot_train_message(plan: Plan) -> str:
    """The message every rank raises when a plan has errors: the stage table and each error with its fix."""
    return (
        f"nanotron_ext: the {plan.strategy!r} plan for pp={plan.pp} cannot train; nothing was allocated.\n"
        + plan.table()
        + "\n"
        + "\n".join(str(f) for f in plan.findings if f.severity == "error")
    )
