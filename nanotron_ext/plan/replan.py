"""A run's re-plan after K steps: the plan it trains and the fastest one under the same memory, both priced by the
run's own steps (the in-run profile), and whether the gap is worth a move.

The new plan is the config's own strategy when it prices steps (``constrained``, ``profiled``), else
``constrained``: a fixed rule (``layout``, ``nanotron``, ``uniform``, ...) would return the split the run already
has. Its engine is the run's own, or the fastest contiguous one where ``replan.engine`` (or ``pp_engine: auto``)
allows it. The memory is the run's: ``memory_cap_gib`` where set, else the largest stage peak of the plan it
trains, so a move never makes a stage hold more than the run already asks of its largest one.

Entry point: :func:`choose_replan`; the CPU runtime (:mod:`nanotron_ext.runtime.replan`) makes the move.
"""

from __future__ import annotations

import dataclasses
import enum
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanotron_ext.config import PlannerConfig
from nanotron_ext.costs.analytic import GIB
from nanotron_ext.errors import ConfigError
from nanotron_ext.inventory.model import BlockInfo
from nanotron_ext.plan.engine_choice import CONTIGUOUS_AUTO_ENGINES, choose_engine, predicted_step
from nanotron_ext.plan.make import plan_with_ranks
from nanotron_ext.plan.types import Plan
from nanotron_ext.report import format_seconds, human_bytes
from nanotron_ext.schedule import V_ENGINE

__all__ = [
    "PRICED_STRATEGIES",
    "REPLAN_CALIBRATE_REPEATS",
    "ReplanChoice",
    "Verdict",
    "choose_replan",
    "gain_noise",
    "measured_lines",
    "replan_engines",
    "replan_profiles",
    "short_run_note",
    "with_replan_after",
]

#: Repeats of the standalone calibration a re-plan takes where the config names no machine profile: it prices only
#: the links, the all-reduces and what the run's own steps did not time.
REPLAN_CALIBRATE_REPEATS = 1
#: Strategies whose split is the fastest simulated step on the config's machine: a re-plan keeps them.
PRICED_STRATEGIES: tuple[str, ...] = ("constrained", "profiled")


class Verdict(enum.Enum):
    """What a re-plan decides."""

    MOVE = "move"
    BEST = "already on the fastest plan"
    SMALL = "gain below min_gain"
    NOISY = "gain within the run's noise"


@dataclass(frozen=True)
class ReplanChoice:
    """The plan a run trains and the fastest one under its memory, each with its predicted step (seconds).

    Attributes:
        step: the step after which the run re-planned.
        old / new: the two plans (``new`` is ``old`` when nothing is faster).
        old_step / new_step: their simulated steps under the in-run profile.
        noise: how far the predicted gain moves between the halves of the run's timed steps (:func:`gain_noise`).
        min_gain: ``replan.min_gain``.
        cap_bytes: the memory every stage of the new plan fits in.
        verdict: what the run does.
        engine_lines: how the engines compared, where the re-plan could change the engine.
    """

    step: int
    old: Plan
    new: Plan
    old_step: float
    new_step: float
    noise: float
    min_gain: float
    cap_bytes: float
    verdict: Verdict
    engine_lines: tuple[str, ...] = ()

    @property
    def gain(self) -> float:
        """The predicted gain of the new plan, a fraction of the old step."""
        return _gain(self.old_step, self.new_step)

    @property
    def moves(self) -> bool:
        return self.verdict is Verdict.MOVE

    def lines(self) -> list[str]:
        """What rank 0 prints: both plans and their predicted steps, and what the run does."""

        def plan_line(title: str, plan: Plan, step: float) -> str:
            peak = max(s.memory_bytes for s in plan.stages)
            return (
                f"  {title} {plan.split_text}  {plan.engine}  predicted {format_seconds(step)}  "
                f"peak {human_bytes(peak)}"
            )

        head = f"replan after step {self.step}, priced by the run's own steps (in-run profile):"
        body = [plan_line("now: ", self.old, self.old_step)]
        if self.new is not self.old:
            body.append(plan_line("best:", self.new, self.new_step))
        cap = f"every stage within {human_bytes(self.cap_bytes)}"
        gain = f"predicted gain {self.gain:.1%} ({cap}), min_gain {self.min_gain:.1%}, run's noise {self.noise:.1%}"
        what = {
            Verdict.MOVE: f"{gain}: moving to the new plan",
            Verdict.BEST: f"the run is on the fastest plan under its memory ({cap}): staying",
            Verdict.SMALL: f"{gain}: below min_gain, staying",
            Verdict.NOISY: f"{gain}: the gain is within the noise of the run's own steps, staying",
        }[self.verdict]
        return [head, *body, *(f"  {line}" for line in self.engine_lines), f"  {what}"]


