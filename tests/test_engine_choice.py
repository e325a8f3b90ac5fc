"""``parallelism.pp_engine: auto`` (issue 31): the engine and the split chosen together, under the memory.

Brute-force references: each engine planned and simulated on its own (``simulate_plan``), the choice the fastest
of those whose every stage fits.
"""

from __future__ import annotations

import json

import pytest

from nanotron_ext.config import bundled_config, config_from_dict, load_config
from nanotron_ext.costs.analytic import GIB
from nanotron_ext.errors import ConfigError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.plan import (
    AUTO_ENGINES,
    CONTIGUOUS_AUTO_ENGINES,
    choose_engine,
    make_plan,
    resolve_engine,
    resolve_vocab_shards,
)
from nanotron_ext.plan.engine_choice import HELD_SENDS
from nanotron_ext.plan.v_plan import make_v_plan, v_plan_timeline
from nanotron_ext.report import format_seconds
from nanotron_ext.schedule.programs import engine_program
from nanotron_ext.schedule.v_replay import stuck_when_sends_wait, transfer_order
from nanotron_ext.simulate import simulate_plan


def _seed(**ext):
    import yaml

    raw = yaml.safe_load(bundled_config().read_text())
    raw["parallelism"]["pp_engine"] = "auto"
    if "cost_strategy" in ext:  # the bundled YAML names its strategy under parallelism:
        raw["parallelism"]["cost_strategy"] = ext.pop("cost_strategy")
    raw["nanotron_ext"].update(ext)
    return config_from_dict(raw, source="seed")


def _by_hand(cfg) -> dict[str, tuple[float, float, bool]]:
    """engine → (simulated step, largest stage peak, plan ok), each planned on its own."""
    out = {}
    for engine in AUTO_ENGINES:
        trial, _ = resolve_vocab_shards(cfg.with_overrides(engine=engine))
        blocks = inventory_from_config(trial)
        if engine == "zbv":  # a V: its own plan, step and per-rank peaks
            v = make_v_plan(blocks, trial)
            out[engine] = (v_plan_timeline(v, blocks, trial).step_time, max(v.peaks), True)
            continue
        plan = make_plan(blocks, trial)
        out[engine] = (simulate_plan(plan, blocks, trial).step_time, max(s.memory_bytes for s in plan.stages), plan.ok)
    return out


def test_auto_takes_the_fastest_engine_and_writes_it_where_nanotron_reads_it() -> None:
    cfg = _seed()
    hand = _by_hand(cfg)
    resolved, choice = resolve_engine(cfg)
    assert choice is not None
    fastest = min((e for e in AUTO_ENGINES if hand[e][2]), key=lambda e: hand[e][0])
    assert choice.engine == fastest == resolved.run.engine == resolved.nanotron["parallelism"]["pp_engine"]
    for option in choice.options:
        assert option.step_time == pytest.approx(hand[option.engine][0], rel=1e-9)
        assert option.peak == hand[option.engine][1]
    assert choice.runner_up is not None and choice.runner_up.engine != choice.engine
    lines = choice.lines()
    assert lines[0].startswith(f"pp_engine: auto -> {fastest}: step ") and "peak" in lines[0]
    assert lines[1].startswith(f"  runner-up {choice.runner_up.engine}: step ")
    # an engine named in the YAML is left alone
    assert resolve_engine(cfg.with_overrides(engine="1f1b")) == (cfg.with_overrides(engine="1f1b"), None)


def test_a_cap_between_zb1p_and_zb2p_peaks_takes_zb1p() -> None:
    """One split for every engine (``flops`` does not depend on it): zb2p is faster and holds more; a cap between
    the two peaks leaves zb1p the fastest that fits, 1F1B the runner-up, and zb2p named as faster but over the
    cap."""
    free = _by_hand(_seed(cost_strategy="flops"))
    assert free["zb2p"][0] < free["zb1p"][0] and free["zb2p"][1] > free["zb1p"][1]
    cap = (free["zb1p"][1] + free["zb2p"][1]) / 2 / GIB
    choice = choose_engine(_seed(cost_strategy="flops", memory_cap_gib=cap))
    assert choice.engine == "zb1p"
    assert choice.runner_up is not None and choice.runner_up.engine == "1f1b" and choice.runner_up.fits
    # The V without the cap holds every micro-batch its memory takes (faster and larger than any here): over it too.
    assert [o.engine for o in choice.faster_not_taken] == ["zbv", "zb2p"]
    assert not any(o.fits for o in choice.faster_not_taken)
    over = choice.faster_not_taken[1]
    assert not over.fits and over.reason.startswith(f"no split fits memory_cap_gib={cap:.3g}")
    assert over.peak == free["zb2p"][1] and over.step_time == pytest.approx(free["zb2p"][0], rel=1e-9)
    assert choice.lines()[3].startswith("  faster, not taken: zb2p: step ") and "memory_cap_gib" in choice.lines()[3]


