"""A re-plan's trial: the plans a run tries against its own, in turns, and the one it keeps, measured.

After the re-plan's choice (:mod:`nanotron_ext.plan.replan`) the run tries each candidate against the plan it has,
through the same move (a resume in the same processes, bit for bit). The turns form a palindrome, the run's plan
first and last, each candidate on the way out and back, the last one once for a double turn in the middle
(``A B C C B A`` runs as ``A B CC B A``): every plan's turns are centred on the same moment, so a machine whose speed
drifts linearly during the trial moves every plan's estimate alike, and every plan is timed for as many steps. Each
turn runs :data:`TURN_WARMUP_STEPS` untimed step (a move's new build pays one-off costs, as a run's first step does),
then ``turn_steps`` timed ones (twice as many in the middle). A plan's estimate is the mean of its turns' median
steps.

The run keeps the fastest plan it tried: its own unless another measured faster by more than the noise and by at
least ``min_gain``. The noise is the run's plan's drift across the trial (half the relative gap between its first
and its last turn: whatever changed the machine's speed in between shows there) plus the steps' scatter (the median
relative deviation of a timed step from its turn's median). Both, not the larger: a machine that sped up once between
the run's first turn and the candidate's (a load gone) moves the run's estimate by the whole drift away from the
candidate's moment, and a turn's median errs by the scatter besides (CI, 2026-11-29: gain 8.2 % beat a drift of
8.0 % on two equal splits, and the run kept the move). Between two candidates the faster estimate wins: both are
moves.

Entry points: :func:`trial_schedule`, :func:`trial_outcome`.
"""

from __future__ import annotations

import enum
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "TURN_WARMUP_STEPS",
    "PlanEstimate",
    "TrialOutcome",
    "TrialSchedule",
    "TrialVerdict",
    "Turn",
    "trial_length",
    "trial_outcome",
    "trial_schedule",
]

#: Untimed steps at the start of each turn: the first step on a new build allocates and pays one-off costs.
TURN_WARMUP_STEPS = 1


@dataclass(frozen=True)
class Turn:
    """One turn of the trial: a plan (0: the run's own; ``i``: the i-th candidate) on consecutive steps."""

    plan: int
    first: int  # its first step, untimed
    timed: tuple[int, ...]

    @property
    def last(self) -> int:
        return self.timed[-1]


