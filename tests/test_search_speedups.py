"""The planning speed-ups of issue 55 give the straightforward computation's answer: many segments' memory peaks at
once equal each segment's own estimate, the round trips' path bound is never above a split's step time and prunes
the branch and bound to brute force's optimum, splits simulated ahead count as nothing until scored, the
reachable ends kept as runs answer whether a split fits as every split does, and the bisection for ``LB*`` that
lets a found split answer its steps lands where sweeping every step does."""

from __future__ import annotations

import dataclasses
import itertools
import random

import numpy as np
import pytest

from nanotron_ext.config import bundled_config, load_config
from nanotron_ext.costs.memory_estimate import SegmentMemory
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.partition.branch_bound import branch_and_bound, score
from nanotron_ext.partition.feasible import _MAX_MISFITS, _Runs, least_cap
from nanotron_ext.partition.optimal import MemoryCap
from nanotron_ext.partition.schedule_aware import ScheduleProblem, StepTimeEvaluator, step_time_partition
from nanotron_ext.partition.step_time_bound import RTOL, Bound, Validity, minimise
from nanotron_ext.strategies.step_time import schedule_problem


def _segments(n: int, longest: int) -> tuple[np.ndarray, np.ndarray]:
    """Every segment of at most ``longest`` blocks, and every one that starts at 0 (the tied pair's)."""
    s, e = np.triu_indices(n + 1, 1)
    keep = (e - s <= longest) | (s == 0)
    return s[keep], e[keep]


@pytest.mark.parametrize(
    ("name", "longest"),
    [
        ("tiny_llama_large_vocab.yaml", 99),
        ("smollm_135m.yaml", 99),  # tied: a segment holding both ends is estimated one by one
        ("last_layer_lm_head_pp4.yaml", 99),  # most weights frozen
        ("llava_like_projector_pp2.yaml", 99),
        ("llama_3_70b.yaml", 12),
    ],
)
def test_many_segments_peaks_at_once_are_each_segments_own_estimate(name, longest):
    base = load_config(bundled_config(name))
    combos = [(e, r, False, 1, 0) for e, r in itertools.product(("1f1b", "zb1p", "zb2p", "afab"), ("gpu", "cpu"))]
    combos += [("1f1b", "gpu", True, 1, 0), ("afab", "cpu", True, 1, 0), ("zb1p", "gpu", True, 3, 1)]
    tied = 0
    for engine, runtime, recompute, dp, zero in combos:
        cfg = base.with_overrides(engine=engine, memory_runtime=runtime)
        run = dataclasses.replace(cfg.run, recompute_layer=recompute, dp=dp, zero_stage=zero)  # dp 3: odd shares
        cfg = dataclasses.replace(cfg, run=run)
        blocks = inventory_from_config(cfg)
        segments = SegmentMemory(blocks, cfg)
        s, e = _segments(len(blocks), longest)
        for k in range(cfg.run.pp):
            one_by_one = np.array([segments(k, int(a), int(b)).peak for a, b in zip(s, e)])
            np.testing.assert_allclose(segments.peaks(k, s, e), one_by_one, rtol=1e-13, err_msg=str((engine, k)))
        tied += cfg.model.tie_word_embeddings
    assert tied == (len(combos) if name == "smollm_135m.yaml" else 0)


def _heavy_first(rng: random.Random) -> ScheduleProblem:
    """A 1F1B problem of near-equal blocks, the first heavier: where the first stage paces the pipeline, the round
    trips bind."""
    pp = rng.randint(2, 5)
    n = rng.randint(pp, min(pp + 3, 8))
    m = rng.randint(pp - 1, 3 * pp)
    f = [rng.uniform(0.8, 1.2) * (rng.uniform(1.1, 1.5) if i == 0 else 1.0) for i in range(n)]
    b = [x * rng.uniform(1.5, 2.5) for x in f]
    u = [0.2 * rng.random() if rng.random() < 0.3 else 0.0 for _ in range(n)]
    send = [0.05 * rng.random() for _ in range(n)]
    first_trainable = rng.choice([0, 0, 0, 1])
    grads = tuple(c > first_trainable for c in range(n + 1))
    return ScheduleProblem(tuple(f), tuple(b), tuple(u), tuple(send), grads, pp, m, "1f1b")


def test_a_heavy_first_stage_waits_for_its_first_gradient_then_paces_the_pipeline():
    # Stage 0: F 1, B 2; stages 1 and 2: F 1, B 1.5; m = 4 (stage 0 warms up with F0, F1). Its F0 (1), micro-batch
    # 0's round trip above it (5), its B0 (2) and its last forward F3 (1), micro-batch 3's round trip (5) and its
    # B3 (2): 16, the simulated step exactly; the other path terms reach 15.5.
    problem = ScheduleProblem((1.0,) * 3, (2.0, 1.5, 1.5), (0.0,) * 3, (0.0,) * 3, (True,) * 4, 3, 4, "1f1b")
    split = (0, 1, 2, 3)
    valid = Validity.build(3, (), None)
    assert float(StepTimeEvaluator(problem)([split])[0]) == 16.0
    assert Bound(problem, valid, round_trips=True).value(split) == 16.0
    assert Bound(problem, valid).value(split) == 15.5


