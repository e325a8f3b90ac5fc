"""``--replan-after K`` through the launcher: upstream Nanotron's own trainer (``run_train.py`` through ``torchrun -m
nanotron_ext.run --cpu-debug``) prices its first K steps with the engine's clock, re-plans, and moves by a re-launch in
the same processes, resuming the checkpoint of step K under the new plan.

The reference is ``test_resume.py``'s: a resume under another split is bit-identical to the run it came from (same
arithmetic, no clipping), so a run that moves trains the same losses and step-6 weights as one that stays on its split
throughout (:func:`upstream.test_resume._same`)."""

from __future__ import annotations

import json
import re

import pytest

from nanotron_ext.checkpoint import RECORD_FILE, locate_checkpoint
from nanotron_ext.errors import ConfigError
from upstream.e2e import launch, tiny_config
from upstream.test_resume import SHAPE, _notes, _placed, _same, _train, kill_inside_save

#: Stage 0 holds the embedding alone: the tiny model's slowest split at pp = 2 (docs/replan.md).
BAD = {"cost_strategy": "layout", "layout": "E|t*2,L"}


@pytest.fixture(scope="module")
def stays(tmp_path_factory):
    """The bad split with a gain no plan reaches: the run re-plans after step 4, stays, and trains 6 steps."""
    return _train(tmp_path_factory.mktemp("stays"), 2, "--replan-after", "4", ext={**BAD, "replan": {"min_gain": 0.99}})


def test_a_run_that_stays_says_why_and_trains_its_plan_to_the_end(stays):
    run, folder = stays
    notes = _notes(run)
    assert "replan after step 4, priced by the run's own steps (in-run profile):" in notes, run.out[-3000:]
    assert re.search(r"^  now:  E\|t\*2,L  1f1b  predicted .* peak ", run.out, re.M)
    assert "below min_gain, staying" in run.out
    assert any(
        re.fullmatch(r"replan: steps 2-4 on E\|t\*2,L \(1f1b\) measured .* a step, predicted .*", n) for n in notes
    ), notes
    assert any(n.startswith("replan: steps 6-6 after the re-plan, on E|t*2,L (1f1b)") for n in notes), notes
    record = json.loads((folder / "checkpoints" / "6" / RECORD_FILE).read_text())
    assert record["stages"] == [0, 1, 1, 1, 1, 1, 1]


def test_a_run_on_a_bad_split_moves_after_k_steps_and_trains_the_bits_of_the_run_that_stayed(stays, tmp_path):
    run, folder = moved = _train(tmp_path, 2, "--replan-after", "3", ext={**BAD, "replan": {"min_gain": 0.0}})
    notes = _notes(run)
    assert "replan after step 3, priced by the run's own steps (in-run profile):" in notes, run.out[-3000:]
    assert re.search(r"predicted gain .*: moving to the new plan", run.out), run.out[-3000:]
    best = re.search(r"^  best: (\S+)  (\S+)  predicted", run.out, re.M)
    assert best is not None and best[2] == "1f1b"
    # Step 3 saved with its plan record, then resumed by the re-launch on the new split, every entry placed once.
    assert json.loads((folder / "checkpoints" / "3" / RECORD_FILE).read_text())["stages"] == [0, 1, 1, 1, 1, 1, 1]
    assert any(
        n.startswith(
            f"re-planning as asked (resume_plan: replan): checkpoint 3 was trained on E|t*2,L "
            f"(layout, pp=2); today: {best[1]}"
        )
        for n in notes
    ), notes
    _placed(run)
    assert sorted(run.losses) == [1, 2, 3, 4, 5, 6]
    _same(stays, moved)  # every step's loss, every weight at step 6
    record = json.loads((folder / "checkpoints" / "6" / RECORD_FILE).read_text())
    assert (record["step"], record["complete"], record["strategy"]) == (6, True, "layout")
    assert record["stages"] != [0, 1, 1, 1, 1, 1, 1]  # the next resume keeps the new split
    assert any(
        re.fullmatch(
            r"replan: the move took .* s \(save .* s, re-launch, build and load .* s\); re-plan .* s; "
            r"rank 0's peak memory \d+ -> \d+ MiB",
            n,
        )
        for n in notes
    ), notes
    assert any(n.startswith("replan: steps 2-3 on E|t*2,L (1f1b) measured") for n in notes), notes
    assert any(n.startswith(f"replan: steps 5-6 after the move, on {best[1]} (1f1b), measured") for n in notes), notes


def test_a_kill_during_the_move_leaves_the_last_complete_checkpoint_the_one_a_resume_takes(tmp_path):
    """torchrun is SIGKILLed while every rank is inside the save of the move's step 3 (weights written, optimizer
    not): step 2's checkpoint stays the latest and valid, step 3's is refused, nothing trained on the new split."""
    config = tiny_config(
        tmp_path, steps=6, checkpoints__checkpoint_interval=2, **SHAPE, ext={**BAD, "replan": {"min_gain": 0.0}}
    )
    log = kill_inside_save(config, 3, "--replan-after", "3")
    folder = tmp_path / "checkpoints"
    assert "moving to the new plan" in log and "re-planning as asked" not in log
    assert (folder / "latest.txt").read_text() == "2"
    assert json.loads((folder / "3" / RECORD_FILE).read_text())["complete"] is False
    assert locate_checkpoint(folder).folder == folder / "2"  # what a resume from the checkpoints folder takes
    with pytest.raises(ConfigError, match=r"complete: false\), so it is not loaded; resume from the last complete one"):
        locate_checkpoint(folder / "3")


def test_a_run_of_at_most_k_steps_trains_its_plan_and_says_why(tmp_path):
    run = launch(tiny_config(tmp_path, steps=3, **SHAPE, ext=BAD), "--replan-after", "3")
    assert run.rc == 0 and sorted(run.losses) == [1, 2, 3], run.out[-3000:]
    assert "replan after step 3: the run has 3 steps, so it trains its plan to the end without re-planning" in _notes(
        run
    ), _notes(run)
    assert "in-run profile" not in run.out
