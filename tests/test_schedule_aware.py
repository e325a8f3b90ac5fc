"""The step-time partitioner (nanotron_ext.partition.schedule_aware): evaluator = simulate, search = brute force,
bounds never above a step time."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from nanotron_ext.config import load_config
from nanotron_ext.errors import PlanningError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.partition import MemoryCap, Requirement, partition
from nanotron_ext.partition.schedule_aware import (
    ScheduleProblem,
    StepTimeEvaluator,
    StepTimeSplit,
    lower_bound,
    slowest_stage_optimum,
    split_memory,
    step_time_partition,
)
from nanotron_ext.plan import make_plan
from nanotron_ext.schedule import min_micro_batches
from nanotron_ext.schedule.simulator import StageTimes, simulate
from nanotron_ext.simulate import simulate_plan


def _random_problem(
    rng: random.Random,
    engines: tuple[str, ...] = ("1f1b", "afab", "zb1p"),
    *,
    ties: bool = False,
    positions: bool = False,
) -> ScheduleProblem:
    n = rng.randint(2, 9)
    pp = rng.randint(1, min(n, 5))
    engine = rng.choice(engines)
    m = rng.randint(min_micro_batches(engine, pp), 9)
    f = [rng.choice([0.0, rng.random(), 5 * rng.random()]) for _ in range(n)]
    b = [x * rng.uniform(0.5, 3) for x in f]
    w = [x * rng.choice([0.0, rng.random(), 1.0]) for x in b]  # weight-gradient share: none, some, all
    u = [0.5 * rng.random() if rng.random() < 0.3 else 0.0 for _ in range(n)]
    send = [0.3 * rng.random() if rng.random() < 0.5 else 0.0 for _ in range(n)]
    if pp > 2 and rng.random() < 0.5:  # links that differ per cut: a row per cut
        send = [tuple(rng.uniform(0.5, 2.0) * x + 0.1 * rng.random() for x in send) for _ in range(pp - 1)]
    first_trainable = rng.choice([0, 0, 0, 1, 2])
    grad_after = tuple(c > first_trainable for c in range(n + 1))
    tied, saving = None, [0.0] * n
    if (
        ties and rng.random() < 0.4
    ):  # a tie: a stage holding both ends saves the lm_head's update and the embedding's sync
        tied = tuple(sorted(rng.sample(range(n), 2)))
        u[tied[0]], u[tied[1]] = 3 * rng.random(), 3 * rng.random()
        saving[tied[0]], saving[tied[1]] = rng.uniform(0, u[tied[0]]), u[tied[1]]
    by_position = []
    if positions and rng.random() < 0.8:  # an in-run profile's prices by stage position, some blocks at some
        for position in rng.sample(("first", "middle", "last"), rng.randint(1, 3)):
            scale = [rng.choice([1.0, rng.uniform(0.5, 1.5)]) for _ in range(n)]
            pb = tuple(x * k for x, k in zip(b, scale))
            by_position.append(
                (
                    position,
                    tuple(x * k for x, k in zip(f, scale)),
                    pb,
                    tuple(min(x * k, y) for x, k, y in zip(w, scale, pb)),
                )
            )
    return ScheduleProblem(
        tuple(f),
        tuple(b),
        tuple(u),
        tuple(send),
        grad_after,
        pp,
        m,
        engine,
        tuple(w),
        tied,
        tuple(saving),
        tuple(by_position),
    )


def _stage_updates_by_hand(problem: ScheduleProblem, bounds) -> list[float]:
    out = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        u = sum(problem.update[s:e])
        if problem.tied_pair is not None and s <= problem.tied_pair[0] and problem.tied_pair[1] < e:
            u -= problem.tied_saving[problem.tied_pair[0]] + problem.tied_saving[problem.tied_pair[1]]
        out.append(u)
    return out


def _all_splits(n: int, pp: int) -> list[tuple[int, ...]]:
    return [(0, *c, n) for c in itertools.combinations(range(1, n), pp - 1)]


def _simulated(problem: ScheduleProblem, bounds) -> float:
    stages, p2p, cuts = problem.simulator_inputs(bounds)
    assert all(isinstance(st, StageTimes) for st in stages)
    return simulate(stages, problem.n_micro_batches, problem.engine, p2p, grad_cuts=cuts).step_time


@pytest.mark.parametrize("seed", range(4))
def test_evaluator_equals_simulate_and_bound_never_above(seed):
    rng = random.Random(seed)
    for _ in range(15):
        problem = _random_problem(rng, ties=True)
        splits = _all_splits(problem.n, problem.pp)
        times = StepTimeEvaluator(problem)(splits)
        for bounds, t in zip(splits, times):
            assert t == pytest.approx(_simulated(problem, bounds), rel=1e-12, abs=1e-15)
            assert lower_bound(problem, bounds) <= t * (1 + 1e-9) + 1e-15
            stages = problem.simulator_inputs(bounds)[0]
            assert [st.update for st in stages] == pytest.approx(_stage_updates_by_hand(problem, bounds), abs=1e-12)


def _every_split_and_the_search(problem: ScheduleProblem) -> tuple[list[float], StepTimeSplit]:
    """Every split's step time by the evaluator, each checked against ``simulate`` and above the lower bound, and
    what the search finds."""
    splits = _all_splits(problem.n, problem.pp)
    times = StepTimeEvaluator(problem)(splits)
    for bounds, t in zip(splits, times):
        assert t == pytest.approx(_simulated(problem, bounds), rel=1e-12, abs=1e-15)
        assert lower_bound(problem, bounds) <= t * (1 + 1e-9) + 1e-15
    return times, step_time_partition(problem)


@pytest.mark.parametrize("seed", range(4))
def test_prices_by_stage_position_keep_evaluator_simulate_bound_and_search_in_step(seed):
    """An in-run profile prices a block by the stage position it runs at: the evaluator still equals simulate, the
    bound stays below every split, and the search finds brute force's fastest split."""
    rng = random.Random(700 + seed)
    by_position = 0
    for _ in range(20):
        problem = _random_problem(rng, ("1f1b", "afab", "zb1p", "zb2p"), ties=True, positions=True)
        by_position += bool(problem.positions) and problem.pp > 1
        times, found = _every_split_and_the_search(problem)
        assert found.step_time == pytest.approx(min(times), rel=1e-9, abs=1e-15)
        assert found.lower_bound <= min(times) * (1 + 1e-9) + 1e-15
    assert by_position >= 5


