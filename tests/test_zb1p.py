"""zb1p (ZB-H1, Qi et al. 2024): the program of each rank (issue 23).

The expected programs are written out by hand from the rule: 1F1B's program (warm-up of ``pp - stage - 1``
forwards, steady 1F1B, cool-down backwards, Nanotron's deferred sends), with ``W`` added: rank ``r`` defers the W
of its first ``r`` backwards; after backward ``i >= r`` (and after the sends issued right after that backward) it
runs the oldest deferred W (micro-batch ``i - r``); after the last backward, every W left.
"""

from __future__ import annotations

import doctest
import random

import pytest

import nanotron_ext.schedule as schedule
import nanotron_ext.schedule.programs as programs
from nanotron_ext.schedule import micro_batch_shortfall, min_micro_batches, too_few_micro_batches
from nanotron_ext.schedule.simulator import Action, StageTimes, engine_order, engine_program, simulate


def _prog(text: str) -> list[tuple[str, int]]:
    out = []
    for word in text.split():
        head = word.rstrip("0123456789")
        out.append((head, int(word[len(head) :])))
    return out


HAND = {
    # pp = 2, m = 3. Rank 0 defers nothing: W right after each B. Rank 1 defers B0's W until after B1.
    (2, 0, 3): "F0 send_act0 F1 send_act1 recv_grad0 B0 W0 F2 send_act2 recv_grad1 B1 W1 recv_grad2 B2 W2",
    (2, 1, 3): "recv_act0 F0 B0 recv_act1 send_grad0 F1 B1 W0 recv_act2 send_grad1 F2 B2 send_grad2 W1 W2",
    # pp = 3, m = 4.
    (3, 0, 4): "F0 send_act0 F1 send_act1 F2 send_act2 recv_grad0 B0 W0 F3 send_act3 recv_grad1 B1 W1 "
    "recv_grad2 B2 W2 recv_grad3 B3 W3",
    (3, 1, 4): "recv_act0 F0 send_act0 recv_act1 F1 send_act1 recv_grad0 B0 recv_act2 send_grad0 F2 send_act2 "
    "recv_grad1 B1 W0 recv_act3 send_grad1 F3 send_act3 recv_grad2 B2 send_grad2 W1 "
    "recv_grad3 B3 send_grad3 W2 W3",
    (3, 2, 4): "recv_act0 F0 B0 recv_act1 send_grad0 F1 B1 recv_act2 send_grad1 F2 B2 W0 recv_act3 send_grad2 "
    "F3 B3 send_grad3 W1 W2 W3",
    # pp = 4, m = 5.
    (4, 0, 5): "F0 send_act0 F1 send_act1 F2 send_act2 F3 send_act3 recv_grad0 B0 W0 F4 send_act4 recv_grad1 B1 W1 "
    "recv_grad2 B2 W2 recv_grad3 B3 W3 recv_grad4 B4 W4",
    (4, 1, 5): "recv_act0 F0 send_act0 recv_act1 F1 send_act1 recv_act2 F2 send_act2 recv_grad0 B0 "
    "recv_act3 send_grad0 F3 send_act3 recv_grad1 B1 W0 recv_act4 send_grad1 F4 send_act4 recv_grad2 B2 "
    "send_grad2 W1 recv_grad3 B3 send_grad3 W2 recv_grad4 B4 send_grad4 W3 W4",
    (4, 2, 5): "recv_act0 F0 send_act0 recv_act1 F1 send_act1 recv_grad0 B0 recv_act2 send_grad0 F2 send_act2 "
    "recv_grad1 B1 recv_act3 send_grad1 F3 send_act3 recv_grad2 B2 W0 recv_act4 send_grad2 F4 send_act4 "
    "recv_grad3 B3 send_grad3 W1 recv_grad4 B4 send_grad4 W2 W3 W4",
    (4, 3, 5): "recv_act0 F0 B0 recv_act1 send_grad0 F1 B1 recv_act2 send_grad1 F2 B2 recv_act3 send_grad2 F3 B3 W0 "
    "recv_act4 send_grad3 F4 B4 send_grad4 W1 W2 W3 W4",
    # pp = 4, m = pp - 1 = 3: no steady phase on rank 0, one steady pair on rank 1.
    (4, 1, 3): "recv_act0 F0 send_act0 recv_act1 F1 send_act1 recv_act2 F2 send_act2 recv_grad0 B0 send_grad0 "
    "recv_grad1 B1 send_grad1 W0 recv_grad2 B2 send_grad2 W1 W2",
    (4, 3, 3): "recv_act0 F0 B0 recv_act1 send_grad0 F1 B1 recv_act2 send_grad1 F2 B2 send_grad2 W0 W1 W2",
}


@pytest.mark.parametrize(("pp", "stage", "m"), sorted(HAND))
def test_zb1p_program_matches_the_hand_written_order(pp: int, stage: int, m: int) -> None:
    assert engine_program("zb1p", pp, stage, m) == _prog(HAND[(pp, stage, m)])


