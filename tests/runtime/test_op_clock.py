"""The engine's own clock (``nanotron_ext.runtime.op_clock``), inside Nanotron's 1F1B and our zb1p on two real gloo
ranks: it times every block's forward, backward and W where the engine ran them and nowhere else, records every
transfer, and changes no bit of the training."""

from __future__ import annotations

from typing import Any

import pytest

from . import timing_workers as w
from .spawn import run_distributed

pytestmark = pytest.mark.slow  # tests/conftest.py: left out of the quick run

TIMEOUT = 120.0
STAGE = {
    0: ["model.token_position_embeddings", *(f"model.decoder.{i}" for i in range(3))],
    1: ["model.decoder.3", "model.final_layer_norm", "model.lm_head", "model.cast_to_fp32", "loss"],
}
DEFERS = ("model.decoder", "model.lm_head")  # the blocks made of linears: zb1p defers their weight gradients


def _run(engine: str, clocked: bool, frozen: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    return run_distributed(w.clocked_steps, 2, args=(engine, clocked, frozen), timeout=TIMEOUT)


@pytest.fixture(scope="module", params=["1f1b", "zb1p"])
def clocked(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, _run(request.param, True)


def test_the_clock_changes_no_bit_of_the_training(clocked: tuple[str, list[dict[str, Any]]]) -> None:
    engine, with_clock = clocked
    without = _run(engine, False)
    for a, b in zip(with_clock, without):
        assert a["losses"] == b["losses"]
        assert a["weights"] == b["weights"]


def test_every_block_of_a_rank_is_timed_once_per_micro_batch_where_the_engine_ran_it(
    clocked: tuple[str, list[dict[str, Any]]],
) -> None:
    engine, ranks = clocked
    steps = ranks[0]["steps"]
    assert len(steps) == 2 and all(len(rank) == 2 for rank in steps)  # two ranks, two recorded steps each
    for pp_rank, rank_steps in enumerate(steps):
        for step in rank_steps:
            assert step["pp_rank"] == pp_rank and step["engine"] == engine
            assert [b["block"] for b in step["blocks"]] == STAGE[pp_rank]
            for block in step["blocks"]:
                name = block["block"]
                assert len(block["forward"]) == w.N_MICRO, name
                assert len(block["backward"]) == w.N_MICRO, name  # everything trains: a gradient reaches every block
                deferred = engine == "zb1p" and name.startswith(DEFERS)
                assert len(block["weight"]) == (w.N_MICRO if deferred else 0), name
                assert all(t >= 0 for t in (*block["forward"], *block["backward"], *block["weight"])), name
                if name.startswith(DEFERS):
                    assert min(block["forward"]) > 0 and min(block["backward"]) > 0, name
            # one engine forward and one backward per micro-batch, each with the blocks it ran
            assert sorted(n for _, n in step["calls"]) == sorted([len(STAGE[pp_rank])] * (2 * w.N_MICRO))
            assert step["update"] > 0
            assert 0 < step["clock"] < sum(sum(b["forward"]) + sum(b["backward"]) for b in step["blocks"])


def test_a_ranks_blocks_add_up_to_no_more_than_its_busy_time_in_the_pipeline(
    clocked: tuple[str, list[dict[str, Any]]],
) -> None:
    """The blocks' spans tile the engine's ops without overlapping: together they are inside the rank's own work in
    the pipeline (the step timer's pipeline part less its waits), and the engine's bookkeeping is what is left."""
    _, ranks = clocked
    for rank_steps, rank_records in zip(ranks[0]["steps"], ranks[0]["records"]):
        for step, record in zip(rank_steps, rank_records):
            blocks = sum(sum(b["forward"]) + sum(b["backward"]) + sum(b["weight"]) for b in step["blocks"])
            busy = record["pipeline"] - record["pipeline_idle"]
            calls = [own for own, _ in step["calls"]]
            assert 0 < blocks <= busy
            assert min(calls) >= -1e-6  # an op's own time holds its blocks': never less than them
            assert blocks + sum(calls) <= busy + 1e-6


def test_every_transfer_is_recorded_on_both_ends(clocked: tuple[str, list[dict[str, Any]]]) -> None:
    _, ranks = clocked
    for step0, step1 in zip(*ranks[0]["steps"]):
        # Nanotron sends a decoder layer's two outputs (hidden states, sequence mask) one call each, and one gradient
        # back per micro-batch: the receiving end sees the same calls, in order, with the same bytes.
        forward = [(s["n_bytes"], s["n_tensors"]) for s in step0["sends"]]
        assert forward == [(r["n_bytes"], r["n_tensors"]) for r in step1["receives"]]
        back = [(s["n_bytes"], s["n_tensors"]) for s in step1["sends"]]
        assert back == [(r["n_bytes"], r["n_tensors"]) for r in step0["receives"]]
        hidden = w.MICRO_BATCH * w.SEQ_LEN * w.SMALL["hidden_size"] * 4
        assert back == [(hidden, 1)] * w.N_MICRO
        assert forward.count((hidden, 1)) == w.N_MICRO
        for s, r in zip(step0["sends"], step1["receives"]):
            assert r["ended"] >= s["posted"]  # one clock for both processes: nothing arrives before it was sent


def test_no_backward_is_timed_where_no_gradient_reaches() -> None:
    """The embedding and the first decoder layer frozen: nothing before decoder.1 needs a gradient, so the clock
    times no backward for the two, and decoder.1's backward ends with the engine's op (no gradient leaves it)."""
    ranks = _run("1f1b", True, frozen=("model.token_position_embeddings", "model.decoder.0"))
    for step in ranks[0]["steps"][0]:
        blocks = {b["block"]: b for b in step["blocks"]}
        assert blocks["model.token_position_embeddings"]["backward"] == ()
        assert blocks["model.decoder.0"]["backward"] == ()
        assert len(blocks["model.decoder.1"]["backward"]) == w.N_MICRO
        assert len(blocks["model.decoder.1"]["forward"]) == w.N_MICRO
