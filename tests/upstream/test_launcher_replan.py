"""``--replan-after K`` through the launcher: upstream Nanotron's own trainer (``run_train.py`` through ``torchrun -m
nanotron_ext.run --cpu-debug``) prices its first K steps with the engine's clock, re-plans, tries the candidate against
its plan in turns (A BB A), each move a re-launch in the same processes resuming the step's checkpoint under the other
plan, and keeps the plan it measured faster.

The reference is ``test_resume.py``'s: a resume under another split is bit-identical to the run it came from (same
arithmetic, no clipping), so a run that tries plans trains the same losses and weights as one that stays on its split
throughout."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from nanotron_ext.checkpoint import RECORD_FILE, locate_checkpoint
from nanotron_ext.errors import ConfigError
from upstream.e2e import TORCHRUN, launch, tiny_config, whole_weights
from upstream.test_resume import SHAPE, _notes, _placed, kill_inside_save

pytestmark = pytest.mark.slow  # real processes, minutes: the slow set (python -m pytest -m slow)

#: Stage 0 holds the embedding alone: the tiny model's slowest split at pp = 2 (docs/replan.md).
BAD = {"cost_strategy": "layout", "layout": "E|t*2,L"}
#: One timed step a turn: steps 4-5 on the run's plan, 6-8 on the candidate, 9-10 back on the run's plan.
REPLAN = {"turn_steps": 1, "trials": 1}
STEPS = 12


def _train(tmp: Path, *launcher_args: str, steps: int = STEPS, **ext: object):
    config = tiny_config(tmp, steps=steps, checkpoints__checkpoint_interval=4, **SHAPE, ext={**BAD, **ext})
    run = launch(config, *launcher_args, nproc=2, torchrun=TORCHRUN)
    assert run.rc == 0, run.out[-4000:]
    return run, tmp


@pytest.fixture(scope="module")
def stays(tmp_path_factory):
    """The bad split with a gain no plan reaches: the run re-plans after step 3, stays, and trains 12 steps."""
    return _train(tmp_path_factory.mktemp("stays"), "--replan-after", "3", replan={**REPLAN, "min_gain": 0.99})


def test_a_run_that_stays_says_why_and_trains_its_plan_to_the_end(stays):
    run, folder = stays
    notes = _notes(run)
    assert "replan after step 3, priced by the run's own steps (in-run profile):" in notes, run.out[-3000:]
    assert re.search(r"^  now:   E\|t\*2,L  1f1b  predicted .* peak ", run.out, re.M)
    assert "below min_gain even at the profile's error, staying" in run.out
    assert any(
        re.fullmatch(r"replan: steps 2-3 on E\|t\*2,L \(1f1b\), under the clock, measured .* a step \(median\).*", n)
        for n in notes
    ), notes
    assert any(n.startswith(f"replan: steps 5-{STEPS} after the re-plan, on E|t*2,L (1f1b)") for n in notes), notes
    record = json.loads((folder / "checkpoints" / str(STEPS) / RECORD_FILE).read_text())
    assert record["stages"] == [0, 1, 1, 1, 1, 1, 1]


def test_a_run_tries_the_candidate_in_turns_and_trains_the_bits_of_the_run_that_stayed(stays, tmp_path):
    """A BB A through three re-launches (two of them moves of the split, one back), each resuming the step's
    checkpoint under the other plan: every step's loss and every weight at the end are those of the run that
    stayed; a checkpoint saved only for a move is removed once a later one was resumed."""
    run, folder = _train(tmp_path, "--replan-after", "3", replan={**REPLAN, "min_gain": 0.0})
    notes = _notes(run)
    assert re.search(r"trying 1 plan\(s\) against the run's in turns, 7 steps", run.out), run.out[-3000:]
    best = re.search(r"^  try 1: (\S+)  (\S+)  predicted", run.out, re.M)
    assert best is not None and best[2] == "1f1b"
    assert f"replan: trial A BB A, steps 4-10; A: E|t*2,L (1f1b), B: {best[1]} (1f1b)" in notes
    for i, (plan, a, b) in enumerate([("A", 4, 5), ("B", 6, 8), ("A", 9, 10)], 1):
        assert any(n.startswith(f"replan: turn {i}/3 ({plan}) steps {a}-{b} on ") for n in notes), notes
    # Step 5 saved for the move (off the interval), resumed on the candidate; step 8 (on the interval) resumed back.
    moved = [n for n in notes if n.startswith("re-planning as asked (resume_plan: replan): checkpoint ")]
    assert moved[:2] == [
        f"re-planning as asked (resume_plan: replan): checkpoint 5 was trained on E|t*2,L (layout, pp=2); today: "
        f"{best[1]}",
        f"re-planning as asked (resume_plan: replan): checkpoint 8 was trained on {best[1]} (layout, pp=2); today: "
        f"E|t*2,L",
    ], notes
    _placed(run)
    assert sorted(run.losses) == list(range(1, STEPS + 1))
    stayed, _ = stays
    assert run.losses == stayed.losses  # every step's loss
    a, b = whole_weights(stays[1] / "checkpoints" / str(STEPS)), whole_weights(folder / "checkpoints" / str(STEPS))
    assert a.keys() == b.keys() and len(a) >= 14 and [k for k in a if not torch.equal(a[k], b[k])] == []
    verdict = next(n for n in run.out.splitlines() if n.startswith("  noise "))
    kept = "E|t*2,L" if "back to" in verdict else best[1]
    record = json.loads((folder / "checkpoints" / str(STEPS) / RECORD_FILE).read_text())
    assert (record["step"], record["complete"], record["strategy"]) == (STEPS, True, "layout")
    assert (record["stages"] == [0, 1, 1, 1, 1, 1, 1]) == (kept == "E|t*2,L")  # the next resume keeps it
    assert not (folder / "checkpoints" / "5").exists()  # superseded by 8, which is on the interval and stays
    assert (folder / "checkpoints" / "8").is_dir()
    assert any(n.startswith(f"replan: steps 12-{STEPS} after the trial, on {kept} (1f1b)") for n in notes), notes
    assert any(re.fullmatch(r"replan: \d move\(s\) took .* s in all; \d+ steps ran on plans .*", n) for n in notes)
    written = json.loads((folder / "checkpoints" / "nanotron_ext_replan.json").read_text())  # every turn, the verdict
    assert [t["first_step"] for t in written["trial"]["turns"]] == [4, 6, 9]
    assert written["kept"]["split"] == kept and written["outcome"]["verdict"] in ("keep", "own_fastest", "within_noise")


def test_a_kill_during_a_move_leaves_the_last_complete_checkpoint_the_one_a_resume_takes(tmp_path):
    """torchrun is SIGKILLed while every rank is inside the save of the first move's step 5 (weights written,
    optimizer not): step 4's checkpoint stays the latest and valid, step 5's is refused, nothing trained on the
    candidate."""
    config = tiny_config(
        tmp_path, steps=STEPS, checkpoints__checkpoint_interval=4, **SHAPE, ext={**BAD, "replan": REPLAN}
    )
    log = kill_inside_save(config, 5, "--replan-after", "3")
    folder = tmp_path / "checkpoints"
    assert "trying 1 plan(s)" in log and "re-planning as asked" not in log
    assert (folder / "latest.txt").read_text() == "4"
    assert json.loads((folder / "5" / RECORD_FILE).read_text())["complete"] is False
    assert locate_checkpoint(folder).folder == folder / "4"  # what a resume from the checkpoints folder takes
    with pytest.raises(ConfigError, match=r"complete: false\), so it is not loaded; resume from the last complete one"):
        locate_checkpoint(folder / "5")


def test_a_run_of_at_most_k_steps_trains_its_plan_and_says_why(tmp_path):
    run = launch(tiny_config(tmp_path, steps=3, **SHAPE, ext=BAD), "--replan-after", "3", torchrun=TORCHRUN)
    assert run.rc == 0 and sorted(run.losses) == [1, 2, 3], run.out[-3000:]
    assert "replan after step 3: the run has 3 steps, so it trains its plan to the end without re-planning" in _notes(
        run
    ), _notes(run)
    assert "in-run profile" not in run.out
