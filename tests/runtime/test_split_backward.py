"""Issue 31: a block's W measured as zb1p and zb2p run it (``nanotron_ext.costs.split_backward``), and what the
profile does with it."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from nanotron_ext.costs import profiled
from nanotron_ext.costs.block_inputs import _make_inputs, _outputs_needing_backward
from nanotron_ext.costs.split_backward import time_weight_pass
from nanotron_ext.machine.pricing import measured_blocks
from nanotron_ext.zero_bubble.store import store_of

from .test_profiled import FAST, _tiny


@pytest.fixture
def counting_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every clock reading is one more than the last: a timed section that runs lasts 1."""
    ticks = itertools.count()
    monkeypatch.setattr(profiled, "clock", lambda: float(next(ticks)))


def test_the_blocks_zero_bubble_splits_time_their_w_and_no_other_does(tmp_path: Path, counting_clock: None) -> None:
    cfg, blocks = _tiny(tmp_path)
    weights = {b.short: t.weight for b, t in zip(blocks, profiled.profile_blocks(blocks, cfg, **FAST))}
    # The decoders' and the lm_head's linears defer their weight gradient; an embedding, a norm, the cast and the
    # loss keep theirs in B (or have none).
    assert weights == {
        "embedding": None,
        "decoder.0": 1.0,
        "decoder.1": 1.0,
        "final_norm": None,
        "lm_head": 1.0,
        "cast": None,
        "loss": None,
    }


def test_a_frozen_block_has_no_w(tmp_path: Path, counting_clock: None) -> None:
    cfg, blocks = _tiny(tmp_path, freeze={"modules": ["*"], "unfreeze": ["lm_head"]})
    weights = {b.short: t.weight for b, t in zip(blocks, profiled.profile_blocks(blocks, cfg, **FAST))}
    assert weights["decoder.0"] is None and weights["lm_head"] == 1.0


def test_the_w_pass_makes_the_weight_gradients_of_a_whole_backward(tmp_path: Path) -> None:
    cfg, blocks = _tiny(tmp_path)
    decoder, cpu = blocks[1], torch.device("cpu")
    with profiled._local_group() as tp_pg:
        module = profiled._standalone_module(decoder, cfg, tp_pg, cpu, None)

        def gradients() -> dict[str, torch.Tensor]:
            grads = {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}
            module.zero_grad(set_to_none=True)
            return grads

        torch.manual_seed(1)
        seconds = time_weight_pass(decoder, module, cfg, cpu, True, torch.Generator().manual_seed(0), profiled.clock)
        split = gradients()
        assert seconds > 0 and store_of(module) is None  # the module is left as it was built
        torch.manual_seed(1)
        inputs = _make_inputs(decoder.role, cfg, torch.float32, cpu, True, torch.Generator().manual_seed(0))
        tensors = _outputs_needing_backward(module(**inputs))
        torch.autograd.backward(tensors, [torch.ones_like(t) if t.dim() == 0 else torch.randn_like(t) for t in tensors])
        whole = gradients()
    assert split.keys() == whole.keys() and len(whole) >= 4  # every linear's weight, the norms' too
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], msg=name)


def test_the_profile_prices_zero_bubble_w_as_measured_within_the_whole_backward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg, blocks = _tiny(tmp_path)
    timing = {
        "decoder": profiled.BlockTiming(1e-3, 4e-3, 1e-4, weight=1.5e-3),
        "lm_head": profiled.BlockTiming(2e-3, 3e-3, 1e-4, weight=3.5e-3),
    }  # a noisy W over its backward
    monkeypatch.setattr(
        profiled,
        "block_timings",
        lambda blocks, cfg, **kw: [timing.get(b.role, profiled.BlockTiming(1e-3, 1e-3, 0.0)) for b in blocks],
    )
    costs = {c.signature.split(":")[0]: c for c in measured_blocks(blocks, cfg)}
    assert costs["decoder"].backward_weight == 1.5e-3
    assert costs["lm_head"].backward_weight == 3e-3  # capped at the backward it is a part of
    assert costs["embedding"].backward_weight is None  # not measured: split by FLOPs where the engine splits


def test_w_is_timed_in_every_other_timed_round_the_first_included(tmp_path: Path) -> None:
    from nanotron_ext.models.profiled_blocks import build_block_module

    cfg, blocks = _tiny(tmp_path)
    forwards: list[int] = []

    def factory(block, cfg, tp_pg):
        module = build_block_module(block, cfg, tp_pg)
        module.register_forward_pre_hook(lambda *args: forwards.append(1))
        return module

    with profiled._local_group() as tp_pg:
        profiled.measure_blocks([(blocks[1], True)], cfg, tp_pg=tp_pg, warmup=2, repeats=3, module_factory=factory)
    # One forward a round (2 warm-up, 3 timed), and one more for the W of timed rounds 1 and 3.
    assert len(forwards) == 5 + 2
