"""The shortcuts that make planning fast (issue 44) give the straightforward computation's answer: a search refused
because no split fits would have found none, a segment's estimate from precomputed blocks is the stage's estimate,
a descent that simulates only the neighbours its lower bound cannot rule out picks the same one, and the
depth-first searches that remember each stage's ends visit the same splits as the plain ones."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanotron_ext.config import bundled_config, load_config
from nanotron_ext.costs.memory_estimate import SegmentMemory, config_stage_memory
from nanotron_ext.errors import PlanningError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.partition import MemoryCap, Requirement, partition
from nanotron_ext.partition.branch_bound import _Walk, branch_and_bound, score
from nanotron_ext.partition.feasible import any_split_fits, least_cap
from nanotron_ext.partition.schedule_aware import (
    ScheduleProblem,
    StepTimeEvaluator,
    _fastest,
    step_time_partition,
)
from nanotron_ext.partition.stage_ends import StageEnds, splits_within
from nanotron_ext.partition.step_time_bound import RTOL, Bound, Validity, minimise
from nanotron_ext.schedule import min_micro_batches
from nanotron_ext.strategies.builtin import _constraints
from nanotron_ext.strategies.memory_fit import only_whether_it_fits, refuse_when_none_fits
from nanotron_ext.strategies.step_time import schedule_problem


def _splits(n: int, pp: int) -> list[tuple[int, ...]]:
    return [(0, *c, n) for c in itertools.combinations(range(1, n), pp - 1)]


@st.composite
def _capped(draw: st.DrawFn) -> tuple[int, int, list[Requirement], MemoryCap]:
    n = draw(st.integers(1, 8))
    pp = draw(st.integers(1, n + 1))  # one more than the blocks: no split at all
    size = st.floats(0.0, 10.0, allow_nan=False)
    static = draw(st.lists(st.one_of(size, st.just(0.0), st.floats(-2.0, 0.0)), min_size=n, max_size=n))
    activation = draw(st.lists(st.one_of(size, st.just(0.0)), min_size=n, max_size=n))
    pending = draw(st.one_of(st.just([]), st.lists(size, min_size=n, max_size=n)))
    flight = draw(st.lists(st.integers(1, 4), min_size=pp, max_size=pp))
    deferred = draw(st.lists(st.integers(0, 3), min_size=pp, max_size=pp)) if pending else []
    reqs = [
        Requirement("flagged", tuple(draw(st.lists(st.booleans(), min_size=n, max_size=n))))
        for _ in range(draw(st.integers(0, 2)))
    ]
    cap = draw(st.floats(0.0, 60.0, allow_nan=False))
    return (
        n,
        pp,
        reqs,
        MemoryCap(
            tuple(static),
            tuple(activation),
            tuple(flight),
            cap,
            overhead=draw(st.sampled_from([0.0, 1.0])),
            pending=tuple(pending),
            deferred=tuple(deferred),
        ),
    )


@settings(max_examples=400, deadline=None)
@given(_capped())
def test_any_split_fits_is_whether_the_partitioner_finds_a_split(case):
    # Negative static bytes make prefix sums that fall: the starts that fit then have gaps (the dense path).
    n, pp, reqs, memory = case
    try:
        partition([1.0] * n, pp, requirements=reqs, memory=memory, in_flight=memory.in_flight)
        found = True
    except PlanningError:
        found = False
    assert any_split_fits(n, pp, reqs, memory) == found


@settings(max_examples=400, deadline=None)
@given(_capped(), st.sampled_from([2e-3, 0.1]))
def test_least_cap_is_within_its_tolerance_below_the_least_any_split_needs(case, rtol):
    # Brute force: the least, over every valid split, of its largest stage's additive part plus the overhead.
    n, pp, reqs, memory = case
    prefixes = [memory.prefix(k) for k in range(min(pp, n))]
    needs = [
        max(prefixes[k][e] - prefixes[k][s] for k, (s, e) in enumerate(zip(sp, sp[1:])))
        for sp in (_splits(n, pp) if pp <= n else [])
        if all(any(r.flags[s:e]) for r in reqs for s, e in zip(sp, sp[1:]))
    ]
    least = least_cap(n, pp, reqs, memory, rtol=rtol)
    if not needs or any_split_fits(n, pp, reqs, memory):  # no split at all, or one fits: nothing to bound
        assert least is None
        return
    room = min(needs)
    assert least is not None and room - rtol * max(abs(room), 1.0) - 1e-9 <= least - memory.overhead <= room


def test_requirements_that_leave_no_split_are_named_under_a_memory_cap_too():
    # Enough flagged blocks of each kind for four stages, but no four stages each holding both kinds.
    reqs = [
        Requirement("weights", (False, False, False, True, True, True, True)),
        Requirement("trainable blocks", (False, False, True, True, True, True, False)),
    ]
    memory = MemoryCap((0.0,) * 7, (0.0,) * 7, (1,) * 4, cap=0.0)
    with pytest.raises(
        PlanningError,
        match="no contiguous split into 4 stages gives every stage weights and trainable blocks; lower pp",
    ):
        partition([1.0] * 7, 4, requirements=reqs, memory=memory, in_flight=memory.in_flight)
    assert not any_split_fits(7, 4, reqs, memory)


@settings(max_examples=300, deadline=None)
@given(_capped())
def test_the_step_time_searchs_windows_admit_a_split_exactly_when_one_is_valid(case):
    n, pp, reqs, memory = case
    if pp > n or min(memory.static) < 0:  # the windows are built for prefix sums that never fall
        return
    valid = Validity.build(n, reqs, memory)
    room = memory.slack_room
    prefixes = [memory.prefix(k) for k in range(pp)]
    brute = any(
        all(
            s < e and prefixes[k][s] >= prefixes[k][e] - room and all(any(r.flags[s:e]) for r in reqs)
            for k, (s, e) in enumerate(zip(sp, sp[1:]))
        )
        for sp in _splits(n, pp)
    )
    assert valid.any_split(pp) == brute


def _tiny_configs():
    for name, pp in (("tiny_llama_large_vocab.yaml", 2), ("smollm_135m.yaml", 4), ("llama_3_2_1b.yaml", 8)):
        for engine in ("1f1b", "zb1p", "afab"):
            cfg = load_config(bundled_config(name), pp=pp).with_overrides(engine=engine)
            yield cfg, inventory_from_config(cfg)


def test_a_search_refused_because_nothing_fits_would_have_found_no_split():
    refused = admitted = 0
    for cfg, blocks in _tiny_configs():
        fastest = max(config_stage_memory(blocks, cfg, 0).peak, 1.0)
        for share in (0.01, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0):
            capped = cfg.with_overrides(memory_cap_gib=share * fastest / 2**30)
            reqs, memory = _constraints(blocks, capped, True)
            refuse_when_none_fits(len(blocks), cfg.run.pp, reqs, memory)  # outside the mode: never
            try:
                with only_whether_it_fits():
                    refuse_when_none_fits(len(blocks), cfg.run.pp, reqs, memory)
            except PlanningError:
                refused += 1
                with pytest.raises(PlanningError):
                    partition(
                        [1.0] * len(blocks), cfg.run.pp, requirements=reqs, memory=memory, in_flight=memory.in_flight
                    )
                with pytest.raises(PlanningError):
                    step_time_partition(schedule_problem(blocks, capped), requirements=reqs, memory=memory)
                continue
            admitted += 1
    assert refused >= 5 and admitted >= 5


@pytest.mark.parametrize(
    "name", ["tiny_llama_large_vocab.yaml", "smollm_135m.yaml", "gemma_2b.yaml", "llama_3_70b.yaml"]
)
def test_a_segments_estimate_from_its_blocks_worked_out_once_is_the_stages_estimate(name):
    for engine, runtime in itertools.product(("1f1b", "zb1p", "zb2p", "afab"), ("gpu", "cpu")):
        cfg = load_config(bundled_config(name), pp=4).with_overrides(engine=engine, memory_runtime=runtime)
        blocks = inventory_from_config(cfg)
        segments = SegmentMemory(blocks, cfg)
        n = len(blocks)
        for k, s in itertools.product(range(4), range(0, n, max(1, n // 8))):
            for e in range(s, min(n, s + 12) + 1):
                assert segments(k, s, e) == config_stage_memory(blocks[s:e], cfg, k), (engine, runtime, k, s, e)


def _problem(rng: random.Random, n: int, pp: int, engine: str | None = None) -> ScheduleProblem:
    engine = engine or rng.choice(("1f1b", "afab", "zb1p", "zb2p"))
    m = rng.randint(min_micro_batches(engine, pp), 2 * pp + 2)
    f = [rng.choice([0.0, rng.random(), 5 * rng.random()]) for _ in range(n)]
    b = [x * rng.uniform(0.5, 3) for x in f]
    w = [x * rng.choice([0.0, rng.random(), 1.0]) for x in b]
    u = [0.5 * rng.random() if rng.random() < 0.3 else 0.0 for _ in range(n)]
    send = [0.3 * rng.random() for _ in range(n)]
    grad_after = tuple(c > rng.choice([0, 0, 1]) for c in range(n + 1))
    return ScheduleProblem(tuple(f), tuple(b), tuple(u), tuple(send), grad_after, pp, m, engine, tuple(w))


@pytest.mark.parametrize("seed", range(3))
def test_a_descent_step_ruling_splits_out_by_their_bound_picks_the_neighbour_scoring_all_would(seed):
    rng = random.Random(700 + seed)
    for _ in range(25):
        n = rng.randint(4, 11)
        problem = _problem(rng, n, rng.randint(2, min(n, 5)))
        bound = Bound(problem, Validity.build(n, (), None))
        splits = np.asarray(rng.sample(_splits(n, problem.pp), min(60, math.comb(n - 1, problem.pp - 1))))
        every, pruned = StepTimeEvaluator(problem), StepTimeEvaluator(problem)
        expected = min(score(every, bound, [tuple(int(x) for x in row) for row in splits]))
        assert _fastest(pruned, bound, splits) == expected
        # The budgets that read the evaluator run as if every split had been simulated.
        assert (pruned.evaluated, pruned.work) == (every.evaluated, every.work)


def _plain_branch_and_bound(evaluate, bound, best, budget):
    """The search as first written: every stage's ends worked out again at every node."""
    n, pp = bound.problem.n, bound.problem.pp
    windows = [bound.windows(k, best[0]) for k in range(pp)]
    coreach = [np.zeros(n + 1, dtype=bool) for _ in range(pp + 1)]
    coreach[pp][n] = True
    for k in range(pp - 1, -1, -1):
        lo, hi = windows[k]
        coreach[k] = np.array(
            [any(coreach[k + 1][e] and lo[e] <= s <= hi[e] for e in range(s + 1, n + 1)) for s in range(n + 1)]
        )
    pending, seen, stack = [], 0, [(0, (), 0)]
    while stack:
        k, head, s = stack.pop()
        prefix = (*head, s)
        if k == pp:
            if s == n:
                pending.append(prefix)
                seen += 1
                if len(pending) >= 512:
                    best, pending = min(best, *score(evaluate, bound, pending)), []
                if seen > budget:
                    return best, False
            continue
        lo, hi = windows[k]
        ends = [
            e
            for e in range(s + 1, n + 1)
            if lo[e] <= s <= hi[e]
            and coreach[k + 1][e]
            and max(ea[e] - sa[s] + c for ea, sa, c in bound.terms[k]) < best[0] * (1 - RTOL)
        ]
        stack.extend((k + 1, prefix, e) for e in reversed(ends))
    if pending:
        best = min(best, *score(evaluate, bound, pending))
    return best, True


