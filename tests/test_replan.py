"""The re-plan after K steps, as planning (no process): the plans it tries against the run's under the run's memory,
the predicted steps it compares, the profile's error that makes a close call, when it stays; and its YAML key and
flag. The trial's arithmetic is in ``tests/test_replan_trial.py``, the moves in ``tests/runtime/test_replan.py``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from nanotron_ext.config import bundled_config, load_config
from nanotron_ext.config_ext import ExtConfig, ReplanConfig
from nanotron_ext.costs.analytic import GIB
from nanotron_ext.errors import ConfigError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.plan import make_plan
from nanotron_ext.plan.engine_choice import predicted_step
from nanotron_ext.plan.replan import PROFILE_ERROR, Verdict, choose_replan, replan_engines, with_replan_after
from nanotron_ext.plan.replan_trial import trial_length

BAD = "E|t*2,L"  # the lm_head beside both decoder layers: stage 1 does nearly all the work
CONTIGUOUS = ("1f1b", "zb1p", "zb2p")
DATA = Path(__file__).parent / "data"


def _setup(**ext):
    cfg = load_config(bundled_config()).with_overrides(**ext)
    blocks = inventory_from_config(cfg)
    return cfg, blocks, make_plan(blocks, cfg.with_overrides(cost_strategy="layout", layout=BAD))


def test_a_bad_split_tries_the_fastest_split_with_both_steps_predicted_by_the_simulator():
    cfg, blocks, bad = _setup()
    choice = choose_replan(cfg, blocks, bad, step=5, engines=("1f1b",))
    best = make_plan(blocks, cfg)  # constrained: the fastest simulated step
    assert choice.verdict is Verdict.TRY and choice.tries
    assert [c.plan.block_ranks for c in choice.candidates] == [best.block_ranks] != [bad.block_ranks]
    assert choice.fastest is choice.candidates[0] and choice.plans == (choice.old, choice.fastest.plan)
    assert choice.old_step == predicted_step(cfg, blocks, bad.block_ranks)
    assert choice.fastest.step == predicted_step(cfg, blocks, best.block_ranks) < choice.old_step
    assert choice.gain == pytest.approx(1 - choice.fastest.step / choice.old_step)
    assert choice.trial_steps == trial_length(2, cfg.ext.replan.turn_steps) == 11
    lines = "\n".join(choice.lines())
    assert "now:   E|t*2,L  1f1b" in lines and "try 1: E,t*2,N|H,C,X  1f1b" in lines
    assert f"{choice.old_step / choice.fastest.step:.3f}x as fast" in lines
    assert "trying 1 plan(s) against the run's in turns, 11 steps" in lines


@pytest.mark.parametrize("strategy", ["layout", "nanotron"])
def test_a_run_on_a_fixed_rule_re_plans_with_the_step_time_strategy(strategy):
    """A run started on a fixed rule (its config says `layout` or `nanotron`) is re-planned by `constrained`: its own
    rule would return the split it has."""
    cfg, blocks, bad = _setup()
    started = cfg.with_overrides(cost_strategy=strategy, layout=BAD)
    choice = choose_replan(started, blocks, bad, step=5, engines=("1f1b",))
    assert choice.tries and choice.fastest.plan.block_ranks == make_plan(blocks, cfg).block_ranks
    assert choice.fastest.plan.strategy == "constrained"


def test_a_run_on_the_fastest_plan_stays():
    cfg, blocks, _ = _setup()
    choice = choose_replan(cfg, blocks, make_plan(blocks, cfg), step=5, engines=("1f1b",))
    assert choice.verdict is Verdict.BEST and choice.fastest.plan is choice.old and not choice.candidates
    assert "the run is on the fastest plan under its memory" in choice.lines()[-1]


HALVES = (1.0, 400.0)  # TFLOP/s: at 1, the analytic p2p is small beside compute and both splits are near alike


def _halves(cfg):
    return [cfg.with_overrides(tflops=tflops) for tflops in HALVES]


@pytest.mark.parametrize(
    ("min_gain", "tflops", "verdict"),
    [
        (0.03, None, Verdict.TRY),  # a gain of about 47 %
        (0.9, None, Verdict.SMALL),  # 47 % plus the error (22 %) is below 90 %
        (0.03, 1.0, Verdict.TRY),  # priced at 1 TFLOP/s the gain is about 4 %
        (0.257, 1.0, Verdict.TRY),  # 4.17 % + 21.57 % >= 25.7 %: at the profile's error it could be worth it
        (0.259, 1.0, Verdict.SMALL),  # 4.17 % + 21.57 % < 25.9 %
    ],
)
def test_a_plan_is_tried_where_its_gain_at_the_profiles_error_reaches_min_gain(min_gain, tflops, verdict):
    cfg, blocks, bad = _setup(replan=ReplanConfig(after_steps=5, min_gain=min_gain))
    choice = choose_replan(
        cfg.with_overrides(tflops=tflops), blocks, bad, step=5, engines=("1f1b",), halves=_halves(cfg)
    )
    gains = [
        1 - predicted_step(h, blocks, choice.fastest.plan.block_ranks) / predicted_step(h, blocks, bad.block_ranks)
        for h in _halves(cfg)
    ]
    assert choice.noise == pytest.approx(abs(gains[0] - gains[1]) / 2) == pytest.approx(0.2157, abs=1e-3)
    assert choice.error == choice.noise  # above the held-out error
    assert choice.gain == pytest.approx(0.4730 if tflops is None else 0.0417, abs=1e-3)
    assert choice.verdict is verdict
    error = f"the profile's error {choice.error:.1%} (held-out {PROFILE_ERROR:.1%}, run's noise {choice.noise:.1%})"
    assert error in choice.lines()[-1]


def test_without_two_halves_or_a_faster_plan_there_is_no_noise_and_the_error_is_the_held_out_one():
    cfg, blocks, bad = _setup()
    one = choose_replan(cfg, blocks, bad, step=5, engines=("1f1b",), halves=_halves(cfg)[:1])
    assert one.noise == 0.0 and one.error == PROFILE_ERROR
    best = make_plan(blocks, cfg)
    assert choose_replan(cfg, blocks, best, step=5, engines=("1f1b",), halves=_halves(cfg)).noise == 0.0


def test_a_half_that_ran_uniformly_slower_is_no_noise(tmp_path):
    """Every op of one half twice as slow (another job on the node) moves both predicted steps alike: the gain, and
    so the error, stays."""
    profile = json.loads((DATA / "machine_flops_only.json").read_text())
    profile["flops_per_second"] /= 2
    (tmp_path / "slow.json").write_text(json.dumps(profile))
    cfg, blocks, bad = _setup(machine=str(DATA / "machine_flops_only.json"))
    halves = [cfg, cfg.with_overrides(machine=str(tmp_path / "slow.json"))]
    assert predicted_step(halves[1], blocks, bad.block_ranks) == pytest.approx(
        2 * predicted_step(halves[0], blocks, bad.block_ranks)
    )
    choice = choose_replan(cfg, blocks, bad, step=5, engines=("1f1b",), halves=halves)
    assert choice.noise == pytest.approx(0.0, abs=1e-12) and choice.error == PROFILE_ERROR


def test_a_close_call_tries_every_plan_within_the_error_of_the_fastest_up_to_trials_and_the_steps_left():
    """Priced by FLOPs alone the final norm is nearly free: the fastest split and the one with the norm across the
    cut are within the error of each other (and a third within it too); each is tried, the fastest first, as many as
    ``replan.trials`` allows, and as many as the steps left allow."""
    cfg, blocks, bad = _setup(machine=str(DATA / "machine_flops_only.json"))
    found = {}
    for trials in (1, 2, 3, 10):
        choice = choose_replan(
            cfg.with_overrides(replan=ReplanConfig(trials=trials)), blocks, bad, step=5, engines=("1f1b",)
        )
        found[trials] = [c.plan.split_text for c in choice.candidates]
        steps = [c.step for c in choice.candidates]
        assert steps == sorted(steps) and all(s <= choice.fastest.step * (1 + choice.error) for s in steps)
    assert found == {
        1: ["E,t*2,N|H,C,X"],
        2: ["E,t*2,N|H,C,X", "E,t*2|L"],
        3: ["E,t*2,N|H,C,X", "E,t*2|L", "E,t|t,L"],
        10: ["E,t*2,N|H,C,X", "E,t*2|L", "E,t|t,L"],  # no other split is within the error
    }
    # At 1 TFLOP/s the other valid splits are 3.5 % and 3.9 % slower than the fastest: beyond the error, not tried.
    slow = load_config(bundled_config()).with_overrides(tflops=1.0, replan=ReplanConfig(trials=10))
    far = choose_replan(slow, blocks, bad, step=5, engines=("1f1b",))
    assert [c.plan.split_text for c in far.candidates] == ["E,t*2,N|H,C,X"] and far.error == PROFILE_ERROR
    three = cfg.with_overrides(replan=ReplanConfig(trials=3))
    for left, tried in ((23, 3), (22, 2), (17, 2), (16, 1), (11, 1)):
        choice = choose_replan(three, blocks, bad, step=5, engines=("1f1b",), steps_left=left)
        assert (choice.verdict, len(choice.candidates)) == (Verdict.TRY, tried), left
        assert choice.trial_steps == trial_length(tried + 1, 2) <= left
    short = choose_replan(three, blocks, bad, step=5, engines=("1f1b",), steps_left=10)
    assert (short.verdict, short.candidates, short.trial_steps) == (Verdict.SHORT, (), 11)
    assert "a trial takes 11 steps, more than the run has left: staying" in short.lines()[-1]


def test_a_run_on_the_fastest_priced_plan_tries_the_plans_within_the_error_of_it_that_min_gain_allows():
    """A close call does not need the run to be off the fastest plan: started on the fastest priced split, the plans
    within the error of it are tried where min_gain allows (at 0, each; at the default, a slower one cannot reach
    it). A cap every split fits: without one, a neighbour holding more than the run's largest stage is no move."""
    cfg, blocks, _ = _setup(machine=str(DATA / "machine_flops_only.json"), memory_cap_gib=100.0)
    best = make_plan(blocks, cfg.with_overrides(cost_strategy="layout", layout="E,t*2,N|H,C,X"))
    tried = cfg.with_overrides(replan=ReplanConfig(trials=10, min_gain=0.0))
    choice = choose_replan(tried, blocks, best, step=5, engines=("1f1b",))
    assert choice.verdict is Verdict.TRY and choice.fastest.plan is choice.old
    assert [c.plan.split_text for c in choice.candidates] == ["E,t*2|L", "E,t|t,L", "E|t*2,L"]
    assert all(choice.old_step <= c.step <= choice.old_step * (1 + choice.error) for c in choice.candidates)
    stays = choose_replan(cfg, blocks, best, step=5, engines=("1f1b",))
    assert stays.verdict is Verdict.BEST and not stays.candidates


