"""The static validator's boundaries: when too few 1F1B micro-batches stop Nanotron, and the memory cap in GiB."""

from __future__ import annotations

import dataclasses

import pytest

from nanotron_ext import make_plan
from nanotron_ext.config import bundled_config, load_config
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.report import human_bytes

GIB = 1 << 30


@pytest.fixture
def tiny():
    cfg = load_config(bundled_config())
    return cfg, inventory_from_config(cfg)


def _run(cfg, **changes):
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, **changes))


def test_1f1b_needs_pp_minus_1_micro_batches(tiny):
    cfg, blocks = tiny
    # Nanotron's 1F1B engine asserts nb_microbatches >= pp - 1: at pp=3, 1 micro-batch stops it (error), 2 run
    # with a pipeline that never fills (warning: bubble at least (3-1)/(2+3-1) = 50 %), 3 are fine.
    fatal = make_plan(blocks, _run(cfg, pp=3, n_micro_batches=1), "flops")
    assert [(f.severity, f.code, f.stage) for f in fatal.findings] == [("error", "few-micro-batches", None)]
    assert fatal.ok is False
    assert fatal.findings[0].message == (
        "1F1B needs at least pp - 1 = 2 micro-batches, got 1: Nanotron's engine asserts nb_microbatches >= pp - 1 "
        "and stops"
    )
    assert fatal.findings[0].fix == (
        "set tokens.batch_accumulation_per_replica >= 3 (>= pp fills the pipeline), or pp_engine: afab"
    )
    runs = make_plan(blocks, _run(cfg, pp=3, n_micro_batches=2), "flops")
    assert [(f.severity, f.code) for f in runs.findings] == [("warning", "few-micro-batches")]
    assert runs.ok is True and "bubble at least 50%" in runs.findings[0].message
    assert make_plan(blocks, _run(cfg, pp=3, n_micro_batches=3), "flops").findings == ()
    # AFAB has no such rule.
    assert make_plan(blocks, _run(cfg, pp=3, n_micro_batches=1, engine="afab"), "flops").findings == ()


def test_memory_cap_is_in_gib(tiny):
    cfg, blocks = tiny
    # Nanotron's rule ignores the cap, so its plan shows the validator's verdict on stage 0 just above and just
    # below the cap (0.3 % either way: a cap misread as 10^9 bytes would flag both).
    need = make_plan(blocks, cfg, "nanotron").stages[0].memory_bytes
    above = make_plan(blocks, cfg.with_overrides(memory_cap_gib=need * 1.003 / GIB), "nanotron")
    assert [f.code for f in above.findings] == ["no-params"]
    below = make_plan(blocks, cfg.with_overrides(memory_cap_gib=need * 0.997 / GIB), "nanotron")
    assert sorted((f.code, f.stage) for f in below.findings) == [("memory", 0), ("no-params", 1)]
    memory = next(f for f in below.findings if f.code == "memory")
    assert memory.severity == "error" and memory.message.startswith(f"stage 0 needs about {need / GIB:.3g} GiB, over")


def test_the_memory_fixes_are_planned_and_name_only_what_the_config_has_not_taken(tiny):
    cfg, blocks = tiny

    def fix(cfg, strategy="nanotron"):
        need = make_plan(blocks, cfg, strategy).stages[0].memory_bytes
        capped = cfg.with_overrides(memory_cap_gib=need * 0.997 / GIB)
        plan = make_plan(blocks, capped, strategy)
        return capped, next(f.fix for f in plan.findings if f.code == "memory")

    def largest(cfg, strategy="nanotron"):
        from nanotron_ext.inventory import inventory_from_config

        return human_bytes(max(s.memory_bytes for s in make_plan(inventory_from_config(cfg), cfg, strategy).stages))

    # 1F1B, dp=1: no "pp_engine: 1f1b", and no ZeRO-1 (nothing to shard the optimizer over at dp=1); each change
    # planned again, with the largest stage it gives, those that fit first; the cap last.
    capped, text = fix(cfg)
    assert text == (
        f"`parallelism.tp: 2` (largest stage {largest(_run(capped, tp=2))}); or "
        "`parallelism.recompute_layer: true` (upstream Nanotron: each decoder layer keeps its input) "
        f"(largest stage {largest(_run(capped, recompute_layer=True))}, still over); or `parallelism.pp: 4` "
        f"(largest stage {largest(capped.with_overrides(pp=4))}, still over); or raise `memory_cap_gib`"
    )
    capped, both = fix(_run(cfg, engine="afab", dp=2))
    assert f"`optimizer.zero_stage: 1` (largest stage {largest(_run(capped, zero_stage=1))}" in both
    assert (
        f"`pp_engine: 1f1b` (fewer micro-batches in flight) (largest stage {largest(_run(capped, engine='1f1b'))}"
        in both
    )
    from nanotron_ext.strategies.fixes import memory_cap_fix

    assert "--cost-strategy memory" not in memory_cap_fix(cfg, "memory", len(blocks))  # it plans under the cap


def test_a_frozen_stage_fix_depends_on_what_the_config_allows(tiny):
    cfg, blocks = tiny
    frozen = cfg.with_overrides(freeze={"modules": ["embedding", "decoder.0"]})
    from nanotron_ext.inventory import inventory_from_config

    blocks = inventory_from_config(frozen)
    refused = make_plan(blocks, frozen, "uniform")  # stage 0 holds only frozen blocks: an error, three ways out
    [finding] = [f for f in refused.findings if f.code == "no-trainable"]
    assert finding.severity == "error" and finding.fix == (
        "use `--cost-strategy constrained` (or `cost_strategy: constrained` under `parallelism:`) to put a trainable "
        "block on every stage, set `allow_frozen_stages: true` under `nanotron_ext:` to run it frozen or lower pp"
    )
    # With one trainable block for two stages no strategy can put one on every stage: none is suggested.
    one = frozen.with_overrides(freeze={"modules": ["*"], "unfreeze": ["lm_head"]})
    lone = make_plan(inventory_from_config(one), one, "uniform")
    assert [f.code for f in lone.findings] == ["no-trainable"]
    assert "--cost-strategy" not in lone.findings[0].fix and lone.findings[0].fix.endswith("or lower pp to 1")
    allowed = make_plan(blocks, frozen.with_overrides(allow_frozen_stages=True), "uniform")
    [finding] = [f for f in allowed.findings if f.code == "no-trainable"]
    assert finding.severity == "warning" and finding.fix == (
        "none needed (`allow_frozen_stages: true` allows it); to train on every stage instead, use `--cost-strategy "
        "constrained` (or `cost_strategy: constrained` under `parallelism:`) with `allow_frozen_stages: false`"
    )


def test_a_verdict_names_each_findings_stages_as_ranges(tiny):
    cfg, blocks = tiny
    plan = make_plan(blocks, _run(cfg, pp=12), "nanotron")  # greedy: blocks on stages 0-2, stages 3 to 11 empty
    assert plan.verdict == "INVALID (few-micro-batches, no-params@1-2, empty-stage@3-11)"