@pytest.mark.parametrize("seed", range(3))
def test_branch_and_bound_remembering_each_stages_ends_visits_what_the_plain_search_does(seed):
    # Sizes with more than 512 splits under the bound: a batch simulated mid-search lowers the best on the way.
    rng = random.Random(900 + seed)
    for _ in range(6):
        n = rng.randint(12, 17)
        problem = _problem(rng, n, rng.randint(3, 5), engine=rng.choice(("1f1b", "zb1p")))
        bound = Bound(problem, Validity.build(n, (), None))
        worst = max(score(StepTimeEvaluator(problem), bound, _splits(n, problem.pp)[:200]))
        start = (worst[0] * 3, worst[1], worst[2])
        # 511 and 1023: a full batch that ends one split past the budget is scored, then the search stops.
        for budget in (40, 511, 700, 1023, 20000):
            plain, remembering = StepTimeEvaluator(problem), StepTimeEvaluator(problem)
            expected = _plain_branch_and_bound(plain, bound, start, budget)
            assert branch_and_bound(remembering, bound, start, budget) == expected
            assert (remembering.evaluated, remembering.work) == (plain.evaluated, plain.work)


def _bounded(rng: random.Random, blocks: tuple[int, int], spread: tuple[float, float]):
    """A random problem of ``blocks`` blocks, its bound, and a value above the bound's min-max by ``spread``."""
    n = rng.randint(*blocks)
    problem = _problem(rng, n, rng.randint(2, 4))
    bound = Bound(problem, Validity.build(n, (), None))
    return n, problem, bound, minimise(bound, 1e9)[0] * rng.uniform(*spread)


