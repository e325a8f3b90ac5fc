"""A V rank's peak memory (``nanotron_ext.costs.v_memory``): both chunks' terms added at the moments they coincide,
the moments checked against a sweep of the simulated timeline."""

from __future__ import annotations

import dataclasses
import random

import pytest

from nanotron_ext.blocks import held_parameters
from nanotron_ext.config import bundled_config, load_config
from nanotron_ext.costs.analytic import param_bytes
from nanotron_ext.costs.memory_estimate import config_stage_memory
from nanotron_ext.costs.v_memory import FIRST_BACKWARD, VRankMemory, v_rank_memory
from nanotron_ext.errors import PlanningError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.partition.v_split import v_floors, v_peaks, v_simulate
from nanotron_ext.schedule.simulator import StageTimes
from nanotron_ext.schedule.v_moments import VMoment, v_moments
from nanotron_ext.schedule.zbv import simulate_zbv, v_rank
from nanotron_ext.strategies.step_time import schedule_problem


def _swept(result, rank: int) -> list[tuple[tuple[int, int], tuple[int, int], int, str]]:
    """The reference: at each start of one of ``rank``'s ops, count by time which micro-batches hold each chunk's
    activations (F's start to B's end) and W state (B's start to W's end)."""
    pp = result.pp
    mine = [o for o in result.ops if v_rank(pp, o.stage) == rank]
    by = {(o.kind, o.micro_batch, o.stage): o for o in mine}
    out = []
    for o in sorted(mine, key=lambda o: o.start):
        t = o.start
        held, pending = [0, 0], [0, 0]
        for f in (x for x in mine if x.kind == "F"):
            b = by[("B", f.micro_batch, f.stage)]
            w = by[("W", f.micro_batch, f.stage)]
            chunk = 0 if f.stage < pp else 1
            held[chunk] += f.start <= t < b.end
            pending[chunk] += b.start <= t < w.end
        out.append(((held[0], held[1]), (pending[0], pending[1]), 0 if o.stage < pp else 1, o.kind))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_each_moment_counts_what_a_sweep_of_the_timeline_counts(seed):
    rng = random.Random(seed)
    pp, m = rng.choice([(2, 4), (3, 6), (4, 8), (4, 5)])
    chunks = []
    for _ in range(2 * pp):
        backward = rng.uniform(1.0, 3.0)
        chunks.append(StageTimes(rng.uniform(0.5, 1.5), backward, weight=backward * rng.uniform(0.2, 0.6)))
    result = simulate_zbv(chunks, m, rng.uniform(0.0, 0.3))
    for rank in range(pp):
        got = v_moments(result, rank)
        assert len(got) == 3 * 2 * m
        assert [tuple(x) for x in got] == _swept(result, rank)


def _v(name: str, pp: int):
    cfg = load_config(bundled_config(name), pp=2 * pp).with_overrides(
        engine="zb1p", n_micro_batches=2 * pp, memory_runtime="gpu"
    )
    blocks = inventory_from_config(cfg)
    problem = schedule_problem(blocks, cfg)
    n = len(blocks)
    bounds = tuple(round(i * n / (2 * pp)) for i in range(2 * pp + 1))
    result = v_simulate(problem, bounds)
    return cfg, blocks, bounds, result


def test_a_ranks_peak_is_its_worst_moment_not_the_sum_of_each_chunks_worst():
    cfg, blocks, bounds, result = _v("smollm_135m.yaml", 4)
    peaks = v_peaks(blocks, cfg, bounds, result)
    apart = 0
    for rank, mem in enumerate(peaks):
        moments = v_moments(result, rank)
        assert mem.pipeline_peak == max(mem.pipeline_at(x) for x in moments)
        assert mem.peak == max(mem.pipeline_peak, mem.optimizer_peak)
        # Each chunk at its own worst, added: an upper bound the V's moments never reach.
        each_worst = (
            mem.weights
            + mem.gradients
            + mem.optimizer
            + mem.buffers
            + mem.overhead
            + sum(
                max(x.held[c] for x in moments) * mem.activations[c]
                + max(x.pending[c] for x in moments) * mem.weight_pending[c]
                for c in (0, 1)
            )
            + max(mem.temporaries)
        )
        assert mem.pipeline_peak <= each_worst
        apart += mem.pipeline_peak < each_worst
    assert apart >= 1  # somewhere the chunks' worst moments do not coincide


