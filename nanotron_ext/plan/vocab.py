"""``nanotron_ext.vocab_shards: auto``: the number of vocabulary shards the step-time objective likes best."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nanotron_ext.config import VOCAB_SHARDS_AUTO, PlannerConfig, vocab_shard_candidates
from nanotron_ext.errors import ConfigError, PlanningError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.partition import bounds_from_ranks
from nanotron_ext.partition.schedule_aware import StepTimeEvaluator
from nanotron_ext.plan.make import make_plan
from nanotron_ext.schedule import V_ENGINE
from nanotron_ext.strategies.step_time import schedule_problem

__all__ = ["VocabChoice", "resolve_vocab_shards", "vocab_shard_candidates"]

#: A larger K must beat the best smaller one by this much: each shard is one more block, one more p2p hop
#: and one more label copy, which the FLOP-rate model does not charge.
MIN_GAIN = 0.01


@dataclass(frozen=True)
class VocabChoice:
    """What ``auto`` chose: ``shards``, and the simulated step time (seconds) of each candidate it planned."""

    shards: int
    step_times: dict[int, float]


def resolve_vocab_shards(cfg: PlannerConfig) -> tuple[PlannerConfig, VocabChoice | None]:
    """Replace ``vocab_shards: auto`` by the K whose plan has the smallest simulated step.

    Each candidate is planned with the config's strategy (by default ``constrained``) and priced by the
    step-time objective on the config's machine (:func:`nanotron_ext.machine.machine_for`). A larger K wins only if it
    is at least :data:`MIN_GAIN` faster. Candidates that cannot be planned are skipped.

    Args:
        cfg: a loaded config.

    Returns:
        ``(cfg with an integer vocab_shards, the choice)``; the config unchanged and None when it was not ``auto``.

    Raises:
        PlanningError: no candidate can be planned (the error of the first one).
    """
    if cfg.ext.vocab_shards != VOCAB_SHARDS_AUTO:
        return cfg, None
    if cfg.run.engine == V_ENGINE:
        raise ConfigError(
            "vocab_shards: auto chooses K by the contiguous plans' simulated steps; pp_engine zbv plans "
            "a V: give vocab_shards a number (1 keeps Nanotron's lm_head)"
        )
    times: dict[int, float] = {}
    best: int | None = None
    first_error: PlanningError | None = None
    for k in vocab_shard_candidates(cfg):
        trial = dataclasses.replace(cfg, ext=dataclasses.replace(cfg.ext, vocab_shards=k))
        blocks = inventory_from_config(trial)
        try:
            plan = make_plan(blocks, trial)
        except PlanningError as exc:  # a K that cannot be planned (too few blocks for pp) is not a candidate
            first_error = first_error or exc
            continue
        problem = schedule_problem(blocks, trial)  # the config's machine, as the plan was made under
        bounds = bounds_from_ranks(plan.block_ranks, cfg.run.pp)
        times[k] = float(StepTimeEvaluator(problem)([bounds])[0])
        if best is None or times[k] < times[best] * (1.0 - MIN_GAIN):
            best = k
    if best is None:
        assert first_error is not None
        raise first_error
    resolved = dataclasses.replace(cfg, ext=dataclasses.replace(cfg.ext, vocab_shards=best))
    return resolved, VocabChoice(best, times)
