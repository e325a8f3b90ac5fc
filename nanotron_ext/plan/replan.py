"""A run's re-plan after K steps: the plan it trains, priced by the run's own steps (the in-run profile), and the
plans worth trying against it under the same memory.

The prices decide what to try, never what to keep: every plan the re-plan proposes is tried against the run's own
in turns (:mod:`nanotron_ext.plan.replan_trial`), and the run keeps the one it measured faster. What to try:

1. The fastest plan under each engine the re-plan may pick: the config's own strategy where it prices steps
   (``constrained``, ``profiled``), else ``constrained`` (a fixed rule, ``layout`` or ``nanotron``, would return the
   split the run already has); then the splits around the fastest one (each cut moved by up to
   :data:`NEIGHBOUR_REACH` blocks, and theirs in turn), priced by the same simulator.
2. The profile's error: the larger of :data:`PROFILE_ERROR`, the held-out error the in-run profile is measured to
   have, and the run's own noise (the gain priced by the first and by the second half of its timed steps, half their
   gap: :func:`gain_noise`).
3. A plan is a candidate when it is within that error of the fastest (a close call between them is measured, not
   guessed; where the run's own plan is the fastest priced, within that error of it) and could, at that error, gain
   ``min_gain`` over the run's plan; the fastest first, at most ``replan.trials`` of them.

The memory is the run's: ``memory_cap_gib`` where set, else the largest stage peak of the plan it trains, so a move
never makes a stage hold more than the run already asks of its largest one.

Entry point: :func:`choose_replan`; :class:`nanotron_ext.integration.replan_session.ReplanSession` runs the trial.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nanotron_ext.config import PlannerConfig
from nanotron_ext.config_ext import replan_after_steps
from nanotron_ext.costs.analytic import GIB
from nanotron_ext.errors import ConfigError, PlanningError
from nanotron_ext.inventory.model import BlockInfo
from nanotron_ext.partition import bounds_from_ranks, ranks_from_bounds
from nanotron_ext.plan.engine_choice import CONTIGUOUS_AUTO_ENGINES, choose_engine, predicted_step
from nanotron_ext.plan.make import plan_with_ranks
from nanotron_ext.plan.replan_trial import trial_length
from nanotron_ext.plan.types import Plan
from nanotron_ext.report import format_seconds, human_bytes
from nanotron_ext.schedule import V_ENGINE

__all__ = [
    "NEIGHBOUR_REACH",
    "PRICED_STRATEGIES",
    "PROFILE_ERROR",
    "Candidate",
    "ReplanChoice",
    "Verdict",
    "choose_replan",
    "gain_noise",
    "replan_engines",
    "short_run_note",
    "with_replan_after",
]

#: Strategies whose split is the fastest simulated step on the config's machine: a re-plan keeps them.
PRICED_STRATEGIES: tuple[str, ...] = ("constrained", "profiled")
#: The least error the re-plan grants the in-run profile's price of a split it did not train: the aim for its
#: held-out error. Measured wider on the SmolLM shape at pp = 2 (0.920-1.108 over three quiet runs, docs/in-run.md), so
#: a plan beyond it may go untried; what is tried is still measured before it is kept.
PROFILE_ERROR = 0.03
#: How far (in blocks) a cut of the fastest split moves to make the splits around it.
NEIGHBOUR_REACH = 2
#: The most splits the search around the fastest one prices.
NEIGHBOUR_BUDGET = 400


class Verdict(enum.Enum):
    """What a re-plan decides before any trial."""

    TRY = "trying plans against the run's in turns"
    BEST = "already on the fastest plan"
    SMALL = "gain below min_gain"
    SHORT = "too few steps left to try a plan"


@dataclass(frozen=True)
class Candidate:
    """A plan the run may try, and its simulated step (s) under the in-run profile."""

    plan: Plan
    step: float

    @property
    def key(self) -> tuple[tuple[int, ...], str]:
        return tuple(self.plan.block_ranks), self.plan.engine


@dataclass(frozen=True)
class ReplanChoice:
    """The plan a run trains and the plans it will try against it, each with its predicted step (s).

    Attributes:
        step: the step after which the run re-planned.
        old / old_step: the run's plan and its simulated step under the in-run profile.
        candidates: the plans to try, fastest first (none unless the verdict is ``TRY``).
        fastest: the fastest plan found (the run's own where nothing is faster).
        noise: how far the predicted gain moves between the halves of the run's timed steps (:func:`gain_noise`).
        error: the profile's error: the larger of :data:`PROFILE_ERROR` and ``noise``.
        min_gain: ``replan.min_gain``; cap_bytes: the memory every stage of a candidate fits in.
        verdict: what the run does; engine_lines: how the engines compared, where the re-plan could change it.
        trial_steps: the steps the trial takes (0 without one).
    """

    step: int
    old: Plan
    old_step: float
    candidates: tuple[Candidate, ...]
    fastest: Candidate
    noise: float
    error: float
    min_gain: float
    cap_bytes: float
    verdict: Verdict
    engine_lines: tuple[str, ...] = ()
    trial_steps: int = 0

    @property
    def gain(self) -> float:
        """The fastest plan's predicted gain over the run's, a fraction of the run's step."""
        return _gain(self.old_step, self.fastest.step)

    @property
    def tries(self) -> bool:
        return self.verdict is Verdict.TRY

    @property
    def plans(self) -> tuple[Plan, ...]:
        """The trial's plans: the run's first, then the candidates."""
        return (self.old, *(c.plan for c in self.candidates))

    def lines(self) -> list[str]:
        """What rank 0 prints: the run's plan, each candidate, and what the run does."""

        def plan_line(title: str, c: Candidate) -> str:
            peak = max(s.memory_bytes for s in c.plan.stages)
            speed = "" if c.plan is self.old else f"  {self.old_step / c.step:.3f}x as fast"
            return (
                f"  {title:<6} {c.plan.split_text}  {c.plan.engine}  predicted {format_seconds(c.step)}  "
                f"peak {human_bytes(peak)}{speed}"
            )

        head = f"replan after step {self.step}, priced by the run's own steps (in-run profile):"
        shown = self.candidates or ((self.fastest,) if self.fastest.plan is not self.old else ())
        body = [plan_line("now:", Candidate(self.old, self.old_step))]
        body += [plan_line(f"try {i}:" if self.tries else "best:", c) for i, c in enumerate(shown, 1)]
        cap = f"every stage within {human_bytes(self.cap_bytes)}"
        gain = (
            f"predicted gain {self.gain:.1%} ({cap}), min_gain {self.min_gain:.1%}, the profile's error "
            f"{self.error:.1%} (held-out {PROFILE_ERROR:.1%}, run's noise {self.noise:.1%})"
        )
        what = {
            Verdict.TRY: f"{gain}: trying {len(self.candidates)} plan(s) against the run's in turns, "
            f"{self.trial_steps} steps",
            Verdict.BEST: f"the run is on the fastest plan under its memory ({cap}): staying",
            Verdict.SMALL: f"{gain}: below min_gain even at the profile's error, staying",
            Verdict.SHORT: f"{gain}: a trial takes {self.trial_steps} steps, more than the run has left: staying "
            f"(a plan is kept only where it is measured)",
        }[self.verdict]
        return [head, *body, *(f"  {line}" for line in self.engine_lines), f"  {what}"]

    def to_dict(self) -> dict[str, Any]:
        def plan(p: Plan, step: float) -> dict[str, Any]:
            return {"split": p.split_text, "engine": p.engine, "predicted_step_s": step}

        return {
            "after_step": self.step,
            "verdict": self.verdict.value,
            "old": plan(self.old, self.old_step),
            "fastest": plan(self.fastest.plan, self.fastest.step),
            "candidates": [plan(c.plan, c.step) for c in self.candidates],
            "predicted_gain": self.gain,
            "noise": self.noise,
            "profile_error": self.error,
            "min_gain": self.min_gain,
            "cap_bytes": self.cap_bytes,
            "trial_steps": self.trial_steps,
        }


def with_replan_after(cfg: PlannerConfig, after_steps: object) -> PlannerConfig:
    """``cfg`` with ``--replan-after K`` applied (the flag's text or number, checked by the rule the YAML's key has,
    naming the flag); the YAML's other replan keys stay. A V with a re-plan refused.

    Raises:
        ConfigError: K is not a whole number of at least 2; the run re-plans and trains a V.
    """
    if after_steps is not None:
        k = replan_after_steps(after_steps, "--replan-after")
        cfg = cfg.with_overrides(replan=dataclasses.replace(cfg.ext.replan, after_steps=k))
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
    steps_left: int | None = None,
) -> ReplanChoice:
    """Price ``trained`` and the plans around the fastest among ``engines`` on ``cfg``'s machine (the in-run
    profile), under the run's memory, and decide what to try (see the module docstring).

    Args:
        cfg: the run's config with ``machine`` set to the in-run profile.
        blocks: its inventory; trained: the plan the run trains.
        step: the step after which it re-plans.
        engines: the engines a candidate may use.
        halves: ``cfg`` priced by the first and by the second half of the timed steps, for the gain's noise
            (:func:`gain_noise`); none where the run timed fewer than two steps.
        steps_left: the steps the run has after ``step`` (None: as many as a trial needs).

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
    bests, engine_lines = _engine_bests(capped, engines, trained.engine)
    own = Candidate(old, old_step)
    fastest = min((c for c in bests if c.key != own.key), key=lambda c: c.step, default=own)
    noise = (
        gain_noise([h.with_overrides(cost_strategy=strategy) for h in halves], blocks, old, fastest.plan)
        if fastest is not own
        else 0.0
    )
    error = max(PROFILE_ERROR, noise)
    replan = cfg.ext.replan
    args = (step, old, old_step)
    if fastest.step >= old_step:
        fastest = own  # the run's plan is the fastest priced: the close calls are the plans within the error of it
    pool = _around(capped, blocks, fastest, bests, error, strategy)
    worth = [c for c in pool if c.key != own.key and _gain(old_step, c.step) + error >= replan.min_gain]
    if not worth:
        verdict = Verdict.BEST if fastest is own else Verdict.SMALL
        return ReplanChoice(*args, (), fastest, noise, error, replan.min_gain, cap, verdict, engine_lines)
    tried = worth[: replan.trials]
    while tried and steps_left is not None and trial_length(len(tried) + 1, replan.turn_steps) > steps_left:
        tried.pop()  # the runner-ups first: the fastest is tried where anything is
    if not tried:
        needed = trial_length(2, replan.turn_steps)
        return ReplanChoice(*args, (), fastest, noise, error, replan.min_gain, cap, Verdict.SHORT, engine_lines, needed)
    length = trial_length(len(tried) + 1, replan.turn_steps)
    return ReplanChoice(
        *args, tuple(tried), fastest, noise, error, replan.min_gain, cap, Verdict.TRY, engine_lines, length
    )


def _engine_bests(
    capped: PlannerConfig, engines: Sequence[str], own_engine: str
) -> tuple[list[Candidate], tuple[str, ...]]:
    """Each engine's fastest plan that fits (the strategy's own search under that engine), and the engines' lines."""
    try:
        choice = choose_engine(capped, engines)
    except ConfigError:
        if own_engine not in engines:
            raise
        return [], ()
    bests = [
        Candidate(o.plan, o.step_time)
        for o in choice.options
        if o.ok and isinstance(o.plan, Plan) and o.step_time is not None
    ]
    return bests, tuple(choice.lines(head="engines: ")) if len(engines) > 1 else ()