@pytest.mark.parametrize("most", [1, 2, 3, 7, 512])
def test_the_branch_and_bounds_walk_gives_every_split_under_its_bound_in_order_whatever_its_steps(most):
    # The walk stops after ``most`` splits, in the middle of a stage's ends too, and goes on from there: the same
    # splits in the same (depth-first: lexicographic) order as one walk, those whose every stage is below the bound.
    rng = random.Random(990 + most)
    for _ in range(8):
        n, problem, bound, below = _bounded(rng, (6, 11), (1.05, 1.4))
        walk = _Walk(StageEnds(bound, below), n, problem.pp, below)
        walked: list[tuple[int, ...]] = []
        while step := walk.splits(most):
            assert len(step) <= most
            walked += step
        every = [sp for sp in _splits(n, problem.pp) if bound.value(sp) < below]
        assert walked == sorted(every)


@pytest.mark.parametrize("seed", range(2))
def test_splits_within_a_bound_are_those_a_plain_enumeration_keeps(seed):
    rng = random.Random(950 + seed)
    for _ in range(10):
        n, problem, bound, limit = _bounded(rng, (5, 12), (1.0, 1.3))
        every = [sp for sp in _splits(n, problem.pp) if bound.value(sp) <= limit]
        assert sorted(splits_within(bound, limit, 10**6)) == sorted(every)


