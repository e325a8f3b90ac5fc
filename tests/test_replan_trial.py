"""The re-plan's trial as arithmetic (no process): the turns it runs, each plan's estimate, the noise and the plan it
keeps (``nanotron_ext.plan.replan_trial``). The moves themselves run in ``tests/runtime/test_replan.py``."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nanotron_ext.plan.replan_trial import (
    TrialVerdict,
    Turn,
    trial_length,
    trial_outcome,
    trial_schedule,
)


def test_two_plans_run_a_then_a_double_turn_of_b_then_a():
    s = trial_schedule(2, 2, start=7)
    assert s.turns == (Turn(0, 7, (8, 9)), Turn(1, 10, (11, 12, 13, 14)), Turn(0, 15, (16, 17)))
    assert (s.first, s.last, s.moves, s.order()) == (7, 17, 2, "A BB A")
    assert trial_length(2, 2) == s.last - s.first + 1 == 11
    assert [s.plan_at(step) for step in (6, 7, 9, 10, 14, 15, 17, 18)] == [None, 0, 0, 1, 1, 0, 0, None]


def test_three_plans_run_a_palindrome_with_the_last_candidate_doubled_in_the_middle():
    s = trial_schedule(3, 1, start=1)
    assert [(t.plan, t.first, t.timed) for t in s.turns] == [
        (0, 1, (2,)),
        (1, 3, (4,)),
        (2, 5, (6, 7)),
        (1, 8, (9,)),
        (0, 10, (11,)),
    ]
    assert s.order() == "A B CC B A" and trial_length(3, 1) == 11 == s.last
    assert trial_length(1, 2) == 0  # nothing to try


@pytest.mark.parametrize(("plans", "turn_steps"), [(1, 2), (2, 0)])
def test_a_trial_needs_two_plans_and_a_timed_step(plans, turn_steps):
    with pytest.raises(ValueError, match="a trial needs two plans and a timed step a turn"):
        trial_schedule(plans, turn_steps, start=1)


def _times(schedule, base, slope=0.0, scatter=()):
    """Each step's seconds: its plan's base time plus a linear drift, and ``scatter`` (step -> added seconds)."""
    out = {}
    for turn in schedule.turns:
        for step in (turn.first, *turn.timed):
            out[step] = base[turn.plan] + slope * step + dict(scatter).get(step, 0.0)
    return out


@given(
    n_plans=st.integers(2, 4),
    turn_steps=st.integers(1, 3),
    start=st.integers(2, 50),
    slope=st.floats(-0.01, 0.01),
    bases=st.lists(st.floats(0.5, 2.0), min_size=4, max_size=4),
)
def test_a_linear_drift_moves_every_plans_estimate_alike(n_plans, turn_steps, start, slope, bases):
    """Every plan's turns are centred on the same moment, so the estimates keep the plans' true differences."""
    s = trial_schedule(n_plans, turn_steps, start)
    o = trial_outcome(s, _times(s, bases, slope), min_gain=0.0)
    shift = o.estimates[0].estimate - bases[0]
    for e in o.estimates:
        assert e.estimate - bases[e.plan] == pytest.approx(shift, abs=1e-9)


def test_a_candidate_faster_beyond_the_noise_and_min_gain_is_kept():
    s = trial_schedule(2, 2, start=7)
    # the run's plan: 1.00 then 1.02 (drift 1 %); steps 8 and 9 scatter 0.01 around their median
    times = _times(s, {0: 1.0, 1: 0.8}, scatter={8: -0.01, 9: 0.01, 16: 0.02, 17: 0.02})
    o = trial_outcome(s, times, min_gain=0.03)
    assert [e.turns for e in o.estimates] == [pytest.approx((1.0, 1.02)), pytest.approx((0.8,))]
    assert o.drift == pytest.approx(0.02 / 2.02)
    assert o.scatter == 0.0  # the median step of the trial sits on its turn's median
    assert o.noise == o.drift and o.gain == pytest.approx(1 - 0.8 / 1.01)
    assert (o.fastest, o.kept, o.verdict) == (1, 1, TrialVerdict.KEEP)
    assert o.speed(1) == pytest.approx(1.01 / 0.8)


def test_the_scatter_is_the_median_deviation_of_a_step_from_its_turns_median():
    s = trial_schedule(2, 2, start=1)  # timed: 2, 3 | 5, 6, 7, 8 | 10, 11
    devs = {2: 0.04, 3: -0.04, 5: 0.02, 6: -0.02, 7: 0.02, 8: -0.02, 10: 0.04, 11: -0.04}
    o = trial_outcome(s, _times(s, {0: 1.0, 1: 1.0}, scatter=devs), min_gain=0.0)
    assert o.drift == 0.0 and o.scatter == pytest.approx(0.03)  # deviations 0.04 ×4 and 0.02 ×4: median 0.03
    assert o.noise == pytest.approx(0.03)


def test_the_noise_is_the_drift_plus_the_scatter_so_a_load_gone_before_the_candidate_is_no_gain():
    """CI's case: the run's first turn was slowed by a load gone by the candidate's turn, two equal plans. The gain
    over the run's mean (7.9 %) beats the drift (7.5 %) alone but not the drift plus the scatter (1.2 %)."""
    s = trial_schedule(2, 2, start=1)  # timed: A 2, 3 | B 5, 6, 7, 8 | A 10, 11
    times = {1: 0.0, 4: 0.0, 9: 0.0, 2: 0.29, 3: 0.31, 10: 0.256, 11: 0.260}
    times.update({5: 0.254, 6: 0.260, 7: 0.254, 8: 0.260})  # B: 0.257, as fast as A once the load went
    o = trial_outcome(s, times, min_gain=0.0)
    assert o.drift == pytest.approx(0.042 / 0.558) and o.scatter == pytest.approx(0.003 / 0.257)
    assert o.gain == pytest.approx(1 - 0.257 / 0.279) and o.drift < o.gain < o.noise
    assert o.noise == pytest.approx(o.drift + o.scatter)
    assert (o.verdict, o.kept) == (TrialVerdict.WITHIN_NOISE, 0)


