"""``patch_nanotron`` with upstream's own model classes and the ``build_model`` name its trainer holds, on two
real gloo processes at pp=2: each rank builds exactly the blocks the plan gave it, and a plan that cannot train
stops both ranks before any block is built."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from runtime.spawn import run_distributed

from upstream.harness import UPSTREAM_EXAMPLES
from upstream.workers import build_through_patched_trainer

pytestmark = pytest.mark.slow  # tests/conftest.py: left out of the quick run


def _seed_config(tmp_path: Path, strategy: str) -> Path:
    """Upstream's tiny-Llama example, shrunk, with GPT-NeoX's 50277-token vocabulary, at pp=2."""
    raw = yaml.safe_load((UPSTREAM_EXAMPLES / "config_tiny_llama.yaml").read_text())
    raw["model"]["model_config"].update(
        hidden_size=16,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=50277,
        tie_word_embeddings=False,
    )
    raw["parallelism"].update(dp=1, pp=2, tp=1)
    raw["tokens"]["batch_accumulation_per_replica"] = 4  # one micro-batch would make every split equally fast
    raw["nanotron_ext"] = {"cost_strategy": strategy}
    path = tmp_path / f"seed_{strategy}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_each_rank_builds_exactly_its_planned_blocks(tmp_path):
    out = run_distributed(
        build_through_patched_trainer, 2, args=(str(_seed_config(tmp_path, "constrained")), None), timeout=120
    )
    assert out[0]["plan_ranks"] == out[1]["plan_ranks"] == [0, 0, 0, 0, 1, 1, 1]  # lm_head gets its own stage
    for r in out:
        planned = [n for n, s in zip(r["names"], r["plan_ranks"]) if s == r["rank"]]
        assert r["built"] == planned and r["params"] > 0
    assert out[0]["output_pp_rank"] == out[1]["output_pp_rank"] == 1


def test_nanotron_rule_on_the_seed_shape_stops_both_ranks_before_anything_is_built(tmp_path):
    out = run_distributed(
        build_through_patched_trainer, 2, args=(str(_seed_config(tmp_path, "nanotron")), None), timeout=120
    )
    for r in out:
        assert r["anything_built"] is False
        assert r["error"].startswith("nanotron_ext: the 'nanotron' plan for pp=2 cannot train; nothing was allocated.")
        assert "stage 1 holds no parameters (cast, loss)" in r["error"]
        assert "Can't use DDP because model in PP=1 has no gradient" in r["error"]


def test_the_gloo_context_builds_upstreams_groups():
    from upstream.workers import gloo_context_groups

    out = run_distributed(gloo_context_groups, 2, args=(2,), timeout=60)
    assert [r["pp_rank"] for r in out] == [0, 1]
    for r in out:  # upstream's 5-D layout: (ep, pp, dp, cp, tp)
        assert r["sizes"] == {"tp_pg": 1, "pp_pg": 2, "dp_pg": 1, "cp_pg": 1, "world_pg": 2}
        assert r["matrix_shape"] == [1, 2, 1, 1, 1]
