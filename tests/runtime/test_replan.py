"""``nanotron_ext.replan`` in ``nanotron-ext train`` with real processes (2 gloo ranks, the bundled tiny model): a run
on a bad split moves after K steps and then trains bit for bit as a run on the new plan from its first step does;
a move of split and engine (1f1b -> zb1p); a move refused for too small a gain; a run too short to re-plan; a rank
killed during the move. The choice itself is tested without processes in ``tests/test_replan.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from .replan_workers import killed_during_the_move
from .spawn import run_ranks
from .train_workers import final_weights, launch_ranks, write_config

STEPS, K = 8, 4
BAD = {"parallelism": {"cost_strategy": "layout"}, "nanotron_ext": {"layout": "E|t*2,L"}}
TIMEOUT = 240.0


def _run(tmp: Path, name: str, changes: dict[str, Any], *extra: str) -> Any:
    config = write_config(tmp / f"{name}.yaml", changes)
    launch = launch_ranks(["--config-file", str(config), "--steps", str(STEPS), *extra], 2, timeout=TIMEOUT)
    assert launch.ok, "\n".join(r.stdout[-3000:] + r.stderr[-3000:] for r in launch.ranks)
    return launch


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The good split (constrained) trained from step 1 without a re-plan."""
    return _run(tmp_path_factory.mktemp("replan_ref"), "ref", {}).metrics


def _same_training(moved: dict[str, Any], reference: dict[str, Any]) -> None:
    assert moved["losses"] == reference["losses"]
    assert moved["grad_norms"] == reference["grad_norms"]
    assert moved["learning_rates"] == reference["learning_rates"]
    weights = final_weights(moved)
    assert len(weights) == len(final_weights(reference)) >= 14 and weights == final_weights(reference)


def test_a_bad_split_moves_after_k_steps_and_trains_as_the_new_plan_from_the_start(tmp_path, reference, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where the ranks make the move's checkpoint
    launch = _run(tmp_path, "bad", BAD, "--replan-after", str(K))
    m, out = launch.metrics, launch.ranks[0].stdout
    assert m["replan"]["verdict"] == "move" and m["replan"]["after_step"] == K, out[-3000:]
    assert m["replan"]["timed_steps"] == K - 1  # step 1 pays one-off costs: not in the run's prices
    assert not list(tmp_path.glob("nanotron-ext-replan-*"))  # the move's checkpoint is removed
    assert m["block_ranks"] == reference["block_ranks"] != [0, 1, 1, 1, 1, 1, 1]
    assert m["replan"]["old"]["split"] == "E|t*2,L" and m["replan"]["new"]["split"] == "E,t*2,N|H,C,X"
    assert m["replan"]["predicted_gain"] > 0.03 and m["replan"]["measured_step_s_after"] > 0
    assert 0 < m["replan"]["noise"] < m["replan"]["predicted_gain"]  # the gain priced by each half of steps 2-K
    _same_training(m, reference)  # split changes are exact: the move loses nothing and adds nothing
    assert "moving to the new plan" in out
    assert f"checkpoint {K}: 20 files verified" in out
    assert (
        f"checkpoint {K} -> split E,t*2,N|H,C,X (pp=2, tp=1, dp=1): 15 of 15 parameters and 45 of 45 optimizer entries"
    ) in out
    assert f"replan: steps {K + 2}-{STEPS} after the move, on E,t*2,N|H,C,X (1f1b), measured" in out
    assert set(m["replan"]["seconds"]) == {"profile", "plan", "save", "build_and_load"}


def test_split_and_engine_move_together_from_1f1b_to_zb1p(tmp_path, reference):
    """Under a cap that zb1p's W store fits and zb2p's activations do not, `replan.engine: auto` moves the run from
    1f1b on the bad split to zb1p on the good one; zb1p computes the same bits as 1f1b."""
    changes = {
        "parallelism": BAD["parallelism"],
        "nanotron_ext": {
            **BAD["nanotron_ext"],
            "memory_cap_gib": 1.055,
            "replan": {"after_steps": K, "engine": "auto"},
        },
    }
    m = _run(tmp_path, "engine", changes).metrics
    assert (m["replan"]["old"]["engine"], m["replan"]["new"]["engine"], m["engine"]) == ("1f1b", "zb1p", "zb1p")
    assert m["block_ranks"] == reference["block_ranks"]
    _same_training(m, reference)


def test_tied_embeddings_move_as_one_weight(tmp_path):
    """Tied, the embedding (stage 0) and the lm_head (stage 1 on both splits) are one weight saved once: the move
    places it and its moments on both ends, and the run trains as the tied run on the new split does."""
    tied = {"model": {"model_config": {"tie_word_embeddings": True}}}
    moved = _run(tmp_path, "tied", {**tied, **BAD}, "--replan-after", str(K))
    reference = _run(tmp_path, "tied_ref", tied).metrics
    assert moved.metrics["replan"]["moved"] and moved.metrics["block_ranks"] == reference["block_ranks"]
    assert "14 of 14 parameters and 42 of 42 optimizer entries" in moved.ranks[0].stdout
    _same_training(moved.metrics, reference)


def test_a_gain_below_min_gain_is_refused_and_the_run_stays(tmp_path, reference):
    changes = {**BAD, "nanotron_ext": {**BAD["nanotron_ext"], "replan": {"after_steps": K, "min_gain": 0.95}}}
    launch = _run(tmp_path, "small", changes)
    m = launch.metrics
    assert m["replan"]["verdict"] == "gain below min_gain" and not m["replan"]["moved"]
    assert m["block_ranks"] == [0, 1, 1, 1, 1, 1, 1]
    assert "below min_gain, staying" in launch.ranks[0].stdout
    assert f"steps {K + 2}-{STEPS} after the re-plan, on E|t*2,L (1f1b)" in launch.ranks[0].stdout
    _same_training(m, reference)


def test_a_run_of_at_most_k_steps_trains_its_plan_and_says_why(tmp_path):
    launch = _run(tmp_path, "short", BAD, "--replan-after", str(STEPS))
    assert "replan" not in launch.metrics and launch.metrics["block_ranks"] == [0, 1, 1, 1, 1, 1, 1]
    assert f"the run has {STEPS} steps, so it trains its plan to the end without re-planning" in launch.ranks[0].stdout


def test_a_rank_killed_during_the_move_ends_the_run_and_leaves_the_checkpoint_incomplete(tmp_path):
    config = write_config(
        tmp_path / "kill.yaml", {**BAD, "nanotron_ext": {**BAD["nanotron_ext"], "replan": {"after_steps": K}}}
    )
    folder = tmp_path / "tmp"
    folder.mkdir()
    outcomes = run_ranks(killed_during_the_move, 2, args=(str(config), str(folder), STEPS), timeout=TIMEOUT, grace=60.0)
    assert outcomes[1].returncode == -9 and not outcomes[1].timed_out
    assert not outcomes[0].ok and not outcomes[0].timed_out and outcomes[0].returncode not in (None, 0)
    assert "rank 1" in (outcomes[0].error or "") + (outcomes[0].output or ""), outcomes[0]
    records = list(folder.glob(f"nanotron-ext-replan-*/{K}/nanotron_ext_plan.json"))
    assert len(records) == 1 and json.loads(records[0].read_text())["complete"] is False
