"""Freeze specs: patterns, exceptions, errors, and what the planner does with them."""

from __future__ import annotations

import pytest

from nanotron_ext import make_plan
from nanotron_ext.config import bundled_config, load_config
from nanotron_ext.errors import ConfigError, PlanningError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.inventory.freeze import FreezeSpec, frozen_names


def planned(freeze, pp=2, projector=False, **ext):
    cfg = load_config(bundled_config()).with_overrides(pp=pp, freeze=freeze, projector=projector or None, **ext)
    return cfg, inventory_from_config(cfg)


def trainable(blocks):
    return {b.short: b.trainable for b in blocks if b.params}


def test_freeze_the_decoder():
    _, blocks = planned({"modules": ["decoder"]})
    assert trainable(blocks) == {
        "embedding": 804_432,
        "decoder.0": 0,
        "decoder.1": 0,
        "final_norm": 16,
        "lm_head": 804_432,
    }


def test_freeze_embedding_and_output():
    _, blocks = planned({"modules": ["embedding", "lm_head"]})
    assert trainable(blocks) == {"embedding": 0, "decoder.0": 4_128, "decoder.1": 4_128, "final_norm": 16, "lm_head": 0}


def test_train_only_output_layer_and_last_layer():
    _, blocks = planned({"modules": ["*"], "unfreeze": ["lm_head"], "unfreeze_last_decoder_layers": 1})
    assert trainable(blocks) == {
        "embedding": 0,
        "decoder.0": 0,
        "decoder.1": 4_128,
        "final_norm": 0,
        "lm_head": 804_432,
    }


def test_projector_only():
    _, blocks = planned({"modules": ["*"], "unfreeze": ["projector"]}, projector=True)
    assert trainable(blocks) == {
        "embedding": 0,
        "projector": 16 * 16,
        "decoder.0": 0,
        "decoder.1": 0,
        "final_norm": 0,
        "lm_head": 0,
    }


def test_module_paths_freeze_whole_blocks():
    # A module path names one block exactly; a path glob names several; roles and short names are not needed.
    _, blocks = planned({"modules": ["model.decoder.1"]})
    assert trainable(blocks) == {
        "embedding": 804_432,
        "decoder.0": 4_128,
        "decoder.1": 0,
        "final_norm": 16,
        "lm_head": 804_432,
    }
    _, blocks = planned({"modules": ["model.decoder.*", "model.lm_head"], "unfreeze": ["model.decoder.0"]})
    assert trainable(blocks) == {
        "embedding": 804_432,
        "decoder.0": 4_128,
        "decoder.1": 0,
        "final_norm": 16,
        "lm_head": 0,
    }


def test_parameter_glob_freezes_inside_a_block():
    _, blocks = planned({"modules": ["model.decoder.*.pp_block.mlp.*"]})
    # gate_up 2·64·16 + down 64·16 = 3072 frozen of 4128
    assert trainable(blocks)["decoder.0"] == 4_128 - 3_072


def test_constrained_gives_each_stage_a_trainable_block_at_pp2_and_pp4():
    spec = {"modules": ["*"], "unfreeze": ["lm_head"], "unfreeze_last_decoder_layers": 1}
    cfg, blocks = planned(spec)
    plan = make_plan(blocks, cfg, "constrained")
    assert plan.ok and all(s.trainable for s in plan.stages)
    # pp=4 has only 2 trainable blocks: an error that names both ways out, or frozen stages if allowed.
    cfg4, blocks4 = planned(spec, pp=4, allow_frozen_stages=None)
    with pytest.raises(PlanningError, match="Two ways out"):
        make_plan(blocks4, cfg4, "constrained")
    cfg4, blocks4 = planned(spec, pp=4, allow_frozen_stages=True)
    plan4 = make_plan(blocks4, cfg4, "constrained")
    assert plan4.ok and sum(1 for s in plan4.stages if s.trainable) == 2