def test_a_cap_nothing_fits_is_refused_naming_each_engine_and_the_limit() -> None:
    with pytest.raises(
        ConfigError,
        match=r"pp_engine: auto found no engine whose plan fits memory_cap_gib=0\.001: "
        r"1f1b: .*; zb1p: .*; zb2p: .*\. Raise memory_cap_gib",
    ):
        resolve_engine(_seed(cost_strategy="flops", memory_cap_gib=0.001))


def test_too_few_micro_batches_for_the_1f1b_family_leaves_the_v_and_says_each_reason() -> None:
    cfg = _seed().with_overrides(pp=2, n_micro_batches=1)
    choice = choose_engine(cfg)  # pp = 2: one micro-batch is pp - 1, which every engine of the family runs
    assert choice.engine in AUTO_ENGINES
    big = load_config("nanotron_ext/configs/smollm_135m.yaml").with_overrides(engine="auto", pp=4, n_micro_batches=2)
    choice = choose_engine(big)  # m = 2 at pp = 4: below the family's pp - 1; a V runs any m
    assert choice.engine == "zbv"
    lines = "\n".join(choice.lines())
    for engine in CONTIGUOUS_AUTO_ENGINES:
        assert f"{engine}: cannot be planned (" in lines and "needs at least pp - 1 = 3 micro-batches, got 2" in lines
    with pytest.raises(ConfigError, match=r"1f1b: cannot be planned \(1F1B needs at least pp - 1 = 3"):
        choose_engine(big, CONTIGUOUS_AUTO_ENGINES)


def test_recompute_is_priced_in_every_option() -> None:
    # Under recompute_layer every backward pays its forward again: each option's step is its plan simulated
    # under that config, and longer than without it.
    import yaml

    raw = yaml.safe_load(bundled_config().read_text())
    raw["parallelism"].update(pp_engine="auto", recompute_layer=True)
    cfg = config_from_dict(raw, source="seed, recompute")
    plain = choose_engine(_seed())
    choice = choose_engine(cfg)
    hand = _by_hand(cfg)
    for option, before in zip(choice.options, plain.options):
        assert option.step_time == pytest.approx(hand[option.engine][0], rel=1e-9)
        assert option.step_time > before.step_time


def test_unresolved_auto_is_refused_where_one_engine_is_needed() -> None:
    cfg = _seed()
    with pytest.raises(ConfigError, match=r"pp_engine: auto is chosen by the planner .*resolve_engine\(cfg\)"):
        make_plan(inventory_from_config(cfg.with_overrides(vocab_shards=1)), cfg)
    with pytest.raises(ValueError, match=r"pp_engine: auto is chosen by the planner"):
        engine_program("auto", 2, 0, 4)


