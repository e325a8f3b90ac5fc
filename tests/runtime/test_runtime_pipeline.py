"""Nanotron's real pipeline machinery on CPU: block placement, 1F1B / AFAB training, PP/TP/DP equivalence.

Each test starts real processes (``spawn.run_distributed``) running Nanotron's engines over gloo. Several
scenarios share one world to keep start-up costs down; results are cached per module.
"""

from __future__ import annotations

import math

import pytest

from . import workers
from .spawn import run_distributed

pytestmark = pytest.mark.slow  # tests/conftest.py: left out of the quick run

BALANCED = [0, 0, 1, 1, 1, 1, 1]  # embedding, decoder.0 | decoder.1, final norm, lm_head, cast, loss
BLOCK_NAMES = [
    "model.token_position_embeddings",
    "model.decoder.0",
    "model.decoder.1",
    "model.final_layer_norm",
    "model.lm_head",
    "model.cast_to_fp32",
    "loss",
]
N_STEPS = 20


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.fixture(scope="module")
def two_rank_runs() -> list[dict]:
    """One 2-process world running every 2-rank training scenario."""
    cases = {
        "1f1b": {"pp": 2, "block_ranks": BALANCED, "engine": "1f1b", "n_steps": N_STEPS},
        "afab": {"pp": 2, "block_ranks": BALANCED, "engine": "afab", "n_steps": N_STEPS},
        "tied": {
            "pp": 2,
            "block_ranks": [0, 0, 0, 1, 1, 1, 1],
            "n_steps": 3,
            "config": {"tie_word_embeddings": True},
            "check_tied": True,
        },
        "tp2_gqa_projector": {
            "tp": 2,
            "n_steps": 3,
            "config": {"num_key_value_heads": 2, "vocab_size": 50278},
            "projector": True,
        },
        "dp2": {"dp": 2, "n_steps": 5},
    }
    return run_distributed(workers.run_cases, 2, args=(cases,), timeout=120)


@pytest.fixture(scope="module")
def one_rank_reference() -> dict:
    """Single-process references (pp=tp=dp=1) for the equivalence checks."""
    cases = {
        "plain": {"n_steps": 5},
        "gqa_projector": {
            "n_steps": 3,
            "config": {"num_key_value_heads": 2, "vocab_size": 50278},
            "projector": True,
        },
    }
    return run_distributed(workers.run_cases, 1, args=(cases,), timeout=90)[0]


def test_nanotron_build_model_leaves_last_rank_without_parameters() -> None:
    """Nanotron's own greedy build_model puts every weight on rank 0 for the tiny large-vocab model."""
    results = run_distributed(workers.nanotron_split, 2, args=(2,), timeout=90)
    for res in results:
        assert res["names"] == BLOCK_NAMES
        assert res["ranks"] == [0, 0, 0, 0, 0, 1, 1]
        assert res["helper_ranks"] == res["ranks"]
        assert (res["input_pp_rank"], res["output_pp_rank"]) == (0, 1)
        assert set(res["errors"]) == {"too_short", "out_of_range", "backwards"}
        assert "7 pipeline blocks" in res["errors"]["too_short"]
        # Training still runs with that split: rank 1 has no parameter, so it builds no optimizer.
        assert res["train"]["losses"] == results[0]["train"]["losses"]
        assert all(math.isfinite(x) for x in res["train"]["losses"])
    rank0, rank1 = results
    assert rank1["local_params"] == 0 and rank1["param_names"] == []
    assert rank0["local_params"] > 0
    assert "model.decoder.0.pp_block.attn.qkv_proj.weight" in rank0["param_names"]
    assert "model.decoder.0.pp_block.mlp.gate_up_proj.weight" in rank0["param_names"]
    assert "model.token_position_embeddings.pp_block.token_embedding.weight" in rank0["param_names"]
    assert "model.lm_head.pp_block.weight" in rank0["param_names"]
    assert rank0["train"]["has_optimizer"] and not rank1["train"]["has_optimizer"]


@pytest.mark.parametrize("engine", ["1f1b", "afab"])
def test_balanced_pipeline_trains(two_rank_runs: list[dict], engine: str) -> None:
    """Regression for the gloo send deadlock too: a decoder-layer boundary carries two tensors."""
    rank0, rank1 = (r[engine] for r in two_rank_runs)
    assert rank0["block_ranks"] == BALANCED
    assert rank0["local_params"] > 0 and rank1["local_params"] > 0
    assert rank0["has_optimizer"] and rank1["has_optimizer"]
    losses = rank0["losses"]
    assert losses == rank1["losses"], "every rank must report the output stage's loss"
    assert len(losses) == N_STEPS and all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(50277), rel=0.02)  # near-uniform start
    assert losses[-1] < losses[0] - 1.0
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5


