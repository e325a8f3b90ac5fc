"""The V placement and its ZB-V schedule, simulated (``nanotron_ext.schedule.zbv``): where each virtual stage runs,
that every op runs once after its input, the floor, the memory it holds, and bad input."""

from __future__ import annotations

import random

import pytest

from nanotron_ext.schedule.simulator import StageTimes, simulate
from nanotron_ext.schedule.v_moments import v_moments
from nanotron_ext.schedule.zbv import POLICIES, VBudget, VOp, simulate_zbv, v_rank, zbv_order

HALF_W = StageTimes(1.0, 2.0, weight=1.0)  # F = B = W = 1 per chunk


def test_the_v_goes_down_the_ranks_and_back_up():
    assert [v_rank(3, s) for s in range(6)] == [0, 1, 2, 2, 1, 0]
    assert [v_rank(1, s) for s in range(2)] == [0, 0]
    with pytest.raises(ValueError, match="virtual stage 6 is outside 0..5; a V over pp=3 ranks has 2 pp stages"):
        v_rank(3, 6)


@pytest.mark.parametrize("pp", [1, 2, 3, 5])
@pytest.mark.parametrize("m_per_pp", [1, 2, 3])
def test_each_rank_runs_every_op_of_its_two_stages_once(pp, m_per_pp):
    m = pp * m_per_pp
    order = zbv_order(pp, m)
    for r, ops in enumerate(order):
        stages = {r, 2 * pp - 1 - r}
        assert sorted(ops) == sorted(VOp(k, j, s) for k in "FBW" for j in range(m) for s in stages)
        # Each stage's forwards and backwards in micro-batch order, each W after its B.
        for s in stages:
            for kind in "FB":
                assert [op.micro_batch for op in ops if op.stage == s and op.kind == kind] == list(range(m))
            assert all(ops.index(VOp("B", j, s)) < ops.index(VOp("W", j, s)) for j in range(m))


@pytest.mark.parametrize(("pp", "m", "p2p"), [(2, 4, 0.0), (3, 7, 0.3), (4, 8, [0.1, 0.2, 0.3, 9.0, 0.3, 0.2, 0.1])])
def test_an_op_starts_after_its_input_arrives_and_a_rank_runs_one_op_at_a_time(pp, m, p2p):
    chunks = [StageTimes(1.0 + 0.1 * s, 2.0, weight=0.5 + 0.1 * s) for s in range(2 * pp)]
    res = simulate_zbv(chunks, m, p2p)
    cuts = [p2p] * (2 * pp - 1) if isinstance(p2p, float) else p2p
    end = {(op.kind, op.micro_batch, op.stage): op.end for op in res.ops}
    for op in res.ops:
        before = (
            ("F", op.micro_batch, op.stage - 1)
            if op.kind == "F" and op.stage > 0
            else ("F", op.micro_batch, op.stage)
            if op.kind == "B" and op.stage == 2 * pp - 1
            else ("B", op.micro_batch, op.stage + 1)
            if op.kind == "B"
            else ("B", op.micro_batch, op.stage)
            if op.kind == "W"
            else None
        )
        if before is None:
            continue
        crossing = v_rank(pp, before[2]) != v_rank(pp, op.stage)
        assert op.start >= end[before] + (cuts[min(op.stage, before[2])] if crossing else 0.0) - 1e-12, op
    for r in range(pp):
        mine = sorted((op for op in res.ops if v_rank(pp, op.stage) == r), key=lambda o: o.start)
        assert all(a.end <= b.start + 1e-12 for a, b in zip(mine, mine[1:]))
        assert res.busy[r] == pytest.approx(sum(o.duration for o in mine))
    assert res.pipeline_time == pytest.approx(max(op.end for op in res.ops))


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (4, 16), (8, 16), (8, 32)])
def test_with_w_half_the_backward_the_v_lands_on_its_floor(pp, m):
    # A V's first activation reaches the last rank after pp - 1 half-stages: (pp - 1) f + m (F + B + W) per rank.
    res = simulate_zbv([HALF_W] * (2 * pp), m)
    assert res.pipeline_time == pytest.approx((pp - 1) * 1.0 + m * 6.0)