@pytest.mark.parametrize(
    ("b", "min_gain", "verdict", "kept"),
    [
        (1.05, 0.0, TrialVerdict.OWN_FASTEST, 0),  # the move the profile promised measured slower
        (0.995, 0.0, TrialVerdict.WITHIN_NOISE, 0),  # 0.5 % faster, the noise is 1 %
        (0.99, 0.0, TrialVerdict.WITHIN_NOISE, 0),  # equal to the noise is not beyond it
        (0.98, 0.03, TrialVerdict.BELOW_MIN_GAIN, 0),  # 2 % faster, beyond the noise, below min_gain
        (0.98, 0.0, TrialVerdict.KEEP, 1),
    ],
)
def test_the_run_goes_back_unless_a_candidate_beats_its_plan_beyond_the_noise_and_min_gain(b, min_gain, verdict, kept):
    s = trial_schedule(2, 1, start=1)  # A on 2, B on 4 and 5, A on 7
    times = {1: 0, 2: 0.99, 3: 0, 4: b, 5: b, 6: 0, 7: 1.01}  # A: 0.99 and 1.01 -> 1.00, drift 1 %
    o = trial_outcome(s, times, min_gain=min_gain)
    assert o.drift == pytest.approx(0.01) and o.scatter == 0.0
    assert (o.verdict, o.kept) == (verdict, kept)


def test_between_two_candidates_the_faster_estimate_wins_however_close():
    s = trial_schedule(3, 1, start=1)  # A 2, B 4, C 6-7, B 9, A 11
    times = {step: 0.0 for step in range(1, 12)}
    times.update({2: 1.0, 11: 1.0, 4: 0.901, 9: 0.901, 6: 0.9, 7: 0.9})
    o = trial_outcome(s, times, min_gain=0.03)
    assert (o.fastest, o.kept, o.verdict) == (2, 2, TrialVerdict.KEEP)
    assert o.to_dict()["estimates_s"] == pytest.approx([1.0, 0.901, 0.9])


def test_a_step_of_the_trial_without_a_time_is_an_error():
    s = trial_schedule(2, 1, start=1)
    with pytest.raises(KeyError):
        trial_outcome(s, {2: 1.0, 4: 1.0}, min_gain=0.0)
