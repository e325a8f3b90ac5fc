"""Tests for ``nanotron-ext simulate`` and the FLOP-rate stage-time model (nanotron_ext.simulate.stage_times)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.cli import main
from nanotron_ext.config import bundled_config, load_config
from nanotron_ext.costs import block_memory, training_flops
from nanotron_ext.costs.analytic import trainable_before
from nanotron_ext.errors import ConfigError, PlanningError
from nanotron_ext.machine import BlockCost, Link, MachineProfile, block_signature
from nanotron_ext.partition.step_time_eval import StepTimeEvaluator
from nanotron_ext.plan import Plan
from nanotron_ext.simulate import StageTimes, simulate
from nanotron_ext.simulate.stage_times import format_seconds, plan_stage_times, simulate_plan
from nanotron_ext.strategies.step_time import schedule_problem

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
T = 1e12  # FLOPs of one unit in the hand-made blocks below


def _block(
    i: int, fwd: float, bwd_in: float, bwd_w: float, params: int, trainable: int, role: str = "other"
) -> BlockInfo:
    return BlockInfo(
        index=i,
        name=f"b{i}" if role == "other" else f"model.{role}",
        role=role,  # type: ignore[arg-type]
        builder="X",
        params=params,
        trainable=trainable,
        param_bytes=2 * params,
        flops_fwd=fwd * T,
        flops_bwd_input=bwd_in * T,
        flops_bwd_weight=bwd_w * T,
    )


def _plan(blocks: list[BlockInfo], ranks: list[int]) -> Plan:
    return Plan(
        strategy="hand",
        pp=max(ranks) + 1,
        engine="1f1b",
        n_micro_batches=2,
        unit="FLOPs",
        block_names=tuple(b.name for b in blocks),
        block_ranks=tuple(ranks),
        block_costs=tuple(training_flops(blocks)),
        stages=(),
    )


# A (trainable) B (frozen lm_head) | C (trainable) D (weightless: the loss); FLOPs in units of 1e12.
HAND = [
    _block(0, 1, 2, 2, 10, 10),
    _block(1, 3, 6, 6, 10, 0, "lm_head"),
    _block(2, 2, 4, 4, 10, 10),
    _block(3, 1, 1, 0, 0, 0, "loss"),
]
CFG = load_config(bundled_config())  # 1f1b, 4 micro-batches of 2 x 32 tokens, fp32, vocabulary 50277
#: What the lm_head sends (its fp32 logits, t x V x 4 bytes: the memory model's output, the one home of "what a
#: block sends"); a bandwidth that ships them in 2 s. Other blocks send t x h x 4 bytes, 1/3142 of it.
LOGITS = block_memory(HAND[1], CFG.model, CFG.run).output
BW = LOGITS / 2.0


def _machine(rate: float, bandwidth: float | None = None, blocks: tuple[BlockCost, ...] = ()) -> MachineProfile:
    """A hand-made machine: one FLOP rate, a link without latency (none: p2p not priced), measured blocks."""
    links = () if bandwidth is None else (Link(-1, -1, 0.0, bandwidth),)
    return MachineProfile(name="hand", source="test", flops_per_second=rate, links=links, blocks=blocks)


def test_stage_times_of_a_hand_made_two_stage_plan():
    # training FLOPs: A = 1 + 2 (weights; no input-grad, nothing trainable before it) = 3;
    # B = 3 + 6 (input-grad) + 0 (frozen) = 9; C = 2 + 4 + 4 = 10; D = 1 + 1 = 2.
    # stage 0: forward 1 + 3 = 4, backward 3 + 9 - 4 = 8; stage 1: forward 2 + 1 = 3, backward 10 + 2 - 3 = 9.
    # p2p: stage 0's last block (B, the lm_head) sends its logits: 2 s at BW. Stage 1 sends nothing.
    assert LOGITS == 2 * 32 * 50277 * 4
    stages, p2p, _ = plan_stage_times(_plan(HAND, [0, 0, 1, 1]), HAND, CFG, machine=_machine(1e12, BW))
    assert stages == [StageTimes(4.0, 8.0), StageTimes(3.0, 9.0)]
    assert p2p == [2.0]
    # A cut after A instead ships hidden states (t x h x 4 bytes), not logits.
    assert plan_stage_times(_plan(HAND, [0, 1, 1, 1]), HAND, CFG, machine=_machine(1e12, BW))[1] == [
        pytest.approx(2.0 * 64 * 16 * 4 / LOGITS)
    ]


def test_hand_made_plan_simulates_to_the_hand_computed_schedule():
    stages, p2p, _ = plan_stage_times(_plan(HAND, [0, 0, 1, 1]), HAND, CFG, machine=_machine(1e12, BW))
    r = simulate(stages, 2, "1f1b", p2p)
    # Transfers take 2 s and start once both sides are there. Stage 0: F0 [0,4] F1 [4,8], sending each at once.
    # Stage 1: activation 0 arrives at 6; F0 [6,9] B0 [9,18]; activation 1 (sent at 8) is only received from
    # 18, so F1 [20,23] B1 [23,32]; gradient 0 leaves at 20 (after activation 1 arrived), gradient 1 at 32.
    # Stage 0: B0 [22,30] B1 [34,42]. Step 42 s, busy 24 s each, bubble 36/84.
    assert [(o.stage, o.kind, o.micro_batch, o.start, o.end) for o in r.ops] == [
        (0, "F", 0, 0.0, 4.0),
        (0, "F", 1, 4.0, 8.0),
        (0, "B", 0, 22.0, 30.0),
        (0, "B", 1, 34.0, 42.0),
        (1, "F", 0, 6.0, 9.0),
        (1, "B", 0, 9.0, 18.0),
        (1, "F", 1, 20.0, 23.0),
        (1, "B", 1, 23.0, 32.0),
    ]
    assert r.step_time == 42.0
    assert r.busy == [24.0, 24.0]
    assert r.bubble_fraction == 36.0 / 84.0


def test_each_cut_is_priced_by_what_crosses_it_logits_across_one_hidden_states_across_the_other():
    # Three stages A | B (the lm_head) | C, D: cut 0 ships A's hidden states (t x h x 4 bytes: eps seconds at BW),
    # cut 1 the logits (2 s). Stage times (FLOPs as above): F = 1, 3, 3; B = 2, 6, 9.
    eps = 64 * 16 * 4 / BW
    stages, p2p, _ = plan_stage_times(_plan(HAND, [0, 1, 2, 2]), HAND, CFG, machine=_machine(1e12, BW))
    assert stages == [StageTimes(1.0, 2.0), StageTimes(3.0, 6.0), StageTimes(3.0, 9.0)]
    assert p2p == [pytest.approx(eps, rel=1e-12), 2.0]
    r = simulate(stages, 2, "1f1b", p2p)
    # By hand, Nanotron's 1F1B (warm-up sends at once, steady-state sends at the next receive):
    # stage 0: F0 [0, 1], F1 [1, 2]. Stage 1: a0 in at 1 + eps, F0 to 4 + eps (sent at once), a1 in at 4 + 2 eps,
    # F1 to 7 + 2 eps. Stage 2: a0 in at 6 + eps, F0, B0 to 18 + eps; a1 in at 20 + eps, then g0 leaves; F1, B1 to
    # 32 + eps. Stage 1: g0 in at 22 + eps, B0 to 28 + eps (g0 sent on), g1 in at 34 + eps, B1 to 40 + eps.
    # Stage 0: g0 in at 28 + 2 eps, B0 to 30 + 2 eps; g1 in at 40 + 2 eps, B1 to 42 + 2 eps.
    assert r.step_time == pytest.approx(42.0 + 2 * eps, rel=1e-12)
    assert r.p2p_times == p2p
    # One time for every cut (the largest tensor over the slowest link) would charge the logits at cut 0 as well.
    assert simulate(stages, 2, "1f1b", max(p2p)).step_time > r.step_time + 1.0
    # The planner's evaluator prices the same split the same way.
    problem = schedule_problem(
        HAND, dataclasses.replace(CFG, run=dataclasses.replace(CFG.run, pp=3, n_micro_batches=2)), _machine(1e12, BW)
    )
    assert StepTimeEvaluator(problem)([(0, 1, 2, 4)])[0] == pytest.approx(r.step_time, rel=1e-12)


def test_p2p_ignored_without_bandwidth_and_on_one_stage():
    assert plan_stage_times(_plan(HAND, [0, 0, 1, 1]), HAND, CFG, machine=_machine(1e12))[1] == [0.0]
    stages, p2p, _ = plan_stage_times(_plan(HAND, [0, 0, 0, 0]), HAND, CFG, machine=_machine(2e12, 1.0))
    assert (stages, p2p) == ([StageTimes(3.5, 8.5)], [])  # forward 7, training 24, at 2 FLOP units/s


def _cuts(plan: Plan, blocks: list[BlockInfo]) -> list[bool]:
    return plan_stage_times(plan, blocks, CFG, machine=_machine(1.0)).grad_cuts


def test_frozen_prefix_cut_carries_no_gradient_in_the_simulation():
    frozen = [_block(0, 1, 2, 2, 10, 0), _block(1, 3, 6, 6, 10, 0), _block(2, 2, 4, 4, 10, 10)]
    assert _cuts(_plan(frozen, [0, 1, 2]), frozen) == [False, False]  # only C, on stage 2, trains
    middle = [_block(0, 1, 2, 2, 10, 0), _block(1, 2, 4, 4, 10, 10), _block(2, 1, 2, 2, 10, 0)]
    assert _cuts(_plan(middle, [0, 1, 2]), middle) == [False, True]
    assert _cuts(_plan(frozen, [0, 1, 1]), frozen) == [False]
    assert _cuts(_plan(HAND, [0, 0, 1, 1]), HAND) == [True]
    cfg = CFG
    plan = _plan(frozen, [0, 1, 1])
    r = simulate_plan(plan, frozen, cfg, machine=_machine(1e12, 1.0))
    stages, p2p, cuts = plan_stage_times(plan, frozen, cfg, machine=_machine(1e12, 1.0))
    assert cuts == [False]
    assert r == simulate(stages, cfg.run.n_micro_batches, cfg.run.engine, p2p, grad_cuts=[False])
    assert r != simulate(stages, cfg.run.n_micro_batches, cfg.run.engine, p2p)  # stage 0 would wait for gradients


def test_frozen_prefix_pays_no_backward():
    frozen = [_block(0, 1, 2, 2, 10, 0), _block(1, 3, 6, 6, 10, 0), _block(2, 2, 4, 4, 10, 10)]
    stages, _, _ = plan_stage_times(_plan(frozen, [0, 1, 2]), frozen, CFG, machine=_machine(1e12))
    assert stages == [StageTimes(1.0, 0.0), StageTimes(3.0, 0.0), StageTimes(2.0, 4.0)]


def test_stage_times_reject_bad_rates_and_foreign_blocks():
    plan = _plan(HAND, [0, 0, 1, 1])
    with pytest.raises(ConfigError, match="flops_per_second=0.0 must be a positive"):
        _machine(0.0)
    with pytest.raises(ConfigError, match="bytes_per_second=inf must be a positive, finite"):
        _machine(1.0, float("inf"))
    with pytest.raises(PlanningError, match="inventory the plan was made from"):
        plan_stage_times(plan, HAND[:3], CFG, machine=_machine(1.0))


def test_format_seconds():
    assert [format_seconds(x) for x in (2.5, 0.0123, 4.2e-6, 3e-9, 0.0)] == [
        "2.5 s",
        "12.3 ms",
        "4.2 µs",
        "3 ns",
        "0 s",
    ]
    # Rounded up to 1000 of a unit, a time moves to the next one; above 999 s, whole seconds.
    assert [format_seconds(x) for x in (0.9997e-3, 999.4e-6, 999.96e-9, 1234.4, -0.002)] == [
        "1 ms",
        "999 µs",
        "1 µs",
        "1234 s",
        "-2 ms",
    ]


# --- the command, in process -------------------------------------------------------------------


def _png(path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG_MAGIC


def test_simulate_prints_table_bubble_and_writes_timeline(tmp_path, capsys):
    out = tmp_path / "tl.png"
    assert main(["simulate", "--tflops", "0.001", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "strategy: constrained" in text
    assert "1f1b: pp=2, micro-batches=4" in text
    assert "ideal (p-1)/(m+p-1) = 20.0%" in text
    # Stage 1 (lm_head, cast, loss) of the tiny model, t = 2·32 tokens, h = 16, V = 50277, at 1e9 FLOP/s:
    # forward 2·t·h·V + t·V + 5·t·V = 122,273,664 FLOPs; backward 4·t·h·V + t·V + 3·t·V = 218,805,504.
    row = next(line for line in text.splitlines() if "lm_head, cast, loss" in line)
    # The update: the lm_head's 804,432 fp32 parameters, 28 bytes each through fused AdamW at 3.0 TB/s.
    cells = re.split(r"\s{2,}", row.strip())
    assert cells[0] == "1" and cells[-3:] == ["122 ms", "219 ms", "7.51 µs"]  # as plan prints times
    assert cells[-3:] == [format_seconds(x) for x in (122_273_664e-9, 218_805_504e-9, 804_432 * 28 / 3e12)]
    lines = text.splitlines()
    assert lines[-2:] == ["VALID: every stage has parameters to train", f"timeline: {out}"]
    assert _png(out)


def test_simulate_json_matches_hand_computed_times(tmp_path, capsys):
    """The tiny model at 1 TFLOP/s with a 1000 B/s link, every number worked out by hand.

    t = 2·32 tokens, s = 32, h = 16, V = 50277, 4 heads of 4, intermediate 64. Stage 0 (embedding, 2 decoder
    layers, final norm) and stage 1 (lm_head, cast, loss), FLOPs per micro-batch:

    * embedding: forward t·h = 1,024; weight gradient t·h = 1,024 (no input gradient: nothing before it).
    * decoder: linear weights 16·4·(4+2·4) + 4·4·16 + 3·16·64 = 4,096; attention 4·t·s·h = 131,072; norms
      2·4·t·h = 8,192. Forward 2·t·4096 + 131,072 + 8,192 = 663,552; input gradient 2·t·4096 + 2·131,072 +
      2·8,192 = 802,816; weight gradient 2·t·4096 + 8,192/2 = 528,384.
    * final norm: forward 4·t·h = 4,096; input gradient 8·t·h = 8,192; weight gradient 2·t·h = 2,048.
    * stage 0: forward a = 1,024 + 2·663,552 + 4,096 = 1,332,224; backward
      b = 1,024 + 2·(802,816 + 528,384) + 8,192 + 2,048 = 2,673,664.
    * stage 1: forward c = 2·t·h·V + t·V + 5·t·V = 122,273,664; backward d = 4·t·h·V + t·V + 3·t·V = 218,805,504.

    The cut carries fp32 activations of t × h = 4,096 bytes: τ = 4.096 s at 1000 B/s plus the analytic model's
    10 µs latency (``--p2p-gbps`` overrides the bandwidth only), the same for the gradient.
    1F1B at pp=2, m=4: stage 0 runs F0 F1 B0 F2 B1 F3 B2 B3, stage 1 F0 B0 F1 B1 F2 B2 F3 B3. A transfer starts
    when both sides have reached it (rendezvous), and stage 1 receives the next activation before it sends the
    previous gradient, so with τ far above every compute time the critical path is: F0 (a), act0 (τ), stage 1's
    F0 B0 (c + d), act1 (τ: stage 1 only now posts its receive), grad0 (τ), B0 F2 (b + a), act2, grad1 (2τ),
    B1 F3 (b + a), act3, grad2 (2τ), B2 (b), grad3 (τ), B3 (b).
    Step = 8τ + (c + d) + 3a + 4b, and the slower stage's update.
    """
    # The FLOP split: under this p2p, constrained's step-time objective moves the decoders to stage 1 (faster by
    # 2·a' + 3·b' of the moved layers), so the hand computation pins the split with `flops`.
    argv = [
        "simulate",
        "--json",
        "--tflops",
        "1",
        "--p2p-gbps",
        "0.000001",
        "--cost-strategy",
        "flops",
        "--out",
        str(tmp_path / "t.png"),
    ]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is True and data["strategy"] == "flops"
    assert data["ideal_bubble_fraction"] == 0.2  # (p-1)/(m+p-1) = 1/5
    assert data["plan"]["block_ranks"] == [0, 0, 0, 0, 1, 1, 1]
    sim = data["simulation"]
    a, b, c, d, tau = 1_332_224e-12, 2_673_664e-12, 122_273_664e-12, 218_805_504e-12, 4.096 + 10e-6
    # The update after the pipeline: each stage's fp32 parameters, 28 bytes each through fused AdamW, at the
    # analytic 3.0 TB/s. Stage 0: embedding 804,432 + 2 decoders of 4,096 + 2·16 + final norm 16 = 812,704;
    # stage 1: the lm_head's 804,432.
    u0, u1 = 812_704 * 28 / 3e12, 804_432 * 28 / 3e12
    got = [(st["forward"], st["backward"], st["update"]) for st in sim["stages"]]
    assert got == [pytest.approx((a, b, u0), rel=1e-12), pytest.approx((c, d, u1), rel=1e-12)]
    assert sim["p2p_times"] == [pytest.approx(tau, rel=1e-12)]
    step = 8 * tau + (c + d) + 3 * a + 4 * b + u0
    assert sim["step_time"] == pytest.approx(step, rel=1e-12)
    assert sim["busy"] == pytest.approx([4 * (a + b) + u0, 4 * (c + d) + u1], rel=1e-9)
    assert sim["bubble_fraction"] == pytest.approx(1 - (4 * (a + b + c + d) + u0 + u1) / (2 * step), rel=1e-12)


def test_simulate_compare_table_and_stage_loads(tmp_path, capsys):
    tl, loads = tmp_path / "tl.png", tmp_path / "loads.png"
    assert main(["simulate", "--compare", "--out", str(tl), "--loads-out", str(loads)]) == 0
    text = capsys.readouterr().out
    table = text.split("every strategy", 1)[1]
    for name in ("nanotron", "uniform", "flops", "memory", "constrained"):
        assert f"\n{name} " in table
    assert "INVALID (no-params@1)" in table  # Nanotron's rule leaves stage 1 without weights
    # The layout row's error is a tag; the whole message goes under the table, never cut.
    assert re.search(r"^layout\s+-.*  cannot plan \[1\]$", table, re.M)
    assert "\n[1] cost_strategy 'layout' needs `layout:` under `nanotron_ext:`, e.g. 'E,t*5|t*6,L'\n" in table
    assert "…" not in text
    # vs best reads as speed: the best's step ÷ this one's, 1.000x for the fastest and below 1 for the others.
    speeds = [float(x) for x in re.findall(r" (\d+\.\d{3})x ", table.split("\n[1]")[0])]
    assert max(speeds) == 1.0 and min(speeds) < 1.0
    assert "ratios (x) are speed: the other plan's time ÷ this one's" in table
    assert _png(tl) and _png(loads)


def test_simulate_compare_json_lists_every_strategy(tmp_path, capsys):
    assert (
        main(
            [
                "simulate",
                "--compare",
                "--json",
                "--out",
                str(tmp_path / "a.png"),
                "--loads-out",
                str(tmp_path / "b.png"),
            ]
        )
        == 0
    )
    entries = {e["strategy"]: e for e in json.loads(capsys.readouterr().out)["compare"]}
    assert entries["nanotron"]["ok"] is False and entries["nanotron"]["block_ranks"] == [0, 0, 0, 0, 0, 1, 1]
    assert entries["constrained"]["ok"] is True and "error" in entries["layout"]


def test_invalid_plan_exits_1_but_is_still_drawn(tmp_path, capsys):
    out = tmp_path / "nanotron.png"
    assert main(["simulate", "--cost-strategy", "nanotron", "--out", str(out)]) == 1
    text = capsys.readouterr().out
    assert "ERROR [stage 1]" in text and "INVALID: this plan cannot train" in text
    assert _png(out)


def test_unplannable_strategy_exits_1(tmp_path, capsys):
    assert main(["simulate", "--pp", "7", "--out", str(tmp_path / "x.png")]) == 1
    assert "no valid plan" in capsys.readouterr().out
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("argv", [["--tflops", "0"], ["--p2p-gbps", "-1"], ["--pp", "0"]])
def test_flag_values_out_of_range_exit_2_naming_the_flag(tmp_path, capsys, argv):
    with pytest.raises(SystemExit) as exc:  # refused where argparse parses them
        main(["simulate", *argv, "--out", str(tmp_path / "x.png")])
    assert exc.value.code == 2
    assert f"nanotron-ext simulate: error: argument {argv[0]}: {argv[1]!r} is not a" in capsys.readouterr().err


def test_a_missing_config_exits_2(tmp_path, capsys):
    assert main(["simulate", "missing.yaml", "--out", str(tmp_path / "x.png")]) == 2
    assert "nanotron-ext: error:" in capsys.readouterr().err


def test_too_few_micro_batches_for_1f1b_exit_2(tmp_path, capsys):
    raw = yaml.safe_load(bundled_config().read_text())
    raw["model"]["model_config"]["num_hidden_layers"] = 8
    raw["parallelism"]["pp"] = 6
    raw["tokens"]["batch_accumulation_per_replica"] = 2
    path = tmp_path / "few.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["simulate", str(path), "--out", str(tmp_path / "x.png")]) == 2
    assert "1F1B needs at least pp - 1 = 5 micro-batches, got 2" in capsys.readouterr().err


# --- measured times (--times profiled) ---------------------------------------------------------------


def _measured(times: list[tuple[float, float, float]]) -> tuple[BlockCost, ...]:
    grads = trainable_before(HAND)
    return tuple(BlockCost(block_signature(b, input_grad=g), *t) for b, g, t in zip(HAND, grads, times))


def test_measured_blocks_sum_each_stage_and_keep_p2p():
    measured = _measured([(1.0, 2.0, 0.5), (3.0, 0.0, 0.0), (4.0, 5.0, 0.25), (6.0, 1.0, 0.0)])
    stages, p2p, _ = plan_stage_times(_plan(HAND, [0, 0, 1, 1]), HAND, CFG, machine=_machine(1e12, BW, measured))
    assert stages == [StageTimes(4.0, 2.0, 0.5), StageTimes(10.0, 6.0, 0.25)]
    assert p2p == [2.0]  # B's logits at BW, as in the FLOP-rate model
    # A block the profile did not measure falls back to the FLOP rate: C (forward 2, backward 8 units).
    stages, _, _ = plan_stage_times(
        _plan(HAND, [0, 0, 1, 1]), HAND, CFG, machine=_machine(1e12, BW, measured[:2] + measured[3:])
    )
    assert stages[1] == StageTimes(8.0, 9.0, 0.0)


def test_simulate_with_profiled_times_measures_blocks_and_adds_the_update(tmp_path, capsys):
    raw = yaml.safe_load(bundled_config().read_text())
    raw["nanotron_ext"] = {"profile_cache": str(tmp_path / "cache")}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    argv = ["simulate", str(path), "--times", "profiled", "--json", "--out", str(tmp_path / "t.png")]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert "6 measured blocks" in data["machine"] and "blocks measured here" in data["machine"]
    sim = data["simulation"]
    # Both stages hold weights, so both have an optimizer step; the step is the pipeline plus the larger one.
    assert all(s["forward"] > 0 and s["backward"] > 0 and s["update"] > 0 for s in sim["stages"])
    assert sim["step_time"] == pytest.approx(sim["pipeline_time"] + max(s["update"] for s in sim["stages"]))
    assert any(op["kind"] == "U" for op in sim["ops"])
    assert len(list((tmp_path / "cache").glob("*.json"))) == 6  # 7 blocks, the two decoder layers share a key
    assert _png(tmp_path / "t.png")


def test_tflops_with_profiled_times_is_a_usage_error(tmp_path, capsys):
    argv = ["simulate", "--times", "profiled", "--tflops", "100", "--out", str(tmp_path / "x.png")]
    assert main(argv) == 2
    assert "times=profiled measures block times; tflops would replace them" in capsys.readouterr().err


def test_the_summary_lines_print_the_simulations_own_step_and_bubbles(tmp_path, capsys):
    # The simulator's one-line summary and simulate's bubble line, read back against the same run's --json: the
    # whole step's bubble, the pipeline part's and the ideal are three figures, and each line must print each one.
    argv = [
        "simulate",
        str(bundled_config("smollm_135m.yaml")),
        "--pp",
        "4",
        "--micro-batches",
        "8",
        "--out",
        str(tmp_path / "t.png"),
    ]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    sim, ideal = out["simulation"], out["ideal_bubble_fraction"]
    pct = {
        name: f"{100 * value:.1f}"
        for name, value in (
            ("bubble", sim["bubble_fraction"]),
            ("pipeline", sim["pipeline_bubble_fraction"]),
            ("ideal", ideal),
        )
    }
    assert len(set(pct.values())) == 3, pct  # three figures apart at the printed precision, or a swap hides
    assert sim["step_time"] > sim["pipeline_time"]  # the update shows: the line names the pipeline part
    assert main(argv) == 0
    text = capsys.readouterr().out
    head = re.search(
        r"^1f1b: pp=4, micro-batches=8, p2p [^,]+, step (\S+ \S+) \(pipeline (\S+ \S+) \+ update\), "
        r"bubble ([\d.]+)% \(pipeline bubble ([\d.]+)%, ideal ([\d.]+)%\)$",
        text,
        re.M,
    )
    assert head, text
    assert head.groups() == (
        format_seconds(sim["step_time"]),
        format_seconds(sim["pipeline_time"]),
        pct["bubble"],
        pct["pipeline"],
        pct["ideal"],
    )
    line = re.search(
        r"^pipeline bubble ([\d.]+)% vs ideal \(p-1\)/\(m\+p-1\) = ([\d.]+)% \(([+-][\d.]+) points\); "
        r"with the update, bubble ([\d.]+)%; step (.+)$",
        text,
        re.M,
    )
    assert line, text
    points = f"{100 * (sim['pipeline_bubble_fraction'] - ideal):+.1f}"
    assert line.groups() == (pct["pipeline"], pct["ideal"], points, pct["bubble"], format_seconds(sim["step_time"]))


def test_the_simulators_own_summary_names_the_steps_bubble_and_the_pipeline_parts_apart():
    # str(SimResult), what a script that prints a simulation reads: the same three figures as simulate's lines.
    from nanotron_ext.inventory import inventory_from_config
    from nanotron_ext.plan import make_plan
    from nanotron_ext.schedule.simulator import ideal_bubble_fraction

    cfg = load_config(bundled_config("smollm_135m.yaml"), pp=4).with_overrides(n_micro_batches=8)
    blocks = inventory_from_config(cfg)
    result = simulate_plan(make_plan(blocks, cfg), blocks, cfg)
    figures = (result.bubble_fraction, result.pipeline_bubble_fraction, ideal_bubble_fraction(4, 8))
    assert len({f"{x:.1%}" for x in figures}) == 3 and result.step_time > result.pipeline_time
    assert (
        f", bubble={figures[0]:.1%} (pipeline part {figures[1]:.1%}, ideal {figures[2]:.1%})"
        in str(result).splitlines()[0]
    )


@pytest.mark.parametrize("engine", ["1f1b", "zbv"])
def test_bubble_is_the_steps_and_pipeline_bubble_the_pipeline_parts_in_every_output(
    engine, tmp_path, capsys, monkeypatch
):
    """docs/simulator.md: "bubble" is always the whole step's idle share, "pipeline bubble" always the pipeline
    part's; plan, simulate, the V's lines, the picture's title and --json keep to it."""
    from nanotron_ext.simulate import timeline

    titles: list[str] = []

    def draw(result, path, **kwargs):
        titles.append(timeline.timeline_figure(result, **kwargs).axes[0].title.get_text())
        return Path(path)

    monkeypatch.setattr(timeline, "plot_timeline", draw)
    picture = ["--engine", engine, "--out", str(tmp_path / "t.png")]
    assert main(["simulate", *picture, "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)["simulation"]
    assert sim["step_time"] > sim["pipeline_time"]  # an update follows: the two figures differ
    assert main(["simulate", *picture]) == 0
    text = capsys.readouterr().out
    assert main(["plan", "--engine", engine]) == 0
    text += capsys.readouterr().out + "\n".join(titles)
    figures = re.findall(r"(pipeline bubble|bubble)[ =]([\d.]+)%", text)
    assert {name for name, _ in figures} == {"bubble", "pipeline bubble"}, figures
    for name, value in figures:
        share = sim["pipeline_bubble_fraction"] if name == "pipeline bubble" else sim["bubble_fraction"]
        assert value == f"{100 * share:.1f}", (name, value, text)
    assert main(["plan", "--engine", engine, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["bubble_fraction"] == pytest.approx(sim["bubble_fraction"], abs=1e-12)


def test_simulate_prints_every_time_as_plan_does(tmp_path, capsys):
    # µs, ms or s by size, three significant digits: never 3.331e-06 or 0.0003057 (of ms).
    for engine in ("1f1b", "zb1p", "zbv"):
        compare = ["--compare", "--loads-out", str(tmp_path / "l.png")] if engine != "zbv" else []
        assert main(["simulate", "--engine", engine, *compare, "--out", str(tmp_path / "t.png")]) == 0
        text = capsys.readouterr().out
        assert not re.search(r"\d[eE][-+]\d", text), text
        assert not re.search(r"ms/mb|ms/step|step ms|busy ms|idle ms|F\+B ms", text, re.M), text  # no unit in a header
        times = re.findall(r"(\d+(?:\.\d+)?) (ns|µs|ms|s)\b", text)
        scale = {"ns": 1e-9, "µs": 1e-6, "ms": 1e-3, "s": 1.0}
        assert len(times) >= 8 and all(format_seconds(float(v) * scale[u]) == f"{v} {u}" for v, u in times), times