def test_without_a_cap_a_move_never_raises_the_largest_stage_above_the_runs():
    """zb1p and zb2p are faster on the good split but hold more than 1F1B's largest stage: without a cap the run
    tries 1F1B only; with a cap between zb1p's need and zb2p's it tries zb1p."""
    cfg, blocks, bad = _setup()
    old_peak = max(s.memory_bytes for s in bad.stages)
    kept = choose_replan(cfg, blocks, bad, step=5, engines=CONTIGUOUS)
    assert [c.plan.engine for c in kept.candidates] == ["1f1b"] and kept.cap_bytes == old_peak
    assert max(s.memory_bytes for s in kept.fastest.plan.stages) <= old_peak
    assert any("zb1p" in line and "without the cap" in line for line in kept.engine_lines)
    cfg, blocks, bad = _setup(memory_cap_gib=1.055)
    moved = choose_replan(cfg, blocks, bad, step=5, engines=CONTIGUOUS)
    assert moved.fastest.plan.engine == "zb1p" and moved.cap_bytes == 1.055 * GIB and moved.tries
    assert "engines: zb1p" in "\n".join(moved.lines())


def test_no_engine_fits_the_cap_the_run_stays_on_its_own():
    cfg, blocks, bad = _setup(memory_cap_gib=0.5)
    choice = choose_replan(cfg, blocks, bad, step=5, engines=("1f1b",))
    assert choice.verdict is Verdict.BEST and choice.fastest.plan is choice.old
    with pytest.raises(ConfigError, match="found no engine whose plan fits"):
        choose_replan(cfg, blocks, bad, step=5, engines=("zb1p",))


