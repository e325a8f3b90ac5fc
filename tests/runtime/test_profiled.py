"""The ``profiled`` strategy: measured per-block times, the on-disk cache, and one plan for every rank."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest
import torch

from nanotron_ext.config import bundled_config, load_config
from nanotron_ext.costs import block_inputs, profiled
from nanotron_ext.errors import ConfigError, PlanningError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.plan import make_plan
from nanotron_ext.strategies import available_strategies

from . import timing_workers
from .spawn import run_distributed

FAST = {"warmup": 1, "repeats": 3}


def _tiny(cache: Path, **ext):
    cfg = load_config(bundled_config()).with_overrides(profile_cache=str(cache), **ext)
    return cfg, inventory_from_config(cfg)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the blocks ``measure_blocks`` is asked to measure."""
    calls: list[str] = []
    real = profiled.measure_blocks

    def measure(blocks, cfg, **kwargs):
        calls.extend(block.short for block, _ in blocks)
        return real(blocks, cfg, **kwargs)

    monkeypatch.setattr(profiled, "measure_blocks", measure)
    return calls


def test_registered() -> None:
    assert "profiled" in available_strategies()


def test_cache_hit_does_not_measure_again(tmp_path: Path, counted: list[str]) -> None:
    cfg, blocks = _tiny(tmp_path)
    first = profiled.profile_blocks(blocks, cfg, **FAST)
    # Both decoder layers share one key: measured once.
    assert counted == ["embedding", "decoder.0", "final_norm", "lm_head", "cast", "loss"]
    assert len(list(tmp_path.glob("*.json"))) == 6
    counted.clear()
    assert profiled.profile_blocks(blocks, cfg, **FAST) == first
    assert counted == []
    # The strategy reads the same cache.
    assert make_plan(blocks, cfg, "profiled").block_costs == tuple(t.total for t in first)
    assert counted == []


def test_cache_misses_on_a_different_key(tmp_path: Path, counted: list[str]) -> None:
    cfg, blocks = _tiny(tmp_path)
    profiled.profile_blocks(blocks, cfg, **FAST)
    counted.clear()
    # Freezing the embedding changes its trainable flags and what the decoder must send back (no input
    # gradient any more for decoder.0): exactly those keys are measured again.
    frozen_cfg, frozen_blocks = _tiny(tmp_path, freeze={"modules": ["embedding"]})
    profiled.profile_blocks(frozen_blocks, frozen_cfg, **FAST)
    assert counted == ["embedding", "decoder.0"]
    # A corrupt entry is measured again, not trusted.
    counted.clear()
    key = profiled.profile_key(blocks[4], cfg, input_grad=True)
    path = tmp_path / f"{profiled._hash(key)}.json"
    assert json.loads(path.read_text())["key"]["role"] == "lm_head"
    path.write_text("{not json")
    profiled.profile_blocks(blocks, cfg, **FAST)
    assert counted == ["lm_head"]


def test_keys() -> None:
    cfg, blocks = _tiny(Path("/nonexistent"))
    key = profiled.profile_key
    assert key(blocks[1], cfg, input_grad=True) == key(blocks[2], cfg, input_grad=True)
    assert key(blocks[1], cfg, input_grad=True) != key(blocks[1], cfg, input_grad=False)
    assert key(blocks[1], cfg, input_grad=True)["role"] == "decoder"
    longer = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, sequence_length=64))
    assert key(blocks[1], cfg, input_grad=True) != key(blocks[1], longer, input_grad=True)


