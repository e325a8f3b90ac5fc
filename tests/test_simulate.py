"""Tests for the pipeline-schedule simulator (nanotron_ext.simulate)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanotron_ext.simulate import (
    Op,
    StageTimes,
    engine_order,
    engine_program,
    ideal_bubble_fraction,
    simulate,
)

ENGINES = ("afab", "1f1b")


def _ops(result):
    return [(o.stage, o.kind, o.micro_batch, o.start, o.end) for o in result.ops]


# --- equal stages: closed form -------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    ("pp", "m", "f", "b"),
    [(1, 1, 1.0, 2.0), (1, 5, 0.3, 0.7), (2, 1, 1.0, 1.0), (2, 4, 1.0, 2.0), (4, 3, 0.01, 0.02),
     (4, 8, 0.0123, 0.0456), (8, 32, 1e-3, 2.5e-3), (3, 7, 2.0, 0.0)],
)  # fmt: skip
def test_equal_stages_match_closed_form(engine, pp, m, f, b):
    r = simulate([StageTimes(f, b)] * pp, m, engine)
    assert math.isclose(r.step_time, (m + pp - 1) * (f + b), rel_tol=1e-12)
    assert math.isclose(r.bubble_fraction, (pp - 1) / (m + pp - 1), rel_tol=1e-12, abs_tol=1e-15)
    assert math.isclose(r.bubble_fraction, ideal_bubble_fraction(pp, m), rel_tol=1e-12, abs_tol=1e-15)
    for s in range(pp):
        assert math.isclose(r.busy[s], m * (f + b), rel_tol=1e-12)
        assert math.isclose(r.idle[s], (pp - 1) * (f + b), rel_tol=1e-12, abs_tol=1e-15)


def test_ideal_bubble_fraction_values():
    assert ideal_bubble_fraction(4, 8) == 3 / 11
    assert ideal_bubble_fraction(2, 2) == 1 / 3
    assert ideal_bubble_fraction(1, 5) == 0.0
    with pytest.raises(ValueError, match="pp=0"):
        ideal_bubble_fraction(0, 4)


# --- Nanotron's per-rank order -------------------------------------------------------------------


def test_afab_order_is_all_forwards_then_all_backwards():
    assert engine_order("afab", 3, 1, 3) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]


def test_1f1b_order_matches_nanotron_warmup_steady_cooldown():
    # pp=4, rank 1: warm-up range(pp - rank - 1) = 2 forwards, then F/B pairs, then 2 cool-down backwards.
    assert engine_order("1f1b", 4, 1, 6) == [
        ("F", 0), ("F", 1),
        ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("F", 4), ("B", 2), ("F", 5), ("B", 3),
        ("B", 4), ("B", 5),
    ]  # fmt: skip
    # Last rank: no warm-up, strict alternation.
    assert engine_order("1f1b", 4, 3, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    # m == pp - 1: rank 0's warm-up eats every micro-batch, so it has no steady phase at all.
    assert engine_order("1f1b", 4, 0, 3) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]


def test_engine_order_rejects_stage_outside_pipeline():
    with pytest.raises(ValueError, match="stage 4 is outside 0..3"):
        engine_order("1f1b", 4, 4, 8)


def test_1f1b_rejects_fewer_than_pp_minus_1_micro_batches_like_nanotron():
    with pytest.raises(ValueError, match=r"at least pp - 1 = 3 micro-batches, got 2.*afab"):
        simulate([StageTimes(1, 1)] * 4, 2, "1f1b")
    # AFAB has no such assertion in Nanotron.
    assert simulate([StageTimes(1, 1)] * 4, 2, "afab").step_time == 10.0


def test_1f1b_with_m_equal_pp_minus_1_runs():
    r = simulate([StageTimes(1.0, 1.0)] * 3, 2, "1f1b")
    assert r.step_time == 8.0  # (m + pp - 1) * (f + b)
    assert r.peak_in_flight == [2, 2, 1]


# --- micro-batches in flight ---------------------------------------------------------------------


@pytest.mark.parametrize(("pp", "m"), [(2, 1), (2, 2), (4, 3), (4, 4), (4, 9), (8, 16)])
def test_peak_in_flight_afab_vs_1f1b(pp, m):
    stages = [StageTimes(1.0 + 0.1 * s, 2.0 - 0.1 * s) for s in range(pp)]
    assert simulate(stages, m, "afab").peak_in_flight == [m] * pp
    assert simulate(stages, m, "1f1b").peak_in_flight == [min(m, pp - s) for s in range(pp)]


# --- hand-computed unequal case ------------------------------------------------------------------

TWO_STAGES = [StageTimes(forward=1.0, backward=2.0), StageTimes(forward=3.0, backward=1.0)]


def test_two_unequal_stages_afab_op_by_op():
    r = simulate(TWO_STAGES, 2, "afab")
    assert _ops(r) == [
        (0, "F", 0, 0.0, 1.0),
        (0, "F", 1, 1.0, 2.0),
        (0, "B", 0, 8.0, 10.0),  # waits for stage 1's B0 (ends at 8)
        (0, "B", 1, 10.0, 12.0),
        (1, "F", 0, 1.0, 4.0),
        (1, "F", 1, 4.0, 7.0),
        (1, "B", 0, 7.0, 8.0),
        (1, "B", 1, 8.0, 9.0),
    ]
    assert r.step_time == 12.0
    assert r.busy == [6.0, 8.0]
    assert r.idle == [6.0, 4.0]
    assert r.bubble_fraction == 10.0 / 24.0
    assert r.peak_in_flight == [2, 2]


def test_two_unequal_stages_1f1b_op_by_op():
    r = simulate(TWO_STAGES, 2, "1f1b")
    assert _ops(r) == [
        (0, "F", 0, 0.0, 1.0),
        (0, "F", 1, 1.0, 2.0),  # rank 0 warm-up is pp - 0 - 1 = 1, then F1 of the steady pair
        (0, "B", 0, 5.0, 7.0),
        (0, "B", 1, 9.0, 11.0),
        (1, "F", 0, 1.0, 4.0),
        (1, "B", 0, 4.0, 5.0),  # last rank backs off straight after each forward
        (1, "F", 1, 5.0, 8.0),
        (1, "B", 1, 8.0, 9.0),
    ]
    assert r.step_time == 11.0
    assert r.idle == [5.0, 3.0]
    assert r.bubble_fraction == 8.0 / 22.0
    assert r.peak_in_flight == [2, 1]


# --- p2p -----------------------------------------------------------------------------------------


def test_p2p_delays_each_hop_single_micro_batch():
    stages = [StageTimes(1.0, 1.0)] * 2
    assert simulate(stages, 1, "1f1b").step_time == 4.0
    r = simulate(stages, 1, "1f1b", p2p_time=0.5)
    assert _ops(r) == [
        (0, "F", 0, 0.0, 1.0),
        (0, "B", 0, 4.0, 5.0),
        (1, "F", 0, 1.5, 2.5),
        (1, "B", 0, 2.5, 3.5),
    ]
    assert r.step_time == 5.0  # one activation hop + one gradient hop


def test_p2p_1f1b_defers_the_gradient_send_until_the_next_activation_arrives():
    # pp=2, m=2, F=B=1, p2p=0.25. Stage 1 finishes B0 at 3.25 but, as Nanotron's run_communication does,
    # sends gradient 0 only after receiving activation 1: that receive is posted at 3.25 (rendezvous) and
    # ends at 3.5, so gradient 0 reaches stage 0 at 3.75, not 3.5.
    r = simulate([StageTimes(1.0, 1.0)] * 2, 2, "1f1b", p2p_time=0.25)
    assert _ops(r) == [
        (0, "F", 0, 0.0, 1.0),
        (0, "F", 1, 1.0, 2.0),
        (0, "B", 0, 3.75, 4.75),
        (0, "B", 1, 5.75, 6.75),  # gradient 1 is sent in the cool-down, at 5.5, received from 5.5
        (1, "F", 0, 1.25, 2.25),
        (1, "B", 0, 2.25, 3.25),
        (1, "F", 1, 3.5, 4.5),
        (1, "B", 1, 4.5, 5.5),
    ]
    assert r.step_time == 6.75
    assert simulate([StageTimes(1.0, 1.0)] * 2, 2, "1f1b").step_time == 6.0


def test_p2p_is_a_rendezvous_a_late_receive_pays_the_whole_transfer():
    # AFAB, same pipeline: activation 1 is sent at 2.0, but stage 1 posts its receive only at 2.25 (after F0),
    # so the transfer runs 2.25-2.5. Likewise gradient 1 (sent 5.5, receive posted 5.75): 5.75-6.0.
    r = simulate([StageTimes(1.0, 1.0)] * 2, 2, "afab", p2p_time=0.25)
    assert _ops(r) == [
        (0, "F", 0, 0.0, 1.0),
        (0, "F", 1, 1.0, 2.0),
        (0, "B", 0, 4.75, 5.75),
        (0, "B", 1, 6.0, 7.0),
        (1, "F", 0, 1.25, 2.25),
        (1, "F", 1, 2.5, 3.5),
        (1, "B", 0, 3.5, 4.5),
        (1, "B", 1, 4.5, 5.5),
    ]
    assert r.step_time == 7.0


def test_engine_program_pp2_1f1b_both_ranks():
    assert engine_program("1f1b", 2, 0, 3) == [
        ("F", 0), ("send_act", 0),  # warm-up forward: sent at once
        ("F", 1), ("send_act", 1), ("recv_grad", 0), ("B", 0),  # queued send runs when B0 asks for its gradient
        ("F", 2), ("send_act", 2), ("recv_grad", 1), ("B", 1),
        ("recv_grad", 2), ("B", 2),
    ]  # fmt: skip
    assert engine_program("1f1b", 2, 1, 3) == [
        ("recv_act", 0), ("F", 0), ("B", 0),
        ("recv_act", 1), ("send_grad", 0), ("F", 1), ("B", 1),  # gradient 0 leaves after activation 1 arrives
        ("recv_act", 2), ("send_grad", 1), ("F", 2), ("B", 2),
        ("send_grad", 2),
    ]  # fmt: skip


def test_engine_program_middle_stage_afab():
    assert engine_program("afab", 3, 1, 2) == [
        ("recv_act", 0), ("F", 0), ("send_act", 0),
        ("recv_act", 1), ("F", 1), ("send_act", 1),
        ("recv_grad", 0), ("B", 0), ("send_grad", 0),
        ("recv_grad", 1), ("B", 1), ("send_grad", 1),
    ]  # fmt: skip


def test_p2p_on_critical_path_of_four_stages():
    # One micro-batch crosses 3 links forward and 3 back: 4 * (1 + 1) + 6 * 0.1.
    r = simulate([StageTimes(1.0, 1.0)] * 4, 1, "afab", p2p_time=0.1)
    assert math.isclose(r.step_time, 8.6, rel_tol=1e-12)


# --- update (gradient sync + optimizer) after the pipeline -------------------------------------------


def test_update_starts_when_the_last_stage_is_done_and_the_slowest_sets_the_step():
    # Pipeline as in test_p2p_1f1b_defers...: ends at 6.75 (stage 0's B1). Stage 1 finished at 5.5 but
    # starts its update with stage 0, at 6.75.
    stages = [StageTimes(1.0, 1.0, update=0.5), StageTimes(1.0, 1.0, update=2.0)]
    r = simulate(stages, 2, "1f1b", p2p_time=0.25)
    assert r.pipeline_time == 6.75
    assert r.step_time == 8.75
    updates = [(o.stage, o.start, o.end) for o in r.ops if o.kind == "U"]
    assert updates == [(0, 6.75, 7.25), (1, 6.75, 8.75)]
    assert r.busy == [4.5, 6.0]
    assert r.idle == [4.25, 2.75]
    assert r.bubble_fraction == 7.0 / 17.5
    assert r.pipeline_bubble_fraction == 5.5 / 13.5  # each stage idles 2.75 of the 6.75-s pipeline
    assert r.peak_in_flight == [2, 1]  # updates hold no micro-batch
    assert "pipeline 6.750 ms + update" in str(simulate([StageTimes(1e-3, 1e-3, 0.5e-3)] * 2, 2, "1f1b", 0.25e-3))


def test_update_leaves_the_pipeline_alone():
    stages = [StageTimes(1.0, 2.0), StageTimes(2.0, 1.0)]
    plain = simulate(stages, 3, "afab", 0.1)
    assert plain.step_time == plain.pipeline_time
    assert plain.bubble_fraction == plain.pipeline_bubble_fraction
    assert all(op.kind != "U" for op in plain.ops)
    updated = simulate([StageTimes(st.forward, st.backward, 0.5 + s) for s, st in enumerate(stages)], 3, "afab", 0.1)
    assert [op for op in updated.ops if op.kind != "U"] == plain.ops
    assert updated.pipeline_time == plain.pipeline_time
    assert updated.step_time == pytest.approx(plain.step_time + 1.5)
    assert updated.pipeline_bubble_fraction == plain.pipeline_bubble_fraction


# --- cuts that carry no gradient (frozen prefix) ------------------------------------------------------


@pytest.mark.parametrize(("pp", "m"), [(0, 4), (2, 0)])
def test_engine_program_rejects_empty_pipelines(pp, m):
    with pytest.raises(ValueError, match=f"pp = {pp} and n_micro_batches = {m}; both must be at least 1"):
        engine_program("afab", pp, 0, m)


def test_engine_program_without_gradient_across_the_cut():
    # Stage 0 is frozen: its activation needs no gradient, so stage 0 never waits for one (its backward only
    # sends the queued activation, as Nanotron's SendTensorWithoutGradientToPipelineBuffer does) and stage 1
    # never sends one (run_communication returns right after receiving an activation without grad).
    assert engine_program("1f1b", 2, 0, 3, grad_out=False) == [
        ("F", 0), ("send_act", 0),
        ("F", 1), ("send_act", 1), ("B", 0),
        ("F", 2), ("send_act", 2), ("B", 1),
        ("B", 2),
    ]  # fmt: skip
    assert engine_program("1f1b", 2, 1, 3, grad_in=False) == [
        ("recv_act", 0), ("F", 0), ("B", 0),
        ("recv_act", 1), ("F", 1), ("B", 1),
        ("recv_act", 2), ("F", 2), ("B", 2),
    ]  # fmt: skip


def test_frozen_prefix_stage_does_not_wait_for_gradients():
    # pp=2, m=2, F=B=1, p2p=0.25, no gradient across the cut. Stage 0: F0 [0,1] F1 [1,2] B0 [2,3] B1 [3,4].
    # Stage 1: activation 0 arrives at 1.25: F0 [1.25,2.25] B0 [2.25,3.25]; activation 1 (sent at 2) is
    # received from 3.25: F1 [3.5,4.5] B1 [4.5,5.5].
    r = simulate([StageTimes(1.0, 1.0)] * 2, 2, "1f1b", p2p_time=0.25, grad_cuts=[False])
    assert _ops(r) == [
        (0, "F", 0, 0.0, 1.0),
        (0, "F", 1, 1.0, 2.0),
        (0, "B", 0, 2.0, 3.0),
        (0, "B", 1, 3.0, 4.0),
        (1, "F", 0, 1.25, 2.25),
        (1, "B", 0, 2.25, 3.25),
        (1, "F", 1, 3.5, 4.5),
        (1, "B", 1, 4.5, 5.5),
    ]
    assert r.step_time == 5.5
    assert simulate([StageTimes(1.0, 1.0)] * 2, 2, "1f1b", 0.25, grad_cuts=[True]).step_time == 6.75
    with pytest.raises(ValueError, match="grad_cuts has 2 entries for 2 stages"):
        simulate([StageTimes(1.0, 1.0)] * 2, 2, "1f1b", grad_cuts=[True, False])


# --- input validation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stages", "m", "engine", "p2p", "match"),
    [
        ([], 4, "1f1b", 0.0, "stages is empty"),
        ([StageTimes(-1.0, 1.0)], 4, "1f1b", 0.0, r"stages\[0\]\.forward = -1\.0.*non-negative"),
        ([StageTimes(1.0, 1.0), StageTimes(1.0, math.nan)], 4, "1f1b", 0.0, r"stages\[1\]\.backward = nan"),
        ([StageTimes(1.0, float("inf"))], 4, "afab", 0.0, r"stages\[0\]\.backward = inf.*finite"),
        ([StageTimes(1.0, 1.0, -0.5)], 4, "afab", 0.0, r"stages\[0\]\.update = -0\.5.*non-negative"),
        ([(1.0, 1.0)], 4, "afab", 0.0, r"stages\[0\] is \(1\.0, 1\.0\).*StageTimes"),
        ([StageTimes(1.0, 1.0)], 0, "afab", 0.0, r"n_micro_batches = 0.*integer >= 1"),
        ([StageTimes(1.0, 1.0)], 2.5, "afab", 0.0, r"n_micro_batches = 2\.5"),
        ([StageTimes(1.0, 1.0)], True, "afab", 0.0, r"n_micro_batches = True"),
        ([StageTimes(1.0, 1.0)], 4, "gpipe", 0.0, r"unknown engine 'gpipe'.*'1f1b', 'afab'"),
        ([StageTimes(1.0, 1.0)], 4, "1F1B", 0.0, r"unknown engine '1F1B'"),
        ([StageTimes(1.0, 1.0)], 4, "afab", -0.1, r"p2p_time = -0\.1.*non-negative"),
        ([StageTimes(1.0, 1.0)], 4, "afab", float("nan"), r"p2p_time = nan"),
    ],
)
def test_bad_input_raises_value_error_naming_value_and_fix(stages, m, engine, p2p, match):
    with pytest.raises(ValueError, match=match):
        simulate(stages, m, engine, p2p_time=p2p)


def test_zero_times_are_allowed_and_give_no_bubble():
    # A stage with nothing trainable before or in it has no backward at all.
    r = simulate([StageTimes(0.0, 0.0)] * 3, 4, "1f1b")
    assert r.step_time == 0.0
    assert r.bubble_fraction == 0.0


# --- result object -------------------------------------------------------------------------------


def test_to_dict_is_json_ready_and_complete():
    d = json.loads(json.dumps(simulate(TWO_STAGES, 2, "1f1b").to_dict()))
    assert d["engine"] == "1f1b"
    assert d["pp"] == 2
    assert d["n_micro_batches"] == 2
    assert d["step_time"] == 11.0
    assert d["peak_in_flight"] == [2, 1]
    assert d["ops"][2] == {"stage": 0, "kind": "B", "micro_batch": 0, "start": 5.0, "end": 7.0}
    assert d["stages"][1] == {"forward": 3.0, "backward": 1.0, "update": 0.0}
    assert d["pipeline_time"] == 11.0


def test_str_and_table_are_aligned():
    r = simulate(TWO_STAGES, 2, "1f1b")
    text = str(r)
    assert text.splitlines()[0] == (
        "1f1b: pp=2, micro-batches=2, p2p=0.000 ms, step=11000.000 ms, bubble=36.4% (ideal 33.3%)"
    )
    table = r.table().splitlines()
    assert table[0].split() == ["stage", "busy", "ms", "idle", "ms", "idle", "%", "peak", "in", "flight"]
    assert table[2].split() == ["0", "6000.000", "5000.000", "45.5%", "2"]
    assert table[3].split() == ["1", "8000.000", "3000.000", "27.3%", "1"]
    assert len({len(line) for line in table}) == 1


# --- properties over random pipelines ------------------------------------------------------------

times = st.floats(min_value=0.0, max_value=10.0, allow_nan=False)


@st.composite
def pipelines(draw):
    pp = draw(st.integers(1, 6))
    stages = [StageTimes(draw(times), draw(times), draw(st.sampled_from([0.0, 0.0, 1.5]))) for _ in range(pp)]
    engine = draw(st.sampled_from(ENGINES))
    m = draw(st.integers(max(1, pp - 1) if engine == "1f1b" else 1, 12))
    return stages, m, engine, draw(st.floats(0.0, 2.0))


@settings(max_examples=200, deadline=None)
@given(pipelines())
def test_schedule_respects_engine_order_and_dependencies(case):
    stages, m, engine, p2p = case
    r = simulate(stages, m, engine, p2p_time=p2p)
    pp = len(stages)
    by_key: dict[tuple[str, int, int], Op] = {(o.kind, o.stage, o.micro_batch): o for o in r.ops if o.kind != "U"}
    assert len(by_key) == 2 * pp * m
    updates = [o for o in r.ops if o.kind == "U"]
    assert [(o.stage, o.start, o.duration) for o in updates] == [
        (s, r.pipeline_time, pytest.approx(stages[s].update)) for s in range(pp) if stages[s].update > 0
    ]
    assert r.step_time == pytest.approx(r.pipeline_time + max(st.update for st in stages))
    for s in range(pp):
        mine = [o for o in r.ops if o.stage == s]
        assert [(o.kind, o.micro_batch) for o in mine if o.kind != "U"] == engine_order(engine, pp, s, m)
        assert all(a.end <= b.start for a, b in zip(mine, mine[1:], strict=False))
        assert math.isclose(r.busy[s] + r.idle[s], r.step_time, rel_tol=1e-9, abs_tol=1e-9)
    for (kind, s, j), op in by_key.items():
        assert op.end - op.start == pytest.approx(stages[s].forward if kind == "F" else stages[s].backward)
        src = s - 1 if kind == "F" else s + 1
        if 0 <= src < pp:
            assert op.start >= by_key[(kind, src, j)].end + p2p
        if kind == "B":
            assert op.start >= by_key[("F", s, j)].end
    assert r.step_time == max(o.end for o in r.ops)
    assert 0.0 <= r.bubble_fraction <= 1.0  # 1.0 when all stages are zero-time and only p2p takes time
    assert 0.0 <= r.pipeline_bubble_fraction <= 1.0
    assert all(idle >= -1e-9 for idle in r.idle)


@settings(max_examples=100, deadline=None)
@given(pipelines(), st.floats(0.0, 1.0))
def test_more_p2p_never_speeds_up_and_1f1b_never_holds_more(case, extra):
    stages, m, engine, p2p = case
    assert simulate(stages, m, engine, p2p + extra).step_time >= simulate(stages, m, engine, p2p).step_time
    if m >= len(stages) - 1:
        afab = simulate(stages, m, "afab", p2p).peak_in_flight
        ofob = simulate(stages, m, "1f1b", p2p).peak_in_flight
        assert all(o <= a for o, a in zip(ofob, afab, strict=True))
