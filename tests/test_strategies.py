"""The strategy registry and the built-in strategies on the bundled example."""

from __future__ import annotations

import dataclasses

import pytest

from nanotron_ext import make_plan
from nanotron_ext.config import bundled_config, load_config
from nanotron_ext.errors import ConfigError, PlanningError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.partition import nanotron_greedy_ranks
from nanotron_ext.strategies import (
    Assignment,
    available_strategies,
    get_strategy,
    register_strategy,
    registry,
)


@pytest.fixture
def tiny():
    cfg = load_config(bundled_config())
    return cfg, inventory_from_config(cfg)


def test_tiny_inventory_written_out(tiny):
    cfg, blocks = tiny
    assert [b.short for b in blocks] == ["embedding", "decoder.0", "decoder.1", "final_norm", "lm_head", "cast", "loss"]
    # decoder: 2 norms (2·16) + qkv (4+2·4)·4·16 + o 16·16 + gate_up 2·64·16 + down 64·16
    assert [b.params for b in blocks] == [50_277 * 16, 4_128, 4_128, 16, 50_277 * 16, 0, 0]
    assert [b.nanotron_cost for b in blocks] == [0, 4_096, 4_096, 0, 804_432, 0, 0]


def test_nanotron_rule_reproduces_the_weightless_stage(tiny):
    cfg, blocks = tiny
    plan = make_plan(blocks, cfg, "nanotron")
    assert plan.block_ranks == (0, 0, 0, 0, 0, 1, 1)
    assert not plan.ok
    assert [f.code for f in plan.findings] == ["no-params"]


def test_greedy_rule_step_by_step():
    # cumulative [1, 2, 3, 10], thresholds [5, 10]: block 3 crosses nothing after being assigned to rank 0? no:
    # 1 <= 5, 2 <= 5, 3 <= 5 stay on 0; block 3 is assigned to rank 0 *before* 10 > 5 is checked.
    assert nanotron_greedy_ranks([1, 1, 1, 7], 2) == [0, 0, 0, 0]
    assert nanotron_greedy_ranks([1, 1, 1, 1], 2) == [0, 0, 0, 1]  # 3 > 2 only after block 2 is placed


@pytest.mark.parametrize("name", ["uniform", "flops", "memory", "constrained"])
def test_optimal_strategies_give_every_stage_weights(tiny, name):
    cfg, blocks = tiny
    plan = make_plan(blocks, cfg, name)
    assert plan.ok and all(s.params > 0 for s in plan.stages)


def test_constrained_puts_a_trainable_block_on_every_stage(tiny):
    cfg, blocks = tiny
    # Train only the embedding and decoder.0: flops happily leaves stage 1 frozen, constrained does not.
    trainable = {"embedding", "decoder.0"}
    blocks = [dataclasses.replace(b, trainable=b.params if b.short in trainable else 0) for b in blocks]
    flops = make_plan(blocks, cfg, "flops")
    # A frozen stage without allow_frozen_stages is an error: the plan cannot train.
    assert [(f.severity, f.code, f.stage) for f in flops.findings] == [("error", "no-trainable", 1)]
    assert flops.ok is False
    assert flops.verdict == "INVALID (no-trainable@1)"
    plan = make_plan(blocks, cfg, "constrained")
    assert plan.ok and plan.block_ranks == (0, 1, 1, 1, 1, 1, 1)


def test_constrained_with_too_few_trainable_blocks_explains_both_ways_out(tiny):
    cfg, blocks = tiny
    blocks = [dataclasses.replace(b, trainable=b.params if b.role == "lm_head" else 0) for b in blocks]
    with pytest.raises(
        PlanningError,
        match=r"only 1 blocks are trainable \(lm_head\).*\(1\) lower pp.*\(2\) set `allow_frozen_stages: true`",
    ):
        make_plan(blocks, cfg, "constrained")
    allowed = cfg.with_overrides(allow_frozen_stages=True)
    plan = make_plan(blocks, allowed, "constrained")
    assert plan.ok and [(f.severity, f.code) for f in plan.findings] == [("warning", "no-trainable")]  # allowed


def test_profiled_and_constrained_refuse_fewer_trainable_blocks_than_stages_alike(tiny, tmp_path):
    cfg, blocks = tiny
    blocks = [dataclasses.replace(b, trainable=b.params if b.role == "lm_head" else 0) for b in blocks]
    cfg = cfg.with_overrides(profile_cache=str(tmp_path))  # nothing gets measured: the check comes first
    errors = {}
    for name in ("constrained", "profiled"):
        with pytest.raises(PlanningError) as info:
            make_plan(blocks, cfg, name)
        errors[name] = str(info.value)
    assert errors["profiled"] == errors["constrained"]
    assert errors["profiled"].startswith("pp=2 but only 1 blocks are trainable (lm_head)")
    assert not list(tmp_path.iterdir())


def test_memory_cap_is_respected_or_explained(tiny):
    cfg, blocks = tiny
    roomy = cfg.with_overrides(memory_cap_gib=1.1)  # 1 GiB of it is the default overhead allowance
    assert make_plan(blocks, roomy, "flops").ok
    tight = cfg.with_overrides(memory_cap_gib=0.01)
    with pytest.raises(PlanningError, match=r"no split fits memory_cap_gib=0.01.*GiB over"):
        make_plan(blocks, tight, "flops")
    assert {f.code for f in make_plan(blocks, tight, "nanotron").findings} == {"no-params", "memory"}


