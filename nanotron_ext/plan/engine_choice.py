"""``parallelism.pp_engine: auto``: the engine and the split chosen together, under the memory every stage has.

Each candidate engine (:data:`AUTO_ENGINES`) gets its own plan from the config's strategy (the default one is
schedule-aware, so each engine gets the split that is fastest under it, ``vocab_shards: auto`` resolved per
engine; ``zbv`` its V plan, :func:`~nanotron_ext.plan.v_plan.make_v_plan`) and that plan's simulated step on the
config's machine (the step-time objective, equal to
``simulate_plan``; under ``recompute_layer`` every backward pays its forward again, as the machine prices it).
The fastest engine whose plan has no error (a stage over ``memory_cap_gib`` or the device's memory is one) wins,
on a tie the one with the smaller peak; with none, the fastest whose every stage fits, its other findings left on
its plan for the validator to report; with no engine whose plan fits, a :class:`~nanotron_ext.errors.ConfigError`
that names each engine's peak and the limit.

Nanotron's trainer (the launcher) runs a V with its sends held to one order of transfers, because a GPU's send waits
for its receive: there auto prices the V so (``sends_wait``), on the split searched with sends posted as made.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nanotron_ext.config import VOCAB_SHARDS_AUTO, PlannerConfig
from nanotron_ext.errors import ConfigError, PlanningError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.machine.memory_limit import memory_limit
from nanotron_ext.partition import bounds_from_ranks
from nanotron_ext.partition.schedule_aware import StepTimeEvaluator
from nanotron_ext.plan.types import Plan
from nanotron_ext.plan.v_plan import VPlan, plan_for, v_plan_timeline
from nanotron_ext.plan.vocab import resolve_vocab_shards
from nanotron_ext.report import format_seconds, human_bytes
from nanotron_ext.schedule import ENGINE_AUTO, V_ENGINE, too_few_micro_batches
from nanotron_ext.strategies.step_time import schedule_problem

__all__ = [
    "AUTO_ENGINES",
    "CONTIGUOUS_AUTO_ENGINES",
    "HELD_SENDS",
    "EngineChoice",
    "EngineOption",
    "choose_engine",
    "engine_option",
    "predicted_step",
    "resolve_engine",
]

#: Simulated steps equal to this many significant digits tie (zb1p and zb2p at m <= 2, say): the smaller peak wins.
TIE_DIGITS = 9
#: The engines that run one contiguous stage per rank (AFAB is left out: it holds all m micro-batches in flight for
#: 1F1B's ideal bubble): a re-plan after K steps chooses among them.
CONTIGUOUS_AUTO_ENGINES: tuple[str, ...] = ("1f1b", "zb1p", "zb2p")
#: The engines ``auto`` chooses from.
AUTO_ENGINES: tuple[str, ...] = (*CONTIGUOUS_AUTO_ENGINES, V_ENGINE)
#: How a V's step is priced where its sends wait (:func:`choose_engine`'s ``sends_wait``).
HELD_SENDS = "its sends held as Nanotron's trainer runs them"


@dataclass(frozen=True)
class EngineOption:
    """One candidate: its plan's simulated step (s) and per-stage peaks (bytes), or why it has no plan."""

    engine: str
    step_time: float | None = None
    peaks: tuple[float, ...] = ()
    fits: bool = False  # every stage within the memory limit
    ok: bool = False  # no error finding at all
    reason: str = ""  # why there is no plan, or the first error of the plan
    plan: Plan | VPlan | None = field(default=None, compare=False, repr=False)
    config: PlannerConfig | None = field(default=None, compare=False, repr=False)  # the config it was planned under
    note: str = ""  # how its step was priced, where that is not the plan's own simulation

    @property
    def peak(self) -> float | None:
        return max(self.peaks) if self.peaks else None

    def describe(self) -> str:
        """``zb1p: step 1.234 s, peak 3.10 GiB`` (with why it was not taken, when it has a reason)."""
        if self.step_time is None or self.peak is None:
            return f"{self.engine}: cannot be planned ({self.reason})"
        if self.plan is None:  # planned without the cap: no split fits under it
            return (
                f"{self.engine}: step {format_seconds(self.step_time)}, peak {human_bytes(self.peak)} without "
                f"the cap ({self.reason})"
            )
        why = "" if self.ok else f" ({self.reason})"
        note = f" ({self.note})" if self.note else ""
        return f"{self.engine}: step {format_seconds(self.step_time)}{note}, peak {human_bytes(self.peak)}{why}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "simulated_step_time": self.step_time,
            "memory_peak_bytes": list(self.peaks),
            "fits": self.fits,
            "ok": self.ok,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class EngineChoice:
    """What ``auto`` chose among ``options`` (in :data:`AUTO_ENGINES` order)."""

    engine: str
    options: tuple[EngineOption, ...]

    @property
    def chosen(self) -> EngineOption:
        return next(o for o in self.options if o.engine == self.engine)

    @property
    def runner_up(self) -> EngineOption | None:
        """The next option by the same rule: fastest without errors, then fastest that fits, then any."""
        rest = [o for o in self.options if o.engine != self.engine]
        return min(rest, key=_rank) if rest else None

    @property
    def faster_not_taken(self) -> tuple[EngineOption, ...]:
        """Options with a faster simulated step than the choice that it passed over (a stage over the memory,
        another error), fastest first: what the limit costs."""
        step = _rounded(self.chosen.step_time)
        return tuple(
            sorted((o for o in self.options if _rounded(o.step_time) < step), key=lambda o: _rounded(o.step_time))
        )

    def lines(self, head: str = "pp_engine: auto -> ") -> list[str]:
        """``pp_engine: auto -> zb1p: step ..., peak ...`` (``head`` first), the runner-up, any faster engine not
        taken, then every other engine by the same rule, each with its step and peak or why it has none."""
        out = [f"{head}{self.chosen.describe()}"]
        if self.runner_up is not None:
            out.append(f"  runner-up {self.runner_up.describe()}")
        out += [f"  faster, not taken: {o.describe()}" for o in self.faster_not_taken if o is not self.runner_up]
        said = {self.engine, *(o.engine for o in self.faster_not_taken)} | (
            set() if self.runner_up is None else {self.runner_up.engine}
        )
        out += [f"  passed over {o.describe()}" for o in sorted(self.options, key=_rank) if o.engine not in said]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "runner_up": None if self.runner_up is None else self.runner_up.engine,
            "faster_not_taken": [o.engine for o in self.faster_not_taken],
            "options": [o.to_dict() for o in self.options],
        }