def test_engines_agree(two_rank_runs: list[dict]) -> None:
    one_f_one_b, afab = two_rank_runs[0]["1f1b"]["losses"], two_rank_runs[0]["afab"]["losses"]
    assert all(_rel(a, b) < 1e-5 for a, b in zip(one_f_one_b, afab))


def test_pp1_matches_pp2(two_rank_runs: list[dict], one_rank_reference: dict) -> None:
    pp1 = one_rank_reference["plain"]["losses"]
    pp2 = two_rank_runs[0]["1f1b"]["losses"][:5]
    assert len(pp1) == 5
    assert all(_rel(a, b) < 1e-5 for a, b in zip(pp2, pp1)), (pp2, pp1)


def test_tied_embeddings_across_stages(two_rank_runs: list[dict]) -> None:
    for res in two_rank_runs:
        tied = res["tied"]
        assert tied["tied"] and tied["tied_max_abs_diff"] == 0.0
        assert all(math.isfinite(x) for x in tied["losses"])
    assert two_rank_runs[0]["tied"]["block_ranks"] == [0, 0, 0, 1, 1, 1, 1]


def test_tp2_gqa_projector_matches_tp1(two_rank_runs: list[dict], one_rank_reference: dict) -> None:
    tp2 = two_rank_runs[0]["tp2_gqa_projector"]
    ref = one_rank_reference["gqa_projector"]
    assert tp2["block_names"] == ref["block_names"]
    assert tp2["block_names"][:3] == ["model.token_position_embeddings", "model.projector", "model.decoder.0"]
    assert all(_rel(a, b) < 1e-5 for a, b in zip(tp2["losses"], ref["losses"])), (
        tp2["losses"],
        ref["losses"],
    )


def test_dp2_ddp_matches_single_replica(two_rank_runs: list[dict], one_rank_reference: dict) -> None:
    """Both replicas see the same data, so DDP-averaged training must equal the single-replica run."""
    for res in two_rank_runs:
        assert res["dp2"]["is_ddp"]
        assert all(_rel(a, b) < 1e-5 for a, b in zip(res["dp2"]["losses"], one_rank_reference["plain"]["losses"]))


# Cuts before the lm_head and the loss carry one tensor; a cut between decoder layers carries the hidden states
# and the boolean sequence mask (which takes other paths through Nanotron's run_communication).
TRACE_CASES = {
    "pp2-1f1b": {"pp": 2, "engine": "1f1b", "block_ranks": [0, 0, 0, 0, 1, 1, 1], "n_micro_batches": 4},
    "pp2-afab": {"pp": 2, "engine": "afab", "block_ranks": [0, 0, 0, 0, 1, 1, 1], "n_micro_batches": 3},
    "pp2-1f1b-decoder-cut": {"pp": 2, "engine": "1f1b", "block_ranks": BALANCED, "n_micro_batches": 4},
    "pp2-1f1b-frozen-stage0": {
        "pp": 2,
        "engine": "1f1b",
        "block_ranks": [0, 0, 0, 0, 1, 1, 1],
        "n_micro_batches": 4,
        "freeze_stage0": True,
    },
}
TRACE_CASES_PP3 = {
    "pp3-1f1b": {"pp": 3, "engine": "1f1b", "block_ranks": [0, 0, 0, 0, 1, 1, 2], "n_micro_batches": 4},
    "pp3-afab": {"pp": 3, "engine": "afab", "block_ranks": [0, 0, 0, 0, 1, 1, 2], "n_micro_batches": 2},
}
# zb1p and zb2p run the simulator's own program (nanotron_ext.zero_bubble): these check that what it executes,
# Nanotron's communication included, is that program call by call.
TRACE_CASES.update(
    {
        "pp2-zb1p": {"pp": 2, "engine": "zb1p", "block_ranks": [0, 0, 0, 0, 1, 1, 1], "n_micro_batches": 4},
        "pp2-zb1p-decoder-cut": {"pp": 2, "engine": "zb1p", "block_ranks": BALANCED, "n_micro_batches": 3},
        "pp2-zb1p-frozen-stage0": {
            "pp": 2,
            "engine": "zb1p",
            "block_ranks": [0, 0, 0, 0, 1, 1, 1],
            "n_micro_batches": 4,
            "freeze_stage0": True,
        },
    }
)
TRACE_CASES_PP3.update(
    {
        "pp3-zb1p": {"pp": 3, "engine": "zb1p", "block_ranks": [0, 0, 0, 0, 1, 1, 2], "n_micro_batches": 5},
        "pp3-zb1p-decoder-cuts": {
            "pp": 3,
            "engine": "zb1p",
            "block_ranks": [0, 1, 2, 2, 2, 2, 2],
            "n_micro_batches": 2,
        },
        # zb2p: stage 0 runs 4 warm-up forwards (all 4 of them at m=4), stage 1 2; W's deferred by 2 per stage.
        "pp3-zb2p": {"pp": 3, "engine": "zb2p", "block_ranks": [0, 0, 0, 0, 1, 1, 2], "n_micro_batches": 6},
        "pp3-zb2p-m4": {"pp": 3, "engine": "zb2p", "block_ranks": [0, 1, 2, 2, 2, 2, 2], "n_micro_batches": 4},
    }
)
TRACE_CASES.update(
    {
        "pp2-zb2p": {"pp": 2, "engine": "zb2p", "block_ranks": [0, 0, 0, 0, 1, 1, 1], "n_micro_batches": 5},
        "pp2-zb2p-frozen-stage0": {
            "pp": 2,
            "engine": "zb2p",
            "block_ranks": [0, 0, 0, 0, 1, 1, 1],
            "n_micro_batches": 4,
            "freeze_stage0": True,
        },
    }
)