def test_a_stage_takes_the_prices_of_its_position():
    # Three blocks at 1 s forward, 2 s backward; measured on the first stage at twice that, on the last at half.
    first = ("first", (2.0,) * 3, (4.0,) * 3, (0.0,) * 3)
    last = ("last", (0.5,) * 3, (1.0,) * 3, (0.0,) * 3)
    problem = ScheduleProblem(
        (1.0,) * 3, (2.0,) * 3, (0.0,) * 3, (0.0,) * 3, (True,) * 4, 3, 3, "1f1b", positions=(first, last)
    )
    forward, backward = problem.stage_times((0, 1, 2, 3))[:2]
    assert (forward, backward) == ([2.0, 1.0, 0.5], [4.0, 2.0, 1.0])  # a middle stage: the mean, not measured there
    alone = ScheduleProblem(
        (1.0,) * 3, (2.0,) * 3, (0.0,) * 3, (0.0,) * 3, (True,) * 4, 1, 3, "1f1b", positions=(first, last)
    )
    assert alone.stage_times((0, 3))[:2] == ([3.0], [6.0])  # one stage has no position: the mean
    with pytest.raises(PlanningError, match=r"positions\['top'\]: a position is one of first, middle, last"):
        ScheduleProblem(
            (1.0,) * 3,
            (2.0,) * 3,
            (0.0,) * 3,
            (0.0,) * 3,
            (True,) * 4,
            2,
            3,
            "1f1b",
            positions=(("top", (1.0,) * 3, (1.0,) * 3, (0.0,) * 3),),
        )


