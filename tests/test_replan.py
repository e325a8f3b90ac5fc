"""The re-plan after K steps, as planning (no process): which plan it picks under the run's memory, the predicted
steps it compares, when it moves and when it stays; and its YAML key. The move itself runs in
``tests/runtime/test_replan.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nanotron_ext.config import bundled_config, load_config
from nanotron_ext.config_ext import ExtConfig, ReplanConfig
from nanotron_ext.costs.analytic import GIB
from nanotron_ext.errors import ConfigError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.plan import make_plan, replan
from nanotron_ext.plan.engine_choice import predicted_step
from nanotron_ext.plan.replan import Verdict, choose_replan, replan_engines

BAD = "E|t*2,L"  # the lm_head beside both decoder layers: stage 1 does nearly all the work
CONTIGUOUS = ("1f1b", "zb1p", "zb2p")
DATA = Path(__file__).parent / "data"


def _setup(**ext):
    cfg = load_config(bundled_config()).with_overrides(**ext)
    blocks = inventory_from_config(cfg)
    return cfg, blocks, make_plan(blocks, cfg.with_overrides(cost_strategy="layout", layout=BAD))


def test_a_bad_split_moves_to_the_fastest_split_with_both_steps_predicted_by_the_simulator():
    cfg, blocks, bad = _setup()
    choice = choose_replan(cfg, blocks, bad, step=5, engines=("1f1b",))
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
    choice = choose_replan(started, blocks, bad, step=5, engines=("1f1b",))
    assert choice.moves and choice.new.block_ranks == make_plan(blocks, cfg).block_ranks
    assert choice.new.strategy == "constrained"


def test_a_run_on_the_fastest_plan_stays():
    cfg, blocks, _ = _setup()
    choice = choose_replan(cfg, blocks, make_plan(blocks, cfg), step=5, engines=("1f1b",))
    assert choice.verdict is Verdict.BEST and choice.new is choice.old and not choice.moves
    assert "the run is on the fastest plan under its memory" in choice.lines()[-1]


HALVES = (1.0, 400.0)  # TFLOP/s: at 1, the analytic p2p is small beside compute and both splits are near alike


def _halves(cfg):
    return [cfg.with_overrides(tflops=tflops) for tflops in HALVES]


@pytest.mark.parametrize(
    ("min_gain", "tflops", "verdict"),
    [
        (0.03, None, Verdict.MOVE),  # the gain is about 47 %, the noise about 22 %
        (0.9, None, Verdict.SMALL),  # 47 % is below 90 %
        (0.03, 1.0, Verdict.NOISY),  # priced at 1 TFLOP/s the gain is about 4 %: within the noise
        (0.05, 1.0, Verdict.SMALL),  # min_gain is checked first
    ],
)
def test_min_gain_and_the_noise_of_the_gain_decide(min_gain, tflops, verdict):
    cfg, blocks, bad = _setup(replan=ReplanConfig(after_steps=5, min_gain=min_gain))
    choice = choose_replan(
        cfg.with_overrides(tflops=tflops), blocks, bad, step=5, engines=("1f1b",), halves=_halves(cfg)
    )
    gains = [
        1 - predicted_step(h, blocks, choice.new.block_ranks) / predicted_step(h, blocks, bad.block_ranks)
        for h in _halves(cfg)
    ]
    assert choice.noise == pytest.approx(abs(gains[0] - gains[1]) / 2) == pytest.approx(0.2157, abs=1e-3)
    assert choice.gain == pytest.approx(0.4730 if tflops is None else 0.0417, abs=1e-3)
    assert choice.verdict is verdict
    assert f"run's noise {choice.noise:.1%}" in choice.lines()[-1]


def test_without_two_halves_or_a_move_there_is_no_noise():
    cfg, blocks, bad = _setup()
    assert choose_replan(cfg, blocks, bad, step=5, engines=("1f1b",), halves=_halves(cfg)[:1]).noise == 0.0
    best = make_plan(blocks, cfg)
    assert choose_replan(cfg, blocks, best, step=5, engines=("1f1b",), halves=_halves(cfg)).noise == 0.0


def test_a_half_that_ran_uniformly_slower_is_no_noise(tmp_path):
    """Every op of one half twice as slow (another job on the node) moves both predicted steps alike: the gain, and
    so the decision, stays; the steps' own spread would have called it noise."""
    profile = json.loads((DATA / "machine_flops_only.json").read_text())
    profile["flops_per_second"] /= 2
    (tmp_path / "slow.json").write_text(json.dumps(profile))
    cfg, blocks, bad = _setup(
        machine=str(DATA / "machine_flops_only.json"), replan=ReplanConfig(after_steps=5, min_gain=0.0)
    )  # a FLOPs-only gain is under 1 %
    halves = [cfg, cfg.with_overrides(machine=str(tmp_path / "slow.json"))]
    assert predicted_step(halves[1], blocks, bad.block_ranks) == pytest.approx(
        2 * predicted_step(halves[0], blocks, bad.block_ranks)
    )
    choice = choose_replan(cfg, blocks, bad, step=5, engines=("1f1b",), halves=halves)
    assert choice.moves and choice.noise == pytest.approx(0.0, abs=1e-12)