def test_a_split_simulated_for_an_equal_problem_is_not_simulated_again_but_counts_as_evaluated():
    from nanotron_ext.schedule.simulator import StageTimes, simulate

    rng = random.Random(55)
    n, pp, m = 12, 3, 4
    times = [tuple(rng.uniform(0.5, 2.0) for _ in range(n)) for _ in range(3)]
    make = lambda f: ScheduleProblem(f, times[1], times[2], tuple([0.01] * n), (True,) * (n + 1), pp, m, "1f1b")  # noqa: E731
    splits = _splits(n, pp)[::7]
    first = StepTimeEvaluator(make(times[0]))
    expected = first(splits)
    again = StepTimeEvaluator(make(times[0]))  # an equal problem, a new evaluator: every split known
    simulated = []
    plain = again._simulate
    again._simulate = lambda bounds: simulated.append(len(bounds)) or plain(bounds)  # type: ignore[method-assign]
    assert np.array_equal(again(splits), expected) and simulated == []
    assert (again.evaluated, again.work) == (first.evaluated, first.work)  # the budgets run as before
    other = make(tuple(t * 2 for t in times[0]))  # other times: nothing known, each simulated as simulate does
    got = StepTimeEvaluator(other)(splits[:3])
    for split, step in zip(splits[:3], got):
        stages = [
            StageTimes(sum(other.forward[a:b]), sum(other.backward[a:b]), sum(other.update[a:b]))
            for a, b in zip(split, split[1:])
        ]
        ref = simulate(stages, m, "1f1b", [0.01] * (pp - 1)).step_time
        assert math.isclose(step, ref, rel_tol=1e-12), (split, step, ref)
