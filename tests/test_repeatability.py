"""Issue 32: a calibration you can take twice. The median's interval, a block's fastest round and its split-half
spread, the blocks timed in interleaved rounds, and the rule that names a figure too uncertain for two calibrations
to agree within 3 %."""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import subprocess
import sys

import pytest
import torch

from nanotron_ext.cli.calibrate import summary
from nanotron_ext.config import bundled_config, load_config
from nanotron_ext.costs import profiled
from nanotron_ext.costs.analytic import trainable_before
from nanotron_ext.errors import ConfigError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.machine import BlockCost, MachineProfile, block_signature
from nanotron_ext.machine.spread import STEP_SHARE_LIMIT, uncertain_figures
from nanotron_ext.stats import fastest, fastest_spread, median_interval, relative_spread


def test_the_median_interval_is_the_order_statistics_of_the_binomial_tail() -> None:
    xs = [float(x) for x in (11, 3, 7, 1, 9, 5, 2, 10, 4, 8, 6)]  # 1..11, shuffled
    # n = 11: P(B <= 1) = 12/2048 <= 0.025 < P(B <= 2) = 67/2048, so k = 2: [x_(2), x_(10)].
    assert median_interval(xs) == (2.0, 10.0, pytest.approx(1 - 2 * 12 / 2048))
    # Below 6 values no k exists: the range, covering 1 - 2^(1-n).
    assert median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0, 0.75)
    with pytest.raises(ValueError, match="at least one value"):
        median_interval([])


def test_the_relative_spread_is_half_the_interval_over_the_median() -> None:
    assert relative_spread([1.0, 2.0, 3.0]) == pytest.approx(0.5)
    assert relative_spread([float(x) for x in range(1, 12)]) == pytest.approx((10 - 2) / 2 / 6)
    assert relative_spread([0.0, 0.0, 0.0]) == 0.0


def test_the_fastest_and_how_far_two_half_calibrations_put_it_apart() -> None:
    xs = [5.0, 3.0, 4.0, 6.0, 2.5, 7.0]  # in the order taken: halves [5, 3, 4] and [6, 2.5, 7]
    assert fastest(xs) == 2.5
    assert fastest_spread(xs) == pytest.approx((3.0 - 2.5) / 2 / 2.5)
    # A drift shows: every value of the second half 10 % slower, the first half's fastest 1.0.
    assert fastest_spread([1.0, 1.2, 1.1, 1.3]) == pytest.approx((1.1 - 1.0) / 2 / 1.0)
    assert fastest_spread([1.0, 1.0, 1.0, 1.0]) == 0.0
    assert fastest_spread([4.0]) == 0.0 and fastest_spread([0.0, 0.0]) == 0.0
    with pytest.raises(ValueError, match="at least one value"):
        fastest([])


def test_blocks_take_turns_in_every_round_the_first_one_rotating(tmp_path, monkeypatch) -> None:
    cfg = load_config(bundled_config()).with_overrides(profile_cache=str(tmp_path))
    blocks = inventory_from_config(cfg)
    calls: list[str] = []

    class Logged(torch.nn.Module):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name, self.weight = name, torch.nn.Parameter(torch.ones(()))

        def forward(self, **inputs):
            calls.append(self.name)
            return next(v for v in inputs.values() if v.is_floating_point()) * self.weight

    pinned: list[bool] = []
    monkeypatch.setattr(profiled, "keep_freed_memory", lambda: pinned.append(True))
    rounds: list[int] = []
    timings = profiled.measure_blocks(
        [(blocks[1], True), (blocks[3], True)],
        cfg,
        tp_pg=None,
        warmup=1,
        repeats=2,
        module_factory=lambda block, cfg, tp_pg: Logged(block.short),
        on_round=rounds.append,
    )
    assert calls == ["decoder.0", "final_norm", "final_norm", "decoder.0", "decoder.0", "final_norm"]
    assert rounds == [2, 2, 2]  # progress: each round's timed blocks, warm-up included
    assert pinned  # timed on CPU in the state the CPU runtime trains in
    assert len(timings) == 2 and all(t.forward > 0 and t.backward > 0 and t.optimizer > 0 for t in timings)


