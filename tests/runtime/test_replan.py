"""``nanotron_ext.replan`` in ``nanotron-ext train`` with real processes (2 gloo ranks, the bundled tiny model): after K
steps the run tries the re-plan's candidates against its plan in turns, through bit-exact moves in the same
processes, keeps the one it measured faster and trains on as a run that never moved does; a close call tried; a move
a transient load made look good undone; a move of split and engine (1f1b -> zb1p); a trial refused for too small a
gain; a run too short to re-plan; a rank killed during a move. The choice and the trial's arithmetic are tested
without processes in ``tests/test_replan.py`` and ``tests/test_replan_trial.py``."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from nanotron_ext.plan.replan_trial import trial_outcome, trial_schedule

from .replan_workers import killed_during_the_move, trained_under_a_transient_load
from .spawn import run_ranks
from .train_workers import final_weights, launch_ranks, write_config

pytestmark = pytest.mark.slow  # real processes, minutes: the slow set (python -m pytest -m slow)

STEPS, K = 18, 4
BAD_SPLIT = "E|t*2,L"
#: One timed step a turn keeps the trials short; the tiny model's blocks are a millisecond.
REPLAN = {"after_steps": K, "turn_steps": 1, "trials": 1}
#: Two micro-batches a step: there zb1p's and zb2p's programs are one, so the two engines on one split are priced
#: alike, a close call by construction; both compute 1F1B's bits.
M2 = {"tokens": {"batch_accumulation_per_replica": 2}}
BAD = {"parallelism": {"cost_strategy": "layout"}, "nanotron_ext": {"layout": BAD_SPLIT, "replan": REPLAN}}
TIMEOUT = 300.0


def _run(tmp: Path, name: str, changes: dict[str, Any], *extra: str, steps: int = STEPS) -> Any:
    config = write_config(tmp / f"{name}.yaml", {**M2, **changes})
    launch = launch_ranks(["--config-file", str(config), "--steps", str(steps), *extra], 2, timeout=TIMEOUT)
    assert launch.ok, "\n".join(r.stdout[-3000:] + r.stderr[-3000:] for r in launch.ranks)
    return launch


def _with_replan(**replan: Any) -> dict[str, Any]:
    return {**BAD, "nanotron_ext": {**BAD["nanotron_ext"], "replan": {**REPLAN, **replan}}}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The good split (constrained) trained from step 1 without a re-plan: in the CPU runtime every split trains the
    same bits (each parameter's initial draw is its own), so this is also the run that stays on the bad split."""
    return _run(tmp_path_factory.mktemp("replan_ref"), "ref", {}).metrics


def _same_training(moved: dict[str, Any], reference: dict[str, Any]) -> None:
    assert moved["losses"] == reference["losses"]
    assert moved["grad_norms"] == reference["grad_norms"]
    assert moved["learning_rates"] == reference["learning_rates"]
    weights = final_weights(moved)
    assert len(weights) == len(final_weights(reference)) >= 14 and weights == final_weights(reference)


def _verdict_of_its_own_steps(record: dict[str, Any]) -> None:
    """The run's verdict is the one its own recorded steps give (every rank's slowest time of each step)."""
    first = record["trial"]["turns"][0]["first_step"]
    schedule = trial_schedule(len(record["candidates"]) + 1, len(record["trial"]["turns"][0]["timed_steps"]), first)
    seconds = {int(s): t for s, t in record["step_seconds"].items()}
    outcome = trial_outcome(schedule, seconds, min_gain=record["min_gain"])
    assert outcome.to_dict() == record["outcome"]
    kept = record["old"] if outcome.kept == 0 else record["candidates"][outcome.kept - 1]
    assert record["kept"] == {"split": kept["split"], "engine": kept["engine"]}