def with_replan_after(cfg: PlannerConfig, after_steps: int | None) -> PlannerConfig:
    """``cfg`` with ``--replan-after K`` applied (the YAML's other replan keys stay); a V with a re-plan refused.

    Raises:
        ConfigError: the run re-plans and trains a V.
    """
    if after_steps is not None:
        cfg = cfg.with_overrides(replan=dataclasses.replace(cfg.ext.replan, after_steps=after_steps))
    if cfg.ext.replan.after_steps is not None and cfg.run.engine == V_ENGINE:
        raise ConfigError(
            "nanotron_ext.replan re-plans contiguous splits, not a V yet: drop replan, or train under "
            "pp_engine 1f1b, zb1p, zb2p or auto"
        )
    return cfg


def short_run_note(after_steps: int, steps: int) -> str:
    """What rank 0 says of a run of ``steps`` steps, at most ``after_steps``: no re-plan."""
    return (
        f"replan after step {after_steps}: the run has {steps} steps, so it trains its plan to the end without "
        f"re-planning"
    )


def replan_engines(cfg: PlannerConfig, *, engine_was_auto: bool) -> tuple[str, ...]:
    """The engines a re-plan may pick: the run's, or every contiguous one (``replan.engine: auto``, or unset under
    ``pp_engine: auto``)."""
    wanted = cfg.ext.replan.engine or ("auto" if engine_was_auto else "keep")
    return CONTIGUOUS_AUTO_ENGINES if wanted == "auto" else (cfg.run.engine,)


def choose_replan(
    cfg: PlannerConfig,
    blocks: Sequence[BlockInfo],
    trained: Plan,
    *,
    step: int,
    engines: Sequence[str],
    halves: Sequence[PlannerConfig] = (),
) -> ReplanChoice:
    """Price ``trained`` and the fastest plan among ``engines`` on ``cfg``'s machine (the in-run profile), under
    the run's memory, and decide.

    Args:
        cfg: the run's config with ``machine`` set to the in-run profile.
        blocks: its inventory; trained: the plan the run trains.
        step: the step after which it re-plans.
        engines: the engines the new plan may use.
        halves: ``cfg`` priced by the first and by the second half of the timed steps, for the gain's noise
            (:func:`gain_noise`); none where the run timed fewer than two steps.

    Raises:
        ConfigError: the run's engine is not among ``engines`` and none of them fits (it then stays).
    """
    strategy = cfg.ext.cost_strategy if cfg.ext.cost_strategy in PRICED_STRATEGIES else "constrained"
    priced = cfg.with_overrides(cost_strategy=strategy, engine=trained.engine)
    old = plan_with_ranks(blocks, priced, trained.block_ranks, trained.strategy, suggest_fixes=False)
    cap = (
        cfg.ext.memory_cap_gib * GIB if cfg.ext.memory_cap_gib is not None else max(s.memory_bytes for s in old.stages)
    )
    capped = priced.with_overrides(memory_cap_gib=cap / GIB)
    old_step = predicted_step(capped, blocks, old.block_ranks)
    engine_lines: tuple[str, ...] = ()
    try:
        choice = choose_engine(capped, engines)
        best = choice.chosen
        engine_lines = tuple(choice.lines(head="engines: ")) if len(engines) > 1 else ()
    except ConfigError:
        if trained.engine not in engines:
            raise
        best = None
    new, new_step = old, old_step
    if (
        best is not None
        and best.ok
        and isinstance(best.plan, Plan)
        and best.step_time is not None
        and best.step_time < old_step
        and (best.plan.block_ranks != old.block_ranks or best.engine != old.engine)
    ):
        new, new_step = best.plan, best.step_time
    gain = _gain(old_step, new_step)
    noise = gain_noise([h.with_overrides(cost_strategy=strategy) for h in halves], blocks, old, new)
    verdict = (
        Verdict.BEST
        if new is old
        else Verdict.SMALL
        if gain < cfg.ext.replan.min_gain
        else Verdict.NOISY
        if noise >= gain
        else Verdict.MOVE
    )
    return ReplanChoice(step, old, new, old_step, new_step, noise, cfg.ext.replan.min_gain, cap, verdict, engine_lines)