def test_what_a_rank_holds_throughout_is_both_chunks_and_a_tied_weight_once():
    cfg, blocks, bounds, result = _v("smollm_135m.yaml", 2)
    assert cfg.model.tie_word_embeddings
    peaks = v_peaks(blocks, cfg, bounds, result)
    chunk = [blocks[s:e] for s, e in zip(bounds, bounds[1:])]
    per = param_bytes(cfg.run)
    for rank, mem in enumerate(peaks):
        mine = [*chunk[rank], *chunk[2 * 2 - 1 - rank]]
        assert mem.weights == held_parameters(mine, True)[0] * per.weights
        apart = [config_stage_memory(c, cfg, 0) for c in (chunk[rank], chunk[3 - rank])]
        tied = rank == 0  # rank 0 holds the embedding (first chunk) and the lm_head (last): one tensor
        assert (mem.weights < apart[0].weights + apart[1].weights) == tied
        assert mem.activations == (apart[0].activations, apart[1].activations)


def test_a_moments_bytes_add_each_chunks_terms_times_its_own_counts():
    mem = VRankMemory(
        rank=0,
        weights=1.0,
        gradients=2.0,
        optimizer=4.0,
        buffers=8.0,
        optimizer_temporaries=16.0,
        overhead=32.0,
        activations=(100.0, 1000.0),
        weight_pending=(10_000.0, 100_000.0),
        temporaries=(1e6, 1e7),
        worst=VMoment((0, 0), (0, 0), 0, "F"),
    )
    assert mem.pipeline_at(VMoment((2, 3), (4, 5), 1, "B")) == 47 + 200 + 3000 + 40_000 + 500_000 + 1e7
    assert mem.pipeline_at(VMoment((1, 0), (0, 1), 0, "F")) == 47 + 100 + 100_000 + 1e6
    assert mem.optimizer_peak == 63  # what it holds throughout (47) and the step's temporaries (16)
    assert mem.peak_at == "pipeline" and mem.peak == mem.pipeline_peak
    stepping = dataclasses.replace(mem, optimizer_temporaries=1e9)  # AdamW's temporaries over any pipeline moment
    assert stepping.peak_at == "optimizer" and stepping.peak == 47 + 1e9


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda cfg, b: v_rank_memory((b[:1], b[1:2]), [], cfg, 0), r"rank 0 of the V has no ops"),
        (
            lambda cfg, b: v_rank_memory((b[:1], []), [VMoment((1, 0), (0, 0), 0, "F")], cfg, 3),
            r"rank 3 of the V has an empty chunk",
        ),
        (
            lambda cfg, b: v_peaks(b, cfg, (0, 1, len(b)), simulate_zbv([StageTimes(1, 2)] * 4, 4)),
            r"bounds \[0, 1, \d+\] are not 4 chunks of \d+ blocks \(pp=2\)",
        ),
        (lambda cfg, b: v_moments(simulate_zbv([StageTimes(1, 2)] * 4, 4), 2), r"rank 2 is outside 0\.\.1"),
    ],
)
def test_bad_input_names_the_value(call, match):
    cfg = load_config(bundled_config("smollm_135m.yaml"), pp=4).with_overrides(engine="zb1p")
    with pytest.raises((PlanningError, ValueError), match=match):
        call(cfg, inventory_from_config(cfg))


def test_every_rank_passes_the_first_backwards_moment_so_the_floor_is_under_every_schedules_peak():
    cfg, blocks, bounds, _ = _v("smollm_135m.yaml", 2)
    problem = schedule_problem(blocks, cfg)
    n = len(blocks)
    for cuts, m in [
        ((1, 2, 3), 4),
        ((2, 5, 8), 4),
        ((3, 6, 9), 4),
        ((1, n - 3, n - 1), 4),
        (bounds[1:-1], 4),
        (bounds[1:-1], 1),
    ]:  # one micro-batch: one activation of each chunk at most
        split = (0, *cuts, n)
        stages, p2p, _ = problem.simulator_inputs(split)
        result = simulate_zbv(stages, m, p2p)
        floors, peaks = v_floors(blocks, cfg, split), v_peaks(blocks, cfg, split, result)
        for rank, (floor, mem) in enumerate(zip(floors, peaks)):
            # The moment is in every schedule: some start on the way up holds at least its counts.
            assert any(
                x.running == FIRST_BACKWARD.running
                and x.kind == "B"
                and all(a >= b for a, b in zip(x.held + x.pending, FIRST_BACKWARD.held + FIRST_BACKWARD.pending))
                for x in v_moments(result, rank)
            ), (split, rank)
            assert mem.optimizer_peak <= floor <= mem.peak
            assert floor == max(mem.pipeline_at(FIRST_BACKWARD), mem.optimizer_peak)