def test_flops_prices_frozen_work():
    cfg, blocks = planned({"modules": ["*"], "unfreeze": ["lm_head"]})
    _, full = planned(None)
    from nanotron_ext.costs import training_flops

    frozen_costs, full_costs = training_flops(blocks), training_flops(full)
    # Everything before the lm_head is a frozen prefix: forward only.
    assert frozen_costs[:4] == [b.flops_fwd for b in blocks[:4]]
    assert all(f < g for f, g in zip(frozen_costs[:4], full_costs[:4]))
    # The cast and loss after the trainable lm_head still pass gradients back.
    assert frozen_costs[5] == blocks[5].flops_fwd + blocks[5].flops_bwd_input


@pytest.mark.parametrize(
    "spec, match",
    [
        (
            {"modules": ["decoder.9"]},
            r"freeze pattern 'decoder.9' matches no module; modules are: embedding, decoder.0-1",
        ),
        ({"modules": ["decoder"], "unfreeze": ["lm_head"]}, r"unfreeze 'lm_head': it is not frozen"),
        (
            {"modules": ["decoder"], "unfreeze": ["decoder.7"]},
            r"^unfreeze pattern 'decoder.7' matches no module; "
            r"modules are: embedding, decoder.0-1, final_norm, lm_head$",
        ),
        ({"modules": ["*"]}, "freezes every parameter"),
        ({"modules": ["*"], "unfreeze_last_decoder_layers": 3}, "has 2 decoder layers"),
        ({"modulez": ["*"]}, r"unknown key\(s\) 'modulez' in 'freeze:'"),
        ({"modules": [""]}, "non-empty patterns"),
    ],
)
def test_bad_specs(spec, match):
    with pytest.raises(ConfigError, match=match):
        planned(spec)


def test_tied_weights_frozen_together():
    cfg = load_config(bundled_config("smollm_135m.yaml"))
    blocks = inventory_from_config(cfg)
    tied = [("model.token_position_embeddings.pp_block.token_embedding.weight", "model.lm_head.pp_block.weight")]
    for alone in ("embedding", "lm_head"):  # either one alone
        with pytest.raises(ConfigError, match="tied .* only one is frozen"):
            frozen_names(FreezeSpec(modules=(alone,)), blocks, tied=tied)
    assert len(frozen_names(FreezeSpec(modules=("embedding", "lm_head")), blocks, tied=tied)) == 2


def test_frozen_stages_allowed_among_equal_step_times_the_split_with_the_least_memory():
    # SmolLM-135M at pp=8, m=16, training the tied embedding/lm_head and the last two layers: many splits tie on
    # step time (the frozen middle stages wait on the first one either way). The search alone put 11.7 GiB on
    # stage 0 and final_norm alone on a stage; the tie-break keeps the step and takes the least memory.
    from nanotron_ext.partition import bounds_from_ranks
    from nanotron_ext.partition.schedule_aware import StepTimeEvaluator, split_memory, step_time_partition
    from nanotron_ext.simulate import simulate_plan
    from nanotron_ext.strategies.builtin import stage_memory_terms
    from nanotron_ext.strategies.step_time import schedule_problem

    freeze = {"modules": ["*"], "unfreeze": ["lm_head", "embedding"], "unfreeze_last_decoder_layers": 2}
    cfg = load_config("examples/configs/smollm_135m.yaml").with_overrides(
        pp=8, n_micro_batches=16, freeze=freeze, allow_frozen_stages=True
    )
    blocks = inventory_from_config(cfg)
    plan = make_plan(blocks, cfg)
    problem = schedule_problem(blocks, cfg)
    alone = step_time_partition(problem, requirements=())  # has params on every stage here anyway
    terms = stage_memory_terms(blocks, cfg)
    chosen = tuple(bounds_from_ranks(plan.block_ranks, 8))
    assert StepTimeEvaluator(problem)([chosen])[0] == pytest.approx(alone.step_time, rel=1e-9)
    assert simulate_plan(plan, blocks, cfg).step_time == pytest.approx(alone.step_time, rel=1e-9)
    assert split_memory(terms, chosen) < 0.6 * split_memory(terms, alone.bounds)
    assert max(s.memory_bytes for s in plan.stages) < 9 * 2**30
    assert all(s.label != "final_norm" for s in plan.stages)
