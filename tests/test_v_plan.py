"""``make_v_plan`` (``nanotron_ext.plan.v_plan``): the V split of a config's blocks for the simulated ZB-V step under
each rank's memory, as plain data that prints two chunks per rank; exact against every split on a small model."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from nanotron_ext.config import load_config
from nanotron_ext.errors import PlanningError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.partition.v_split import v_peaks, v_simulate
from nanotron_ext.plan.v_plan import make_v_plan
from nanotron_ext.schedule.zbv import v_rank
from nanotron_ext.strategies.step_time import schedule_problem

TINY = Path(__file__).resolve().parents[1] / "nanotron_ext" / "configs" / "tiny_llama_large_vocab.yaml"


def _tiny(**ext: object):
    cfg = load_config(TINY, pp=2).with_overrides(**ext)
    return cfg, inventory_from_config(cfg)


def _every_split(cfg, blocks) -> dict[tuple[int, ...], tuple[float, float]]:
    """Every split into four chunks that each train something: its best simulated step (the loss chunk's W deferred or at once), its peak."""
    chunked = cfg.with_overrides(pp=4, engine="zb1p")
    problem = schedule_problem(blocks, chunked)
    out = {}
    trains = [b.trainable > 0 for b in blocks]
    for cuts in itertools.combinations(range(1, len(blocks)), 3):
        bounds = (0, *cuts, len(blocks))
        if not all(any(trains[a:b]) for a, b in zip(bounds, bounds[1:])):
            continue  # a chunk that trains nothing (the cast, the loss alone) is not a V the plan may take
        results = [v_simulate(problem, bounds, eager) for eager in ((), (3,))]
        best = min(results, key=lambda r: r.step_time)
        out[bounds] = (best.step_time, max(x.peak for x in v_peaks(blocks, chunked, bounds, best)))
    return out


def test_the_tiny_models_v_is_the_fastest_split_and_prints_two_chunks_per_rank() -> None:
    cfg, blocks = _tiny()
    plan = make_v_plan(blocks, cfg)
    assert plan.step_time == pytest.approx(min(step for step, _ in _every_split(cfg, blocks).values()), rel=1e-12)
    assert plan.stages == sorted(plan.stages) and set(plan.stages) == {0, 1, 2, 3}
    assert plan.block_ranks == [v_rank(2, s) for s in plan.stages]
    assert [len(ops) for ops in plan.order] == [6 * cfg.run.n_micro_batches] * 2
    text = plan.table()
    for r in (0, 1):
        row = next(line for line in text.splitlines() if line.strip().startswith(str(r)))
        assert f"{r}: " in row and f"{3 - r}: " in row  # the rank's way down and way up
    assert "loss" in text.splitlines()[2]  # rank 0 holds the loss chunk
    assert json.loads(json.dumps(plan.to_dict()))["bounds"] == list(plan.bounds)
    assert all(any(b.trainable for b in blocks[lo:hi]) for lo, hi in zip(plan.bounds, plan.bounds[1:]))
    assert len(plan.p2p) == 3 and plan.p2p[0] > 0  # one figure per cut, as priced


def test_each_rank_is_held_to_the_memory_cap() -> None:
    cfg, blocks = _tiny()
    splits = _every_split(cfg, blocks)
    peaks = sorted({peak for _, peak in splits.values()})
    cap = (peaks[0] + peaks[-1]) / 2  # some splits fit, others not
    capped, capped_blocks = _tiny(memory_cap_gib=cap / 2**30)
    plan = make_v_plan(capped_blocks, capped)
    assert max(plan.peaks) <= cap and plan.limit == pytest.approx(cap)
    fitting = [step for step, peak in splits.values() if peak <= cap]
    assert plan.step_time >= min(fitting) - 1e-15
    small, small_blocks = _tiny(memory_cap_gib=peaks[0] / 2 / 2**30)
    with pytest.raises(PlanningError, match=r"no V split of 7 blocks over pp=2 ranks fits under .*GiB on one rank; "
                                            r"use pp_engine zb1p, or raise pp, tp or the memory"):
        make_v_plan(small_blocks, small)


def test_every_chunk_trains_something_even_where_a_chunk_of_frozen_blocks_would_be_faster() -> None:
    """The embedding frozen: the first chunk must reach decoder.0, the first block that trains; with decoder.0 frozen
    too, three blocks train and no V of four chunks can."""
    cfg, blocks = _tiny(freeze={"modules": ["embedding"]})
    plan = make_v_plan(blocks, cfg)
    assert plan.chunk(0) == ("model.token_position_embeddings", "model.decoder.0")
    assert all(any(b.trainable for b in blocks[lo:hi]) for lo, hi in zip(plan.bounds, plan.bounds[1:]))
    cfg, blocks = _tiny(freeze={"modules": ["embedding", "decoder.0"]})
    with pytest.raises(PlanningError, match=r"a V over pp=2 ranks needs a trainable block in each of its 4 chunks; "
                                            r"3 blocks train \(decoder.1, final_norm, lm_head\): unfreeze one, lower pp "
                                            r"or use pp_engine zb1p"):
        make_v_plan(blocks, cfg)


def test_a_model_with_fewer_blocks_than_chunks_is_refused() -> None:
    cfg = load_config(TINY, pp=4)
    with pytest.raises(PlanningError, match=r"cuts the model into 8 chunks, but it has 7 pipeline blocks; lower pp "
                                            r"to 3 or less"):
        make_v_plan(inventory_from_config(cfg), cfg)