def test_memory_cap_search_keeps_the_overhead_allowance(tiny):
    # 1 MiB above the 1 GiB overhead allowance: every stage of the tiny model needs more than that (its lm_head
    # alone is 3 MiB of weights), so no split fits; a search that forgot the overhead would take the whole GiB.
    cfg, blocks = tiny
    assert cfg.ext.overhead_gib == 1.0 and cfg.ext.objective == "step_time"
    almost = cfg.with_overrides(memory_cap_gib=1.0 + 1 / 1024)
    for name in ("flops", "constrained"):  # the FLOP partitioner and the step-time search
        with pytest.raises(PlanningError, match=r"no split fits memory_cap_gib=1: .*GiB over"):
            make_plan(blocks, almost, name)


def test_the_caps_fix_names_the_1f1b_engine_only_to_an_afab_run(tiny):
    cfg, blocks = tiny
    almost = cfg.with_overrides(memory_cap_gib=1.0 + 1 / 1024)  # no split fits (see the test above)
    for engine, named in (("afab", True), ("1f1b", False)):
        with pytest.raises(PlanningError, match="no split fits memory_cap_gib=1") as exc:
            make_plan(blocks, almost.with_overrides(engine=engine), "flops")
        assert ("the 1f1b engine (fewer micro-batches in flight)" in str(exc.value)) is named, str(exc.value)


def test_layout_strategy(tiny):
    cfg, blocks = tiny
    plan = make_plan(blocks, cfg.with_overrides(layout="E,t|t,L"), "layout")
    assert plan.block_ranks == (0, 0, 1, 1, 1, 1, 1)
    with pytest.raises(ConfigError, match="has 3 stages but pp=2"):
        make_plan(blocks, cfg.with_overrides(layout="E,t|t|L"), "layout")
    with pytest.raises(ConfigError, match="needs `layout:`"):
        make_plan(blocks, cfg, "layout")


def test_unknown_strategy_lists_the_known_ones():
    with pytest.raises(
        ConfigError,
        match=r"unknown cost strategy 'flop'; did you mean 'flops'\? known strategies: nanotron, uniform, flops",
    ):
        get_strategy("flop")


def test_register_and_import_path(tiny, monkeypatch):
    cfg, blocks = tiny
    # a registry of its own, so the test strategy does not leak into later tests' comparisons
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    @register_strategy("test-last-block-alone")
    class LastAlone:
        name = "test-last-block-alone"

        def assign(self, blocks, cfg):
            return Assignment([0] * (len(blocks) - 1) + [1], [1.0] * len(blocks), "blocks")

    assert "test-last-block-alone" in available_strategies()
    assert make_plan(blocks, cfg, "test-last-block-alone").block_ranks == (0, 0, 0, 0, 0, 0, 1)
    with pytest.raises(ConfigError, match="already registered"):
        register_strategy("flops")(LastAlone)
    by_path = make_plan(blocks, cfg, "nanotron_ext.strategies.builtin:Uniform")
    assert by_path.block_ranks == make_plan(blocks, cfg, "uniform").block_ranks
    with pytest.raises(ConfigError, match="cannot be imported"):
        get_strategy("nanotron_ext.nope:Thing")


def test_pp_larger_than_weighted_blocks_says_the_largest_that_works(tiny):
    cfg, blocks = tiny
    with pytest.raises(
        PlanningError, match=r"pp=6 needs 6 blocks with parameters .* has 5 .*largest pp that works is 5"
    ):
        make_plan(blocks, cfg.with_overrides(pp=6), "flops")


def test_plans_are_deterministic_and_serialise(tiny):
    cfg, blocks = tiny
    a, b = make_plan(blocks, cfg, "constrained"), make_plan(blocks, cfg, "constrained")
    assert a == b and a.to_json() == b.to_json()
    assert '"block_ranks": [' in a.to_json()


def test_allow_frozen_stages_lets_the_default_take_a_faster_frozen_stage(tmp_path):
    # Two trainable blocks (the last decoder layer and the lm_head) at pp=2: without allow_frozen_stages each
    # stage gets one; with it, the fastest split keeps the frozen prefix on stage 0, where no gradient crosses
    # the cut back (on a machine whose links cost 1 ms a tensor), and the default is then the fastest valid plan
    # of every strategy.
    from nanotron_ext.machine import Link, MachineProfile
    from nanotron_ext.plan import plan_every_strategy
    from nanotron_ext.simulate import simulate_plan

    slow_links = MachineProfile(name="slow links", source="test", links=(Link(-1, -1, 1e-3, 1e9),))
    slow_links.save(tmp_path / "slow.json")
    cfg = load_config("nanotron_ext/configs/last_layer_lm_head_pp4.yaml", pp=2).with_overrides(
        machine=str(tmp_path / "slow.json")
    )
    blocks = inventory_from_config(cfg)
    strict = make_plan(blocks, cfg.with_overrides(allow_frozen_stages=False))
    assert all(s.trainable > 0 for s in strict.stages)
    free = make_plan(blocks, cfg)
    assert free.stages[0].trainable == 0 and free.ok
    steps = {
        a.strategy: simulate_plan(a.plan, blocks, cfg).step_time
        for a in plan_every_strategy(blocks, cfg)
        if a.plan is not None and a.plan.ok
    }
    assert steps["constrained"] <= min(steps.values()) * (1 + 1e-12)
    assert simulate_plan(strict, blocks, cfg).step_time > steps["constrained"]
