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

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from nanotron_ext.config import PlannerConfig
from nanotron_ext.costs.analytic import GIB
from nanotron_ext.errors import ConfigError
from nanotron_ext.inventory.model import BlockInfo
from nanotron_ext.plan.engine_choice import CONTIGUOUS_AUTO_ENGINES, choose_engine, predicted_step
from nanotron_ext.plan.make import plan_with_ranks
from nanotron_ext.plan.types import Plan
from nanotron_ext.report import format_seconds, human_bytes

__all__ = ["PRICED_STRATEGIES", "ReplanChoice", "Verdict", "choose_replan", "gain_noise", "replan_engines"]

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
            return (f"  {title} {plan.split_text}  {plan.engine}  predicted {format_seconds(step)}  "
                    f"peak {human_bytes(peak)}")

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


def replan_engines(cfg: PlannerConfig, *, engine_was_auto: bool) -> tuple[str, ...]:
    """The engines a re-plan may pick: the run's, or every contiguous one (``replan.engine: auto``, or unset under
    ``pp_engine: auto``)."""
    wanted = cfg.ext.replan.engine or ("auto" if engine_was_auto else "keep")
    return CONTIGUOUS_AUTO_ENGINES if wanted == "auto" else (cfg.run.engine,)


def choose_replan(cfg: PlannerConfig, blocks: Sequence[BlockInfo], trained: Plan, *, step: int,
                  engines: Sequence[str], halves: Sequence[PlannerConfig] = ()) -> ReplanChoice:
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
    cap = cfg.ext.memory_cap_gib * GIB if cfg.ext.memory_cap_gib is not None else max(
        s.memory_bytes for s in old.stages)
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
    if (best is not None and best.ok and isinstance(best.plan, Plan) and best.step_time is not None
            and best.step_time < old_step
            and (best.plan.block_ranks != old.block_ranks or best.engine != old.engine)):
        new, new_step = best.plan, best.step_time
    gain = _gain(old_step, new_step)
    noise = gain_noise([h.with_overrides(cost_strategy=strategy) for h in halves], blocks, old, new)
    verdict = (Verdict.BEST if new is old else Verdict.SMALL if gain < cfg.ext.replan.min_gain
               else Verdict.NOISY if noise >= gain else Verdict.MOVE)
    return ReplanChoice(step, old, new, old_step, new_step, noise, cfg.ext.replan.min_gain, cap, verdict,
                        engine_lines)


def gain_noise(halves: Sequence[PlannerConfig], blocks: Sequence[BlockInfo], old: Plan, new: Plan) -> float:
    """Half the gap between the gain of ``new`` over ``old`` priced by each half of the run's timed steps; 0 without
    two halves.

    The noise of the decision, not of the steps: a half that ran uniformly slower (another job on the node, a
    throttled clock) moves both predicted steps alike and leaves the gain where it was, so it is no reason to stay.
    """
    if len(halves) != 2:
        return 0.0
    gains = [_gain(predicted_step(h.with_overrides(engine=old.engine), blocks, old.block_ranks),
                   predicted_step(h.with_overrides(engine=new.engine), blocks, new.block_ranks)) for h in halves]
    return abs(gains[0] - gains[1]) / 2


def _gain(old_step: float, new_step: float) -> float:
    """The gain of a step of ``new_step`` over ``old_step``: a fraction of the old step."""
    return 1.0 - new_step / old_step if old_step > 0 else 0.0
