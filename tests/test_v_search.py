"""The best V split under memory (``nanotron_ext.partition.v_search``): branch and bound, checked against every
split by brute force on small models, under caps that bind."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import pytest
from v_cases import v_case

from nanotron_ext.errors import PlanningError
from nanotron_ext.partition.schedule_problem import ScheduleProblem
from nanotron_ext.partition.v_search import search_v_split, v_lower_bound
from nanotron_ext.partition.v_split import (
    descend_v_split,
    simulate_within,
    v_budget,
    v_floors,
    v_peaks,
    v_simulate,
)
from nanotron_ext.strategies.step_time import schedule_problem

CASES = [("tiny_llama_large_vocab.yaml", 2, None), ("smollm_135m.yaml", 2, 6), ("smollm_135m.yaml", 3, 7)]


@functools.cache
def _case(name: str, pp: int, layers: int | None):
    """The blocks priced as 2·pp chunks (zb1p's B and W, m = 2·pp, the GPU's memory terms), every split with weights
    on every chunk, and each one's simulated step and largest rank peak."""
    cfg, blocks, valid = v_case(name, pp, layers, memory_runtime="gpu")
    n = len(blocks)
    problem = schedule_problem(blocks, cfg)
    splits = {}
    for c in itertools.combinations(range(1, n), 2 * pp - 1):
        if valid((0, *c, n)):
            result = v_simulate(problem, (0, *c, n))
            splits[(0, *c, n)] = (result.step_time, max(x.peak for x in v_peaks(blocks, cfg, (0, *c, n), result)))
    return cfg, blocks, problem, valid, splits


def _fits(blocks, cfg, cap):
    return lambda bounds, result: max(x.peak for x in v_peaks(blocks, cfg, bounds, result)) <= cap


def _even(n: int, chunks: int) -> tuple[int, ...]:
    return tuple(round(i * n / chunks) for i in range(chunks + 1))


