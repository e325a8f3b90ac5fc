"""The static validator's boundaries: when too few 1F1B micro-batches stop Nanotron, and the memory cap in GiB."""

from __future__ import annotations

import dataclasses

import pytest

from nanotron_ext import make_plan
from nanotron_ext.config import bundled_config, load_config
from nanotron_ext.inventory import inventory_from_config

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
        "and stops")
    assert fatal.findings[0].fix == (
        "set tokens.batch_accumulation_per_replica >= 3 (>= pp fills the pipeline), or pp_engine: afab")
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