def _without_w(program: list) -> list:
    return [step for step in program if step.action is not Action.WEIGHT]


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("extra", [-1, 0, 1, 3, 9])
@pytest.mark.parametrize(("grad_in", "grad_out"), [(True, True), (False, True), (True, False), (False, False)])
def test_zb1p_is_1f1b_plus_w_one_per_micro_batch_fifo(pp: int, extra: int, grad_in: bool, grad_out: bool) -> None:
    m = max(1, pp + extra)
    for stage in range(pp):
        zb = engine_program("zb1p", pp, stage, m, grad_in=grad_in, grad_out=grad_out)
        one = engine_program("1f1b", pp, stage, m, grad_in=grad_in, grad_out=grad_out)
        assert _without_w(zb) == one  # same F/B, same sends and receives at the same places
        ws = [j for a, j in zb if a is Action.WEIGHT]
        assert ws == list(range(m))  # one W per micro-batch, oldest first
        for j in range(m):  # each W after its own B; W of micro-batch j never before backward j + stage
            w_at = zb.index((Action.WEIGHT, j))
            assert zb.index((Action.BACKWARD, j)) < w_at
            later = min(j + stage, m - 1)
            assert zb.index((Action.BACKWARD, later)) < w_at
        # at most ``stage`` deferred W's pending after any step, and a W never sits between a backward and a
        # send the 1F1B program issues right after it
        pending = 0
        for k, (action, _) in enumerate(zb):
            pending += {Action.BACKWARD: 1, Action.WEIGHT: -1}.get(action, 0)
            if action is Action.WEIGHT:
                assert pending <= stage
                assert k + 1 == len(zb) or zb[k + 1][0] is not Action.SEND_GRAD
            assert action is Action.WEIGHT or pending <= stage + 1


def test_engine_order_of_zb1p_lists_w() -> None:
    assert engine_order("zb1p", 2, 1, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("W", 0), ("W", 1)]


def test_weight_is_compute_and_not_communication() -> None:
    assert Action.WEIGHT == "W" and Action.WEIGHT.is_compute
    assert not Action.WEIGHT.is_send and not Action.WEIGHT.carries_gradient and Action.WEIGHT.peer == 0


def test_zb1p_micro_batch_rule_is_1f1b_s() -> None:
    for pp in range(1, 9):
        assert min_micro_batches("zb1p", pp) == min_micro_batches("1f1b", pp)
        for m in range(1, 2 * pp + 1):
            assert (micro_batch_shortfall("zb1p", pp, m) is None) == (micro_batch_shortfall("1f1b", pp, m) is None)


def test_zb1p_with_too_few_micro_batches_is_refused_with_the_rule_and_the_fix() -> None:
    why = too_few_micro_batches("zb1p", 4, 2)
    assert why is not None and why.startswith("zb1p")
    assert "at least pp - 1 = 3 micro-batches, got 2" in why
    assert "batch_accumulation_per_replica >= 4" in why and "pp_engine: afab" in why
    with pytest.raises(ValueError, match=r"zb1p .*needs at least pp - 1 = 3 micro-batches, got 2.*>= 4"):
        engine_program("zb1p", 4, 0, 2)
    warning = micro_batch_shortfall("zb1p", 4, 3)
    assert warning is not None and not warning.fatal and "zb1p" in str(warning) and "never fills" in str(warning)


def test_docstring_examples_run() -> None:
    for module in (schedule, programs):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted > 0, module.__name__


# --- simulate ---------------------------------------------------------------------------------------------------


def _starts(result, stage: int) -> str:
    return " ".join(f"{op.kind}{op.micro_batch}@{op.start:g}" for op in result.ops if op.stage == stage)


def test_zb1p_pp2_m2_op_by_op() -> None:
    """F = B = W = 1 (``StageTimes(forward=1, backward=2, weight=1)``: backward is B + W), no p2p.

    Stage 1: F0 [1,2] (activation 0 at 1), B0 [2,3] (its W deferred), recv_act1 (posted by stage 0 at 2) at 3,
    then it posts gradient 0, F1 [3,4], B1 [4,5], posts gradient 1, W0 [5,6], W1 [6,7].
    Stage 0: F0 [0,1], F1 [1,2], waits for gradient 0 (posted at 3): B0 [3,4], W0 [4,5]; gradient 1 (posted at
    5): B1 [5,6], W1 [6,7]. Step 7 = m(F+B+W) + (p-1)(F+B-W) = 6 + 1; 1F1B (backward 2 as one op): 9.
    """
    stages = [StageTimes(1.0, 2.0, weight=1.0)] * 2
    r = simulate(stages, 2, "zb1p")
    assert _starts(r, 0) == "F0@0 F1@1 B0@3 W0@4 B1@5 W1@6"
    assert _starts(r, 1) == "F0@1 B0@2 F1@3 B1@4 W0@5 W1@6"
    assert [op.duration for op in r.ops if op.kind in "BW"] == [1.0] * 8
    assert r.step_time == 7.0
    assert simulate(stages, 2, "1f1b").step_time == 9.0