def test_a_close_call_is_tried_in_turns_and_the_run_trains_the_bits_of_a_run_that_never_moved(
    tmp_path, reference, monkeypatch
):
    """From 1f1b on the bad split, with the engine free and room for zb2p: zb1p and zb2p on the good split are priced
    alike (a close call), so the run tries both against its plan, A B CC B A: a move of split and engine, two engine
    swaps, a move back; keeps the plan its own steps measured fastest, and every loss and weight is the run's that
    never re-planned (zb1p and zb2p compute 1F1B's bits)."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where the ranks make the moves' checkpoints
    changes = _with_replan(trials=2, engine="auto")
    changes["nanotron_ext"]["memory_cap_gib"] = 1.07
    launch = _run(tmp_path, "close", changes)
    m, out = launch.metrics, launch.ranks[0].stdout
    r = m["replan"]
    assert r["verdict"] == "trying plans against the run's in turns" and r["after_step"] == K, out[-3000:]
    assert r["timed_steps"] == K - 1  # step 1 pays one-off costs: not in the run's prices
    good = "E,t*2,N|H,C,X"
    assert [(c["split"], c["engine"]) for c in r["candidates"]] == [(good, "zb1p"), (good, "zb2p")]
    assert r["candidates"][0]["predicted_step_s"] == r["candidates"][1]["predicted_step_s"]
    assert r["trial"]["order"] == "A B CC B A" and r["trial_steps"] == 11
    moves = [(mv["after_step"], mv["split"], mv["engine"]) for mv in r["moves"]]
    assert moves[:4] == [(6, good, "zb1p"), (8, good, "zb2p"), (11, good, "zb1p"), (13, BAD_SPLIT, "1f1b")]
    assert [set(mv["seconds"]) for mv in r["moves"][:4]] == [{"save", "build_and_load"}, set(), set()] + [
        {"save", "build_and_load"}
    ]
    _verdict_of_its_own_steps(r)
    for turn in r["trial"]["turns"]:  # a step's time is its slowest rank's
        for step in turn["timed_steps"]:
            slowest = max(rank["step_times_s"][step - 1] for rank in m["ranks"])
            assert r["step_seconds"][str(step)] == slowest
    kept = (r["kept"]["split"], r["kept"]["engine"])
    assert len(moves) == 4 + (kept != (BAD_SPLIT, "1f1b")) and moves[-1][1:] == kept
    assert (m["engine"], m["block_ranks"] == [0, 1, 1, 1, 1, 1, 1]) == (kept[1], kept[0] == BAD_SPLIT)
    assert r["cost"]["moves"] == len(moves) and r["cost"]["steps_on_other_plans"] > 0
    assert not list(tmp_path.glob("nanotron-ext-replan-*"))  # every move's checkpoint is removed
    _same_training(m, reference)  # every move is exact: the trial loses nothing and adds nothing
    assert f"replan: trial A B CC B A, steps 5-15; A: {BAD_SPLIT} (1f1b), B: {good} (zb1p), C: {good} (zb2p)" in out
    for i, (a, b) in enumerate([(5, 6), (7, 8), (9, 11), (12, 13), (14, 15)], 1):
        assert f"replan: turn {i}/5 ({'ABCBA'[i - 1]}) steps {a}-{b} on " in out
    assert "replan: the trial measured (each plan: its turns' median steps, and their mean):" in out
    assert f"after the trial, on {kept[0]} ({kept[1]})" in out


@pytest.mark.timed  # beside CI's other pass the trial measures that pass's load as much as the plans
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores: one loaded rank, one quiet")
def test_a_move_a_transient_load_made_look_good_is_measured_and_undone(tmp_path):
    """Rank 0's core is shared with two CPU hogs until the re-plan decides: the profile prices rank 0's layers slow
    and the re-plan proposes moving work to rank 1; the trial, the hogs gone and the ranks free to run on either core,
    measures that the move does not pay its 15 %, the run goes back, and its report calls nothing faster than what it
    measured."""
    # Layers long enough that the move the hogs make look good is slower on a quiet machine by more than the steps'
    # noise: at 64 tokens a sequence it moved one layer (3|5), which measured as fast as 4|4 (the trial kept it in 1
    # quiet launch of 3); at 256 it moves two (2|6), whose step over the run's the trials measured at 0.96-1.29 (1.17
    # the median of 18 launches alone). The profile, under the hogs, priced it 25-27 % faster: a move must pay 15 %.
    shape = {"num_hidden_layers": 8, "hidden_size": 128, "intermediate_size": 512, "vocab_size": 1024}
    changes = {
        "model": {"model_config": shape},
        "tokens": {"sequence_length": 256},
        "parallelism": {"cost_strategy": "layout"},
        "nanotron_ext": {"layout": "E,t*4|t*4,L", "replan": {**REPLAN, "turn_steps": 2, "min_gain": 0.15}},
    }
    config = write_config(tmp_path / "load.yaml", changes)
    metrics = tmp_path / "metrics.json"
    # The hogs must make a move look good first. On a machine loaded on both cores already (CI runs two passes side
    # by side), one hog did not show in the profile in 3 of 4 CI launches (hence two): a launch where they do not
    # show tests nothing, so it is taken again, and where they never show the test says so instead of passing or
    # failing on a premise that did not hold.
    for _ in range(3):
        outcomes = run_ranks(
            trained_under_a_transient_load, 2, args=(str(config), STEPS, str(metrics)), timeout=TIMEOUT
        )
        assert all(o.ok for o in outcomes), outcomes
        m = json.loads(metrics.read_text())
        r = m["replan"]
        if r["candidates"]:
            break
    else:
        pytest.skip("the hogs did not show in the profile in 3 launches (both cores already loaded): no move to undo")
    waited = {"each rank's share of the trial waiting for a core": [o.value for o in outcomes]}
    split = r"t\*(\d+)"
    layers_on_rank_0 = [sum(int(n) for n in re.findall(split, c["split"].split("|")[0])) for c in r["candidates"]]
    assert layers_on_rank_0 and max(layers_on_rank_0) < 4, r  # the profile moves work off the loaded rank
    _verdict_of_its_own_steps(r)
    assert r["outcome"]["kept"] == 0 and r["kept"]["split"] == "E,t*4|t*4,L", (r["outcome"], waited)
    assert r["outcome"]["verdict"] in ("own_fastest", "within_noise")
    # The run trains what the trial kept: it moved to the candidate and back, and no more.
    assert [mv["split"] for mv in r["moves"]] == [r["candidates"][0]["split"], "E,t*4|t*4,L"], r["moves"]
    assert m["block_ranks"] == [0] * 5 + [1] * 8  # the embedding and four layers, then the other four and the head
    out = outcomes[0].output
    assert "back to the run's plan" in out or "back to it" in out
    assert "after the trial, on E,t*4|t*4,L (1f1b)" in out


def test_tied_embeddings_move_as_one_weight(tmp_path):
    """Tied, the embedding (stage 0) and the lm_head (stage 1 on both splits) are one weight saved once: a move
    places it and its moments on both ends, and the run trains as the tied run that never moved does."""
    tied = {"model": {"model_config": {"tie_word_embeddings": True}}}
    moved = _run(tmp_path, "tied", {**tied, **BAD})
    reference = _run(tmp_path, "tied_ref", tied).metrics
    assert moved.metrics["replan"]["moves"]
    assert "14 of 14 parameters and 42 of 42 optimizer entries" in moved.ranks[0].stdout
    _same_training(moved.metrics, reference)


def test_a_gain_below_min_gain_is_not_tried_and_the_run_stays(tmp_path, reference):
    launch = _run(tmp_path, "small", _with_replan(min_gain=0.95))
    m = launch.metrics
    assert m["replan"]["verdict"] == "gain below min_gain" and not m["replan"]["moved"]
    assert m["replan"]["trial"] is None and m["replan"]["moves"] == []
    assert m["block_ranks"] == [0, 1, 1, 1, 1, 1, 1]
    assert "below min_gain even at the profile's error, staying" in launch.ranks[0].stdout
    assert f"steps {K + 2}-{STEPS} after the re-plan, on {BAD_SPLIT} (1f1b)" in launch.ranks[0].stdout
    _same_training(m, reference)


def test_a_run_of_at_most_k_steps_trains_its_plan_and_says_why(tmp_path):
    launch = _run(tmp_path, "short", BAD, "--replan-after", "8", steps=8)
    assert "replan" not in launch.metrics and launch.metrics["block_ranks"] == [0, 1, 1, 1, 1, 1, 1]
    assert "the run has 8 steps, so it trains its plan to the end without re-planning" in launch.ranks[0].stdout


def test_a_rank_killed_during_a_move_ends_the_run_and_leaves_the_checkpoint_incomplete(tmp_path):
    config = write_config(tmp_path / "kill.yaml", BAD)
    folder = tmp_path / "tmp"
    folder.mkdir()
    outcomes = run_ranks(killed_during_the_move, 2, args=(str(config), str(folder), STEPS), timeout=TIMEOUT, grace=60.0)
    assert outcomes[1].returncode == -9 and not outcomes[1].timed_out
    assert not outcomes[0].ok and not outcomes[0].timed_out and outcomes[0].returncode not in (None, 0)
    assert "rank 1" in (outcomes[0].error or "") + (outcomes[0].output or ""), outcomes[0]
    records = list(folder.glob("nanotron-ext-replan-*/*/nanotron_ext_plan.json"))
    assert len(records) == 1 and json.loads(records[0].read_text())["complete"] is False
