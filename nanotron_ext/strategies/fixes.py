"""What to change when a plan cannot train or does not fit: the fixes that the validator and the strategies print.

Each suggestion depends on what the config already has, so that no message tells a user to set what is set:
no "use constrained" under ``constrained``, no "the 1f1b engine" under 1F1B, no ``allow_frozen_stages: true``
when it is true.
"""

from __future__ import annotations

from nanotron_ext.config import PlannerConfig

__all__ = ["FIX_STRATEGY", "frozen_stage_fix", "memory_cap_fix", "or_list", "strategy_fix"]

FIX_STRATEGY = "use `--cost-strategy constrained` (or `cost_strategy: constrained` under `parallelism:`)"


def or_list(items: list[str]) -> str:
    """``a, b or c``: the ways out, in the order given."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def strategy_fix(strategy: str) -> list[str]:
    """``[FIX_STRATEGY]`` unless the plan already comes from ``constrained``."""
    return [] if strategy == "constrained" else [FIX_STRATEGY]


def memory_cap_fix(cfg: PlannerConfig, strategy: str, n_blocks: int) -> str:
    """The ways to fit under ``memory_cap_gib`` that this config has not taken yet."""
    run = cfg.run
    ways = ["raise the cap"]
    if run.pp < n_blocks:
        ways.append("use a larger pp")
    if run.zero_stage == 0 and run.dp > 1:  # ZeRO-1 shards the optimizer state over dp: nothing to shard at dp=1
        ways.append("optimizer.zero_stage: 1")
    if run.engine == "afab":
        ways.append("the 1f1b engine (fewer micro-batches in flight)")
    if strategy != "memory":
        ways.append("`--cost-strategy memory` (it balances the estimate's additive part)")
    return or_list(ways)


def frozen_stage_fix(cfg: PlannerConfig, strategy: str, n_trainable: int) -> str:
    """What to change about a stage that holds only frozen parameters, given whether the config allows it
    (``allow_frozen_stages``) and how many trainable blocks the model has (``n_trainable``)."""
    pp = cfg.run.pp
    if cfg.ext.allow_frozen_stages:
        if n_trainable < pp:
            how = f"unfreeze more blocks (only {n_trainable} train, for pp={pp}) or lower pp to {max(n_trainable, 1)}"
        else:
            how = or_list(
                [f"{w} with `allow_frozen_stages: false`" for w in strategy_fix(strategy)]
                or [
                    "set `allow_frozen_stages: false` under `nanotron_ext:` (constrained then puts a "
                    "trainable block on every stage)"
                ]
            )
        return f"none needed (`allow_frozen_stages: true` allows it); to train on every stage instead, {how}"
    ways = [f"{w} to put a trainable block on every stage" for w in strategy_fix(strategy) if n_trainable >= pp]
    ways += [
        "set `allow_frozen_stages: true` under `nanotron_ext:` to run it frozen",
        f"lower pp{f' to {n_trainable}' if 0 < n_trainable < pp else ''}",
    ]
    return or_list(ways)
