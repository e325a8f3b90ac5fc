"""The partitioner: exact tiny cases, a brute-force reference for optimality, and its errors."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanotron_ext.costs.prefix_sums import prefix_sums
from nanotron_ext.errors import PlanningError
from nanotron_ext.partition import MemoryCap, Partition, Requirement, partition


def test_exact_tiny_cases():
    assert partition([1, 1, 1, 3], 2).bounds == (0, 3, 4)
    assert partition([1, 1, 1, 1], 2).bounds == (0, 2, 4)
    assert partition([5], 1).stage_costs == (5.0,)
    # [3, 3 | 3, 1, 1, 1] has both stages at 6; every other split has a stage of 7 or more.
    assert partition([3, 3, 3, 1, 1, 1], 2).bounds == (0, 2, 6)


def test_tie_break_prefers_even_stages():
    # Slowest stage is 10 whatever happens; the evenest split of the rest is chosen.
    p = partition([10, 1, 1, 1, 1], 3)
    assert p.max_cost == 10
    assert p.bounds == (0, 1, 3, 5)


def test_requirement_binds():
    # Without the requirement the best split is [1, 1, 1 | 10]; block 3 has no weights, so stage 1 must
    # take block 2 as well.
    req = Requirement("blocks with parameters", (True, True, True, False))
    assert partition([1, 1, 1, 10], 2).bounds == (0, 3, 4)
    p = partition([1, 1, 1, 10], 2, requirements=[req])
    assert p.bounds == (0, 2, 4)
    assert p.stage_costs == (2.0, 11.0)


def test_stage_dependent_cost_under_1f1b():
    # Stage 0 holds 2 micro-batches of activations, stage 1 holds 1: activations weigh double on stage 0.
    p = partition([0, 0, 0, 0], 2, per_in_flight=[1, 1, 1, 1], in_flight=[2, 1])
    # [0 | 0, 0, 0] costs 2·1 and 1·3; [0, 0 | 0, 0] would cost 2·2 = 4 on stage 0.
    assert p.stage_costs == (2.0, 3.0)
    assert p.bounds == (0, 1, 4)


def test_no_stage_is_left_empty_even_when_that_would_be_evener():
    # Two blocks of activations only, stage 0 holding 2 micro-batches: [b0 | b1] costs (2, 1). An empty stage 0,
    # [ | b0, b1], would cost (0, 2): the same slowest stage and a smaller sum of squares, but Nanotron needs
    # a block on every PP rank.
    p = partition([0, 0], 2, per_in_flight=[1, 1], in_flight=[2, 1])
    assert p.bounds == (0, 1, 2)
    assert p.stage_costs == (2.0, 1.0)


def test_memory_cap_moves_the_split():
    mem = MemoryCap(static=(3, 1, 1, 1), activation=(0, 0, 0, 0), in_flight=(1, 1), cap=3.0)
    p = partition([1, 1, 1, 1], 2, memory=mem)
    assert p.bounds == (0, 1, 4)


def test_ranks_roundtrip():
    p = partition([1, 2, 3, 4, 5], 3)
    assert Partition.from_ranks(p.ranks(), [1, 2, 3, 4, 5]).bounds == p.bounds


@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf")])
def test_bad_costs(bad):
    with pytest.raises(PlanningError, match=r"cost of block 1 is .*finite and non-negative"):
        partition([1.0, bad, 1.0], 2)


def test_pp_larger_than_blocks():
    with pytest.raises(PlanningError, match=r"pp=5 stages but the model has only 3 blocks; use pp <= 3"):
        partition([1, 1, 1], 5)


def test_requirement_too_few_flags_says_largest_pp():
    req = Requirement("trainable blocks", (False, True, False, True), fix="unfreeze more")
    with pytest.raises(
        PlanningError, match=r"needs 3 trainable blocks .* has 2 \(b1, b3\).*largest pp that works is 2"
    ):
        partition([1, 1, 1, 1], 3, requirements=[req], names=["b0", "b1", "b2", "b3"])


def test_memory_infeasible_says_by_how_much():
    gib = float(1 << 30)
    mem = MemoryCap(static=(2 * gib, 2 * gib), activation=(0, 0), in_flight=(1, 1), cap=1 * gib)
    with pytest.raises(PlanningError, match=r"least memory any valid split needs is 2 GiB on stage 0 \(1 GiB over\)"):
        partition([1, 1], 2, memory=mem)


# --- brute force reference -------------------------------------------------------------------------------


def brute_force(costs, pp, flags=None, static=None, act=None, flight=None, cap=None):
    """All compositions of n blocks into pp non-empty contiguous stages; (min max, min sumsq at that max)."""
    n, best = len(costs), None
    for cuts in itertools.combinations(range(1, n), pp - 1):
        bounds = (0, *cuts, n)
        stage_costs, ok = [], True
        for k in range(pp):
            a, b = bounds[k], bounds[k + 1]
            mult = flight[k] if flight else 1
            stage_costs.append(sum(costs[a:b]) + (mult * sum(act[a:b]) if act and not static else 0))
            if flags is not None and not any(flags[a:b]):
                ok = False
            if cap is not None and sum(static[a:b]) + flight[k] * sum(act[a:b]) > cap * (1 + 1e-9):
                ok = False
        if ok:
            key = (max(stage_costs), sum(c * c for c in stage_costs))
            best = (
                key
                if best is None or key[0] < best[0] - 1e-12 or (math.isclose(key[0], best[0]) and key[1] < best[1])
                else best
            )
    return best


instances = st.integers(1, 12).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, 30).map(float), min_size=n, max_size=n),
        st.integers(1, min(5, n)),
        st.one_of(st.none(), st.lists(st.booleans(), min_size=n, max_size=n)),
        st.one_of(
            st.none(),
            st.tuples(
                st.lists(st.integers(0, 9).map(float), min_size=n, max_size=n),
                st.lists(st.integers(0, 3).map(float), min_size=n, max_size=n),
                st.integers(5, 40).map(float),
            ),
        ),
    )
)


@settings(max_examples=300, deadline=None)
@given(instances)
def test_matches_brute_force(instance):
    costs, pp, flags, memory = instance
    reqs = [Requirement("flagged blocks", tuple(flags))] if flags is not None else []
    flight = [pp - k for k in range(pp)]
    cap = None
    if memory is not None:
        static, act, cap_value = memory
        cap = MemoryCap(tuple(static), tuple(act), tuple(flight), cap_value)
    ref = brute_force(
        costs, pp, flags, *(memory[:2] if memory else (None, None)), flight, memory[2] if memory else None
    )
    if ref is None:
        with pytest.raises(PlanningError):
            partition(costs, pp, requirements=reqs, memory=cap)
        return
    got = partition(costs, pp, requirements=reqs, memory=cap)
    assert math.isclose(got.max_cost, ref[0], rel_tol=1e-9, abs_tol=1e-9)
    assert math.isclose(sum(c * c for c in got.stage_costs), ref[1], rel_tol=1e-6, abs_tol=1e-6)
    assert len(got.bounds) == pp + 1 and all(a < b for a, b in zip(got.bounds, got.bounds[1:]))
    if flags is not None:
        assert all(any(flags[got.bounds[k] : got.bounds[k + 1]]) for k in range(pp))


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 10).flatmap(
        lambda n: st.tuples(
            st.lists(st.integers(0, 20).map(float), min_size=n, max_size=n),
            st.lists(st.integers(0, 5).map(float), min_size=n, max_size=n),
            st.integers(1, min(4, n)),
        )
    )
)
def test_stage_dependent_costs_match_brute_force(instance):
    costs, act, pp = instance
    flight = [pp - k for k in range(pp)]
    ref = brute_force(costs, pp, act=act, flight=flight)
    got = partition(costs, pp, per_in_flight=act, in_flight=flight)
    assert math.isclose(got.max_cost, ref[0], rel_tol=1e-9, abs_tol=1e-9)


def _every_start_programme(costs, pp, flags=None, static=None, act=None, flight=None, cap=None):
    """The partitioner's two programmes over every start of every stage (``O(pp · n²)``, as before it looked only
    at the stages a trial cost admits): the split it chooses, ties to the earliest start."""
    n = len(costs)
    flight = flight or [1] * pp
    scale = float(sum(costs) + (sum(act) * max(flight) if act and not static else 0.0)) or 1.0
    cp = np.concatenate([[0.0], np.cumsum(np.asarray(costs) / scale)])
    ap = np.concatenate([[0.0], np.cumsum(np.asarray(act if act and not static else [0.0] * n) / scale)])
    idx = np.arange(n + 1)
    valid = idx[:, None] < idx[None, :]
    if flags is not None:
        fp = np.concatenate([[0], np.cumsum(np.asarray(flags, dtype=np.int64))])
        valid = valid & ((fp[None, :] - fp[:, None]) >= 1)

    def ok(k):
        if cap is None:
            return valid
        q = np.concatenate([[0.0], np.cumsum(static)]) + flight[k] * np.concatenate([[0.0], np.cumsum(act)])
        return valid & ((q[None, :] - q[:, None]) <= cap + cap * 1e-9)

    def programme(combine, limit=None):
        value, choices = np.full(n + 1, np.inf), []
        value[0] = 0.0
        for k in range(pp):
            mult = float(flight[k]) if act and not static else 1.0
            s = (cp[None, :] - cp[:, None]) + mult * (ap[None, :] - ap[:, None])
            good = ok(k) if limit is None else ok(k) & (s <= limit)
            cand = np.where(good, np.maximum(value[:, None], s) if combine == "max" else value[:, None] + s * s, np.inf)
            choices.append(np.argmin(cand, axis=0))
            value = cand.min(axis=0)
        return float(value[n]), choices

    best, _ = programme("max")
    if not math.isfinite(best):
        return None
    _, choices = programme("sumsq", best * (1 + 1e-9) + 1e-15)
    bounds = [n]
    for k in range(pp - 1, -1, -1):
        bounds.append(int(choices[k][bounds[-1]]))
    return tuple(bounds[::-1])


@pytest.mark.parametrize("seed", range(6))
def test_the_programme_over_admitted_stages_chooses_the_split_of_the_one_over_every_start(seed):
    """The partitioner looks only at stages whose cost a trial admits (doubled until a split is found): the same
    split as the programme over every start, ties included (integer costs, zero-cost runs, flags, a memory cap)."""
    rng = random.Random(seed)
    for _ in range(40):
        n = rng.randint(1, 90)
        pp = rng.randint(1, min(n, 24))
        costs = [float(rng.choice([0, 0, 1, 2, 3, rng.randint(0, 50)])) for _ in range(n)]
        flags = [rng.random() < 0.6 for _ in range(n)] if rng.random() < 0.5 else None
        reqs = [Requirement("flagged blocks", tuple(flags))] if flags is not None else []
        flight = [pp - k for k in range(pp)]
        cap, static, act = None, None, None
        if rng.random() < 0.5:
            static = [float(rng.randint(0, 9)) for _ in range(n)]
            act = [float(rng.randint(0, 3)) for _ in range(n)]
            cap = float(rng.randint(5, 20) + sum(static) / pp)
        memory = None if cap is None else MemoryCap(tuple(static), tuple(act), tuple(flight), cap)
        ref = _every_start_programme(costs, pp, flags, static, act, flight, cap)
        if ref is None:
            with pytest.raises(PlanningError):
                partition(costs, pp, requirements=reqs, memory=memory)
            continue
        assert partition(costs, pp, requirements=reqs, memory=memory).bounds == ref


def test_a_segments_sum_is_the_difference_of_two_prefix_sums():
    """The one home of the partitioners' and searches' segment sums: exact on a tiny case, in the dtype asked for,
    and every segment of random values against its sum."""
    assert prefix_sums([1.5, 2.0, 4.25]).tolist() == [0.0, 1.5, 3.5, 7.75]
    flags = prefix_sums([True, False, True], np.int64)
    assert flags.dtype == np.int64 and flags.tolist() == [0, 1, 1, 2]
    assert prefix_sums([]).tolist() == [0.0]
    values = np.random.default_rng(0).random(9)
    p = prefix_sums(values)
    for s, e in itertools.combinations(range(10), 2):
        assert math.isclose(p[e] - p[s], sum(values[s:e]), rel_tol=1e-12)