@pytest.fixture
def counting_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every clock reading is one more than the last: a timed section lasts 1 when it runs, and a section
    that does not run (no backward, no optimizer step) stays 0. What is timed, not how fast."""
    ticks = itertools.count()
    monkeypatch.setattr(profiled, "clock", lambda: float(next(ticks)))


def test_what_each_block_times(tmp_path: Path, counting_clock: None) -> None:
    cfg, blocks = _tiny(tmp_path)
    timings = dict(zip((b.short for b in blocks), profiled.profile_blocks(blocks, cfg, **FAST)))
    # Every block but the cast has a backward (the fp32 cast of fp32 logits returns its input); blocks with
    # weights get an optimizer step, the cast and the loss none.
    got = {name: (t.forward, t.backward, t.optimizer) for name, t in timings.items()}
    weighted = (1.0, 1.0, 1.0)
    assert got == {
        "embedding": weighted,
        "decoder.0": weighted,
        "decoder.1": weighted,
        "final_norm": weighted,
        "lm_head": weighted,
        "cast": (1.0, 0.0, 0.0),
        "loss": (1.0, 1.0, 0.0),
    }


def test_frozen_prefix_costs_forward_only(tmp_path: Path, counting_clock: None) -> None:
    cfg, blocks = _tiny(tmp_path, freeze={"modules": ["*"], "unfreeze": ["lm_head"]})
    timings = dict(zip((b.short for b in blocks), profiled.profile_blocks(blocks, cfg, **FAST)))
    got = {name: (t.forward, t.backward, t.optimizer) for name, t in timings.items()}
    # Frozen prefix: forward only, nothing to step. The lm_head: its weight gradient, its step. After it the
    # cast passes its input through (no backward) and the loss sends a gradient back.
    frozen = (1.0, 0.0, 0.0)
    assert got == {
        "embedding": frozen,
        "decoder.0": frozen,
        "decoder.1": frozen,
        "final_norm": frozen,
        "lm_head": (1.0, 1.0, 1.0),
        "cast": (1.0, 0.0, 0.0),
        "loss": (1.0, 1.0, 0.0),
    }


def test_fastest_of_repeats_after_warmup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, blocks = _tiny(tmp_path)
    # Per round the clock is read before/after forward, before/after backward, before/after the optimizer step.
    # The first round is the warm-up; the four timed ones split into halves of two.
    forward, backward = [0.5, 3.0, 1.0, 2.0, 4.0], [0.5, 6.0, 5.0, 4.0, 7.0]
    optimizer = [0.5, 9.0, 8.0, 7.0, 10.0]
    ticks = []
    now = 0.0
    for f, b, o in zip(forward, backward, optimizer):
        ticks += [now, now + f, now + f + 1, now + f + 1 + b, now + f + b + 2, now + f + b + 2 + o]
        now += f + b + o + 10
    readings = iter(ticks)
    monkeypatch.setattr(profiled, "clock", lambda: next(readings))
    # The final norm needs no process group; its input and weight both want gradients, so backward runs.
    timing = profiled.measure_block(blocks[3], cfg, input_grad=True, tp_pg=None, warmup=1, repeats=4)
    assert (timing.forward, timing.backward, timing.optimizer) == (1.0, 4.0, 7.0)  # the warm-up's 0.5 left out
    # Half the gap between the two halves' fastest, ÷ the fastest: |1 - 2| / 2 / 1, |5 - 4| / 2 / 4, |8 - 7| / 2 / 7.
    assert timing.spread == pytest.approx((0.5, 0.125, 1 / 14))
    assert next(readings, None) is None  # every reading used: one optimizer step per warm-up and repeat


def test_every_timed_section_starts_with_cold_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, blocks = _tiny(tmp_path)
    events: list[str] = []
    monkeypatch.setattr(profiled, "clock", lambda: events.append("clock") or float(len(events)))
    flush = profiled.flush_caches
    monkeypatch.setattr(profiled, "flush_caches", lambda device: events.append("flush") or flush(device))
    make_inputs = profiled._make_inputs
    monkeypatch.setattr(profiled, "_make_inputs", lambda *a: events.append("inputs") or make_inputs(*a))
    profiled.measure_block(blocks[3], cfg, input_grad=True, tp_pg=None, warmup=1, repeats=2)
    # Per round: flush, then the inputs (hot, as a neighbour just made them), forward timed; flush, backward timed;
    # flush, optimizer step timed.
    timed = ["flush", "clock", "clock"]
    assert events == (["flush", "inputs", "clock", "clock"] + timed + timed) * 3


@pytest.mark.parametrize(("cache_mib", "flushed_mib"), [(96, 192), (8, 64)])
def test_the_flush_is_twice_the_last_level_cache_and_at_least_64_mib(
    monkeypatch: pytest.MonkeyPatch, cache_mib: int, flushed_mib: int
) -> None:
    monkeypatch.delenv(block_inputs.FLUSH_MIB_VARIABLE, raising=False)  # tests/conftest.py sets it for the suite
    monkeypatch.setattr(block_inputs, "_last_level_cache_bytes", lambda: cache_mib * 2**20)
    monkeypatch.setattr(block_inputs, "_flush_buffers", {})
    block_inputs.flush_caches(torch.device("cpu"))
    buffer = block_inputs._flush_buffers["cpu"]
    assert buffer.numel() * buffer.element_size() == flushed_mib * 2**20


def test_the_flush_size_variable_overrides_the_cache_and_a_bad_value_names_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(block_inputs, "_last_level_cache_bytes", lambda: 480 * 2**20)
    monkeypatch.setenv(block_inputs.FLUSH_MIB_VARIABLE, "16")
    assert block_inputs.flush_bytes("cpu") == block_inputs.flush_bytes("cuda") == 16 * 2**20
    monkeypatch.delenv(block_inputs.FLUSH_MIB_VARIABLE)
    assert block_inputs.flush_bytes("cpu") == 960 * 2**20
    for bad in ("0", "1.5", "-3", "lots"):
        monkeypatch.setenv(block_inputs.FLUSH_MIB_VARIABLE, bad)
        with pytest.raises(
            ConfigError,
            match=rf"NANOTRON_EXT_FLUSH_MIB={bad!r} must be a whole number of MiB >= 1 "
            r".*unset it for twice the last-level cache",
        ):
            block_inputs.flush_bytes("cpu")


def test_a_timing_taken_after_another_flush_is_another_cache_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(bundled_config())
    block = inventory_from_config(cfg)[1]
    keys = []
    for mib in ("64", "128"):
        monkeypatch.setenv(block_inputs.FLUSH_MIB_VARIABLE, mib)
        keys.append(profiled.profile_key(block, cfg, input_grad=True))
    assert keys[0]["flush_bytes"] == 64 * 2**20 and keys[0] != keys[1]


def test_the_last_level_cache_is_read_from_linux() -> None:
    if not list(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size")):
        pytest.skip("this OS reports no CPU cache sizes in /sys/devices/system/cpu/cpu0/cache")
    sizes = [p.read_text().strip() for p in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size")]
    largest = max(int(x.rstrip("KMG")) * {"K": 2**10, "M": 2**20, "G": 2**30}.get(x[-1], 1) for x in sizes)
    assert block_inputs._last_level_cache_bytes() == largest > 0


def test_plan_splits_the_measured_times(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The strategy plans from what the profiler measures: scripted block times, split worked out by hand."""
    scripted = timing_workers.ScriptedTime(timing_workers.SCRIPT_A)
    monkeypatch.setattr(profiled, "clock", scripted.clock)
    monkeypatch.setattr(
        profiled, "measure_blocks", timing_workers.with_factory(profiled.measure_blocks, scripted.factory)
    )
    cfg, blocks = _tiny(tmp_path)
    plan = make_plan(blocks, cfg, "profiled")
    assert plan.ok, plan.table()
    assert plan.unit == "seconds"
    assert plan.block_costs == (2.0, 6.0, 6.0, 1.0, 2.0, 1.0, 2.0)
    assert plan.block_ranks == (0, 0, 1, 1, 1, 1, 1)  # 8 | 12: the best cut (see SCRIPT_A)


