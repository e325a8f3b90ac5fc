"""The re-plan's bookkeeping in one process (``nanotron_ext.integration.replan_session``): which plan each step
trains on once the trial has measured its plans. The moves themselves run in ``test_replan.py``."""

from __future__ import annotations

from nanotron_ext.config import bundled_config, load_config
from nanotron_ext.integration.replan_session import ReplanSession
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.plan import make_plan
from nanotron_ext.plan.replan import choose_replan, with_replan_after
from nanotron_ext.plan.replan_trial import TrialVerdict, trial_outcome, trial_schedule


def test_after_the_trial_the_run_trains_the_plan_it_kept_not_the_one_that_measured_fastest():
    cfg = with_replan_after(load_config(bundled_config()), 4)
    blocks = inventory_from_config(cfg)
    bad = make_plan(blocks, cfg.with_overrides(cost_strategy="layout", layout="E|t*2,L"))
    session = ReplanSession(cfg, bad, first_step=1, last_step=40, engine_was_auto=False, say=lambda line: None)
    session.choice = choose_replan(cfg, blocks, bad, step=4, engines=("1f1b",))
    assert len(session.choice.plans) == 2
    session.schedule = trial_schedule(2, 2, start=5)
    # The candidate measured 3 % faster, within its steps' scatter (each turn's steps 10 % apart): not kept.
    seconds = {}
    for turn in session.schedule.turns:
        base = 1.0 if turn.plan == 0 else 0.97
        for i, step in enumerate((turn.first, *turn.timed)):
            seconds[step] = base * (1.1 if i % 2 else 1.0)
    session.outcome = trial_outcome(session.schedule, seconds, min_gain=0.0)
    assert (session.outcome.fastest, session.outcome.kept) == (1, 0), session.outcome
    assert session.outcome.verdict is TrialVerdict.WITHIN_NOISE
    after = session.schedule.last + 1
    assert session.target(after) is session.choice.plans[0] and session.choice.plans[0] == bad
    assert [session.target(s) is session.choice.plans[1] for s in (6, 8, 12, 13)] == [False, True, True, False]