def test_a_stage_holding_both_ends_of_a_tie_runs_one_update_and_no_sync():
    # Blocks: embedding (update 1, of which 0.25 the tied sync), a layer (2), lm_head (1.5: all of it saved).
    problem = ScheduleProblem(
        (1.0,) * 3,
        (1.0,) * 3,
        (1.0, 2.0, 1.5),
        (0.0,) * 3,
        (True,) * 4,
        2,
        2,
        "1f1b",
        tied_pair=(0, 2),
        tied_saving=(0.25, 0.0, 1.5),
    )
    assert problem.stage_times((0, 2, 3))[2] == [3.0, 1.5]  # apart: each end steps and syncs
    assert problem.stage_times((0, 3, 3))[2] == [2.75, 0.0]  # together: one step, no sync
    single = ScheduleProblem(
        (1.0,) * 3,
        (1.0,) * 3,
        (1.0, 2.0, 1.5),
        (0.0,) * 3,
        (True,) * 4,
        1,
        2,
        "1f1b",
        tied_pair=(0, 2),
        tied_saving=(0.25, 0.0, 1.5),
    )
    assert single.stage_times((0, 3))[2] == [2.75]
    with pytest.raises(PlanningError, match=r"tied_saving\[2\] = 2.0 exceeds update\[2\] = 1.5"):
        ScheduleProblem(
            (1.0,) * 3,
            (1.0,) * 3,
            (1.0, 2.0, 1.5),
            (0.0,) * 3,
            (True,) * 4,
            2,
            2,
            "1f1b",
            tied_pair=(0, 2),
            tied_saving=(0.25, 0.0, 2.0),
        )
    with pytest.raises(PlanningError, match=r"tied_pair = \(2, 0\); pass \(embedding, lm_head\)"):
        ScheduleProblem((1.0,) * 3, (1.0,) * 3, (1.0,) * 3, (0.0,) * 3, (True,) * 4, 2, 2, "1f1b", tied_pair=(2, 0))


@pytest.mark.parametrize("engine", ["zb1p", "zb2p"])
@pytest.mark.parametrize("seed", range(3))
def test_zero_bubble_evaluator_equals_simulate_bound_below_search_is_brute_force(seed, engine):
    rng = random.Random(300 + seed)
    for _ in range(15):
        problem = _random_problem(rng, (engine,), ties=True)
        times, found = _every_split_and_the_search(problem)
        assert found.exact and found.step_time == pytest.approx(min(times), rel=1e-9, abs=1e-15)


