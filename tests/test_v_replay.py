"""``replay_v_order`` (``nanotron_ext.schedule.v_replay``): the step of the V order the engine runs, under real
times."""

from __future__ import annotations

import pytest

from nanotron_ext.schedule.simulator import StageTimes
from nanotron_ext.schedule.v_replay import Transfer, replay_v_order, stuck_when_sends_wait, transfer_order
from nanotron_ext.schedule.zbv import VOp, VResult, _schedule, zbv_order

UNIT = StageTimes(1.0, 2.0, weight=1.0)


def _ops(text: str) -> list[VOp]:
    return [VOp(s[0], int(s[1:].split("@")[0]), int(s.split("@")[1])) for s in text.split()]


def test_a_two_rank_micro_batch_by_hand() -> None:
    """F 1, B 1 (of a backward of 2), W 1, every crossing 0.5; the cut at the V's bottom (stage 1 to 2) costs
    nothing."""
    order = [_ops("F0@0 F0@3 B0@3 W0@3 B0@0 W0@0"), _ops("F0@1 F0@2 B0@2 W0@2 B0@1 W0@1")]
    result = replay_v_order(order, [UNIT] * 4, 1, p2p_time=0.5)
    starts = {(o.kind, o.stage): o.start for o in result.ops}
    assert starts == {
        ("F", 0): 0.0,
        ("F", 1): 1.5,
        ("F", 2): 2.5,
        ("F", 3): 4.0,
        ("B", 3): 5.0,
        ("W", 3): 6.0,
        ("B", 2): 6.5,
        ("W", 2): 7.5,
        ("B", 1): 8.5,
        ("W", 1): 9.5,
        ("B", 0): 10.0,
        ("W", 0): 11.0,
    }
    assert result.pipeline_time == 12.0
    assert result.busy == (6.0, 6.0)


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_on_equal_times_the_engines_order_takes_what_its_list_schedule_took(pp: int, m: int) -> None:
    _, times = _schedule([UNIT] * (2 * pp), m, [0.0] * (2 * pp - 1), None)
    result = replay_v_order(zbv_order(pp, m), [UNIT] * (2 * pp), m)
    assert {(o.kind, o.micro_batch, o.stage): (o.start, o.end) for o in result.ops} == {
        tuple(op): span for op, span in times.items()
    }


def test_the_update_follows_the_pipeline_on_the_slower_rank() -> None:
    chunks = [StageTimes(1.0, 2.0, weight=1.0, update=u) for u in (0.5, 0.25, 0.25, 1.0)]
    result = replay_v_order(zbv_order(2, 2), chunks, 2)
    assert result.step_time == result.pipeline_time + 1.5  # rank 0 holds stages 0 and 3


def test_an_order_that_waits_forever_or_misses_an_op_is_refused() -> None:
    good = zbv_order(2, 1)
    stuck = [_ops("F0@3 F0@0 B0@3 W0@3 B0@0 W0@0"), good[1]]  # rank 0's up chunk before the down chunk feeds it
    with pytest.raises(ValueError, match=r"waits forever.*0: 'F0@3'"):
        replay_v_order(stuck, [UNIT] * 4, 1)
    with pytest.raises(ValueError, match="rank 1's order is not each F, B and W of its chunks 1 and 2 once"):
        replay_v_order([good[0], good[1][:-1]], [UNIT] * 4, 1)


def test_the_simulators_chosen_order_replays_to_its_own_step() -> None:
    """simulate_zbv keeps the order of the rule it chose; replayed (what the engine runs) it takes no longer."""
    from nanotron_ext.schedule.zbv import simulate_zbv

    chunks = [
        StageTimes(1.0, 3.0, weight=1.0),
        StageTimes(2.0, 4.0, weight=2.0),
        StageTimes(1.5, 3.0, weight=0.5),
        StageTimes(3.0, 6.0, weight=2.0),
    ]
    result = simulate_zbv(chunks, 4, 0.25)
    assert [len(ops) for ops in result.order] == [24, 24]
    assert replay_v_order(result.order, chunks, 4, 0.25).pipeline_time <= result.pipeline_time + 1e-12