def test_the_engines_a_replan_may_pick():
    cfg = load_config(bundled_config())
    assert replan_engines(cfg, engine_was_auto=False) == ("1f1b",)
    assert replan_engines(cfg, engine_was_auto=True) == CONTIGUOUS
    assert replan_engines(cfg.with_overrides(replan=ReplanConfig(engine="auto")), engine_was_auto=False) == CONTIGUOUS
    assert replan_engines(cfg.with_overrides(replan=ReplanConfig(engine="keep")), engine_was_auto=True) == ("1f1b",)


def test_the_replan_key_reads_a_mapping_and_refuses_bad_values():
    assert ExtConfig(replan={"after_steps": 5}).replan == ReplanConfig(5, 0.03, None, 2, 2)
    assert ExtConfig().replan.after_steps is None  # off by default
    for bad, match in [
        ({"after_step": 5}, "did you mean 'after_steps'"),
        ({"after_steps": 1}, r"^nanotron_ext.replan.after_steps=1 must be a whole number of at least 2 .*, e.g. "),
        ({"after_steps": True}, "after_steps=True must be a whole number"),
        ({"after_steps": "20"}, "after_steps='20' must be a whole number"),  # the YAML's value is typed
        ({"min_gain": 1.0}, r"min_gain=1.0 must be a fraction of the step in \[0, 1\)"),
        ({"min_gain": -0.1}, "min_gain=-0.1 must be"),
        ({"engine": "autp"}, "did you mean 'auto'"),
        ({"trials": 0}, r"replan.trials=0 must be a whole number of at least 1 .*, e.g. trials: 2"),
        ({"turn_steps": 1.5}, r"replan.turn_steps=1.5 must be a whole number of at least 1 .*, e.g. turn_steps: 2"),
        ("after 5", "replan is text"),
    ]:
        with pytest.raises(ConfigError, match=match):
            ExtConfig(replan=bad)


@pytest.mark.parametrize("typed", ["0", "1", "-3", "abc", "2.5"])
def test_replan_after_has_the_keys_rule_and_names_the_flag(typed):
    """One rule, K >= 2, for the flag and the YAML alike; the flag's error names the flag and what was typed."""
    cfg = load_config(bundled_config())
    with pytest.raises(ConfigError, match=rf"^--replan-after {re.escape(typed)} must be a whole number of at least 2 "):
        with_replan_after(cfg, typed)
    assert with_replan_after(cfg, "20").ext.replan.after_steps == 20
    assert with_replan_after(cfg, None).ext.replan.after_steps is None
