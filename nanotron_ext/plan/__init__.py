"""Plan: one strategy's block → stage split as plain data, with what each stage costs and the validator's
findings (what cannot train, why, and what to change)."""

from nanotron_ext.plan.compare import Attempt, plan_every_strategy
from nanotron_ext.plan.engine_choice import (
    AUTO_ENGINES,
    CONTIGUOUS_AUTO_ENGINES,
    EngineChoice,
    EngineOption,
    choose_engine,
    engine_option,
    resolve_engine,
)
from nanotron_ext.plan.make import make_plan, plan_with_ranks
from nanotron_ext.plan.types import Finding, Plan, StagePlan
from nanotron_ext.plan.validate import cannot_train_message, validate_plan
from nanotron_ext.plan.vocab import VocabChoice, resolve_vocab_shards

__all__ = [
    "AUTO_ENGINES",
    "CONTIGUOUS_AUTO_ENGINES",
    "Attempt",
    "EngineChoice",
    "EngineOption",
    "Finding",
    "Plan",
    "StagePlan",
    "VocabChoice",
    "cannot_train_message",
    "choose_engine",
    "engine_option",
    "make_plan",
    "plan_every_strategy",
    "plan_with_ranks",
    "resolve_engine",
    "resolve_vocab_shards",
    "validate_plan",
]
