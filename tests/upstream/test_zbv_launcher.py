"""``pp_engine: zbv`` through the launcher: upstream Nanotron's own trainer runs the V
(``ZeroBubbleVPipelineEngine``, its sends held to their one order as a GPU's waiting sends need), and a checkpoint
moves into a V, out of it and stays on it, bit for bit against the contiguous run it started from (the reference of
``test_resume.py``: plan A trained 6 steps, saving at 2, 4 and 6)."""

from __future__ import annotations

import json

import pytest

from nanotron_ext.checkpoint import RECORD_FILE
from upstream.test_resume import LAYOUT_A, _notes, _placed, _same, _train

pytestmark = pytest.mark.slow  # tests/conftest.py: left out of the quick run

#: The V the planner searches for the tiny model at pp=2: embedding | decoders | final norm | lm_head, cast, loss.
V_SPLIT = "E|t*2|N|H,C,X"
ZBV = {"parallelism__pp_engine": "zbv", "ext": {"cost_strategy": "constrained"}}


@pytest.fixture(scope="module")
def runs(plan_a, tmp_path_factory):
    """Plan A (contiguous, 1f1b: tests/upstream/conftest.py's) and its step-2 checkpoint resumed under zbv with
    --replan (steps 3-6)."""
    tmp = tmp_path_factory.mktemp("zbv_launcher")
    a = plan_a
    v = _train(tmp / "v", 2, "--replan", checkpoints__resume_checkpoint_path=str(a[1] / "checkpoints" / "2"), **ZBV)
    return a, v


def test_a_contiguous_checkpoint_resumes_into_a_v_bit_for_bit(runs):
    a, v = runs
    notes = _notes(v[0])
    assert (
        f"re-planning as asked (resume_plan: replan): checkpoint 2 was trained on E,t|t,L (layout, pp=2); "
        f"today: {V_SPLIT}"
    ) in notes
    assert any(n.startswith("'v-search' plan for pp=2") for n in notes)
    _placed(v[0])
    _same(a, v)  # steps 3-6 as logged, every weight at step 6
    record = json.loads((v[1] / "checkpoints" / "6" / RECORD_FILE).read_text())
    assert (record["engine"], record["stages"], record["v_stages"]) == (
        "zbv",
        [0, 1, 1, 1, 0, 0, 0],
        [0, 1, 1, 2, 3, 3, 3],
    )


def test_a_v_checkpoint_stays_on_its_v_or_leaves_it_bit_for_bit(runs, tmp_path):
    """Resumed under zbv, the V's step-4 checkpoint keeps its recorded chunks; under A's contiguous layout (without
    --replan) it cannot, says why, and moves onto A's split. Both end at A's step-6 weights."""
    a, v = runs
    kept = _train(tmp_path / "kept", 2, checkpoints__resume_checkpoint_path=str(v[1] / "checkpoints" / "4"), **ZBV)
    assert (
        f"resuming checkpoint 4 on its recorded split {V_SPLIT} (v-search, pp=2), which is today's plan too"
        in _notes(kept[0])
    )
    _same(a, kept)
    out = _train(tmp_path / "out", 2, checkpoints__resume_checkpoint_path=str(v[1] / "checkpoints" / "4"), ext=LAYOUT_A)
    assert (
        f"the config asks pp_engine 1f1b, the checkpoint was trained on a V (pp_engine zbv): checkpoint 4 "
        f"({V_SPLIT}) moves onto the new plan E,t|t,L; its weights, optimizer states and learning-rate schedule "
        f"go to their new owners"
    ) in _notes(out[0])
    _placed(out[0])
    _same(a, out)
