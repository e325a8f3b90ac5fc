"""``pp_engine: zb1p`` and ``zb2p`` (``nanotron_ext.zero_bubble``) against Nanotron's own 1F1B engine, in real gloo
processes.

Same model, weights and data under both engines, two optimizer steps each: the losses and every parameter
gradient the optimizer sees (after the dp and tied-weight syncs) must match to fp32 rounding. Each dp replica
reads its own data, so a missing DDP sync would show; every case also checks that W steps applied deferred
products, so an engine that deferred nothing could not pass by being 1F1B. The order each executes, communication
included, is checked against ``engine_program`` in ``test_runtime_pipeline.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from . import train_workers as tw
from . import zb_workers
from .spawn import run_distributed

pytestmark = pytest.mark.slow  # tests/conftest.py: left out of the quick run

TOL = 1e-5
PP2 = [0, 0, 1, 1, 1, 1, 1]  # embedding, decoder.0 | decoder.1, final norm, lm_head, cast, loss
TP2 = {"tp": 2, "pp": 2, "config": {"vocab_size": 50278}, "block_ranks": PP2}

TWO_RANKS = {
    "pp2": {"pp": 2, "block_ranks": PP2},
    # Stage 0 wholly frozen, stage 1 with a frozen MLP: frozen weights get no W and no gradient.
    "frozen": {"pp": 2, "block_ranks": PP2, "freeze": "token_position_embeddings,decoder.0,decoder.1.pp_block.mlp"},
    # Three vocabulary shards, the first on stage 0 with every decoder layer.
    "vocab_chain": {"pp": 2, "block_ranks": [0, 0, 0, 0, 0, 1, 1], "vocab_shards": 3, "config": {"vocab_size": 1009}},
    # parallelism.recompute_layer: zb1p with every decoder layer recomputed in its backward, against 1F1B without
    # recomputation (so the recomputed forward is checked too); W still defers the recomputed linears' products.
    "recompute": {"pp": 2, "block_ranks": PP2, "recompute": True, "ref": {"recompute": False}},
    # Tied embeddings with both ends on stage 0: one tensor used twice in a stage, its weight gradient made in B at
    # the embedding and deferred to W at the lm_head; both parts must reach it (issue 31).
    "tied_one_stage": {"pp": 2, "block_ranks": [0, 0, 0, 0, 0, 1, 1], "config": {"tie_word_embeddings": True}},
    # Tied across stages: the lm_head's deferred part must be in .grad before the tied all-reduce.
    "tied_two_stages": {"pp": 2, "block_ranks": PP2, "config": {"tie_word_embeddings": True}},
    # A step that failed between a B and its W left that backward's products in the store: the next step starts
    # with none of them (emulated: one stale product queued as micro-batch 0's before the first step).
    "after_failed_step": {"pp": 2, "block_ranks": PP2, "after_failed_step": True},
    # The projector's linear is a subclass with its own forward: its W runs in B, with one warning.
    "unknown_linear": {"pp": 2, "block_ranks": [0, 0, 0, 1, 1, 1, 1, 1], "opaque": True},
}
FOUR_RANKS = {
    "pp4": {"pp": 4, "block_ranks": [0, 1, 2, 3, 3, 3, 3], "n_micro": 6},
    "dp2_pp2": {"pp": 2, "dp": 2, "block_ranks": PP2},
    "tp2_pp2": TP2,
    # Nanotron's async REDUCE_SCATTER linears run their synchronous path under zb1p. The reference is 1F1B on
    # the synchronous path: on gloo, Nanotron 0.2's async REDUCE_SCATTER backward gives other gradients.
    "tp2_pp2_reduce_scatter_async": {**TP2, "tp_mode": "REDUCE_SCATTER", "tp_async": True, "ref": {"tp_async": False}},
}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_distributed(zb_workers.compare_engines, 2, args=(TWO_RANKS,), timeout=180)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_distributed(zb_workers.compare_engines, 4, args=(FOUR_RANKS,), timeout=270)


def _check(results: list[dict], name: str, engine: str) -> None:
    for res in results:
        out = res[name][engine]
        assert "error" not in out, (name, res["rank"], out.get("error"))
        assert out["steps"] == 2
        assert out["zb_losses"] == pytest.approx(out["losses"], rel=TOL, abs=0), (name, res["rank"])
        assert out["grad_rel"] <= TOL, (name, res["rank"], out["grad_rel"])
    # Every W step applied something somewhere (one W per micro-batch and step on each rank).
    assert any(sum(res[name][engine]["popped"]) > 0 for res in results), name


@pytest.mark.parametrize("engine", zb_workers.ZERO_BUBBLE_ENGINES)
@pytest.mark.parametrize("name", sorted(TWO_RANKS))
def test_zero_bubble_equals_1f1b_two_ranks(two_ranks: list[dict], name: str, engine: str) -> None:
    _check(two_ranks, name, engine)


@pytest.mark.parametrize("engine", zb_workers.ZERO_BUBBLE_ENGINES)
@pytest.mark.parametrize("name", sorted(FOUR_RANKS))
def test_zero_bubble_equals_1f1b_four_ranks(four_ranks: list[dict], name: str, engine: str) -> None:
    _check(four_ranks, name, engine)


EMBEDDING, LM_HEAD = "model.token_position_embeddings.pp_block.token_embedding.weight", "model.lm_head.pp_block.weight"


@pytest.mark.parametrize(
    ("name", "rank0", "rank1"),
    [
        ("tied_one_stage", {EMBEDDING}, set()),  # one tensor, named once, on the stage that holds both ends
        ("tied_two_stages", {EMBEDDING}, {LM_HEAD}),  # a copy on each stage, synced by the tied all-reduce
        ("pp2", set(), set()),
    ],
)
def test_the_tied_cases_are_tied(two_ranks: list[dict], name: str, rank0: set, rank1: set) -> None:
    # Their equality with 1F1B above means something only if the embedding and the lm_head are one weight.
    tied = {res["rank"]: set(res[name]["zb2p"]["tied"]) & {EMBEDDING, LM_HEAD} for res in two_ranks}
    assert tied == {0: rank0, 1: rank1}


@pytest.mark.parametrize("engine", zb_workers.ZERO_BUBBLE_ENGINES)
def test_each_w_applies_its_stage_linears(two_ranks: list[dict], engine: str) -> None:
    """pp2: stage 0 defers decoder.0's four linears, stage 1 decoder.1's four and the lm_head; the frozen stage
    none; the vocabulary chain's shards defer like the lm_head."""
    pp2 = [res["pp2"][engine]["popped"] for res in two_ranks]
    assert pp2 == [[4] * 8, [5] * 8]
    assert [res["frozen"][engine]["popped"] for res in two_ranks] == [[0] * 8, [3] * 8]
    assert [res["vocab_chain"][engine]["popped"] for res in two_ranks] == [[9] * 8, [2] * 8]


