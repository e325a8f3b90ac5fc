"""Cutting the blocks into a V's 2·pp chunks for the simulated ZB-V step (``nanotron_ext.partition.v_split``): a
descent, checked against every split by brute force on small models."""

from __future__ import annotations

import itertools

import pytest
from v_cases import v_case

from nanotron_ext.config import bundled_config, load_config
from nanotron_ext.errors import PlanningError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.partition.v_split import MOVES, descend_v_split, v_step
from nanotron_ext.strategies.step_time import schedule_problem


def _case(name: str, pp: int, layers: int | None = None):
    """The blocks of ``name`` priced as 2·pp stages under zb1p, m = 2·pp; the splits with weights on every chunk."""
    cfg, blocks, valid = v_case(name, pp, layers)
    n = len(blocks)
    splits = [(0, *c, n) for c in itertools.combinations(range(1, n), 2 * pp - 1) if valid((0, *c, n))]
    return schedule_problem(blocks, cfg), valid, splits


@pytest.mark.parametrize(
    ("name", "pp", "layers", "within"),
    [
        ("tiny_llama_large_vocab.yaml", 2, None, 1.0),  # 4 splits: every seed reaches the best
        ("smollm_135m.yaml", 2, 6, 1.05),  # 56 splits: a local search, within 5 % of the best from any seed
    ],
)
def test_the_descent_never_loses_stops_where_no_move_helps_and_nears_the_best_split(name, pp, layers, within):
    problem, valid, splits = _case(name, pp, layers)
    steps = {split: v_step(problem, split) for split in splits}
    best = min(steps.values())
    for seed in splits[:: max(1, len(splits) // 6)]:
        found = descend_v_split(problem, seed, valid=valid)
        assert found.seed_step == steps[seed] and found.step <= found.seed_step
        assert found.step == steps[found.bounds] and found.step <= best * within * (1 + 1e-12)  # ties round apart
        for cut, move in itertools.product(range(1, len(seed) - 1), MOVES):
            neighbour = list(found.bounds)
            neighbour[cut] += move
            if tuple(neighbour) in steps:
                assert steps[tuple(neighbour)] >= found.step * (1 - 1e-12), (found.bounds, neighbour)


def test_the_descent_takes_only_splits_the_constraints_accept():
    problem, valid, splits = _case("tiny_llama_large_vocab.yaml", 2)
    steps = {split: v_step(problem, split) for split in splits}
    best = min(steps, key=steps.get)
    allowed = [split for split in splits if split != best]  # the best split forbidden: the descent must not take it
    for seed in allowed:
        found = descend_v_split(problem, seed, valid=lambda bounds: valid(bounds) and tuple(bounds) != best)
        assert found.bounds != best and found.bounds in allowed


def test_the_descent_stops_at_its_budget_with_the_best_so_far():
    problem, valid, splits = _case("smollm_135m.yaml", 2, 6)
    seed = max(splits, key=lambda split: v_step(problem, split))
    assert descend_v_split(problem, seed, valid=valid, max_evals=1).bounds == seed
    few = descend_v_split(problem, seed, valid=valid, max_evals=4)
    assert few.evaluated == 4 and few.step < few.seed_step


def test_a_split_that_is_no_v_or_no_valid_seed_is_refused():
    problem, valid, splits = _case("tiny_llama_large_vocab.yaml", 2)
    with pytest.raises(PlanningError, match=r"seed split \[0, 1, 2, 7\] is not 4 non-empty chunks of 7 blocks"):
        descend_v_split(problem, (0, 1, 2, 7), valid=valid)
    cfg = load_config(bundled_config("tiny_llama_large_vocab.yaml"), pp=3).with_overrides(
        engine="zb1p", n_micro_batches=3
    )
    with pytest.raises(PlanningError, match="3 chunks; a V has two per rank"):
        descend_v_split(schedule_problem(inventory_from_config(cfg), cfg), (0, 1, 2, 7))


def _plain_descent(problem, seed, valid, max_evals):
    """The descent with every trial simulated to its end (no budget in bytes: every trial has a step)."""
    best, evaluated, improved = tuple(seed), 1, True
    best_step = v_step(problem, best)
    while improved and evaluated < max_evals:
        improved = False
        for cut in range(1, len(best) - 1):
            for move in MOVES:
                trial = list(best)
                trial[cut] += move
                if not trial[cut - 1] < trial[cut] < trial[cut + 1] or not valid(trial):
                    continue
                step, evaluated = v_step(problem, trial), evaluated + 1
                if step < best_step * (1 - 1e-12):
                    best, best_step, improved = tuple(trial), step, True
                if evaluated >= max_evals:
                    break
            if evaluated >= max_evals:
                break
    return best, best_step, evaluated


@pytest.mark.parametrize("max_evals", range(2, 14))
def test_a_descent_that_stops_slower_trials_early_walks_as_one_that_simulates_them_to_the_end(max_evals):
    problem, valid, splits = _case("smollm_135m.yaml", 2, 6)
    for seed in splits[::9]:
        found = descend_v_split(problem, seed, valid=valid, max_evals=max_evals)
        assert (found.bounds, found.step, found.evaluated) == _plain_descent(problem, seed, valid, max_evals)