def _around(
    capped: PlannerConfig,
    blocks: Sequence[BlockInfo],
    fastest: Candidate,
    bests: Sequence[Candidate],
    error: float,
    strategy: str,
) -> list[Candidate]:
    """Every plan found within ``error`` of ``fastest``'s step, fastest first: the engines' bests, and the splits
    around the fastest under its engine (each cut moved by up to :data:`NEIGHBOUR_REACH` blocks, then around those
    within the error, at most :data:`NEIGHBOUR_BUDGET` priced), each valid under the run's memory."""
    bound = fastest.step * (1 + error)
    found = {c.key: c for c in bests if c.step <= bound}
    cfg = capped.with_overrides(engine=fastest.plan.engine)
    pp = cfg.run.pp
    seen = {tuple(fastest.plan.block_ranks)}
    frontier = [(fastest.step, tuple(fastest.plan.block_ranks))]
    priced = 0
    while frontier and priced < NEIGHBOUR_BUDGET:
        _, ranks = heapq.heappop(frontier)
        for other in _neighbours(ranks, pp):
            if other in seen or priced >= NEIGHBOUR_BUDGET:
                continue
            seen.add(other)
            priced += 1
            step = predicted_step(cfg, blocks, other)
            if step > bound:
                continue
            try:
                plan = plan_with_ranks(blocks, cfg, other, strategy, suggest_fixes=False)
            except PlanningError:
                continue
            if plan.ok:
                found.setdefault((other, plan.engine), Candidate(plan, step))
                heapq.heappush(frontier, (step, other))
    return sorted(found.values(), key=lambda c: (c.step, c.key))


def _neighbours(ranks: tuple[int, ...], pp: int) -> list[tuple[int, ...]]:
    """The contiguous splits with one cut of ``ranks`` moved by 1 to :data:`NEIGHBOUR_REACH` blocks, no stage
    emptied."""
    bounds = bounds_from_ranks(list(ranks), pp)
    out = []
    for cut in range(1, pp):
        for delta in range(-NEIGHBOUR_REACH, NEIGHBOUR_REACH + 1):
            moved = list(bounds)
            moved[cut] += delta
            if delta and all(a < b for a, b in zip(moved, moved[1:])):
                out.append(tuple(ranks_from_bounds(moved)))
    return out


def gain_noise(halves: Sequence[PlannerConfig], blocks: Sequence[BlockInfo], old: Plan, new: Plan) -> float:
    """Half the gap between the gain of ``new`` over ``old`` priced by each half of the run's timed steps; 0 without
    two halves.

    The noise of the decision, not of the steps: a half that ran uniformly slower (another job on the node, a
    throttled clock) moves both predicted steps alike and leaves the gain where it was.
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
