"""One run's re-plan, whichever way it trains: the steps it clocks, the choice, the trial in turns, the plan it keeps
and what it reports (``docs/replan.md``).

The CPU runtime (``nanotron-ext train``, :mod:`nanotron_ext.runtime.replan`) and the launcher around Nanotron's own
trainer (:mod:`nanotron_ext.integration.replan`) differ only in how a step is clocked and how a move is made (a
rebuild in the same processes; a re-launch of the script on the move's checkpoint). Everything else lives here:

1. Steps 2..K of the run (of the launch, under the launcher) run under the engine's clock; after step K
   :meth:`ReplanSession.decide` prices them (the in-run profile) and chooses what to try
   (:func:`nanotron_ext.plan.replan.choose_replan`).
2. The trial (:mod:`nanotron_ext.plan.replan_trial`): :meth:`ReplanSession.target` names the plan each step must run
   on; the way to train moves whenever it changes and reports the move (:meth:`ReplanSession.moved`). At the end of
   each turn the ranks share their steps' times (a step's time is its slowest rank's) and rank 0 prints the turn.
3. After the trial's last step every rank reaches the same verdict from the same times, and the run moves to the plan
   it keeps, if that is not the one it is on.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanotron_ext.config import PlannerConfig
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.machine.in_run_shared import run_profiles
from nanotron_ext.plan.replan import ReplanChoice, choose_replan, replan_engines
from nanotron_ext.plan.replan_trial import TrialOutcome, TrialSchedule, trial_outcome, trial_schedule
from nanotron_ext.plan.types import Plan
from nanotron_ext.report import format_seconds

__all__ = ["Move", "ReplanSession"]

#: ``gather(obj)``: every rank's ``obj``, in rank order, on every rank (a collective).
Gather = Callable[[Any], list[Any]]


@dataclass
class Move:
    """One move of the run: after which step, to which plan, and what it took (seconds, this rank's clock)."""

    after_step: int
    split: str
    engine: str
    seconds: dict[str, float] = field(default_factory=dict)
    checkpoint_bytes: int | None = None
    peak_rss_mib: tuple[float, float] | None = None  # this process's peak resident memory before and after

    def to_dict(self) -> dict[str, Any]:
        return {
            "after_step": self.after_step,
            "split": self.split,
            "engine": self.engine,
            "seconds": dict(self.seconds),
            "checkpoint_bytes": self.checkpoint_bytes,
            "peak_rss_mib": None if self.peak_rss_mib is None else list(self.peak_rss_mib),
        }


class ReplanSession:
    """The re-plan of one run (see the module docstring).

    Args:
        cfg: the run's config (``replan.after_steps`` set; engine and vocabulary shards resolved).
        plan: the plan the run starts on.
        first_step: the run's (the launch's) first step; last_step: its last.
        engine_was_auto: the config asked ``pp_engine: auto`` (the re-plan may then change the engine).
        say: prints on rank 0.
    """

    def __init__(
        self,
        cfg: PlannerConfig,
        plan: Plan,
        *,
        first_step: int,
        last_step: int,
        engine_was_auto: bool,
        say: Callable[[str], None],
    ) -> None:
        assert cfg.ext.replan.after_steps is not None
        self.cfg, self.plan, self.say = cfg, plan, say
        self.first_step, self.last_step = first_step, last_step
        self.decide_after = first_step - 1 + cfg.ext.replan.after_steps
        self.engines = replan_engines(cfg, engine_was_auto=engine_was_auto)
        self.choice: ReplanChoice | None = None
        self.schedule: TrialSchedule | None = None
        self.outcome: TrialOutcome | None = None
        self.times: dict[int, float] = {}  # each step's seconds: this rank's, then (after each turn) every rank's max
        self.moves: list[Move] = []
        self.seconds: dict[str, float] = {}  # what the re-plan itself took: profile, plan
        self.timed_steps: int | None = None  # the steps the clock recorded (rank 0; None elsewhere)

    # -- what each step does -------------------------------------------------------------------------------

    def clocked(self, step: int) -> bool:
        """Step ``step`` runs under the engine's clock: the run's steps 2..K (the first pays one-off costs)."""
        return self.choice is None and step <= self.decide_after

    def recorded(self, step: int) -> bool:
        """The clock records step ``step`` into the run's prices."""
        return self.first_step < step <= self.decide_after

    def record(self, step: int, seconds: float) -> None:
        self.times[step] = seconds

    def target(self, step: int) -> Plan:
        """The plan step ``step`` must run on."""
        if self.schedule is not None and self.choice is not None:
            turn = self.schedule.plan_at(step)
            if turn is not None:
                return self.choice.plans[turn]
            if self.outcome is not None and step > self.schedule.last:
                return self.choice.plans[self.outcome.kept]
        return self.plan

    def next_move(self, step: int) -> Plan | None:
        """The plan to move to after step ``step``, or None to train on."""
        target = self.target(step + 1)
        return None if _same_plan(target, self.plan) else target

    def moved(self, step: int, plan: Plan, move: Move) -> None:
        """The run moved to ``plan`` after step ``step``."""
        self.plan = plan
        self.moves.append(move)

    # -- the decision and the trial ----------------------------------------------------------------------

    def decide(self, step: int, gathered: Any, rank: int) -> ReplanChoice:
        """After step K: the in-run profile of the clocked steps, then what to try (collective: every rank alike).

        Args:
            gathered: the clock's ``gather()`` (None off rank 0); rank: this process's global rank.
        """
        start = time.perf_counter()
        n_timed = sum(1 for s in self.times if self.recorded(s))
        self.timed_steps = None if gathered is None else len(gathered[0])
        with tempfile.TemporaryDirectory(prefix="nanotron-ext-replan-profile-") as tmp:
            paths = run_profiles(self.cfg, self.plan.block_ranks, gathered, n_timed, rank, Path(tmp))
            whole, *halves = [self.cfg.with_overrides(machine=str(p)) for p in paths]
            self.seconds["profile"] = time.perf_counter() - start
            start = time.perf_counter()
            choice = choose_replan(
                whole,
                inventory_from_config(whole),
                self.plan,
                step=step,
                engines=self.engines,
                halves=halves,
                steps_left=self.last_step - step,
            )
            self.seconds["plan"] = time.perf_counter() - start
        self.choice = choice
        for line in choice.lines():
            self.say(f"nanotron_ext: {line}" if line.startswith("replan") else line)
        if choice.tries:
            self.schedule = trial_schedule(len(choice.plans), self.cfg.ext.replan.turn_steps, step + 1)
            self.say(
                f"nanotron_ext: replan: trial {self.schedule.order()}, steps {self.schedule.first}-"
                f"{self.schedule.last}; {_legend(choice.plans)}"
            )
        return choice

    def turn_done(self, step: int, gather: Gather) -> None:
        """After each step of the trial: where a turn ends, share its steps' times (each step's slowest rank) and
        print the turn; after the last, decide what the run keeps (collective at a turn's end)."""
        if self.schedule is None or self.choice is None:
            return
        turn = next((t for t in self.schedule.turns if t.last == step), None)
        if turn is None:
            return
        every = gather({s: self.times[s] for s in turn.timed})
        for s in turn.timed:
            self.times[s] = max(rank_times[s] for rank_times in every)
        number = self.schedule.turns.index(turn) + 1
        plan = self.choice.plans[turn.plan]
        median = statistics.median(self.times[s] for s in turn.timed)
        self.say(
            f"nanotron_ext: replan: turn {number}/{len(self.schedule.turns)} ({chr(ord('A') + turn.plan)}) steps "
            f"{turn.first}-{turn.last} on {plan.split_text} ({plan.engine}): {format_seconds(median)} a step "
            f"(median of {len(turn.timed)} after {turn.timed[0] - turn.first} untimed)"
        )
        if step == self.schedule.last:
            self.outcome = trial_outcome(self.schedule, self.times, min_gain=self.cfg.ext.replan.min_gain)
            for line in self.verdict_lines():
                self.say(line)

    # -- what it reports ---------------------------------------------------------------------------------

    def verdict_lines(self) -> list[str]:
        """The trial's verdict: each plan's estimate and speed against the run's, the noise, what the run keeps."""
        o, c = self.outcome, self.choice
        assert o is not None and c is not None
        lines = ["nanotron_ext: replan: the trial measured (each plan: its turns' median steps, and their mean):"]
        for e in o.estimates:
            plan = c.plans[e.plan]
            speed = "the run's plan" if e.plan == 0 else f"{o.speed(e.plan):.3f}x as fast as the run's plan"
            turns = ", ".join(format_seconds(t) for t in e.turns)
            lines.append(
                f"  {chr(ord('A') + e.plan)}  {plan.split_text}  {plan.engine}  {turns} -> "
                f"{format_seconds(e.estimate)}  {speed}"
            )
        kept = c.plans[o.kept]
        lines.append(
            f"  noise {o.noise:.1%} (drift of the run's plan {o.drift:.1%} + steps' scatter {o.scatter:.1%}), "
            f"min_gain {o.min_gain:.1%}: {chr(ord('A') + o.fastest)} {o.verdict.value}; the run trains "
            f"{kept.split_text} ({kept.engine}) from step {self.schedule.last + 1 if self.schedule else '?'}"
        )
        return lines

    def cost(self) -> dict[str, Any]:
        """What the trial cost: each move's seconds, and the steps it ran on plans other than the one kept."""
        kept = None if self.outcome is None else self.outcome.kept
        slower = 0
        if self.schedule is not None and kept is not None:
            slower = sum(t.last - t.first + 1 for t in self.schedule.turns if t.plan != kept)
        return {
            "move_seconds": sum(sum(m.seconds.values()) for m in self.moves),
            "moves": len(self.moves),
            "steps_on_other_plans": slower,
        }

    def after_lines(self, first_timed: int) -> list[str]:
        """After the last step (rank 0): the cost of the trial, the steps before the re-plan and after the trial
        against the predictions (``first_timed``: the first clocked step's number)."""
        c = self.choice
        if c is None:
            return []
        out = []
        before = [self.times[s] for s in range(first_timed, c.step + 1) if s in self.times]
        if before:
            median = statistics.median(before)
            out.append(
                f"replan: steps {first_timed}-{c.step} on {c.old.split_text} ({c.old.engine}), under the clock, "
                + _against(median, c.old_step)
            )
        if self.moves:
            cost = self.cost()
            out.append(
                f"replan: {cost['moves']} move(s) took {cost['move_seconds']:.2f} s in all; "
                f"{cost['steps_on_other_plans']} steps ran on plans other than the one kept; re-plan "
                f"{self.seconds.get('profile', 0) + self.seconds.get('plan', 0):.2f} s"
            )
        start = (self.schedule.last if self.schedule is not None else c.step) + 2
        after = [self.times[s] for s in range(start, self.last_step + 1) if s in self.times]
        if after:
            kept = c.plans[self.outcome.kept] if self.outcome is not None else c.old
            predicted = next((x.step for x in c.candidates if x.plan is kept), c.old_step)
            median = statistics.median(after)
            what = "after the trial" if self.schedule is not None else "after the re-plan"
            out.append(
                f"replan: steps {start}-{start + len(after) - 1} {what}, on {kept.split_text} ({kept.engine}), "
                + _against(median, predicted)
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        """The ``replan`` record of ``--metrics-out``: the choice, every turn, the verdict, the moves and the cost."""
        c = self.choice
        if c is None:
            return {}
        turns = []
        if self.schedule is not None:
            for t in self.schedule.turns:
                plan = c.plans[t.plan]
                turns.append(
                    {
                        "plan": t.plan,
                        "split": plan.split_text,
                        "engine": plan.engine,
                        "first_step": t.first,
                        "timed_steps": list(t.timed),
                        "seconds": [self.times.get(s) for s in t.timed],
                    }
                )
        kept = c.plans[self.outcome.kept] if self.outcome is not None else c.old
        return {
            **c.to_dict(),
            "trial": None if self.schedule is None else {"order": self.schedule.order(), "turns": turns},
            "outcome": None if self.outcome is None else self.outcome.to_dict(),
            "kept": {"split": kept.split_text, "engine": kept.engine},
            "moved": not _same_plan(kept, c.old),
            "moves": [m.to_dict() for m in self.moves],
            "cost": self.cost(),
            "seconds": dict(self.seconds),
            "timed_steps": self.timed_steps,
            "step_seconds": {str(s): t for s, t in sorted(self.times.items())},
        }


def _same_plan(a: Plan, b: Plan) -> bool:
    return tuple(a.block_ranks) == tuple(b.block_ranks) and a.engine == b.engine


def _legend(plans: Sequence[Plan]) -> str:
    """``A: E|t*2,L (1f1b), B: ...``."""
    return ", ".join(f"{chr(ord('A') + i)}: {p.split_text} ({p.engine})" for i, p in enumerate(plans))


def _against(median: float, predicted: float) -> str:
    """A measured median step beside its prediction, in the re-plan's report."""
    return (
        f"measured {format_seconds(median)} a step (median), predicted {format_seconds(predicted)} "
        f"(predicted ÷ measured {predicted / median:.3f})"
    )