FAMILY_RANKS = {2: [0, 0, 0, 0, 1, 1, 1], 3: [0, 0, 0, 0, 1, 1, 2], 4: [0, 1, 2, 3, 3, 3, 3]}


def _zb2p_family(pp: int) -> dict[str, dict]:
    """zb2p at every m from pp - 1 to 3·pp on ``FAMILY_RANKS[pp]``."""
    return {
        f"zb2p-m{m}": {"pp": pp, "engine": "zb2p", "block_ranks": FAMILY_RANKS[pp], "n_micro_batches": m}
        for m in range(pp - 1, 3 * pp + 1)
    }


@pytest.fixture(scope="module")
def traces() -> dict[int, list[dict]]:
    """Each rank's trace of every case below, one world per size: both tests' cases of a size share its launch."""
    cases = {2: {**TRACE_CASES, **_zb2p_family(2)}, 3: {**TRACE_CASES_PP3, **_zb2p_family(3)}, 4: _zb2p_family(4)}
    return _Worlds(cases)


class _Worlds(dict):
    """world size -> every rank's traces, run when a test first asks for that size."""

    def __init__(self, cases: dict[int, dict[str, dict]]) -> None:
        super().__init__()
        self.cases = cases

    def __missing__(self, world: int) -> list[dict]:
        self[world] = run_distributed(workers.engine_trace, world, args=(self.cases[world],), timeout=240)
        return self[world]


@pytest.mark.parametrize(("world", "cases"), [(2, TRACE_CASES), (3, TRACE_CASES_PP3)])
def test_simulator_program_is_what_nanotron_engine_runs(traces: _Worlds, world: int, cases: dict) -> None:
    """The simulator's per-rank order of forwards, backwards, sends and receives is Nanotron's, call by call."""
    from nanotron_ext.simulate import engine_program

    for name, case in cases.items():
        pp = case["pp"]
        grad_cuts = [not case.get("freeze_stage0", False)] + [True] * (pp - 2)
        for rank, trace in enumerate(traces[world]):
            expected = engine_program(
                case["engine"], pp, rank, case["n_micro_batches"],
                grad_in=rank == 0 or grad_cuts[rank - 1], grad_out=rank == pp - 1 or grad_cuts[rank],
            )  # fmt: skip
            assert [tuple(x) for x in trace[name]] == expected, f"{name}, PP rank {rank}"


@pytest.mark.parametrize("pp", sorted(FAMILY_RANKS))
def test_every_zb2p_program_runs_to_completion(traces: _Worlds, pp: int) -> None:
    """Issue 31: zb2p at every m from pp - 1 to 3·pp runs on Nanotron's machinery over gloo without a deadlock,
    call by call as its program says (zb1p keeps 1F1B's communication, traced above)."""
    from nanotron_ext.simulate import engine_program

    for name, case in _zb2p_family(pp).items():
        for rank, trace in enumerate(traces[pp]):
            expected = engine_program(case["engine"], pp, rank, case["n_micro_batches"])
            assert [tuple(x) for x in trace[name]] == expected, f"{name}, PP rank {rank}"