def test_zb1p_pp4_m8_equal_stages_hand_schedule() -> None:
    """p = 4, m = 8, F = B = W = 1, no p2p: the step is 27 against 1F1B's 33.

    Hand schedule (start times; stage r defers r W's, runs W_{i-r} after B_i, all the rest at the end):

    * Forward of micro-batch 0 reaches stage k at k. Warm-up: stage k runs pp - k - 1 forwards back to back.
    * Stage 3 (no warm-up): F0@3 B0@4; each next activation arrives one step after stage 2 sent it, so
      F1@5 B1@6 F2@7 B2@8 F3@9 B3@10, then W0@11 (B3 is its 4th backward, i = 3 >= 3) and F B W from then on:
      F4@12 B4@13 W1@14 ... F7@21 B7@22 W4@23, then W5 W6 W7 at 24 25 26: ends at 27.
    * Stage 2: F0@2 F1@3; B0 needs stage 3's gradient 0, sent when stage 3 receives activation 1 (at 5): B0@5;
      F2@6 (activation 2 from stage 1) B1@7 F3@8 B2@9 W0@10 F4@11 B3@12 W1@13 ... B7@23 W5@24 W6@25 W7@26.
    * Stage 1: F0@1 F1@2 F2@3; gradient 0 leaves stage 2 at 6: B0@6 F3@7 B1@8 W0@9 F4@10 B2@11 W1@12 ...
      F7@19 B5@20 W4@21 B6@22 W5@23 B7@24 W6@25 W7@26.
    * Stage 0: F0..F3 @0..3; gradient 0 leaves stage 1 when it receives activation 3, at 7: B0@7 W0@8 F4@9 B1@10
      W1@11 ... F7@18 B4@19 W4@20, then B5@21 W5@22 B6@23 W6@24 B7@25 W7@26.

    Every stage ends at 27 and is busy m(F+B+W) = 24, so each idles (p-1)(F+B-W) = 3: bubble 3/27 = 1/9.
    1F1B with the same backward (B + W = 2 as one op) takes (m + p - 1)(F + B + W) = 11 · 3 = 33.
    (A bubble of (p-1)(F+B-2W) would be 0 here: the hand schedule says 3 per stage.)
    """
    r = simulate([StageTimes(1.0, 2.0, weight=1.0)] * 4, 8, "zb1p")
    assert _starts(r, 3) == (
        "F0@3 B0@4 F1@5 B1@6 F2@7 B2@8 F3@9 B3@10 W0@11 F4@12 B4@13 W1@14 F5@15 B5@16 W2@17 "
        "F6@18 B6@19 W3@20 F7@21 B7@22 W4@23 W5@24 W6@25 W7@26"
    )
    assert _starts(r, 2) == (
        "F0@2 F1@3 B0@5 F2@6 B1@7 F3@8 B2@9 W0@10 F4@11 B3@12 W1@13 F5@14 B4@15 W2@16 "
        "F6@17 B5@18 W3@19 F7@20 B6@21 W4@22 B7@23 W5@24 W6@25 W7@26"
    )
    assert _starts(r, 1) == (
        "F0@1 F1@2 F2@3 B0@6 F3@7 B1@8 W0@9 F4@10 B2@11 W1@12 F5@13 B3@14 W2@15 "
        "F6@16 B4@17 W3@18 F7@19 B5@20 W4@21 B6@22 W5@23 B7@24 W6@25 W7@26"
    )
    assert _starts(r, 0) == (
        "F0@0 F1@1 F2@2 F3@3 B0@7 W0@8 F4@9 B1@10 W1@11 F5@12 B2@13 W2@14 F6@15 B3@16 W3@17 "
        "F7@18 B4@19 W4@20 B5@21 W5@22 B6@23 W6@24 B7@25 W7@26"
    )
    assert r.step_time == 27.0
    assert r.busy == [24.0] * 4 and r.idle == [3.0] * 4
    assert r.bubble_fraction == pytest.approx(1 / 9, abs=1e-15)
    assert simulate([StageTimes(1.0, 2.0, weight=1.0)] * 4, 8, "1f1b").step_time == 33.0


def _random_stages(rng, pp: int) -> list[StageTimes]:
    out = []
    for _ in range(pp):
        f = rng.choice([0.0, rng.uniform(0.1, 3.0)])
        b = f * rng.uniform(0.5, 3.0)
        out.append(StageTimes(f, b, rng.choice([0.0, rng.random()]), b * rng.choice([0.0, rng.random(), 1.0])))
    return out