def test_the_list_schedules_own_times_are_what_its_order_replays_to() -> None:
    """On random times, p2p and caps, under every rule: each op starts as soon as its rank and input allow, so the
    order replayed as the engine runs it takes exactly the scheduler's times (a rank that jumped past an arrival
    another rank, free at the same moment, was about to make would start its op late)."""
    import random

    from nanotron_ext.schedule.v_list import POLICIES, Stalled

    rng = random.Random(7)
    for _ in range(60):
        pp, m = rng.randint(2, 4), rng.randint(1, 6)
        chunks = [
            StageTimes(rng.uniform(0.1, 2.0), b, weight=b * rng.random())
            for b in (rng.uniform(0.3, 4.0) for _ in range(2 * pp))
        ]
        cuts = [rng.choice([0.0, rng.uniform(0.0, 1.0)]) for _ in range(2 * pp - 1)]
        cap = rng.choice([None, 2 * pp, 3])
        for policy in POLICIES:
            try:
                order, times = _schedule(chunks, m, cuts, cap, policy)
            except Stalled:
                continue
            replayed = replay_v_order(order, chunks, m, p2p_time=cuts)
            got = {(o.kind, o.micro_batch, o.stage): (o.start, o.end) for o in replayed.ops}
            for op, (start, end) in times.items():
                assert got[tuple(op)] == pytest.approx((start, end), abs=1e-9), (pp, m, cap, policy, op)


def test_the_transfers_order_two_ranks_two_micro_batches_by_hand() -> None:
    """Keys are the taker's start with every op one unit: F0@1 1; F1@1 and F0@3 3 (stage 1 first); B0@2 and F1@3 5
    (stage 2 first); B0@0 and B1@2 7 (stage 0 first); B1@0 9."""
    order = zbv_order(2, 2)
    assert [[str(op) for op in ops] for ops in order] == [
        "F0@0 F1@0 F0@3 B0@3 F1@3 B1@3 B0@0 W0@3 B1@0 W1@3 W0@0 W1@0".split(),
        "F0@1 F0@2 F1@1 F1@2 B0@2 B0@1 B1@2 B1@1 W0@2 W0@1 W1@2 W1@1".split(),
    ]
    assert [[str(t) for t in ts] for ts in transfer_order(order)] == [
        [
            "send F0@0 to rank 1",
            "send F1@0 to rank 1",
            "recv F0@3 from rank 1",
            "send B0@3 to rank 1",
            "recv F1@3 from rank 1",
            "recv B0@0 from rank 1",
            "send B1@3 to rank 1",
            "recv B1@0 from rank 1",
        ],
        [
            "recv F0@1 from rank 0",
            "recv F1@1 from rank 0",
            "send F0@2 to rank 0",
            "recv B0@2 from rank 0",
            "send F1@2 to rank 0",
            "send B0@1 to rank 0",
            "recv B1@2 from rank 0",
            "send B1@1 to rank 0",
        ],
    ]


def _as_made(order: list[list[VOp]]) -> list[list[Transfer]]:
    """Each rank's transfers as its ops make them: an op's receive before it, its send after it."""
    transfers = transfer_order(order)
    place = [{op: i for i, op in enumerate(ops)} for ops in order]
    return [sorted(ts, key=lambda t, r=r: (place[r][t.op], t.kind == "send")) for r, ts in enumerate(transfers)]


@pytest.mark.parametrize("pp", [2, 3, 4, 5, 6])
def test_where_sends_wait_the_transfers_order_never_deadlocks_and_posting_as_made_does(pp: int) -> None:
    import random

    from nanotron_ext.schedule.zbv import simulate_zbv

    rng = random.Random(pp)
    for m in range(1, 3 * pp + 1):
        orders = [zbv_order(pp, m)]
        chunks = [
            StageTimes(rng.uniform(0.5, 2.0), b, weight=b * rng.uniform(0.2, 0.6))
            for b in (rng.uniform(1.0, 4.0) for _ in range(2 * pp))
        ]
        orders.append([list(ops) for ops in simulate_zbv(chunks, m, rng.uniform(0.0, 0.5)).order])
        for order in orders:
            transfers = transfer_order(order)
            assert stuck_when_sends_wait(transfers) is None, (pp, m)
            for r, ts in enumerate(transfers):  # a rank's receives come in the order its ops take them
                takers = [t.op for t in ts if t.kind == "recv"]
                assert takers == [op for op in order[r] if op in takers], (pp, m, r)
        assert (stuck_when_sends_wait(_as_made(orders[0])) is None) == (m == 1), (pp, m)