def test_plan_and_simulate_print_the_choice(capsys) -> None:
    from nanotron_ext.cli import main

    assert main(["plan", "--engine", "auto"]) == 0
    out = capsys.readouterr().out
    assert "pp_engine: auto -> " in out and "runner-up" in out
    assert main(["plan", "--engine", "auto", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["engine_choice"]["engine"] == data["engine"] and len(data["engine_choice"]["options"]) == 4
    assert main(["simulate", "--engine", "auto", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["engine"] == data["engine_choice"]["engine"] != "auto"


def test_on_an_h100_the_zero_bubble_plans_that_do_not_fit_are_passed_over() -> None:
    """Llama-3-8B at pp=4, 16 micro-batches, on the analytic H100 (79.18 GiB): zb1p and zb2p are faster but
    their deferred W's and micro-batches in flight put a stage over the GPU; 1F1B fits. Llama-3-70B fits under
    no engine at pp=4: refused, with the GPU's memory named."""
    choice = choose_engine(load_config(bundled_config("llama_3_8b.yaml"), pp=4).with_overrides(engine="auto"))
    assert choice.engine == "1f1b" and choice.chosen.fits
    assert [(o.engine, o.fits) for o in choice.faster_not_taken] == [("zb2p", False), ("zb1p", False)]
    assert all("over 79.18 GiB per GPU" in o.reason for o in choice.faster_not_taken)
    with pytest.raises(ConfigError, match=r"no engine whose plan fits 79\.18 GiB per GPU \(H100 SXM \(analytic\)\)"):
        choose_engine(load_config(bundled_config("llama_3_70b.yaml"), pp=4).with_overrides(engine="auto"))


def test_under_a_cap_that_rules_out_zb2p_auto_takes_the_v_where_it_beats_zb1p() -> None:
    """SmolLM-135M at pp=4, 8 micro-batches, 12 GiB per GPU: zb2p is fastest but over the cap; the V fits (its
    two chunks per rank at 1F1B-like memory) and beats zb1p, so auto takes zbv with the plan it priced."""
    cfg = load_config(bundled_config("smollm_135m.yaml"), pp=4).with_overrides(engine="auto", memory_cap_gib=12.0)
    choice = choose_engine(cfg)
    zb1p = next(o for o in choice.options if o.engine == "zb1p")
    assert choice.engine == "zbv" and choice.chosen.fits and choice.chosen.step_time < zb1p.step_time
    assert choice.chosen.peak is not None and choice.chosen.peak <= 12.0 * GIB
    assert [o.engine for o in choice.faster_not_taken] == ["zb2p"]
    resolved = cfg.with_overrides(engine=choice.engine)  # what resolve_engine writes (tested above)
    v = make_v_plan(inventory_from_config(resolved), resolved)
    assert (v.step_time, v.peaks) == (choice.chosen.step_time, choice.chosen.peaks)
    lines = choice.lines()
    assert lines[0] == f"pp_engine: auto -> {choice.chosen.describe()}" and lines[1].startswith("  runner-up zb1p: ")
    assert lines[2].startswith("  faster, not taken: zb2p: ") and lines[3].startswith("  passed over 1f1b: step ")
    assert len(lines) == 4


def test_held_sends_cost_the_v_where_a_send_is_ready_before_its_turn() -> None:
    """The seed model at pp = 2, m = 4 on the analytic H100's latency-bound prices: holding the V's sends to one
    order of transfers makes its step longer than the simulation with sends posted as made. The launcher's auto
    prices the V so (Nanotron's trainer holds them), the contiguous engines as before, and chooses by those prices."""
    cfg = _seed().with_overrides(pp=2, n_micro_batches=4, engine="zbv")
    blocks = inventory_from_config(cfg)
    v = make_v_plan(blocks, cfg)
    free, held = v_plan_timeline(v, blocks, cfg).step_time, v_plan_timeline(v, blocks, cfg, sends_wait=True).step_time
    assert free == pytest.approx(v.step_time, rel=1e-12) and held > free, (free, held)
    # The plan keeps the transfers keyed by its own times, which the engine holds its sends to: not the unit keys.
    unit = transfer_order(v.order_for(2, 4))
    assert v.transfers_for(2, 4) != unit and stuck_when_sends_wait(v.transfers_for(2, 4)) is None
    auto = cfg.with_overrides(engine="auto")
    posted, waiting = choose_engine(auto), choose_engine(auto, sends_wait=True)
    v_held = next(o for o in waiting.options if o.engine == "zbv")
    assert (v_held.step_time, v_held.peaks, v_held.note) == (held, v.peaks, HELD_SENDS)
    assert v_held.describe().startswith(f"zbv: step {format_seconds(held)} ({HELD_SENDS}), peak ")
    assert [o for o in waiting.options if o.engine != "zbv"] == [o for o in posted.options if o.engine != "zbv"]
    fastest_fit = min((o for o in waiting.options if o.fits), key=lambda o: (o.step_time, o.peak))
    assert waiting.engine == fastest_fit.engine
