"""The Nanotron adapter on real processes: the collective validator, ``patch_nanotron``, and model inventories.

One 2-process gloo world (pp=2) runs every scenario (``train_workers.integration_world``); the test functions
check its results. ``patch_nanotron``'s swap and undo are also checked in this process.
"""

from __future__ import annotations

import pytest

from nanotron_ext.config import load_config

from . import train_workers
from .spawn import run_distributed

pytestmark = pytest.mark.slow  # tests/conftest.py: left out of the quick run

VARIANTS = {
    "tiny": {},
    # GQA (4 query heads, 2 KV heads) + the projector block, tp=1.
    "gqa_projector": {"model": {"model_config": {"num_key_value_heads": 2}}, "nanotron_ext": {"projector": True}},
}


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return run_distributed(train_workers.integration_world, 2, args=(VARIANTS,), timeout=90)


def test_validator_raises_the_same_table_on_every_rank(world: list[dict]) -> None:
    """Nanotron's greedy ranks [0,0,0,0,0,1,1]: PP rank 1 holds cast and loss only."""
    messages = [r["validator"] for r in world]
    assert all(m is not None for m in messages), "check_every_rank_trains must raise on every rank"
    assert messages[0] == messages[1], "every rank must raise the same table"
    text = messages[0]
    assert "PP rank(s) [1] would have no gradient" in text and "holds no parameters at all" in text
    assert "NO GRADIENT" in text and "cast, loss" in text
    assert "Can't use DDP because model in PP=1 has no gradient" in text
    assert "--cost-strategy constrained" in text and "allow_frozen_stages: true" in text
    # The table has one row per world rank, the same on both.
    table_lines = [line for line in text.splitlines() if line.strip().startswith(("0", "1"))]
    assert len(table_lines) == 2


def test_validator_allows_frozen_stages_when_asked(world: list[dict]) -> None:
    rows = world[0]["validator_allowed_rows"]
    assert rows == world[1]["validator_allowed_rows"]
    assert [(r["pp_rank"], r["trainable"] > 0) for r in rows] == [(0, True), (1, False)]


def test_collective_check_names_a_frozen_only_stage(world: list[dict]) -> None:
    """Constrained split [0,0,0,0,1,1,1], lm_head frozen: PP rank 1 holds 804,432 weights, none trainable."""
    assert [r["frozen_count"] for r in world] == [0, 1], "rank 1 owns the one frozen parameter, the lm_head weight"
    messages = [r["frozen_validator"] for r in world]
    assert all(m is not None for m in messages), "check_every_rank_trains must raise on every rank"
    assert messages[0] == messages[1], "every rank must raise the same table"
    first, *rest = messages[0].splitlines()
    assert first == (
        "nanotron_ext: PP rank(s) [1] would have no gradient — the stage holds only frozen parameters; DDP would "
        'stop with "Can\'t use DDP because model in PP=1 has no gradient" and the optimizer with "got an empty '
        'parameter list".'
    )
    rows = [line.split() for line in rest if line.strip().startswith(("0", "1"))]
    assert [(r[0], r[1], r[-1]) for r in rows] == [("0", "0", "ok"), ("1", "1", "GRADIENT")]  # "NO GRADIENT"
    assert rest[-1].startswith("fix: use `--cost-strategy constrained`")
    allowed = [(r["pp_rank"], r["params"], r["trainable"]) for r in world[0]["frozen_allowed_rows"]]
    assert allowed == [(0, 804_432 + 2 * 4_128 + 16, 804_432 + 2 * 4_128 + 16), (1, 804_432, 0)]
    assert world[1]["frozen_allowed_rows"] == world[0]["frozen_allowed_rows"]


def test_patch_nanotron_swaps_build_model_and_undo_restores(world: list[dict]) -> None:
    for r in world:
        assert r["patched_is_ours"] and r["restored"]
        # Nanotron's own build_model call went through our planner: the constrained split, not the greedy one
        # (which leaves stage 1 without parameters).
        assert r["patched_ranks"] == r["patched_plan_ranks"] != [0, 0, 0, 0, 0, 1, 1]
    assert world[0]["patched_local_params"] > 0 and world[1]["patched_local_params"] > 0


def test_patch_nanotron_in_process() -> None:
    import nanotron.models
    import nanotron.models.base as base

    from nanotron_ext import integration

    cfg = load_config(train_workers.TINY_YAML)
    original_base, original_pkg = base.build_model, nanotron.models.build_model
    undo = integration.patch_nanotron(cfg)
    try:
        assert base.build_model is integration.build_model
        assert nanotron.models.build_model is integration.build_model
    finally:
        undo()
    assert base.build_model is original_base and nanotron.models.build_model is original_pkg
    with integration.patched_nanotron(cfg):
        assert base.build_model is integration.build_model
    assert base.build_model is original_base


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_inventory_from_model_equals_inventory_from_config(world: list[dict], variant: str) -> None:
    inv = world[0]["inventories"][variant]
    assert inv["model"] == inv["config"], "names, roles and parameter counts must agree exactly"
    assert inv["allocated"] == 0, "inventory_from_model must build blocks on meta only"
    names = [b["name"] for b in inv["model"]]
    if variant == "gqa_projector":
        assert names[1] == "model.projector"
        qkv = dict(p[:2] for b in inv["model"] for p in b["parameters"])[
            "model.decoder.0.pp_block.attn.qkv_proj.weight"
        ]
        assert qkv == (4 + 2 * 2) * 4 * 16  # (q heads + 2 kv heads) x head_dim x hidden
    assert world[1]["inventories"][variant] == inv, "every rank sees the same inventory"