def _profile(cfg, spreads: dict[str, tuple[float, float, float]]) -> MachineProfile:
    """Every block 1 ms forward, 2 ms backward, no update; spreads by block short name (default none)."""
    blocks = inventory_from_config(cfg)
    costs = {}
    for b, grad in zip(blocks, trainable_before(blocks)):
        sig = block_signature(b, input_grad=grad)
        costs.setdefault(sig, BlockCost(sig, 1e-3, 2e-3, 0.0, spread=spreads.get(b.short, (0.0, 0.0, 0.0))))
    return MachineProfile(name="test", source="test", blocks=tuple(costs.values()))


def test_a_figure_is_named_when_it_could_move_a_stage_by_more_than_the_limit() -> None:
    cfg = load_config(bundled_config())
    m = cfg.run.n_micro_batches
    # 7 blocks of 3 ms each per micro-batch over pp=2: a stage's step is 7 * 3 ms * m / 2. The lm_head's forward
    # (1 ms a micro-batch) moves it by spread * m * 1 ms: over 1.5 % from a spread of 1.5 % * 21 / 2 = 15.75 %.
    stage = 7 * 3e-3 * m / 2
    limit = STEP_SHARE_LIMIT * stage / (m * 1e-3)
    assert math.isclose(limit, 0.1575)
    assert uncertain_figures(cfg, _profile(cfg, {"lm_head": (0.99 * limit, 0.0, 0.0)})) == []
    (found,) = uncertain_figures(cfg, _profile(cfg, {"lm_head": (1.01 * limit, 0.0, 0.0)}))
    assert (found.what, found.spread) == ("lm_head forward", 1.01 * limit)
    assert found.step_share == pytest.approx(1.01 * STEP_SHARE_LIMIT)
    # Two decoder layers share one measurement: its spread counts twice, so half of it suffices.
    (found,) = uncertain_figures(
        cfg,
        _profile(
            cfg,
            {"decoder.0": (0.0, 0.0, 0.0), "decoder.1": (0.0, 0.0, 0.0)} | {"decoder.0": (0.0, 0.51 * limit / 2, 0.0)},
        ),
    )
    assert found.what == "decoder.0-1 backward" and found.step_share == pytest.approx(1.02 * STEP_SHARE_LIMIT)


def test_calibrate_prints_each_spread_and_warns_naming_the_figure() -> None:
    cfg = load_config(bundled_config())
    text = summary(cfg, _profile(cfg, {"lm_head": (0.25, 0.004, 0.0)}))
    assert "± fwd %" in text and "25.00" in text and "0.40" in text
    warnings = [line for line in text.splitlines() if line.startswith("WARNING:")]
    assert len(warnings) == 1 and warnings[0].startswith("WARNING: lm_head forward could move by ±25.0%")
    quiet = summary(
        cfg,
        dataclasses.replace(
            _profile(cfg, {}), blocks=tuple(dataclasses.replace(b, spread=None) for b in _profile(cfg, {}).blocks)
        ),
    )
    assert "WARNING" not in quiet and "  -  " in quiet


@pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="the malloc policy is glibc's mallopt; nothing to set here"
)
@pytest.mark.parametrize(("env", "kept"), [("", "True freed memory kept"), ("1", "False system defaults")])
def test_glibc_keeps_freed_memory_unless_the_user_opts_out(env: str, kept: str) -> None:
    code = (
        "from nanotron_ext.allocator import keep_freed_memory, malloc_policy; "
        "print(keep_freed_memory(), malloc_policy())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "NANOTRON_EXT_SYSTEM_MALLOC": env},
    )
    assert out.stdout.strip() == kept


def test_a_profile_with_a_bad_spread_is_refused_naming_it() -> None:
    cfg = load_config(bundled_config())
    good = _profile(cfg, {"lm_head": (0.1, 0.0, 0.0)})
    assert MachineProfile.from_json(good.to_json()) == good  # the spreads survive JSON
    sig = good.blocks[0].signature
    with pytest.raises(
        ConfigError,
        match=rf"blocks\[{sig}\]\.spread of its backward=-0.1 must be a finite number >= 0 "
        r"\(a fraction\)",
    ):
        dataclasses.replace(good, blocks=(dataclasses.replace(good.blocks[0], spread=(0.0, -0.1, 0.0)),))
    with pytest.raises(ConfigError, match=r"spread=\[0.1\] must be three fractions"):
        dataclasses.replace(good, blocks=(dataclasses.replace(good.blocks[0], spread=(0.1,)),))