@pytest.mark.parametrize("seed", range(3))
def test_the_round_trips_bound_is_never_above_a_step_and_often_above_the_other_terms(seed):
    rng = random.Random(1200 + seed)
    tighter = total = 0
    for _ in range(40):
        problem = _heavy_first(rng)
        valid = Validity.build(problem.n, (), None)
        plain, tight = Bound(problem, valid), Bound(problem, valid, round_trips=True)
        splits = [(0, *c, problem.n) for c in itertools.combinations(range(1, problem.n), problem.pp - 1)]
        times = StepTimeEvaluator(problem)(splits)
        for split, t in zip(splits, times):
            assert tight.value(split) <= t * (1 + 1e-9) + 1e-12, (problem, split)
            tighter += tight.value(split) > plain.value(split) * (1 + 1e-9)
            total += 1
        assert step_time_partition(problem).step_time == pytest.approx(min(times), rel=1e-12)
    assert tighter >= max(15, total // 20)  # the term binds: a bound that never did would test nothing


@pytest.mark.parametrize("seed", range(2))
def test_branch_and_bound_pruned_by_the_round_trips_finds_brute_forces_fastest_from_the_splits_it_leaves(seed):
    rng = random.Random(1300 + seed)
    for _ in range(12):
        problem = _heavy_first(rng)
        valid = Validity.build(problem.n, (), None)
        bound = Bound(problem, valid)
        splits = [(0, *c, problem.n) for c in itertools.combinations(range(1, problem.n), problem.pp - 1)]
        brute = min(score(StepTimeEvaluator(problem), bound, splits))
        tight = Bound(problem, valid, round_trips=True)
        poor = (brute[0] * 3, 0.0, splits[0])  # the search must find the optimum itself
        found, done = branch_and_bound(StepTimeEvaluator(problem), bound, poor, 10**6, prune=tight)
        assert done and found == brute
        # From the optimum (as after the descent) the search proves it, simulating the splits the bound leaves.
        plain, pruned = StepTimeEvaluator(problem), StepTimeEvaluator(problem)
        assert branch_and_bound(pruned, bound, brute, 10**6, prune=tight) == (brute, True)
        assert branch_and_bound(plain, bound, brute, 10**6) == (brute, True)
        left = [
            sp
            for sp in splits
            if max(tight.stage_value(k, sp[k], np.array([sp[k + 1]]))[0] for k in range(problem.pp))
            < brute[0] * (1 - 1e-9)
        ]
        assert pruned.evaluated == len(left) <= plain.evaluated


def test_the_round_trips_leave_the_70b_shapes_branch_and_bound_under_half_the_splits():
    # Llama-3-70B at tp 4, pp 16, recomputed layers: the first stage takes a sixth layer and paces the pipeline.
    cfg = load_config(bundled_config("llama_3_70b.yaml")).with_overrides(pp=16)
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, tp=4, recompute_layer=True))
    problem = schedule_problem(inventory_from_config(cfg), cfg)
    found = step_time_partition(problem)
    assert found.exact and found.evaluated < 10_000  # the search prunes by them too: 19,505 splits without
    valid = Validity.build(problem.n, (), None)
    bound, best = Bound(problem, valid), (found.step_time, 0.0, found.bounds)
    plain, pruned = StepTimeEvaluator(problem), StepTimeEvaluator(problem)
    assert branch_and_bound(plain, bound, best, 10**6)[1]
    assert branch_and_bound(pruned, bound, best, 10**6, prune=Bound(problem, valid, round_trips=True))[1]
    assert pruned.evaluated < plain.evaluated / 2


def test_splits_simulated_ahead_count_as_nothing_until_scored():
    rng = random.Random(1400)
    problem = _heavy_first(rng)
    splits = [(0, *c, problem.n) for c in itertools.combinations(range(1, problem.n), problem.pp - 1)]
    ahead, plain = StepTimeEvaluator(problem), StepTimeEvaluator(problem)
    ahead.prefetch(splits)
    assert (ahead.evaluated, ahead.work) == (0, 0.0)
    simulated = []
    ahead._simulate = lambda bounds: simulated.append(len(bounds))  # type: ignore[method-assign]
    assert np.array_equal(ahead(splits[:3]), plain(splits[:3])) and simulated == []
    assert (ahead.evaluated, ahead.work) == (plain.evaluated, plain.work)


def _splits(n: int, pp: int) -> list[tuple[int, ...]]:
    return [(0, *c, n) for c in itertools.combinations(range(1, n), pp - 1)]