def _rank(o: EngineOption) -> tuple[int, float, float]:
    """Sort key of the rule: no error first, then every stage fitting, then the simulated step (rounded to
    :data:`TIE_DIGITS` significant digits, so that engines whose programs time alike tie), then the smaller peak."""
    return (0 if o.ok else 1 if o.fits else 2, _rounded(o.step_time), o.peak if o.peak is not None else float("inf"))


def _rounded(step: float | None) -> float:
    """A simulated step to :data:`TIE_DIGITS` significant digits (infinite when there is none)."""
    return float(f"{step:.{TIE_DIGITS}e}") if step is not None and math.isfinite(step) else math.inf


def choose_engine(
    cfg: PlannerConfig, engines: Sequence[str] = AUTO_ENGINES, *, sends_wait: bool = False
) -> EngineChoice:
    """Plan ``cfg`` under each of ``engines`` and take the fastest whose plan fits (see the module docstring);
    ``sends_wait``: the V is priced with its sends held, as Nanotron's trainer runs it (:data:`HELD_SENDS`).

    Raises:
        ConfigError: no engine has a plan whose every stage fits the memory (each engine's peak, the limit and
            the fixes named), or none can run at all (each one's reason).
    """
    options = tuple(engine_option(cfg, engine, sends_wait=sends_wait) for engine in engines)
    best = min(options, key=_rank)
    if not best.fits:
        limit = memory_limit(cfg)
        where = f"{limit}" if limit is not None else "its memory"
        raise ConfigError(
            f"pp_engine: auto found no engine whose plan fits {where}: "
            + "; ".join(o.describe() for o in options)
            + ". Raise memory_cap_gib (or plan for a larger GPU), set parallelism.recompute_layer: true, use more "
            "pipeline stages (pp) or tensor parallelism (tp), or fewer micro-batches in flight (pp_engine: 1f1b)"
        )
    return EngineChoice(best.engine, options)