def gain_noise(halves: Sequence[PlannerConfig], blocks: Sequence[BlockInfo], old: Plan, new: Plan) -> float:
    """Half the gap between the gain of ``new`` over ``old`` priced by each half of the run's timed steps; 0 without
    two halves.

    The noise of the decision, not of the steps: a half that ran uniformly slower (another job on the node, a
    throttled clock) moves both predicted steps alike and leaves the gain where it was, so it is no reason to stay.
    """
    if len(halves) != 2:
        return 0.0
    gains = [
        _gain(
            predicted_step(h.with_overrides(engine=old.engine), blocks, old.block_ranks),
            predicted_step(h.with_overrides(engine=new.engine), blocks, new.block_ranks),
        )
        for h in halves
    ]
    return abs(gains[0] - gains[1]) / 2


def _gain(old_step: float, new_step: float) -> float:
    """The gain of a step of ``new_step`` over ``old_step``: a fraction of the old step."""
    return 1.0 - new_step / old_step if old_step > 0 else 0.0


def measured_lines(
    choice: ReplanChoice, before: Sequence[float], after: Sequence[float], *, first_timed: int
) -> list[str]:
    """Rank 0's measured steps against what the re-plan predicted.

    Args:
        choice: the re-plan's decision (``choice.step``: the last step before it).
        before: the wall time of each timed step before the re-plan, from step ``first_timed`` to ``choice.step``.
        after: each step from ``choice.step + 2`` on (step ``choice.step + 1`` is the first of a new build, as the
            run's first step was; not timed).
    """
    k, mean_before = choice.step, statistics.fmean(before)
    lines = [
        f"replan: steps {first_timed}-{k} on {choice.old.split_text} ({choice.old.engine}) measured "
        f"{format_seconds(mean_before)} a step, predicted {format_seconds(choice.old_step)} "
        f"({mean_before / choice.old_step:.3f}x of predicted)"
    ]
    if after:
        mean_after = statistics.fmean(after)
        plan, predicted = (choice.new, choice.new_step) if choice.moves else (choice.old, choice.old_step)
        what = "after the move" if choice.moves else "after the re-plan"
        lines.append(
            f"replan: steps {k + 2}-{k + 1 + len(after)} {what}, on {plan.split_text} ({plan.engine}), "
            f"measured {format_seconds(mean_after)} a step, predicted {format_seconds(predicted)} "
            f"({mean_after / predicted:.3f}x of predicted; {mean_after / mean_before:.3f}x of the steps "
            f"before)"
        )
    return lines


def replan_profiles(
    cfg: PlannerConfig, block_ranks: Sequence[int], gathered: Any, n_timed: int, rank: int, folder: Path
) -> list[Path]:
    """The in-run profile of a run's timed steps, then (from two timed steps) those of their first and second halves,
    for the gain's noise; written to ``folder`` on every rank, the same on each (collective).

    Args:
        cfg: the run's config; its ``machine`` profile is the base, else a standalone calibration taken now.
        block_ranks: the split the steps ran on; gathered: the clock's ``gather()`` (None off rank 0).
        n_timed: the steps every rank timed; rank: this process's global rank.
    """
    from nanotron_ext.machine import load_machine
    from nanotron_ext.machine.calibrate import calibrate
    from nanotron_ext.machine.in_run_shared import shared_in_run_profile, split_steps

    base = (
        load_machine(cfg.ext.machine)
        if cfg.ext.machine is not None
        else calibrate(cfg, warmup=1, repeats=REPLAN_CALIBRATE_REPEATS, progress=False)
    )
    half = n_timed // 2  # every rank timed the same steps: the same calls on each
    parts = [slice(None)] + ([slice(None, half), slice(half, None)] if n_timed >= 2 else [])
    paths = []
    for i, part in enumerate(parts):
        steps = None if gathered is None else [rank_steps[part] for rank_steps in gathered]
        profile = shared_in_run_profile(cfg, [split_steps(block_ranks, steps)], base, rank, what="replan")
        paths.append(folder / f"in_run_profile_{i}.json")
        paths[-1].write_text(profile.to_json())
    return paths