def test_unbuildable_block_is_a_clear_error(tmp_path: Path) -> None:
    cfg, blocks = _tiny(tmp_path)
    odd = [dataclasses.replace(b, role="other") if b.short == "final_norm" else b for b in blocks]
    with pytest.raises(PlanningError, match="cannot build block model.final_layer_norm"):
        profiled.profile_blocks(odd, cfg, **FAST)


@pytest.mark.slow  # real processes
def test_same_plan_on_every_rank_when_one_rank_measures_differently(tmp_path: Path) -> None:
    """Rank 1's blocks take other times (a heavy lm_head); rank 0 measures and broadcasts."""
    r0, r1 = run_distributed(timing_workers.profiled_plan, 2, args=(str(tmp_path),), timeout=60)
    for r in (r0, r1):
        assert r["plan_ok"]
        assert r["plan_ranks"] == [0, 0, 1, 1, 1, 1, 1]  # SCRIPT_A's best split
        assert r["plan_costs"] == [2.0, 6.0, 6.0, 1.0, 2.0, 1.0, 2.0]
    assert r0["measured_while_planning"] == 6 and r1["measured_while_planning"] == 0
    # The test can fail: planning from its own measurements, rank 1 would choose another split.
    assert r0["local_ranks"] == [0, 0, 1, 1, 1, 1, 1]
    assert r1["local_ranks"] == [0, 0, 0, 0, 1, 1, 1]  # SCRIPT_B's best split
    assert not (tmp_path / "rank1").exists(), "only rank 0 touches the timing cache"


@pytest.mark.slow  # real processes
def test_rank0_profiling_failure_raises_on_every_rank(tmp_path: Path) -> None:
    """Building the lm_head fails on rank 0 only: rank 0 broadcasts the error, so no rank is left waiting in the
    broadcast (the spawn helper kills a rank that is, and the test fails), and every rank raises it."""
    results = run_distributed(timing_workers.profiled_fails_on_rank0, 2, args=(str(tmp_path),), timeout=60)
    expected = (
        "PlanningError: profiling on global rank 0 failed: RuntimeError: scripted failure on rank 0: "
        "cannot build model.lm_head"
    )
    assert results == [{"rank": 0, "error": expected}, {"rank": 1, "error": expected}]


@pytest.mark.slow  # real processes
def test_the_cpu_runtime_keeps_freed_memory_as_calibration_does() -> None:
    (result,) = run_distributed(timing_workers.malloc_policy_in_the_runtime, 1, timeout=60)
    assert result == {"before": "system defaults", "inside": "freed memory kept"}