@pytest.mark.parametrize("engine", zb_workers.ZERO_BUBBLE_ENGINES)
def test_unknown_linear_warns_once_and_names_it(two_ranks: list[dict], engine: str) -> None:
    rank0, rank1 = (res["unknown_linear"][engine] for res in two_ranks)
    assert len(rank0["fallbacks"]) == 1, rank0["fallbacks"]
    assert "model.projector.pp_block.proj (OpaqueLinear)" in rank0["fallbacks"][0]
    assert rank1["fallbacks"] == [] and rank0["ref_fallbacks"] == []
    assert rank0["popped"] == [4] * 8  # decoder.0's linears still defer; the projector's W ran in B


def test_cli_trains_with_pp_engine_zb1p_and_auto(tmp_path: Path) -> None:
    """``nanotron-ext train`` with ``pp_engine: zb1p`` in the YAML, and with ``pp_engine: auto``, which trains the
    engine the planner takes and says so; the same losses on the same split (``flops`` places the blocks: the
    default, schedule-aware strategy may split differently per engine). Equal to 1F1B's gradients: the
    exactness cases above."""
    from nanotron_ext.config import load_config
    from nanotron_ext.plan import resolve_engine

    losses = {}
    for engine in ("zb1p", "auto"):
        config = tw.write_config(tmp_path / f"{engine}.yaml", {"parallelism": {"pp_engine": engine}})
        launch = tw.launch_ranks(
            ["--config-file", str(config), "--steps", "3", "--cost-strategy", "flops"], 2, timeout=120
        )
        assert launch.ok and launch.metrics is not None, launch.describe()
        runs = resolve_engine(load_config(config, cost_strategy="flops"))[0].run.engine if engine == "auto" else engine
        assert launch.metrics["engine"] == runs and f"engine {runs} |" in launch.ranks[0].stdout
        if engine == "auto":
            assert f"pp_engine: auto -> {runs}: step " in launch.ranks[0].stdout, launch.ranks[0].stdout[-2000:]
        losses[engine] = launch.metrics["losses"]
    assert losses["auto"] == pytest.approx(losses["zb1p"], rel=TOL, abs=0)
