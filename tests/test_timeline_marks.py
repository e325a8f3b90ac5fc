"""What the timeline draws, as data (nanotron_ext.simulate.timeline_marks): transfers, a V's chunks, floors, the
numbering rule, and the share a row waits on transfers."""

from __future__ import annotations

import itertools

import pytest

from nanotron_ext.config import bundled_config, load_config
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.plan.v_plan import make_v_plan, v_plan_timeline
from nanotron_ext.report import percent
from nanotron_ext.simulate import StageTimes, simulate
from nanotron_ext.simulate.timeline_marks import (
    MIN_WIDTH,
    Box,
    Hop,
    boxes,
    hops,
    numbered_kinds,
    row_note,
    transfer_wait,
    v_chunks,
)


def test_the_transfers_of_a_hand_worked_1f1b_step():
    # pp=2, m=2, F=B=1 s, p2p 0.25 s (tests/test_simulate.py works the schedule out). Stage 1 receives act0 as soon
    # as F0 ends; act1 once it has posted that receive after B0 (3.25); stage 0 gets grad0 once stage 1 sends it,
    # at its next receive (3.5), and grad1 after stage 1's B1 (5.5).
    result = simulate([StageTimes(1.0, 1.0)] * 2, 2, "1f1b", 0.25)
    assert hops(result, boxes(result)) == [
        Hop(0, "gradient", 0, 0, 3.5, 3.75),
        Hop(0, "gradient", 1, 0, 5.5, 5.75),
        Hop(1, "activation", 0, 0, 1.0, 1.25),
        Hop(1, "activation", 1, 0, 3.25, 3.5),
    ]
    # A cut behind a frozen prefix carries no gradient: its transfers are left out.
    assert [h.what for h in hops(result, boxes(result), grad_cuts=[False])] == ["activation"] * 2


@pytest.mark.parametrize("engine", ["afab", "1f1b", "zb1p", "zb2p"])
def test_every_transfer_is_made_before_it_leaves_and_its_rank_waits_through_it(engine):
    # A rendezvous: the sender's op has ended, and the receiver computes nothing while it is in flight. Cuts of
    # different p2p times catch a transfer priced by the wrong cut.
    stages = [StageTimes(1.0, 2.0, weight=0.5), StageTimes(0.5, 1.0, weight=0.25), StageTimes(2.0, 3.0, weight=1.0)]
    result = simulate(stages, 5, engine, [0.3, 0.7])
    drawn = boxes(result)
    transfers = hops(result, drawn)
    assert len(transfers) == 2 * 5 * 2  # each micro-batch's activation and gradient over each of the two cuts
    end = {(b.row, b.kind, b.micro_batch): b.end for b in drawn}
    for h in transfers:
        sender = h.row - 1 if h.what == "activation" else h.row + 1
        assert h.start >= end[(sender, "F" if h.what == "activation" else "B", h.micro_batch)] - 1e-12
        assert h.end - h.start == pytest.approx([0.3, 0.7][h.cut])
        assert not any(b.start < h.end - 1e-12 and h.start + 1e-12 < b.end for b in drawn if b.row == h.row)


def _tiny_v():
    cfg = load_config(bundled_config()).with_overrides(engine="zbv")
    blocks = inventory_from_config(cfg)
    plan = make_v_plan(blocks, cfg)
    return plan, v_plan_timeline(plan, blocks, cfg)