@pytest.mark.parametrize("pp", range(2, 7))
def test_at_w_half_the_backward_the_v_beats_zb1p_and_holds_no_more_than_1f1b(pp):
    whole = StageTimes(2.0, 4.0, weight=2.0)  # a rank's two chunks as one stage
    for m in range(pp, 4 * pp + 1):
        v = simulate_zbv([HALF_W] * (2 * pp), m)
        assert v.pipeline_time < simulate([whole] * pp, m, "zb1p").pipeline_time, (pp, m)
        # 1F1B's first rank holds min(pp, m) micro-batches of its whole stage: two chunks each.
        one_f_one_b = 2 * max(simulate([whole] * pp, m, "1f1b").peak_in_flight)
        assert max(v.peak_held) <= 2 * pp and max(v.peak_in_flight) <= one_f_one_b, (pp, m)


def test_no_rule_with_the_reserve_for_the_way_up_stalls_whatever_the_times_the_p2p_and_the_cap():
    import random

    from nanotron_ext.schedule.zbv import _schedule

    rng = random.Random(43)
    for _ in range(120):
        pp = rng.randint(1, 4)
        chunks = [
            StageTimes(rng.uniform(0.1, 2.0), b, weight=b * rng.random())
            for b in (rng.uniform(0.2, 3.0) for _ in range(2 * pp))
        ]
        cuts = [rng.choice([0.0, rng.uniform(0.0, 2.0)]) for _ in range(2 * pp - 1)]
        m, cap = rng.randint(1, 4 * pp), rng.choice([None, 2, 3, 2 * pp + 2])
        for policy in (p for p in POLICIES if p.down_reserve):
            _schedule(chunks, m, cuts, cap, policy)  # raises Stalled if it stalls
        assert max(simulate_zbv(chunks, m, cuts, cap).peak_held) <= (2 * pp if cap is None else cap)


def test_a_smaller_cap_is_kept_and_costs_time():
    roomy, tight = simulate_zbv([HALF_W] * 8, 8), simulate_zbv([HALF_W] * 8, 8, cap=3)
    assert max(tight.peak_held) <= 3 < max(roomy.peak_held)
    assert tight.pipeline_time > roomy.pipeline_time


def test_the_cut_at_the_vs_bottom_stays_on_its_rank():
    # pp = 3: six chunks
    free = simulate_zbv([HALF_W] * 6, 6, [0.0] * 5)
    bottom = simulate_zbv([HALF_W] * 6, 6, [0.0, 0.0, 1e6, 0.0, 0.0])  # cut 2: stages 2 and 3, both on rank 2
    assert bottom.pipeline_time == free.pipeline_time
    assert simulate_zbv([HALF_W] * 6, 6, [0.0, 0.5, 0.0, 0.0, 0.0]).pipeline_time > free.pipeline_time