def test_zb1p_problem_of_the_hand_schedule():
    # Four equal blocks F = 1, B = 1, W = 1 on 4 stages, m = 8: tests/test_zb1p.py's hand schedule, step 27;
    # without the split (weight 0) zb1p is 1F1B: 33.
    split = ScheduleProblem((1.0,) * 4, (2.0,) * 4, (0.0,) * 4, (0.0,) * 4, (True,) * 5, 4, 8, "zb1p", (1.0,) * 4)
    assert list(StepTimeEvaluator(split)([(0, 1, 2, 3, 4)])) == [27.0]
    assert step_time_partition(split).step_time == 27.0
    assert lower_bound(split, (0, 1, 2, 3, 4)) <= 27.0
    unsplit = ScheduleProblem((1.0,) * 4, (2.0,) * 4, (0.0,) * 4, (0.0,) * 4, (True,) * 5, 4, 8, "zb1p")
    assert list(StepTimeEvaluator(unsplit)([(0, 1, 2, 3, 4)])) == [33.0]
    with pytest.raises(PlanningError, match=r"weight\[2\] = 3\.0 exceeds backward\[2\] = 2\.0"):
        ScheduleProblem((1.0,) * 4, (2.0,) * 4, (0.0,) * 4, (0.0,) * 4, (True,) * 5, 4, 8, "zb1p", (1.0, 1.0, 3.0, 1.0))
    with pytest.raises(PlanningError, match=r"zb1p .*needs at least pp - 1 = 3 micro-batches, got 2"):
        ScheduleProblem((1.0,) * 4, (2.0,) * 4, (0.0,) * 4, (0.0,) * 4, (True,) * 5, 4, 2, "zb1p", (1.0,) * 4)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_search_matches_brute_force(seed, ties):
    rng = random.Random(100 + seed + 50 * ties)
    for _ in range(20):
        problem = _random_problem(rng, ties=ties)
        brute = min(StepTimeEvaluator(problem)(_all_splits(problem.n, problem.pp)))
        found = step_time_partition(problem)
        assert found.exact
        assert found.step_time == pytest.approx(brute, rel=1e-9, abs=1e-15)
        assert found.lower_bound <= brute * (1 + 1e-9) + 1e-15
        assert _simulated(problem, found.bounds) == pytest.approx(found.step_time, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("seed", range(3))
def test_ties_in_step_time_go_to_the_least_memory_as_brute_force(seed):
    rng = random.Random(400 + seed)
    mattered = 0
    for _ in range(40):
        problem = _random_problem(rng)
        n, pp = problem.n, problem.pp
        terms = MemoryCap(
            tuple(rng.random() for _ in range(n)),
            tuple(rng.random() for _ in range(n)),
            tuple(rng.randint(1, pp) for _ in range(pp)),
            cap=math.inf,
        )
        splits = _all_splits(n, pp)
        times = StepTimeEvaluator(problem)(splits)
        fastest = min(times)
        least = min(split_memory(terms, sp) for sp, t in zip(splits, times) if t <= fastest * (1 + 1e-9))
        found = step_time_partition(problem, least_memory=terms)
        assert found.step_time == pytest.approx(fastest, rel=1e-9, abs=1e-15)
        assert split_memory(terms, found.bounds) == pytest.approx(least, rel=1e-12)
        mattered += split_memory(terms, step_time_partition(problem).bounds) > least * (1 + 1e-9)
    assert mattered >= 3  # the tie-break chose another split than the search alone in several cases


def test_the_tie_break_weighs_a_split_by_its_largest_stage():
    # Blocks 1 and 2 take no time: the three splits tie at 15. Their largest stages (a stage's min is the other's
    # total less it): 5.5, 4.99 and 4.995, the last two close enough to be weighed together; by the smaller stage
    # the third (1.005 < 1.01) would win.
    problem = ScheduleProblem(
        (1.0, 0.0, 0.0, 1.0), (2.0, 0.0, 0.0, 2.0), (0.0,) * 4, (0.0,) * 4, (True,) * 5, 2, 4, "1f1b"
    )
    terms = MemoryCap((0.5, 4.49, 0.005, 1.005), (0.0,) * 4, (1, 1), cap=math.inf)
    splits = [(0, 1, 4), (0, 2, 4), (0, 3, 4)]
    assert list(StepTimeEvaluator(problem)(splits)) == [15.0] * 3
    assert step_time_partition(problem).bounds == (0, 1, 4)
    assert step_time_partition(problem, least_memory=terms).bounds == (0, 2, 4)


@pytest.mark.parametrize("seed", range(2))
def test_lower_bound_is_the_min_max_of_the_path_bound_over_all_splits(seed):
    # The bisection starts from brackets (FLOP min-max, the FLOP split's own bound): it must still land on
    # the smallest path bound any split has, never above it (it is stated as a bound on the optimum).
    rng = random.Random(200 + seed)
    for _ in range(20):
        problem = _random_problem(rng)
        brute = min(lower_bound(problem, s) for s in _all_splits(problem.n, problem.pp))
        found = step_time_partition(problem)
        assert found.lower_bound == pytest.approx(brute, rel=1e-8, abs=1e-15)
        assert found.lower_bound <= brute * (1 + 1e-9) + 1e-15


def test_search_respects_requirements_and_memory_cap():
    rng = random.Random(7)
    for _ in range(30):
        problem = _random_problem(rng)
        n, pp = problem.n, problem.pp
        flags = tuple(rng.random() < 0.7 for _ in range(n))
        static = tuple(rng.random() for _ in range(n))
        memory = MemoryCap(static, (0.0,) * n, (1,) * pp, cap=max(static) * 2.5)
        req = Requirement("flagged blocks", flags)

        def ok(bounds, flags=flags, static=static, memory=memory) -> bool:
            return all(
                any(flags[s:e]) and sum(static[s:e]) <= memory.cap * (1 + 1e-9) for s, e in zip(bounds[:-1], bounds[1:])
            )

        valid = [s for s in _all_splits(n, pp) if ok(s)]
        if not valid:
            with pytest.raises(PlanningError):
                step_time_partition(problem, requirements=[req], memory=memory)
            continue
        found = step_time_partition(problem, requirements=[req], memory=memory)
        assert ok(found.bounds)
        assert found.step_time == pytest.approx(min(StepTimeEvaluator(problem)(valid)), rel=1e-9, abs=1e-15)


def test_memory_cap_leaves_room_for_the_overhead_and_the_micro_batches_in_flight():
    # The cap holds the overhead allowance too, and each stage's activations count once per micro-batch it holds
    # (1F1B: pp - stage): a search that compares a stage with the whole cap, or with one micro-batch, picks splits
    # that do not fit. Both searches (step time and FLOPs) are checked against brute force.
    rng = random.Random(17)
    checked = 0
    for _ in range(40):
        problem = _random_problem(rng)
        n, pp = problem.n, problem.pp
        static = tuple(rng.random() for _ in range(n))
        activation = tuple(0.3 * rng.random() for _ in range(n))
        flight = tuple(
            min(problem.n_micro_batches, pp - k) if problem.engine == "1f1b" else problem.n_micro_batches
            for k in range(pp)
        )
        overhead = max(static)
        fair = (sum(static) + max(flight) * sum(activation)) / pp  # one stage's share of the largest stage memory
        memory = MemoryCap(static, activation, flight, cap=overhead + fair * rng.uniform(1.0, 2.0), overhead=overhead)

        def fits(bounds, memory=memory) -> bool:
            return all(
                memory.overhead + sum(memory.static[s:e]) + memory.in_flight[k] * sum(memory.activation[s:e])
                <= memory.cap * (1 + 1e-9)
                for k, (s, e) in enumerate(zip(bounds[:-1], bounds[1:]))
            )

        splits = _all_splits(n, pp)
        valid = [s for s in splits if fits(s)]
        if not valid:
            with pytest.raises(PlanningError):
                step_time_partition(problem, memory=memory)
            continue
        checked += len(valid) < len(splits)
        found = step_time_partition(problem, memory=memory)
        assert fits(found.bounds), (found.bounds, memory)
        assert found.step_time == pytest.approx(min(StepTimeEvaluator(problem)(valid)), rel=1e-9, abs=1e-15)
        flop = partition(list(problem.forward), pp, memory=memory)
        assert fits(flop.bounds), (flop.bounds, memory)
    assert checked >= 10  # cases where the cap rules out some splits but not all


def test_slowest_stage_optimum_equals_the_dp():
    rng = random.Random(3)
    for _ in range(100):
        n = rng.randint(1, 30)
        pp = rng.randint(1, n)
        costs = [rng.choice([0.0, rng.random(), 10 * rng.random()]) for _ in range(n)]
        assert slowest_stage_optimum(costs, pp) == pytest.approx(partition(costs, pp).max_cost, rel=1e-8, abs=1e-12)


def test_tight_budget_still_returns_a_bound_that_holds():
    rng = random.Random(11)
    problem = ScheduleProblem(
        tuple(rng.random() for _ in range(14)),
        tuple(2 * rng.random() for _ in range(14)),
        (0.0,) * 14,
        (0.0,) * 14,
        (False,) + (True,) * 14,
        5,
        6,
        "1f1b",
    )
    brute = min(StepTimeEvaluator(problem)(_all_splits(14, 5)))
    found = step_time_partition(problem, budget=1)
    assert found.lower_bound <= brute * (1 + 1e-9)
    assert found.step_time <= (1 + found.gap) * brute * (1 + 1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_too_large_to_search_still_carries_a_proven_gap(seed, monkeypatch):
    """Above the search's size limit the bound's split is simulated once: its step time is the simulator's, and
    step ≤ (1 + gap) · the brute-force optimum."""
    from nanotron_ext.partition import schedule_aware

    monkeypatch.setattr(schedule_aware, "_MAX_SIMULATED", 0)  # every problem counts as too large to search
    rng = random.Random(300 + seed)
    for _ in range(10):
        problem = _random_problem(rng)
        found = step_time_partition(problem)
        brute = min(StepTimeEvaluator(problem)(_all_splits(problem.n, problem.pp)))
        assert found.evaluated == 1
        assert found.step_time == pytest.approx(_simulated(problem, found.bounds), rel=1e-12, abs=1e-15)
        assert found.lower_bound <= brute * (1 + 1e-9) + 1e-15
        assert found.step_time <= (1 + found.gap) * brute * (1 + 1e-9) + 1e-15


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_constrained_is_never_slower_than_the_flop_split_on_a_bundled_shape(pp):
    cfg = load_config("nanotron_ext/configs/smollm_360m.yaml", pp=pp)
    blocks = inventory_from_config(cfg)
    steps = {
        name: simulate_plan(make_plan(blocks, cfg, name), blocks, cfg).step_time
        for name in ("constrained", "flops", "nanotron", "uniform")
    }
    assert steps["constrained"] <= min(steps.values()) * (1 + 1e-9)
    slow = make_plan(blocks, cfg.with_overrides(objective="slowest_stage"), "constrained")
    assert slow.block_ranks == make_plan(blocks, cfg, "flops").block_ranks  # the FLOP min-max stays available


def test_micro_batches_override_reaches_the_run_and_the_yaml():
    cfg = load_config("nanotron_ext/configs/smollm_360m.yaml").with_overrides(n_micro_batches=13)
    assert cfg.run.n_micro_batches == 13
    assert cfg.nanotron["tokens"]["batch_accumulation_per_replica"] == 13


@pytest.mark.parametrize("gbps", [None, 1.0])
def test_the_planner_and_simulate_price_every_split_identically(gbps):
    # One pricing: the step-time objective (schedule_problem + StepTimeEvaluator) and `simulate` (simulate_plan)
    # give every split of the seed model the same step time, sends included. The seed model's splits differ a
    # lot in what crosses a cut (hidden states, or vocabulary-sized logits after the lm_head).
    from nanotron_ext.partition import ranks_from_bounds
    from nanotron_ext.plan import Plan
    from nanotron_ext.strategies.step_time import schedule_problem

    cfg = load_config("nanotron_ext/configs/tiny_llama_large_vocab.yaml").with_overrides(p2p_gbps=gbps)
    blocks = inventory_from_config(cfg)
    planner = StepTimeEvaluator(schedule_problem(blocks, cfg))
    splits = _all_splits(len(blocks), cfg.run.pp)
    priced = planner(splits)
    base = make_plan(blocks, cfg, "constrained")
    for bounds, step in zip(splits, priced):
        plan = Plan(**{**base.__dict__, "block_ranks": tuple(ranks_from_bounds(bounds))})
        simulated = simulate_plan(plan, blocks, cfg).step_time
        assert simulated == pytest.approx(step, rel=1e-12), bounds
    assert len(set(priced.round(15))) > 2  # the splits really differ