def engine_option(cfg: PlannerConfig, engine: str, *, sends_wait: bool = False) -> EngineOption:
    """``cfg``'s default plan under ``engine`` (``vocab_shards: auto`` resolved for it), its simulated step and
    per-stage peaks; an option without a plan, and why, where the engine cannot run or no split satisfies the
    strategy (under ``memory_cap_gib``: with the step and peaks of its plan without the cap, what the cap costs)."""
    trial = cfg.with_overrides(engine=engine)
    shortfall = too_few_micro_batches(engine, trial.run.pp, trial.run.n_micro_batches)
    if shortfall is not None:
        return EngineOption(engine, reason=shortfall)
    if engine == V_ENGINE and trial.ext.vocab_shards == VOCAB_SHARDS_AUTO:
        return EngineOption(engine, reason="vocab_shards: auto is chosen for contiguous plans only")
    try:
        trial, _ = resolve_vocab_shards(trial)
        blocks = inventory_from_config(trial)
        plan = plan_for(blocks, trial)
    except PlanningError as exc:  # no split fits the cap under this engine: what it would need without the cap
        if trial.ext.memory_cap_gib is None:
            return EngineOption(engine, reason=str(exc))
        uncapped = engine_option(
            dataclasses.replace(cfg, ext=dataclasses.replace(cfg.ext, memory_cap_gib=None)),
            engine,
            sends_wait=sends_wait,
        )
        return dataclasses.replace(uncapped, fits=False, ok=False, reason=str(exc), plan=None, config=None)
    if isinstance(plan, VPlan):  # it exists only where every chunk trains and every rank fits
        if sends_wait:  # the split searched with sends posted as made, priced as the trainer runs it
            held = v_plan_timeline(plan, blocks, trial, sends_wait=True).step_time
            return EngineOption(engine, held, plan.peaks, True, True, "", plan, trial, note=HELD_SENDS)
        return EngineOption(engine, plan.step_time, plan.peaks, True, True, "", plan, trial)
    step = predicted_step(trial, blocks, plan.block_ranks)
    errors = [f for f in plan.findings if f.severity == "error"]
    fits = not any(f.code == "memory" for f in errors)
    reason = errors[0].message if errors else ""
    return EngineOption(engine, step, tuple(s.memory_bytes for s in plan.stages), fits, not errors, reason, plan, trial)


def predicted_step(cfg: PlannerConfig, blocks: Sequence[Any], ranks: Sequence[int]) -> float:
    """The simulated step (seconds) of the contiguous split ``ranks`` under ``cfg``'s engine and machine: the
    step-time objective, equal to ``simulate_plan``'s."""
    return float(StepTimeEvaluator(schedule_problem(blocks, cfg))([bounds_from_ranks(ranks, cfg.run.pp)])[0])


def resolve_engine(
    cfg: PlannerConfig,
    engines: Sequence[str] = AUTO_ENGINES,
    *,
    sends_wait: bool = False,
) -> tuple[PlannerConfig, EngineChoice | None]:
    """Replace ``pp_engine: auto`` by the engine :func:`choose_engine` takes among ``engines`` (``sends_wait`` as
    there).

    Returns:
        ``(cfg with that engine, the choice)``; the config unchanged and None when it names an engine.

    Raises:
        ConfigError: as :func:`choose_engine`.
    """
    if cfg.run.engine != ENGINE_AUTO:
        return cfg, None
    choice = choose_engine(cfg, engines, sends_wait=sends_wait)
    return cfg.with_overrides(engine=choice.engine), choice
