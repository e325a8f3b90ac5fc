"""``memory_cap_gib`` is a guarantee: a plan accepted under a cap trains with every rank's measured peak below it.

Real processes: two gloo ranks build the planned split with the CPU runtime (Nanotron 0.2's engines), train two
steps (the second with Adam's state alive), and record every allocation of torch's CPU allocator from before the
model is built (``nanotron_ext.runtime.memory_measure``). The cap is set 1 % above the plan's own estimate, with
``memory_runtime: cpu`` (single-tensor AdamW, no overhead allowance: the measured quantity is live tensor bytes).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from nanotron_ext.config import bundled_config, config_from_dict
from nanotron_ext.costs.analytic import GIB
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.plan import make_plan

from . import workers
from .spawn import run_distributed


def _raw(dtype: str, engine: str, vocab_shards: int = 1) -> dict[str, Any]:
    raw = yaml.safe_load(bundled_config().read_text())
    raw["nanotron_ext"]["vocab_shards"] = vocab_shards
    raw["model"]["dtype"] = dtype
    raw["parallelism"]["pp_engine"] = engine
    raw["nanotron_ext"]["memory_runtime"] = "cpu"
    return raw


@pytest.mark.parametrize("dtype,engine,vocab_shards", [
    ("float32", "1f1b", 1), ("bfloat16", "afab", 1),
    ("float32", "1f1b", 3),  # the vocabulary-shard chain: lm_head rows, fp32 exp of the slice, statistics
    ("bfloat16", "1f1b", 2),
])
def test_a_plan_accepted_under_a_cap_just_above_its_estimate_stays_under_it(
    dtype: str, engine: str, vocab_shards: int
) -> None:
    raw = _raw(dtype, engine, vocab_shards)
    cfg = config_from_dict(raw)
    blocks = inventory_from_config(cfg)
    estimate = max(s.memory_bytes for s in make_plan(blocks, cfg).stages)
    raw["nanotron_ext"]["memory_cap_gib"] = cap_gib = estimate * 1.01 / GIB
    capped = config_from_dict(raw)
    plan = make_plan(blocks, capped)
    assert plan.ok, plan.findings
    results = run_distributed(workers.measure_memory, 2, args=(raw, list(plan.block_ranks)), timeout=120)
    for r in results:
        stage = plan.stages[r["pp_rank"]]
        # The guarantee, and the estimate it rests on: never under the measured peak.
        assert r["peak"] < cap_gib * GIB, (r["pp_rank"], r["peak"], cap_gib * GIB)
        assert stage.memory_bytes >= r["peak"], (r["pp_rank"], stage.memory_bytes, r["peak"])
        # Exact terms: the tensors Nanotron's optimizer and the model hold.
        assert stage.memory is not None
        assert (stage.memory.weights, stage.memory.gradients) == (r["weights"], r["gradients"])


def test_the_issues_cap_that_did_not_protect_now_refuses_the_plan() -> None:
    # memory_cap_gib 0.025 (25.6 MiB) was accepted for the tiny example, whose stage 1 then peaked at 36.8 MiB.
    raw = _raw("float32", "1f1b")
    raw["nanotron_ext"]["memory_cap_gib"] = 0.025
    cfg = config_from_dict(raw)
    plan = make_plan(inventory_from_config(cfg), cfg)
    assert not plan.ok
    assert [(f.code, f.stage) for f in plan.findings] == [("memory", 1)]
    assert re.match(r"stage 1 needs about 0\.036\d* GiB, over memory_cap_gib=0\.025", plan.findings[0].message)
