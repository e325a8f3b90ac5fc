"""Which plan a resume trains: by default the split the checkpoint was trained with, even where pricing would
choose another today (a re-measured profile, ``vocab_shards: auto``); another one only where the config asks for
what the recorded split cannot be (another pp or number of vocabulary shards, another explicit layout) or the
user asks to re-plan (``nanotron_ext.resume_plan: replan``, ``--replan``). Either way it says so in one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import get_args

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.checkpoint.locate import ResumeSource
from nanotron_ext.checkpoint.record import ModelKey, PlanRecord, record_for
from nanotron_ext.config import PlannerConfig, ResumePlan
from nanotron_ext.errors import CheckpointError, PlanningError
from nanotron_ext.machine import MachineProfile
from nanotron_ext.plan import AUTO_ENGINES, CONTIGUOUS_AUTO_ENGINES, EngineChoice, Plan, plan_with_ranks, resolve_engine
from nanotron_ext.plan.v_plan import VPlan, make_v_plan

__all__ = [
    "RESUME_PLANS",
    "ResumeChoice",
    "ResumePlan",
    "check_same_model",
    "choose_plan",
    "kept_vocab_shards",
    "launch_engine",
]

RESUME_PLANS: tuple[str, ...] = get_args(ResumePlan)


@dataclass(frozen=True)
class ResumeChoice:
    """The plan a resume trains, whether it is the recorded one, and the line that says why."""

    plan: Plan | VPlan
    kept: bool
    note: str


def check_same_model(source: ResumeSource, cfg: PlannerConfig) -> None:
    """Refuse, before anything is built, a checkpoint of another model than the config's.

    Raises:
        CheckpointError: the recorded model differs (names both, and what to do).
    """
    record = source.record
    if record is None or record.model is None:
        return
    now = ModelKey(
        cfg.model.family,
        cfg.model.hidden_size,
        cfg.model.num_hidden_layers,
        cfg.model.vocab_size,
        cfg.model.tie_word_embeddings,
    )
    if record.model != now:
        raise CheckpointError(
            f"{source.label} ({source.folder}) holds another model than {cfg.source}: {record.model} against {now}; "
            f"point checkpoints.resume_checkpoint_path at a checkpoint of this model, or fix model_config"
        )


def kept_vocab_shards(source: ResumeSource | None, cfg: PlannerConfig, mode: ResumePlan) -> int | None:
    """The number of vocabulary shards to keep under ``vocab_shards: auto``: the recorded one, unless re-planning."""
    if source is None or source.record is None or mode == "replan" or cfg.ext.vocab_shards != "auto":
        return None
    return source.record.vocab_shards


def launch_engine(cfg: PlannerConfig) -> tuple[PlannerConfig, EngineChoice | None]:
    """``pp_engine: auto`` resolved as a launch resolves it (the launcher, and the resume ``plan --checkpoint``
    describes): among every engine, the V priced with its sends held as Nanotron's trainer runs them; only among the
    contiguous ones under a re-plan after K steps, which moves between contiguous splits.

    Raises:
        ConfigError: as :func:`~nanotron_ext.plan.resolve_engine`.
    """
    engines = CONTIGUOUS_AUTO_ENGINES if cfg.ext.replan.after_steps is not None else AUTO_ENGINES
    return resolve_engine(cfg, engines, sends_wait=True)


def _why_not_kept(record: PlanRecord, now: PlanRecord, cfg: PlannerConfig) -> str | None:
    """Why the recorded split cannot be kept under ``cfg`` (``now``: the record of today's plan); None if it can."""
    if record.pp != cfg.run.pp:
        return f"the config asks pp={cfg.run.pp}, the checkpoint was trained at pp={record.pp}"
    if record.vocab_shards != now.vocab_shards:
        return f"the config asks {now.vocab_shards} vocabulary shard(s), the checkpoint has {record.vocab_shards}"
    if now.blocks != record.blocks:
        return "the model's pipeline blocks differ from the recorded ones"
    if bool(record.v_stages) != bool(now.v_stages):
        return (
            f"the config asks pp_engine {now.engine}, the checkpoint was trained on "
            f"{'a V (pp_engine zbv)' if record.v_stages else f'a contiguous split ({record.engine})'}"
        )
    if cfg.ext.cost_strategy == "layout" and (now.stages, now.v_stages) != (record.stages, record.v_stages):
        return f"the config's layout {cfg.ext.layout!r} asks for another split"
    return None


def _recorded_plan(record: PlanRecord, blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> Plan | VPlan | str:
    """The recorded split planned under ``cfg``, or why it cannot train there."""
    if record.v_stages:
        try:
            return make_v_plan(blocks, cfg, v_stages=record.v_stages, strategy=record.strategy)
        except PlanningError as exc:
            return str(exc)
    kept = plan_with_ranks(blocks, cfg, record.stages, record.strategy)
    return kept if kept.ok else next(f.message for f in kept.findings if f.severity == "error")


def choose_plan(
    today: Plan | VPlan,
    blocks: Sequence[BlockInfo],
    cfg: PlannerConfig,
    source: ResumeSource,
    machine: MachineProfile,
    *,
    mode: ResumePlan = "keep",
) -> ResumeChoice:
    """The plan a resume of ``source`` trains, given the plan made ``today`` for the same blocks.

    Args:
        today: the plan the config makes now.
        blocks: the model's blocks (as planned today).
        cfg: the config.
        source: the checkpoint.
        machine: the machine model that priced today's plan (for the record of what changed).
        mode: ``keep`` (default) or ``replan``.
    """
    if mode not in RESUME_PLANS:
        raise CheckpointError(
            f"nanotron_ext.resume_plan={mode!r} is unknown; use keep (the default: train the "
            f"checkpoint's recorded split) or replan"
        )
    now = record_for(today, cfg, machine)
    record = source.record
    if record is None:
        return ResumeChoice(
            today,
            False,
            f"{source.label} has no nanotron_ext plan record (Nanotron saved it alone): its "
            f"state is placed by name onto today's split {now.layout}",
        )
    if mode == "replan":
        same = (
            "the same split"
            if (record.stages, record.v_stages, record.blocks) == (now.stages, now.v_stages, now.blocks)
            else now.layout
        )
        return ResumeChoice(
            today,
            False,
            f"re-planning as asked (resume_plan: replan): {source.label} was trained on "
            f"{record.layout} ({record.strategy}, pp={record.pp}); today: {same}",
        )
    why = _why_not_kept(record, now, cfg)
    if why is None:
        kept = _recorded_plan(record, blocks, cfg)
        if not isinstance(kept, str):
            if (kept.block_ranks, kept.engine) == (today.block_ranks, today.engine):
                tail = ", which is today's plan too"
            else:
                tail = (
                    f"; today {today.strategy!r} would choose {now.layout}: set nanotron_ext.resume_plan: replan "
                    f"(or --replan) to move to it"
                )
            return ResumeChoice(
                kept,
                True,
                f"resuming {source.label} on its recorded split {record.layout} "
                f"({record.strategy}, pp={record.pp}){tail}",
            )
        why = f"the recorded split cannot train under today's config ({kept})"
    return ResumeChoice(
        today,
        False,
        f"{why}: {source.label} ({record.layout}) moves onto the new plan {now.layout}; "
        f"its weights, optimizer states and learning-rate schedule go to their new owners",
    )