@pytest.mark.parametrize("seed", range(3))
def test_without_a_split_zb1p_times_exactly_as_1f1b_and_afab_1f1b_ignore_weight(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(40):
        pp = rng.randint(1, 6)
        m = rng.randint(max(1, pp - 1), 10)
        stages = _random_stages(rng, pp)
        p2p = rng.choice([0.0, 0.3 * rng.random()])
        first_grad = rng.choice([0, 0, rng.randint(0, pp)])  # a frozen prefix sends no gradient back
        cuts = [i >= first_grad for i in range(pp - 1)]
        unsplit = [StageTimes(st.forward, st.backward, st.update) for st in stages]
        one = simulate(unsplit, m, "1f1b", p2p, grad_cuts=cuts)
        zero_w = simulate(unsplit, m, "zb1p", p2p, grad_cuts=cuts)
        assert zero_w.step_time == one.step_time
        assert [(o.stage, o.kind, o.micro_batch, o.start, o.end) for o in zero_w.ops if o.kind != "W"] == [
            (o.stage, o.kind, o.micro_batch, o.start, o.end) for o in one.ops
        ]
        for engine in ("1f1b", "afab"):  # weight is inside backward for them: same result
            assert (
                simulate(stages, m, engine, p2p, grad_cuts=cuts).to_dict()["ops"]
                == simulate(unsplit, m, engine, p2p, grad_cuts=cuts).to_dict()["ops"]
            )
        zb = simulate(stages, m, "zb1p", p2p, grad_cuts=cuts)
        assert zb.peak_in_flight == one.peak_in_flight
        assert zb.busy == pytest.approx(one.busy, rel=1e-12, abs=1e-15)  # the same work, split in two
        assert sum(o.kind == "W" for o in zb.ops) == m * pp


def test_weight_above_backward_is_refused() -> None:
    with pytest.raises(
        ValueError, match=r"stages\[1\]\.weight = 3\.0 exceeds its backward 2\.0; backward is the whole"
    ):
        simulate([StageTimes(1.0, 2.0), StageTimes(1.0, 2.0, weight=3.0)], 2, "zb1p")
    with pytest.raises(ValueError, match=r"stages\[0\]\.weight = -1\.0; times must be finite, non-negative"):
        simulate([StageTimes(1.0, 2.0, weight=-1.0)], 2, "zb1p")


def test_simulate_refuses_zb1p_with_too_few_micro_batches() -> None:
    with pytest.raises(ValueError, match=r"zb1p .*needs at least pp - 1 = 3 micro-batches, got 1.*>= 4"):
        simulate([StageTimes(1.0, 2.0, weight=1.0)] * 4, 1, "zb1p")


def test_timeline_draws_w_in_its_own_colour_with_a_legend_entry(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    import numpy as np
    from matplotlib.colors import to_rgb
    from matplotlib.image import imread

    from nanotron_ext.simulate import timeline

    zb = simulate([StageTimes(1e-3, 2e-3, weight=1e-3)] * 3, 4, "zb1p")
    one = simulate([StageTimes(1e-3, 2e-3, weight=1e-3)] * 3, 4, "1f1b")
    assert (timeline.WEIGHT_COLOR, "weight gradient (deferred W)") in timeline.legend_entries(zb)
    assert (timeline.BACKWARD_COLOR, "backward (input gradient)") in timeline.legend_entries(zb)
    assert all(colour != timeline.WEIGHT_COLOR for colour, _ in timeline.legend_entries(one))
    rgb = np.asarray(to_rgb(timeline.WEIGHT_COLOR))
    share = {}
    for name, result in (("zb", zb), ("one", one)):
        img = imread(timeline.plot_timeline(result, tmp_path / f"{name}.png"))
        share[name] = float((np.abs(img[..., :3] - rgb).max(axis=-1) < 0.02).mean())
    assert share["one"] == 0.0 and share["zb"] > 0.01  # W boxes, not just a legend swatch


# --- pricing: the B/W split ---------------------------------------------------------------------------------------


def _seed():
    from nanotron_ext.config import bundled_config, load_config
    from nanotron_ext.inventory import inventory_from_config

    cfg = load_config(bundled_config())  # tiny_llama_large_vocab: embedding, 2 decoders, norm, head, cast, loss
    return cfg, inventory_from_config(cfg)


def test_rate_model_prices_b_and_w_by_their_own_flops() -> None:
    from nanotron_ext.machine import EngineOverhead, MachineProfile, price_blocks

    cfg, blocks = _seed()
    machine = MachineProfile(
        name="1 TFLOP/s", source="test", flops_per_second=1e12, overhead=EngineOverhead(block_call=1e-6)
    )
    prices = price_blocks(machine, blocks, cfg)
    by_name = {b.name: i for i, b in enumerate(blocks)}
    # decoder.0: input-gradient 802816 FLOPs, weight-gradient 528384: W = 528384 / 1e12 s, B = the rest + the call
    i = by_name["model.decoder.0"]
    assert prices.weight[i] == pytest.approx(528384e-12, rel=1e-12)
    assert prices.backward[i] - prices.weight[i] == pytest.approx(802816e-12 + 1e-6, rel=1e-12)
    # the embedding makes its weight gradient in B (the engine does not defer it): W 0, B its 1024 FLOPs + the call
    i = by_name["model.token_position_embeddings"]
    assert prices.weight[i] == 0.0
    assert prices.backward[i] == pytest.approx(1024e-12 + 1e-6, rel=1e-9)
    assert prices.weight[by_name["model.final_layer_norm"]] == 0.0
    # blocks without parameters (cast, loss) have no W
    assert prices.weight[by_name["model.cast_to_fp32"]] == 0.0 and prices.weight[by_name["loss"]] == 0.0


def test_frozen_blocks_have_no_w_and_measured_blocks_split_by_flops_or_by_their_measured_w() -> None:
    import dataclasses

    from nanotron_ext.costs import trainable_before
    from nanotron_ext.machine import BlockCost, MachineProfile, block_signature, price_blocks

    cfg, blocks = _seed()
    frozen = [
        b.with_trainable(lambda name: False) if b.role == "decoder" and b.name.endswith(".1") else b for b in blocks
    ]
    grads = trainable_before(frozen)
    sig = {b.name: block_signature(b, input_grad=g) for b, g in zip(frozen, grads)}
    costs = [
        BlockCost(sig["model.decoder.0"], 1e-3, 3e-3),  # no split: 3 ms × 528384 / (802816 + 528384)
        BlockCost(sig["model.decoder.1"], 1e-3, 2e-3),  # frozen: W = 0
        BlockCost(sig["model.lm_head"], 1e-3, 4e-3, backward_weight=1.5e-3),
    ]  # measured split
    prices = price_blocks(MachineProfile(name="m", source="test", blocks=tuple(costs)), frozen, cfg)
    by_name = {b.name: i for i, b in enumerate(frozen)}
    assert prices.weight[by_name["model.decoder.0"]] == pytest.approx(3e-3 * 528384 / 1331200, rel=1e-12)
    assert prices.weight[by_name["model.decoder.1"]] == 0.0
    assert prices.backward[by_name["model.decoder.1"]] == 2e-3
    assert prices.weight[by_name["model.lm_head"]] == 1.5e-3
    # the rate-model frozen decoder too
    rate = price_blocks(MachineProfile(name="r", source="test", flops_per_second=1e12), frozen, cfg)
    assert rate.weight[by_name["model.decoder.1"]] == 0.0
    assert rate.backward[by_name["model.decoder.1"]] == pytest.approx(802816e-12, rel=1e-12)
    assert dataclasses.replace(costs[2], backward_weight=None).backward_weight is None


def test_backward_weight_survives_json_and_a_bad_one_is_refused(tmp_path) -> None:
    from nanotron_ext.errors import ConfigError
    from nanotron_ext.machine import BlockCost, MachineProfile, load_machine

    machine = MachineProfile(
        name="m", source="t", blocks=(BlockCost("decoder:x", 1.0, 2.0, 0.5, 0.75), BlockCost("decoder:y", 1.0, 2.0))
    )
    machine.save(tmp_path / "m.json")
    assert load_machine(tmp_path / "m.json") == machine
    with pytest.raises(ConfigError, match=r"backward_weight=3\.0 exceeds its backward=2\.0.*null: split by FLOPs"):
        MachineProfile(name="m", source="t", blocks=(BlockCost("decoder:x", 1.0, 2.0, 0.0, 3.0),))
    with pytest.raises(ConfigError, match=r"backward_weight=-1\.0 must be a finite number >= 0"):
        MachineProfile(name="m", source="t", blocks=(BlockCost("decoder:x", 1.0, 2.0, 0.0, -1.0),))


def test_one_pricing_for_every_engine_only_the_engine_differs() -> None:
    from nanotron_ext.strategies.step_time import schedule_problem

    cfg, blocks = _seed()
    problems = {e: schedule_problem(blocks, cfg.with_overrides(engine=e)) for e in ("1f1b", "afab", "zb1p")}
    for field in ("forward", "backward", "update", "send", "weight", "grad_after"):
        assert len({getattr(p, field) for p in problems.values()}) == 1, field
    assert {p.engine for p in problems.values()} == {"1f1b", "afab", "zb1p"}
    assert sum(problems["zb1p"].weight) > 0


def test_plan_stage_times_carry_the_split_under_zb1p_only() -> None:
    import json

    from nanotron_ext.machine import MachineProfile, price_blocks
    from nanotron_ext.plan import make_plan
    from nanotron_ext.simulate import plan_stage_times, simulate_plan

    cfg, blocks = _seed()
    machine = MachineProfile(name="1 TFLOP/s", source="test", flops_per_second=1e12)
    plan = make_plan(blocks, cfg, "flops")
    weights = price_blocks(machine, blocks, cfg).weight
    expected = [sum(w for w, r in zip(weights, plan.block_ranks) if r == k) for k in range(plan.pp)]
    zb = plan_stage_times(plan, blocks, cfg.with_overrides(engine="zb1p"), machine=machine)
    assert [st.weight for st in zb.stages] == pytest.approx(expected, rel=1e-12) and min(expected) > 0
    one = plan_stage_times(plan, blocks, cfg.with_overrides(engine="1f1b"), machine=machine)
    assert [st.weight for st in one.stages] == [0.0] * plan.pp
    assert [st.backward for st in one.stages] == [st.backward for st in zb.stages]
    result = simulate_plan(plan, blocks, cfg, machine=machine, engine="zb1p")
    assert result.engine == "zb1p" and any(op.kind == "W" for op in result.ops)
    assert [s["weight"] for s in json.loads(json.dumps(result.to_dict()))["stages"]] == pytest.approx(expected)
    assert "weight" not in simulate_plan(plan, blocks, cfg, machine=machine).to_dict()["stages"][0]


# --- memory: the deferred W's state -------------------------------------------------------------------------------


def test_pending_tensors_of_the_tiny_config_by_hand() -> None:
    """tiny_llama_large_vocab: micro-batch 2 × 32 = 64 tokens, h = 16, 4 heads of 4 (q = k = v = 16), f = 64,
    V = 50277, fp32 (4 bytes). A hidden-sized tensor is 64 × 16 × 4 = 4096 bytes."""
    from nanotron_ext.costs.block_memory import pending_tensors, weight_pending

    cfg, blocks = _seed()
    pending = {b.name: pending_tensors(b, cfg.model, cfg.run) for b in blocks}
    # The embedding and the norms make their weight gradients in B: nothing waits for a W.
    assert pending["model.token_position_embeddings"] == {} and pending["model.final_layer_norm"] == {}
    decoder = pending["model.decoder.0"]
    assert decoder["qkv_proj.input"] == 4096 and decoder["qkv_proj.output_grad"] == 64 * 48 * 4
    assert decoder["o_proj.input"] == 64 * 16 * 4 and decoder["o_proj.output_grad"] == 4096
    assert decoder["gate_up_proj.input"] == 4096 and decoder["gate_up_proj.output_grad"] == 64 * 128 * 4
    assert decoder["down_proj.input"] == 64 * 64 * 4 and decoder["down_proj.output_grad"] == 4096
    assert not any("layernorm" in name for name in decoder)
    # qkv 4096 + 12288 + o 4096 + 4096 + gate_up 4096 + 32768 + down 16384 + 4096
    assert weight_pending(blocks[1], cfg.model, cfg.run) == 81920
    assert pending["model.lm_head"] == {"weight.input": 4096, "weight.output_grad": 64 * 50277 * 4}  # logits' grad
    assert pending["model.cast_to_fp32"] == {} and pending["loss"] == {}


def test_frozen_weights_keep_nothing_for_a_deferred_w() -> None:
    from nanotron_ext.costs.block_memory import pending_tensors, weight_pending

    cfg, blocks = _seed()
    decoder = blocks[1]
    assert weight_pending(decoder.with_trainable(lambda name: False), cfg.model, cfg.run) == 0.0
    mlp_only = pending_tensors(decoder.with_trainable(lambda name: ".mlp." in name), cfg.model, cfg.run)
    assert mlp_only == {
        "gate_up_proj.input": 4096,
        "gate_up_proj.output_grad": 32768,
        "down_proj.input": 16384,
        "down_proj.output_grad": 4096,
    }
    assert weight_pending(blocks[4].with_trainable(lambda name: False), cfg.model, cfg.run) == 0.0  # lm_head


def test_stage_peak_adds_rank_times_the_deferred_state_under_zb1p_only() -> None:
    """Split embedding, decoder.0, decoder.1 | final_norm, lm_head, cast, loss (pp = 2, m = 4). Stage 0 defers
    no earlier W, but during a B the products of its own micro-batch wait for the W right after it (at most the
    stage's 2 × 81920 bytes); stage 1 also defers one earlier W: the lm_head's 4096 + 12870912 = 12875008 bytes.
    AFAB's and 1F1B's estimates have no such term."""
    from nanotron_ext.costs.memory_estimate import config_stage_memory

    cfg, blocks = _seed()
    parts = [blocks[:3], blocks[3:]]
    zb = [config_stage_memory(part, cfg.with_overrides(engine="zb1p"), k) for k, part in enumerate(parts)]
    one = [config_stage_memory(part, cfg.with_overrides(engine="1f1b"), k) for k, part in enumerate(parts)]
    assert [m.deferred for m in zb] == [0, 1] and [m.deferred for m in one] == [0, 0]
    assert zb[0].weight_pending == 2 * 81920 and zb[1].weight_pending == 12875008
    assert 0 < zb[0].pipeline_peak - one[0].pipeline_peak <= 2 * 81920
    assert 12875008 < zb[1].pipeline_peak - one[1].pipeline_peak <= 2 * 12875008
    assert zb[1].peak == max(zb[1].pipeline_peak, zb[1].optimizer_peak) and zb[1].to_dict()["deferred"] == 1
    assert one[1].weight_pending == 0.0 and one[1].pending_weights == 0.0


def test_deferred_counts() -> None:
    from nanotron_ext.costs.block_memory import deferred_at_once

    assert deferred_at_once("zb1p", 4, 8) == [0, 1, 2, 3]
    assert deferred_at_once("zb1p", 4, 3) == [0, 1, 2, 2]  # m = pp - 1: stage 3's last W runs first of three
    assert deferred_at_once("zb1p", 8, 7)[7] == 6
    assert deferred_at_once("1f1b", 4, 8) == deferred_at_once("afab", 4, 8) == [0] * 4
    # it is the most W's pending while the stage computes, the running W left out, counted from the program
    for pp, m in [(2, 1), (3, 2), (4, 3), (4, 8), (5, 6), (8, 16)]:
        for stage in range(pp):
            pending = most = 0
            for action, _ in engine_program("zb1p", pp, stage, m):
                if action.is_compute:
                    most = max(most, pending - (action is Action.WEIGHT))
                pending += {Action.BACKWARD: 1, Action.WEIGHT: -1}.get(action, 0)
            assert pending == 0 and most == deferred_at_once("zb1p", pp, m)[stage], (pp, m, stage)


def test_memory_cap_counts_the_deferred_state_brute_force() -> None:
    from nanotron_ext.partition import MemoryCap, partition
    from nanotron_ext.partition.schedule_aware import ScheduleProblem, step_time_partition

    rng = random.Random(5)
    checked = 0
    for _ in range(60):
        n, pp = rng.randint(3, 8), rng.randint(2, 4)
        pp = min(pp, n)
        static = tuple(rng.random() for _ in range(n))
        act = tuple(0.3 * rng.random() for _ in range(n))
        pend = tuple(0.5 * rng.random() for _ in range(n))
        flight, deferred = tuple(pp - k for k in range(pp)), tuple(range(pp))
        cap = (sum(static) + pp * sum(act) + sum(pend)) / pp * rng.uniform(0.8, 2.0)
        memory = MemoryCap(static, act, flight, cap=cap, pending=pend, deferred=deferred)

        def fits(bounds, memory=memory) -> bool:
            return all(
                sum(memory.static[s:e])
                + memory.in_flight[k] * sum(memory.activation[s:e])
                + memory.deferred[k] * sum(memory.pending[s:e])
                <= memory.cap * (1 + 1e-9)
                for k, (s, e) in enumerate(zip(bounds[:-1], bounds[1:]))
            )

        import itertools

        splits = [(0, *c, n) for c in itertools.combinations(range(1, n), pp - 1)]
        valid = [s for s in splits if fits(s)]
        costs = [rng.random() for _ in range(n)]
        problem = ScheduleProblem(
            tuple(costs),
            tuple(2 * c for c in costs),
            (0.0,) * n,
            (0.0,) * n,
            (True,) * (n + 1),
            pp,
            pp,
            "zb1p",
            tuple(c for c in costs),
        )
        if not valid:
            with pytest.raises(Exception, match="memory_cap_gib|no split|constraints"):
                partition(costs, pp, memory=memory)
            continue
        checked += len(valid) < len(splits)
        assert fits(partition(costs, pp, memory=memory).bounds)
        found = step_time_partition(problem, memory=memory)
        assert fits(found.bounds)
    assert checked >= 5


# --- CLI: --engine and plan --compare-engines ----------------------------------------------------------------------


def test_engine_override_reaches_the_run_and_the_yaml() -> None:
    from nanotron_ext.errors import ConfigError

    cfg, _ = _seed()
    zb = cfg.with_overrides(engine="zb1p")
    assert zb.run.engine == "zb1p" and zb.nanotron["parallelism"]["pp_engine"] == "zb1p"
    assert cfg.run.engine == "1f1b"  # the original is untouched
    with pytest.raises(ConfigError, match=r"parallelism.pp_engine='zb3p' is not one of 1f1b, afab, zb1p, zb2p"):
        cfg.with_overrides(engine="zb3p")


def test_plan_and_simulate_take_engine(tmp_path, capsys) -> None:
    import json

    from nanotron_ext.cli import main

    assert main(["plan", "--engine", "zb1p", "--tflops", "0.001"]) == 0
    text = capsys.readouterr().out
    assert "engine=zb1p" in text and "simulated step:" in text and "(zb1p, 4 micro-batches" in text
    assert "W state/mb" in text and "deferred W" in text  # the memory table shows the deferred state
    assert main(["plan", "--engine", "1f1b", "--tflops", "0.001"]) == 0
    assert "W state/mb" not in capsys.readouterr().out
    assert main(["simulate", "--engine", "zb1p", "--tflops", "0.001", "--json", "--out", str(tmp_path / "t.png")]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["engine"] == "zb1p" and data["simulation"]["engine"] == "zb1p"
    kinds = {op["kind"] for op in data["simulation"]["ops"]}
    assert kinds == {"F", "B", "W", "U"}  # U: each stage's optimizer step after the pipeline
    assert main(["simulate", "--engine", "zb1p", "--tflops", "0.001", "--out", str(tmp_path / "t.png")]) == 0
    assert "of which W/mb" in capsys.readouterr().out


def test_zb1p_with_too_few_micro_batches_is_refused_on_the_command_line(tmp_path, capsys) -> None:
    from nanotron_ext.cli import main

    assert (
        main(["simulate", "--engine", "zb1p", "--pp", "4", "--micro-batches", "2", "--out", str(tmp_path / "t.png")])
        == 2
    )
    err = capsys.readouterr().err
    assert "zb1p (ZB-H1" in err and "needs at least pp - 1 = 3 micro-batches, got 2" in err
    assert "batch_accumulation_per_replica >= 4" in err
    assert main(["plan", "--engine", "zb1p", "--pp", "4", "--micro-batches", "2"]) == 1
    out = capsys.readouterr().out
    assert "needs at least pp - 1 = 3 micro-batches, got 2" in out and "INVALID" in out
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--engine", "zb3p"])
    assert exc.value.code == 2 and "invalid choice: 'zb3p'" in capsys.readouterr().err


def test_plan_compare_engines_table_and_json(capsys) -> None:
    import json

    from nanotron_ext.cli import main
    from nanotron_ext.config import bundled_config, load_config
    from nanotron_ext.inventory import inventory_from_config
    from nanotron_ext.plan import make_plan
    from nanotron_ext.simulate import simulate_plan

    # The rows on Llama-3.2-1B: the V search of its zbv row costs 1.8 s of CPU, 16 on Llama-3-8B, whose size only
    # the table's memory verdicts below need.
    config = str(bundled_config("llama_3_2_1b.yaml"))
    assert main(["plan", config, "--pp", "4", "--compare-engines", "--json"]) == 0
    rows = {r["engine"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == {"1f1b", "zb1p", "zb2p", "zbv"}  # zbv's row: tests/test_v_plan.py
    for engine, row in rows.items():  # each engine's default plan, planned and simulated under that engine
        if engine == "zbv":
            continue
        cfg = load_config(config, pp=4).with_overrides(engine=engine)
        blocks = inventory_from_config(cfg)
        plan = make_plan(blocks, cfg)
        assert row["block_ranks"] == list(plan.block_ranks)
        assert row["simulated_step_time"] == pytest.approx(simulate_plan(plan, blocks, cfg).step_time, rel=1e-12)
        assert row["memory_peak_bytes"] == [s.memory_bytes for s in plan.stages]
    assert (
        rows["zb2p"]["simulated_step_time"] < rows["zb1p"]["simulated_step_time"] < rows["1f1b"]["simulated_step_time"]
    )
    assert rows["zb2p"]["bubble_fraction"] < rows["zb1p"]["bubble_fraction"] < rows["1f1b"]["bubble_fraction"]
    # On one split (each engine's default fits the GPU's memory its own way): zb1p holds more, most on the last
    # stage (3 deferred W's); stage 0 defers no earlier W, only its own micro-batch's products wait during a B.
    from nanotron_ext.plan import plan_with_ranks

    zb = load_config(config, pp=4).with_overrides(engine="zb1p")
    same = [
        s.memory_bytes
        for s in plan_with_ranks(inventory_from_config(zb), zb, rows["1f1b"]["block_ranks"], "constrained").stages
    ]
    one = rows["1f1b"]["memory_peak_bytes"]
    assert 0 < same[0] - one[0] < same[3] - one[3]
    config = str(bundled_config("llama_3_8b.yaml"))
    assert main(["plan", config, "--pp", "4", "--compare-engines"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("engine"))
    assert lines[head].split()[:3] == ["engine", "stages", "(block"] and "memory peak per stage" in lines[head]
    assert [lines[head + k].split()[0] for k in (2, 3, 4)] == ["1f1b", "zb1p", "zb2p"]
    at = lines[head].index("verdict")  # aligned columns: every row's verdict starts under the header
    # 1F1B's default fits the H100's 80 GB; zb1p's deferred W's put two stages over it (three by the CPU count)
    assert lines[head + 2][at:].startswith("OK") and lines[head + 3][at:].startswith("INVALID (memory@0,3)")
    assert main(["plan", "--compare", "--compare-engines"]) == 2