@dataclass(frozen=True)
class TrialSchedule:
    """The turns of a trial over ``n_plans`` plans (the run's own and its candidates), from step ``turns[0].first``."""

    n_plans: int
    turns: tuple[Turn, ...]

    @property
    def first(self) -> int:
        return self.turns[0].first

    @property
    def last(self) -> int:
        return self.turns[-1].last

    @property
    def moves(self) -> int:
        """The moves between turns (the run's plan is where the trial starts)."""
        return len(self.turns) - 1

    def plan_at(self, step: int) -> int | None:
        """The plan step ``step`` runs on, or None outside the trial."""
        return next((t.plan for t in self.turns if t.first <= step <= t.last), None)

    def order(self) -> str:
        """``A B CC B A``: the turns by letter, a double turn doubled."""
        single = min(len(t.timed) for t in self.turns)
        return " ".join(chr(ord("A") + t.plan) * (len(t.timed) // single) for t in self.turns)


def trial_length(n_plans: int, turn_steps: int) -> int:
    """The steps a trial over ``n_plans`` plans takes (warm-ups included)."""
    return (2 * n_plans - 1) * TURN_WARMUP_STEPS + 2 * n_plans * turn_steps if n_plans > 1 else 0


def trial_schedule(n_plans: int, turn_steps: int, start: int) -> TrialSchedule:
    """The palindrome of turns over ``n_plans`` plans (at least 2), ``turn_steps`` timed steps a turn, from step
    ``start``.

    Raises:
        ValueError: fewer than two plans, or ``turn_steps`` below 1.
    """
    if n_plans < 2 or turn_steps < 1:
        raise ValueError(f"a trial needs two plans and a timed step a turn, got {n_plans} and {turn_steps}")
    order = [*range(n_plans - 1), n_plans - 1, *range(n_plans - 2, -1, -1)]
    turns, step = [], start
    for i, plan in enumerate(order):
        n = turn_steps * (2 if i == n_plans - 1 else 1)  # the middle turn stands for the way out and back:
        # every plan is timed for 2 * turn_steps steps
        timed = tuple(range(step + TURN_WARMUP_STEPS, step + TURN_WARMUP_STEPS + n))
        turns.append(Turn(plan, step, timed))
        step = timed[-1] + 1
    return TrialSchedule(n_plans, tuple(turns))


class TrialVerdict(enum.Enum):
    """What the trial decided."""

    KEEP = "measured faster beyond the noise: keeping it"
    OWN_FASTEST = "the run's plan measured fastest: back to it"
    WITHIN_NOISE = "faster within the noise: back to the run's plan"
    BELOW_MIN_GAIN = "faster by less than min_gain: back to the run's plan"


@dataclass(frozen=True)
class PlanEstimate:
    """One plan's turns in the trial: each turn's median step (s), and their mean, its estimate."""

    plan: int
    turns: tuple[float, ...]

    @property
    def estimate(self) -> float:
        return statistics.fmean(self.turns)


@dataclass(frozen=True)
class TrialOutcome:
    """The trial measured: each plan's estimate, the noise and its parts, the plan kept and why."""

    estimates: tuple[PlanEstimate, ...]  # by plan index
    drift: float
    scatter: float
    noise: float  # their sum
    min_gain: float
    fastest: int
    kept: int
    verdict: TrialVerdict

    @property
    def own(self) -> float:
        """The run's plan's estimate (s)."""
        return self.estimates[0].estimate

    def speed(self, plan: int) -> float:
        """How many times as fast as the run's plan ``plan`` measured (the run's time ÷ its time)."""
        return self.own / self.estimates[plan].estimate

    @property
    def gain(self) -> float:
        """The fastest plan's measured gain over the run's, a fraction of the run's step."""
        return 1.0 - self.estimates[self.fastest].estimate / self.own

    def to_dict(self) -> dict[str, Any]:
        return {
            "estimates_s": [e.estimate for e in self.estimates],
            "turn_medians_s": [list(e.turns) for e in self.estimates],
            "noise": self.noise,
            "drift": self.drift,
            "scatter": self.scatter,
            "fastest": self.fastest,
            "kept": self.kept,
            "measured_gain": self.gain,
            "verdict": self.verdict.name.lower(),
        }


def trial_outcome(schedule: TrialSchedule, seconds: Mapping[int, float], *, min_gain: float) -> TrialOutcome:
    """The trial's estimates and verdict from each timed step's seconds (``seconds[step]``; steps not timed are not
    read).

    Raises:
        KeyError: a timed step of the schedule has no time.
    """
    medians: dict[int, list[float]] = {p: [] for p in range(schedule.n_plans)}
    deviations = []
    for turn in schedule.turns:
        times = [seconds[s] for s in turn.timed]
        median = statistics.median(times)
        medians[turn.plan].append(median)
        deviations += [abs(t - median) / median for t in times] if median > 0 else []
    estimates = tuple(PlanEstimate(p, tuple(m)) for p, m in medians.items())
    first, last = estimates[0].turns[0], estimates[0].turns[-1]
    drift = abs(first - last) / (first + last) if first + last > 0 else 0.0
    scatter = statistics.median(deviations) if deviations else 0.0
    noise = drift + scatter
    fastest = min(range(schedule.n_plans), key=lambda p: (estimates[p].estimate, p))
    gain = 1.0 - estimates[fastest].estimate / estimates[0].estimate
    if fastest == 0:
        verdict = TrialVerdict.OWN_FASTEST
    elif gain <= noise:
        verdict = TrialVerdict.WITHIN_NOISE
    elif gain < min_gain:
        verdict = TrialVerdict.BELOW_MIN_GAIN
    else:
        verdict = TrialVerdict.KEEP
    kept = fastest if verdict is TrialVerdict.KEEP else 0
    return TrialOutcome(estimates, drift, scatter, noise, min_gain, fastest, kept, verdict)