def test_noise_equal_to_the_gain_stays(monkeypatch):
    cfg, blocks, bad = _setup()
    gain = choose_replan(cfg, blocks, bad, step=5, engines=("1f1b",)).gain
    monkeypatch.setattr(replan, "gain_noise", lambda *_: gain)
    assert choose_replan(cfg, blocks, bad, step=5, engines=("1f1b",), halves=_halves(cfg)).verdict is Verdict.NOISY


def test_without_a_cap_a_move_never_raises_the_largest_stage_above_the_runs():
    """zb1p and zb2p are faster on the good split but hold more than 1F1B's largest stage: without a cap the run
    keeps 1F1B; with a cap between zb1p's need and zb2p's it takes zb1p."""
    cfg, blocks, bad = _setup()
    old_peak = max(s.memory_bytes for s in bad.stages)
    kept = choose_replan(cfg, blocks, bad, step=5, engines=CONTIGUOUS)
    assert kept.new.engine == "1f1b" and kept.cap_bytes == old_peak
    assert max(s.memory_bytes for s in kept.new.stages) <= old_peak
    assert any("zb1p" in line and "without the cap" in line for line in kept.engine_lines)
    cfg, blocks, bad = _setup(memory_cap_gib=1.055)
    moved = choose_replan(cfg, blocks, bad, step=5, engines=CONTIGUOUS)
    assert moved.new.engine == "zb1p" and moved.cap_bytes == 1.055 * GIB and moved.moves
    assert "engines: zb1p" in "\n".join(moved.lines())


def test_no_engine_fits_the_cap_the_run_stays_on_its_own():
    cfg, blocks, bad = _setup(memory_cap_gib=0.5)
    choice = choose_replan(cfg, blocks, bad, step=5, engines=("1f1b",))
    assert choice.verdict is Verdict.BEST and choice.new is choice.old
    with pytest.raises(ConfigError, match="found no engine whose plan fits"):
        choose_replan(cfg, blocks, bad, step=5, engines=("zb1p",))


def test_the_engines_a_replan_may_pick():
    cfg = load_config(bundled_config())
    assert replan_engines(cfg, engine_was_auto=False) == ("1f1b",)
    assert replan_engines(cfg, engine_was_auto=True) == CONTIGUOUS
    assert replan_engines(cfg.with_overrides(replan=ReplanConfig(engine="auto")), engine_was_auto=False) == CONTIGUOUS
    assert replan_engines(cfg.with_overrides(replan=ReplanConfig(engine="keep")), engine_was_auto=True) == ("1f1b",)


def test_the_replan_key_reads_a_mapping_and_refuses_bad_values():
    assert ExtConfig(replan={"after_steps": 5}).replan == ReplanConfig(5, 0.03, None)
    assert ExtConfig().replan.after_steps is None  # off by default
    for bad, match in [
        ({"after_step": 5}, "did you mean 'after_steps'"),
        ({"after_steps": 1}, "after_steps=1 must be an integer >= 2"),
        ({"after_steps": True}, "after_steps=True must be an integer"),
        ({"min_gain": 1.0}, r"min_gain=1.0 must be a fraction of the step in \[0, 1\)"),
        ({"min_gain": -0.1}, "min_gain=-0.1 must be"),
        ({"engine": "autp"}, "did you mean 'auto'"),
        ("after 5", "replan is text"),
    ]:
        with pytest.raises(ConfigError, match=match):
            ExtConfig(replan=bad)