# The tiny model's fastest split also has the least peak: no cap binds there.
@pytest.mark.parametrize(
    ("case", "cap"),
    [
        *((case, cap) for case in CASES for cap in ("none", "the median peak")),
        *((case, "just under the fastest split's peak") for case in CASES[1:]),
    ],
    ids=lambda x: f"{x[0]}-pp{x[1]}" if isinstance(x, tuple) else x,
)
def test_the_search_finds_the_fastest_split_that_fits_and_proves_it(case, cap):
    cfg, blocks, problem, valid, splits = _case(*case)
    fastest = min(splits.values())
    limit = {
        "none": math.inf,
        "the median peak": sorted(peak for _, peak in splits.values())[len(splits) // 2],
        "just under the fastest split's peak": max(
            (peak for _, peak in splits.values() if peak < fastest[1]), default=None
        ),
    }[cap]
    best = min(step for step, peak in splits.values() if peak <= limit)
    got = search_v_split(problem, _even(len(blocks), 2 * case[1]), valid=valid, fits=_fits(blocks, cfg, limit))
    assert got.bounds in splits and splits[got.bounds][1] <= limit
    assert got.step == best == splits[got.bounds][0]
    assert got.proven and got.bound == got.step and got.gap == 0.0
    assert (best > fastest[0]) == cap.startswith("just under")  # that cap binds: the fastest split is over it


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-pp{c[1]}")
def test_the_lower_bound_is_under_every_splits_step(case):
    _, _, problem, _, splits = _case(*case)
    assert all(v_lower_bound(problem, bounds) <= step * (1 + 1e-12) for bounds, (step, _) in splits.items())


@pytest.mark.parametrize(("pp", "m", "per_chunk"), [(2, 4, 2), (3, 6, 1), (4, 8, 2)])
def test_the_lower_bound_is_the_vs_floor_on_equal_chunks_and_adds_the_cuts_above_the_last_rank(pp, m, per_chunk):
    # Equal chunks with W half the backward: ZB-V lands on its floor, (pp - 1) F / 2 + m (F + B + W) for a rank's
    # two chunks, and the bound is exact. With p2p the first forward crosses pp - 1 cuts to reach the last rank.
    n = 2 * pp * per_chunk
    bounds = tuple(range(0, n + 1, per_chunk))

    def problem(p2p: float) -> ScheduleProblem:
        return ScheduleProblem(
            forward=(1.0,) * n,
            backward=(2.0,) * n,
            update=(0.0,) * n,
            send=(p2p,) * n,
            grad_after=(True,) * (n + 1),
            pp=2 * pp,
            n_micro_batches=m,
            engine="zb1p",
            weight=(1.0,) * n,
        )

    floor = (pp - 1) * per_chunk + m * 2 * per_chunk * 3
    assert v_lower_bound(problem(0.0), bounds) == floor == v_simulate(problem(0.0), bounds).step_time
    assert (
        v_lower_bound(problem(0.25), bounds) == floor + (pp - 1) * 0.25 <= v_simulate(problem(0.25), bounds).step_time
    )


def test_no_split_that_fits_is_said_and_none_is_returned():
    cfg, blocks, problem, valid, splits = _case(*CASES[1])
    got = search_v_split(
        problem,
        _even(len(blocks), 4),
        valid=valid,
        fits=_fits(blocks, cfg, min(peak for _, peak in splits.values()) * 0.99),
    )
    assert got.bounds is None and got.step == math.inf and not got.proven


def test_a_search_out_of_budget_says_how_far_it_may_be_from_the_best():
    cfg, blocks, problem, valid, splits = _case(*CASES[2])
    seed = _even(len(blocks), 6)
    short = search_v_split(problem, seed, valid=valid, max_evals=3)
    assert not short.proven and short.bound <= min(step for step, _ in splits.values()) <= short.step
    assert short.gap == short.step / short.bound - 1 > 0
    walked = search_v_split(problem, seed, valid=valid, max_nodes=5)  # the bound falls back to the average work
    assert not walked.proven and walked.bound <= min(step for step, _ in splits.values())


def test_the_descent_keeps_to_splits_that_fit_and_refuses_a_seed_that_does_not():
    cfg, blocks, problem, valid, splits = _case(*CASES[1])
    peaks = sorted(peak for _, peak in splits.values())
    cap = peaks[len(peaks) // 2]
    seed = next(b for b, (_, peak) in sorted(splits.items(), key=lambda kv: -kv[1][0]) if peak <= cap)
    moved = descend_v_split(problem, seed, valid=valid, fits=_fits(blocks, cfg, cap))
    assert splits[moved.bounds][1] <= cap and moved.step <= splits[seed][0]
    over = next(b for b, (_, peak) in splits.items() if peak > cap)
    with pytest.raises(PlanningError, match=r"seed split \[.*\] does not fit the memory; start from one that does"):
        descend_v_split(problem, over, valid=valid, fits=_fits(blocks, cfg, cap))


@pytest.mark.parametrize(
    ("seed", "match"),
    [
        ((0, 3, 5, 11), r"seed split \[0, 3, 5, 11\] is not 4 non-empty chunks of 11 blocks"),
        ((0, 3, 3, 5, 11), r"seed split \[0, 3, 3, 5, 11\] is not 4 non-empty chunks"),
    ],
)
def test_a_seed_that_is_no_split_is_refused(seed, match):
    _, _, problem, _, _ = _case(*CASES[1])
    with pytest.raises(PlanningError, match=match):
        search_v_split(problem, seed)


def test_an_odd_number_of_chunks_is_no_v():
    _, _, problem, _, _ = _case(*CASES[1])
    with pytest.raises(PlanningError, match=r"3 chunks; a V has two per rank"):
        search_v_split(dataclasses.replace(problem, pp=3, send=problem.send[:2]), (0, 3, 6, 11))


@pytest.mark.parametrize("case", CASES[1:], ids=lambda c: f"{c[0]}-pp{c[1]}")
def test_scheduled_under_its_byte_budget_every_split_keeps_each_ranks_estimate_under_the_cap(case):
    cfg, blocks, problem, valid, splits = _case(*case)
    # Under the fastest split's least peak whatever its order (v_floors), where other splits' are lower: no order
    # of it fits. Else (the fastest split has the least floor) just under its peak as it runs unbudgeted.
    fastest = min(splits, key=splits.get)
    floors = {bounds: max(v_floors(blocks, cfg, bounds)) for bounds in splits}
    under = [floor for floor in floors.values() if floor < floors[fastest]]
    cap = max(under) if under else max(peak for _, peak in splits.values() if peak < splits[fastest][1])

    def budgets(bounds):
        return v_budget(blocks, cfg, bounds, cap)

    scheduled = {}
    for bounds in splits:
        result = simulate_within(problem, bounds, budgets=budgets)
        if result is not None:
            assert max(x.peak for x in v_peaks(blocks, cfg, bounds, result)) <= cap * (1 + 1e-9), bounds
            scheduled[bounds] = result.step_time
    assert len(scheduled) > sum(peak <= cap for _, peak in splits.values())  # the budget makes more splits fit
    assert (fastest not in scheduled) == bool(under)
    # The budget alone keeps the search's split under the cap (no check of the peaks after simulating).
    got = search_v_split(problem, _even(len(blocks), 2 * case[1]), valid=valid, budgets=budgets)
    assert got.proven and got.step == min(scheduled.values()) and scheduled[got.bounds] == got.step


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-pp{c[1]}")
@pytest.mark.parametrize("quantile", [0.1, 0.5, 0.9])
def test_the_walk_keeps_every_split_whose_bound_is_under_the_threshold_and_no_other(case, quantile):
    from nanotron_ext.partition.v_search import _leaves, _Prices

    _, blocks, problem, _, _ = _case(*case)
    n, chunks = len(blocks), problem.pp
    bounds = {(0, *c, n): v_lower_bound(problem, (0, *c, n)) for c in itertools.combinations(range(1, n), chunks - 1)}
    threshold = sorted(bounds.values())[int(quantile * (len(bounds) - 1))]
    leaves, dropped = _leaves(_Prices(problem), problem.n_micro_batches, n, threshold, 10**6, 10**7)
    assert dropped == math.inf
    assert {split for _, split in leaves} == {split for split, lb in bounds.items() if lb < threshold}
    for lb, split in leaves:
        assert math.isclose(lb, bounds[split], rel_tol=1e-12)


@pytest.mark.parametrize("cap", ["the tenth percentile peak", "just under the fastest split's peak"])
def test_from_any_seed_that_fits_the_descent_ends_on_a_split_that_fits(cap):
    cfg, blocks, problem, valid, splits = _case(*CASES[1])
    peaks = sorted(peak for _, peak in splits.values())
    fastest = min(splits, key=lambda b: splits[b][0])
    limit = peaks[len(peaks) // 10] if cap.startswith("the tenth") else splits[fastest][1] * (1 - 1e-9)
    for seed in [b for b, (_, peak) in splits.items() if peak <= limit]:
        moved = descend_v_split(problem, seed, valid=valid, fits=_fits(blocks, cfg, limit))
        assert splits[moved.bounds][1] <= limit, (seed, moved.bounds)