def test_the_step_adds_the_slowest_ranks_update_of_both_chunks_and_the_fastest_rule_is_kept():
    chunks = [StageTimes(1.0, 2.0, update=0.1 * s, weight=0.5) for s in range(4)]  # rank 0: 0 + 0.3, rank 1: 0.1 + 0.2
    res = simulate_zbv(chunks, 4)
    assert res.step_time == pytest.approx(res.pipeline_time + 0.3)
    assert str(res).startswith(f"zbv: pp=2, micro-batches=4, step={res.step_time * 1e3:.3f} ms, pipeline bubble=")
    from nanotron_ext.schedule.zbv import _schedule

    each = [max(e for _, e in _schedule(chunks, 4, [0.0] * 3, None, p)[1].values()) for p in POLICIES]
    assert res.pipeline_time == min(each)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: simulate_zbv([HALF_W] * 3, 4), "3 chunks; a V needs two per rank"),
        (lambda: simulate_zbv([StageTimes(-1.0, 2.0)] * 2, 4), r"chunks\[0\].forward = -1.0"),
        (lambda: simulate_zbv([StageTimes(1.0, 2.0, weight=3.0)] * 2, 4), r"chunks\[0\].weight = 3.0 exceeds"),
        (lambda: simulate_zbv([HALF_W] * 4, 4, [0.1, 0.2]), "one per cut"),
        (lambda: simulate_zbv([HALF_W] * 4, 0), "micro-batches = 0"),
        (lambda: zbv_order(2, 4, cap=1), "cap = 1; a rank holds both chunks"),
        (lambda: simulate_zbv([HALF_W] * 4, 4, eager=[4]), r"eager stages \[4\] are not all virtual stages of 0\.\.3"),
    ],
)
def test_bad_input_names_the_value_and_the_fix(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("eager", [(7,), (0, 3, 4)])
def test_an_eager_chunk_runs_each_w_right_after_its_b_and_defers_nothing(eager):
    chunks = [StageTimes(1.0 + 0.1 * s, 2.0, weight=0.5 + 0.1 * s) for s in range(8)]
    result = simulate_zbv(chunks, 8, 0.05, eager=eager)
    lazy = simulate_zbv(chunks, 8, 0.05)

    def deferred(res):
        by = {(o.kind, o.micro_batch, o.stage): o for o in res.ops}
        return {(j, s) for (kind, j, s), op in by.items() if kind == "W" and op.start > by[("B", j, s)].end}

    assert not {s for _, s in deferred(result)} & set(eager)
    assert {s for _, s in deferred(lazy)} & set(eager)  # left to the rule, some of them wait
    assert sorted((o.kind, o.micro_batch, o.stage) for o in result.ops) == sorted(
        (o.kind, o.micro_batch, o.stage) for o in lazy.ops
    )


def _dynamic_bytes(result, budget, rank):
    """Bytes of activations and W state ``rank`` holds at each of its ops' starts, as v_rank_memory counts them."""
    pp = result.pp
    return [
        sum(n * budget.activation[s] for n, s in zip(x.held, (rank, 2 * pp - 1 - rank)))
        + sum(n * budget.pending[s] for n, s in zip(x.pending, (rank, 2 * pp - 1 - rank)))
        for x in v_moments(result, rank)
    ]


@pytest.mark.parametrize("seed", range(8))
def test_a_budget_in_bytes_holds_at_every_ops_start_and_a_loose_one_lifts_the_count_cap(seed):
    rng = random.Random(seed)
    pp, m = rng.choice([(2, 4), (3, 6), (4, 8)])
    chunks = [
        StageTimes(rng.uniform(0.5, 1.5), b := rng.uniform(1.0, 3.0), weight=b * rng.uniform(0.2, 0.6))
        for _ in range(2 * pp)
    ]
    activation = tuple(rng.uniform(1.0, 10.0) for _ in range(2 * pp))
    pending = tuple(rng.uniform(0.0, 5.0) for _ in range(2 * pp))
    least = [activation[r] + pending[r] + activation[2 * pp - 1 - r] + pending[2 * pp - 1 - r] for r in range(pp)]
    budget = VBudget(activation, pending, tuple(x * rng.uniform(1.0, 4.0) for x in least))
    result = simulate_zbv(chunks, m, 0.1, budget=budget)
    for rank in range(pp):
        assert max(_dynamic_bytes(result, budget, rank)) <= budget.budget[rank] * (1 + 1e-9)
    # Under a budget the bytes bound a rank, not 1F1B's count: a loose one is no count cap at all.
    loose = VBudget(activation, pending, (1e12,) * pp)
    assert simulate_zbv(chunks, m, 0.1, budget=loose).ops == simulate_zbv(chunks, m, 0.1, cap=2 * m + 1).ops


def test_a_tight_budget_holds_fewer_and_costs_time_and_one_under_a_micro_batch_is_refused():
    chunks = [HALF_W] * 8
    free = simulate_zbv(chunks, 8)
    # Each micro-batch reserves its activations (1, more than its W state), and the B that runs 0.5 besides: 6
    # bytes take five chunk-activations (5.5), where reserving both from the F took four.
    budget = VBudget((1.0,) * 8, (0.5,) * 8, (6.0,) * 4)
    tight = simulate_zbv(chunks, 8, budget=budget)
    assert max(tight.peak_held) == 5 < max(free.peak_held) and tight.step_time > free.step_time
    with pytest.raises(
        ValueError,
        match=r"rank 0's budget of 2\.4 bytes is under one micro-batch of both its "
        r"chunks \(2\.5\): no order fits",
    ):
        simulate_zbv(chunks, 8, budget=VBudget((1.0,) * 8, (0.5,) * 8, (2.4,) * 4))
    # W state larger than the activations (a loss chunk's logits' gradient): each micro-batch reserves it.
    heavy = VBudget((0.5,) * 8, (1.0,) * 8, (6.0,) * 4)
    assert max(simulate_zbv(chunks, 8, budget=heavy).peak_held) == 5
