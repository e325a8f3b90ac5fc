"""The re-plan after K steps, as planning (no process): which plan it picks under the run's memory, the predicted
steps it compares, when it moves and when it stays; and its YAML key. The move itself runs in
``tests/runtime/test_replan.py``."""

from __future__ import annotations

import pytest

from nanotron_ext.config import bundled_config, load_config
from nanotron_ext.config_ext import ExtConfig, ReplanConfig
from nanotron_ext.costs.analytic import GIB
from nanotron_ext.errors import ConfigError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.plan import make_plan
from nanotron_ext.plan.engine_choice import predicted_step
from nanotron_ext.plan.replan import Verdict, choose_replan, replan_engines

BAD = "E|t*2,L"  # the lm_head beside both decoder layers: stage 1 does nearly all the work
CONTIGUOUS = ("1f1b", "zb1p", "zb2p")


def _setup(**ext):
    cfg = load_config(bundled_config()).with_overrides(**ext)
    blocks = inventory_from_config(cfg)
    return cfg, blocks, make_plan(blocks, cfg.with_overrides(cost_strategy="layout", layout=BAD))


def test_a_bad_split_moves_to_the_fastest_split_with_both_steps_predicted_by_the_simulator():
    cfg, blocks, bad = _setup()
    choice = choose_replan(cfg, blocks, bad, step=5, spread=0.01, engines=("1f1b",))
    best = make_plan(blocks, cfg)  # constrained: the fastest simulated step
    assert choice.verdict is Verdict.MOVE and choice.moves
    assert choice.new.block_ranks == best.block_ranks != bad.block_ranks and choice.new.engine == "1f1b"
    assert choice.old_step == predicted_step(cfg, blocks, bad.block_ranks)
    assert choice.new_step == predicted_step(cfg, blocks, best.block_ranks) < choice.old_step
    assert choice.gain == pytest.approx(1 - choice.new_step / choice.old_step)
    lines = "\n".join(choice.lines())
    assert "now:  E|t*2,L  1f1b" in lines and "best: E,t*2,N|H,C,X  1f1b" in lines and "moving to the new plan" in lines


@pytest.mark.parametrize("strategy", ["layout", "nanotron"])
def test_a_run_on_a_fixed_rule_re_plans_with_the_step_time_strategy(strategy):
    """A run started on a fixed rule (its config says `layout` or `nanotron`) is re-planned by `constrained`: its own
    rule would return the split it has."""
    cfg, blocks, bad = _setup()
    started = cfg.with_overrides(cost_strategy=strategy, layout=BAD)
    choice = choose_replan(started, blocks, bad, step=5, spread=0.0, engines=("1f1b",))
    assert choice.moves and choice.new.block_ranks == make_plan(blocks, cfg).block_ranks
    assert choice.new.strategy == "constrained"


def test_a_run_on_the_fastest_plan_stays():
    cfg, blocks, _ = _setup()
    choice = choose_replan(cfg, blocks, make_plan(blocks, cfg), step=5, spread=0.0, engines=("1f1b",))
    assert choice.verdict is Verdict.BEST and choice.new is choice.old and not choice.moves
    assert "the run is on the fastest plan under its memory" in choice.lines()[-1]


@pytest.mark.parametrize(("min_gain", "spread", "verdict"), [
    (0.03, 0.01, Verdict.MOVE),
    (0.9, 0.01, Verdict.SMALL),  # the gain is about 47 %: below 90 %
    (0.03, 0.6, Verdict.NOISY),  # the run's own steps moved more than the gain
    (0.03, 0.47, Verdict.MOVE),
])
def test_min_gain_and_the_runs_noise_decide(min_gain, spread, verdict):
    cfg, blocks, bad = _setup(replan=ReplanConfig(after_steps=5, min_gain=min_gain))
    choice = choose_replan(cfg, blocks, bad, step=5, spread=spread, engines=("1f1b",))
    assert choice.gain == pytest.approx(0.4736, abs=1e-3)  # the analytic H100's prices
    assert choice.verdict is verdict


def test_noise_equal_to_the_gain_stays():
    cfg, blocks, bad = _setup()
    gain = choose_replan(cfg, blocks, bad, step=5, spread=0.0, engines=("1f1b",)).gain
    assert choose_replan(cfg, blocks, bad, step=5, spread=gain, engines=("1f1b",)).verdict is Verdict.NOISY


def test_without_a_cap_a_move_never_raises_the_largest_stage_above_the_runs():
    """zb1p and zb2p are faster on the good split but hold more than 1F1B's largest stage: without a cap the run
    keeps 1F1B; with a cap between zb1p's need and zb2p's it takes zb1p."""
    cfg, blocks, bad = _setup()
    old_peak = max(s.memory_bytes for s in bad.stages)
    kept = choose_replan(cfg, blocks, bad, step=5, spread=0.0, engines=CONTIGUOUS)
    assert kept.new.engine == "1f1b" and kept.cap_bytes == old_peak
    assert max(s.memory_bytes for s in kept.new.stages) <= old_peak
    assert any("zb1p" in line and "without the cap" in line for line in kept.engine_lines)
    cfg, blocks, bad = _setup(memory_cap_gib=1.055)
    moved = choose_replan(cfg, blocks, bad, step=5, spread=0.0, engines=CONTIGUOUS)
    assert moved.new.engine == "zb1p" and moved.cap_bytes == 1.055 * GIB and moved.moves
    assert "engines: zb1p" in "\n".join(moved.lines())


def test_no_engine_fits_the_cap_the_run_stays_on_its_own():
    cfg, blocks, bad = _setup(memory_cap_gib=0.5)
    choice = choose_replan(cfg, blocks, bad, step=5, spread=0.0, engines=("1f1b",))
    assert choice.verdict is Verdict.BEST and choice.new is choice.old
    with pytest.raises(ConfigError, match="found no engine whose plan fits"):
        choose_replan(cfg, blocks, bad, step=5, spread=0.0, engines=("zb1p",))


def test_the_engines_a_replan_may_pick():
    cfg = load_config(bundled_config())
    assert replan_engines(cfg, engine_was_auto=False) == ("1f1b",)
    assert replan_engines(cfg, engine_was_auto=True) == CONTIGUOUS
    assert replan_engines(cfg.with_overrides(replan=ReplanConfig(engine="auto")), engine_was_auto=False) == CONTIGUOUS
    assert replan_engines(cfg.with_overrides(replan=ReplanConfig(engine="keep")), engine_was_auto=True) == ("1f1b",)


def test_the_replan_key_reads_a_mapping_and_refuses_bad_values():
    assert ExtConfig(replan={"after_steps": 5}).replan == ReplanConfig(5, 0.03, None)
    assert ExtConfig().replan.after_steps is None  # off by default
    for bad, match in [({"after_step": 5}, "did you mean 'after_steps'"),
                       ({"after_steps": 1}, "after_steps=1 must be an integer >= 2"),
                       ({"after_steps": True}, "after_steps=True must be an integer"),
                       ({"min_gain": 1.0}, r"min_gain=1.0 must be a fraction of the step in \[0, 1\)"),
                       ({"min_gain": -0.1}, "min_gain=-0.1 must be"),
                       ({"engine": "autp"}, "did you mean 'auto'"),
                       ("after 5", "replan is text")]:
        with pytest.raises(ConfigError, match=match):
            ExtConfig(replan=bad)