def test_a_vs_ops_get_their_chunks_and_its_transfers_arrive_when_the_replay_says():
    plan, result = _tiny_v()
    drawn = boxes(result, v_chunks(result, plan.order))
    pp, m = plan.pp, plan.n_micro_batches
    for rank in range(pp):
        ours = [b for b in drawn if b.row == rank and b.kind != "U"]
        assert sorted((b.kind, b.micro_batch, b.chunk) for b in ours) == sorted(
            (k, j, c) for k in "FBW" for j in range(m) for c in (rank, 2 * pp - 1 - rank)
        )
        assert all(b.second == (b.chunk >= pp) for b in ours)
        # In time, the rank's ops are its order's (ops of no length at one moment aside).
        timed = [(b.kind, b.micro_batch, b.chunk) for b in ours if b.end > b.start]
        ordered = [tuple(op) for op in plan.order[rank]]
        assert timed == [op for op in ordered if op in timed]
    transfers = hops(result, drawn)
    assert len(transfers) == 4 * (pp - 1) * m  # F and B across every cut but the V's bottom
    by_op = {(b.kind, b.micro_batch, b.chunk): b for b in drawn}
    for h in transfers:
        taker = next(
            b
            for b in drawn
            if b.row == h.row
            and b.kind == ("F" if h.what == "activation" else "B")
            and b.micro_batch == h.micro_batch
            and b.chunk in (h.cut, h.cut + 1)
        )
        before = [b.end for b in drawn if b.row == h.row and b.end <= taker.start and b is not taker]
        # The replay starts an op once its rank is free and its input is there: no earlier, no later.
        assert taker.start == pytest.approx(max([h.end, *before]), abs=1e-15)
        maker_chunk = h.cut if taker.chunk == h.cut + 1 else h.cut + 1
        assert h.start == by_op[(taker.kind, h.micro_batch, maker_chunk)].end


def test_v_chunks_refuses_an_order_that_is_not_the_steps():
    plan, result = _tiny_v()
    with pytest.raises(ValueError, match="rank 0's order holds .*, whose chunk is not on it"):
        v_chunks(result, [plan.order[1], plan.order[0]])
    with pytest.raises(ValueError, match="is not in the V's order"):
        v_chunks(result, [plan.order[0][:-1], plan.order[1]])


def test_a_stage_whose_work_is_a_sliver_of_the_step_is_drawn_at_the_floor_and_its_times_printed():
    result = simulate([StageTimes(1e-9, 2e-9), StageTimes(1.0, 2.0)], 4, "1f1b", 0.5)
    drawn = boxes(result)
    small = [b for b in drawn if b.row == 0]
    assert all(b.floored and b.width == pytest.approx(MIN_WIDTH * result.step_time) for b in small)
    assert not any(b.floored for b in drawn if b.row == 1)
    assert row_note(0, drawn) == "F 1 ns, B 2 ns" and row_note(1, drawn) is None


def test_the_numbering_rule_is_one_for_every_row():
    # Kind F: every box 30 px at 10 px/s; kind B: one box of 10 px on another row. Labels need 20 px.
    drawn = [
        Box(0, "F", 0, 0.0, 3.0, 3.0),
        Box(1, "F", 1, 0.0, 3.0, 3.0),
        Box(0, "B", 0, 3.0, 9.0, 6.0),
        Box(1, "B", 1, 3.0, 4.0, 1.0),
    ]
    assert numbered_kinds(drawn, 10.0, 20.0) == frozenset({"F"})
    assert numbered_kinds(drawn, 10.0, 10.0) == frozenset({"F", "B"})
    assert numbered_kinds(drawn, 10.0, 31.0) == frozenset()


def test_transfer_wait_counts_only_what_no_op_covers():
    drawn = [Box(0, "F", 0, 0.0, 1.0, 1.0), Box(0, "F", 1, 2.0, 3.0, 1.0)]
    transfers = [Hop(0, "activation", 0, 0, 0.5, 2.5), Hop(0, "activation", 1, 0, 1.5, 1.8)]
    assert transfer_wait(0, drawn, transfers) == pytest.approx(1.0)  # 1.0 to 2.0 only
    assert transfer_wait(1, drawn, transfers) == 0.0


@pytest.mark.parametrize(
    ("fraction", "text"),
    [(0.998, "99.8%"), (0.0004, "0.04%"), (1.0, "100%"), (0.0, "0%"), (0.913, "91%"), (0.99999, "99.999%")],
)
def test_a_share_that_is_not_whole_never_prints_as_0_or_100_percent(fraction, text):
    assert percent(fraction) == text


def test_boxes_take_one_chunk_per_op():
    result = simulate([StageTimes(1.0, 1.0)] * 2, 2, "1f1b")
    with pytest.raises(ValueError, match="3 chunks for 8 ops"):
        boxes(result, [0, 1, 2])
    assert all(b.chunk is None and not b.second for b in boxes(result))
    assert [b.gid for b in itertools.islice(boxes(result), 2)] == ["F0@0", "F1@0"]