def _least_largest_stage(prefixes: list[np.ndarray], pp: int) -> float:
    """Brute force: the least, over every split, of its largest stage (``q[e] - q[s]`` on its stage)."""
    n = len(prefixes[0]) - 1
    return min(
        max(prefixes[k][e] - prefixes[k][s] for k, (s, e) in enumerate(zip(sp, sp[1:]))) for sp in _splits(n, pp)
    )


@pytest.mark.parametrize("seed", range(4))
def test_the_runs_of_reachable_ends_say_a_split_fits_exactly_when_one_does(seed):
    # Blocks from a few sizes (ties, zeros, rooms that equal a segment exactly) or any size; a stage's blocks
    # alone may be too large for it, which splits the reachable ends into runs.
    rng = random.Random(seed)
    for _ in range(150):
        n = rng.randint(1, 9)
        pp = rng.randint(1, n + 1)
        sizes = [0.0, 0.1, 0.2, 0.3, 1.0, 2.5, 7.0] if rng.random() < 0.5 else None
        prefixes = [
            np.concatenate([[0.0], np.cumsum([rng.choice(sizes) if sizes else rng.uniform(0, 5) for _ in range(n)])])
            for _ in range(pp)
        ]
        rooms = {float(q[e] - q[s]) for q in prefixes for s in range(n + 1) for e in range(s, n + 1)}
        runs = _Runs(prefixes)
        for room in sorted(rooms)[:: max(1, len(rooms) // 12)] + [rng.uniform(0, 10), -1.0]:
            every = _splits(n, pp) if pp <= n else []
            fits = any(
                all(prefixes[k][e] - prefixes[k][s] <= room for k, (s, e) in enumerate(zip(sp, sp[1:]))) for sp in every
            )
            assert runs.reach(room) is fits, (n, pp, room, [q.tolist() for q in prefixes])


def test_many_blocks_too_large_alone_leave_the_question_to_the_array_sweep():
    # Alternating sizes: under a room of 5, every other block fits no stage alone, more than the runs keep.
    n, pp = 2 * (_MAX_MISFITS + 2), 3
    sizes = [1.0, 10.0] * (n // 2)
    memory = MemoryCap(tuple(sizes), (0.0,) * n, (1,) * pp, cap=5.0)
    prefixes = [memory.prefix(k) for k in range(pp)]
    assert _Runs(prefixes).reach(5.0) is None
    assert _Runs(prefixes).reach(10.0 * n) is True
    least = least_cap(n, pp, [], memory, rtol=1e-6)  # its low probes asked of the sweep, its high of the runs
    exact = _least_largest_stage(prefixes, pp)
    assert least is not None and exact * (1 - 1e-6) <= least <= exact


def _swept(bound: Bound) -> list[float]:
    """Count ``bound``'s sweeps: the values it is asked under, in order."""
    asked: list[float] = []
    reach = bound.reach

    def counted(x: float) -> list[np.ndarray] | None:
        asked.append(x)
        return reach(x)

    bound.reach = counted  # type: ignore[method-assign]
    return asked


def _every_step_swept(bound: Bound, hi: float, lo: float) -> tuple[float, list[np.ndarray]]:
    """``minimise`` as first written: a sweep at every step of the bisection."""
    reach = bound.reach(hi)
    if not 0.0 < lo < hi or bound.reach(lo) is not None:
        lo = 0.0
    while hi - lo > RTOL * hi:
        mid = 0.5 * (lo + hi)
        r = bound.reach(mid)
        lo, hi, reach = (mid, hi, reach) if r is None else (lo, mid, r)
    return hi, reach


def test_the_bisection_for_the_least_bound_lands_where_sweeping_every_step_does_with_fewer_sweeps():
    swept = plain = 0
    for name, pp, engine in itertools.product(("smollm_135m.yaml", "llama_3_8b.yaml"), (4, 8), ("1f1b", "zb1p")):
        cfg = load_config(bundled_config(name), pp=pp).with_overrides(engine=engine)
        problem = schedule_problem(inventory_from_config(cfg), cfg)
        for kind, lo in itertools.product(({}, {"slowest_stage": True}), (0.0, 1e-4)):
            fast, slow = (
                Bound(problem, Validity.build(problem.n, (), None), **kind),
                Bound(problem, Validity.build(problem.n, (), None), **kind),
            )
            asked, every = _swept(fast), _swept(slow)
            x, reach = minimise(fast, 1e3, lo)
            y, expected = _every_step_swept(slow, 1e3, lo)
            assert x == y, (name, pp, engine, kind)
            assert all(np.array_equal(a, b) for a, b in zip(reach, expected, strict=True))
            assert set(asked) <= set(every)  # no value the bisection as first written does not test
            swept, plain = swept + len(asked), plain + len(every)
    assert swept < 0.65 * plain, (swept, plain)  # 736 of 1,436; 1,108 when a split answers only the first steps