def test_a_held_send_costs_the_time_it_waits_for_the_receive_before_it() -> None:
    """Rank 1 makes F1@2's activation at 5.1, but its order takes B0@3's gradient first: that arrives at 5.8 (B0@3
    ends at 5.7, the crossing takes 0.1), so F1@3 on rank 0 starts at 5.9, not 5.7."""
    order = zbv_order(2, 2)
    chunks = [StageTimes(1.0, 2.3, weight=0.8)] * 4
    free = {(o.kind, o.micro_batch, o.stage): o.start for o in replay_v_order(order, chunks, 2, 0.1).ops}
    held = {
        (o.kind, o.micro_batch, o.stage): o.start for o in replay_v_order(order, chunks, 2, 0.1, sends_wait=True).ops
    }
    assert (free[("F", 1, 2)], free[("B", 0, 2)], free[("F", 1, 3)]) == pytest.approx((4.1, 5.8, 5.7))
    assert (held[("F", 1, 2)], held[("B", 0, 2)], held[("F", 1, 3)]) == pytest.approx((4.1, 5.8, 5.9))

    def spans(result: VResult) -> dict:
        return {(o.kind, o.micro_batch, o.stage): (o.start, o.end) for o in result.ops}

    on_unit = replay_v_order(order, [UNIT] * 4, 2, sends_wait=True)
    assert spans(on_unit) == spans(replay_v_order(order, [UNIT] * 4, 2))  # the keys' own times: nothing held


def _random_v(rng, pp: int, m: int) -> tuple[list[StageTimes], float, list[list[VOp]]]:
    """Chunks of random times (W up to 0.6 of the backward), a random crossing, and the list schedule's order."""
    from nanotron_ext.schedule.zbv import simulate_zbv

    chunks = []
    for _ in range(2 * pp):
        backward = rng.uniform(1.0, 4.0)
        chunks.append(StageTimes(rng.uniform(0.5, 2.0), backward, weight=rng.uniform(0.0, 0.6 * backward)))
    p2p = rng.uniform(0.0, 0.5)
    return chunks, p2p, [list(ops) for ops in simulate_zbv(chunks, m, p2p).order]


def test_keyed_by_the_plans_own_times_the_held_sends_cost_a_fraction_of_the_unit_keys() -> None:
    """60 random Vs (pp 2-5, m 1-3 pp): keyed by the times the order was scheduled under, every order gets through
    where sends wait, no held step is longer than under unit keys, and holding costs under a tenth of what it costs
    under unit keys, on average (measured over 300: 0.32 % of the step against 6.86 %)."""
    import random

    rng = random.Random(0)
    unit_cost, plan_cost = [], []
    for _ in range(60):
        pp = rng.randint(2, 5)
        m = rng.randint(1, 3 * pp)
        chunks, p2p, order = _random_v(rng, pp, m)
        planned = transfer_order(order, chunks, p2p)
        assert stuck_when_sends_wait(planned) is None
        free = replay_v_order(order, chunks, m, p2p).step_time
        unit = replay_v_order(order, chunks, m, p2p, sends_wait=True).step_time
        plan = replay_v_order(order, chunks, m, p2p, sends_wait=True, keys_from=chunks).step_time
        assert free <= plan <= unit * (1 + 1e-12)
        unit_cost.append(unit / free - 1)
        plan_cost.append(plan / free - 1)
    assert sum(plan_cost) < sum(unit_cost) / 10, (sum(plan_cost), sum(unit_cost))


def test_where_ops_of_no_length_tie_the_plans_keys_into_an_order_that_stops_the_unit_keys_serve() -> None:
    """A forward of 2 on chunk 0 and of 1 on chunk 2, every other op of no length: keyed by those times the
    transfers cannot all be made (the replay stops), so the order keeps the unit keys, which get through."""
    from nanotron_ext.schedule.simulator import per_cut_p2p
    from nanotron_ext.schedule.v_replay import _keyed, _op_times, _starts
    from nanotron_ext.schedule.zbv import simulate_zbv

    zero = StageTimes(0.0, 0.0, weight=0.0)
    chunks, m = [StageTimes(2.0, 0.0, weight=0.0), zero, StageTimes(1.0, 0.0, weight=0.0), zero], 4
    order = [list(ops) for ops in simulate_zbv(chunks, m, 0.0).order]
    cuts = per_cut_p2p(0.0, 4)
    tied = _keyed(order, _starts(order, chunks, m, cuts))
    with pytest.raises(ValueError, match="waits forever"):
        _op_times(order, chunks, m, cuts, tied)
    assert transfer_order(order, chunks, 0.0) == transfer_order(order) != tied
    replay_v_order(order, chunks, m, sends_wait=True, keys_from=chunks)  # gets through
