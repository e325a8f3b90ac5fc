"""Issue 31: the profile a run's own ops make (``benchmarks/_in_run_ops.py``), which ``zb_measured_cpu.py`` replays
in the simulator against the engine. Exact hand cases: each figure is the median of what the run recorded."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _in_run_ops import (  # noqa: E402
    calibrated_ops,
    in_run_stages,
    measured_pipeline,
    one_step,
    op_fastest,
    op_means,
    per_step_ratios,
    step_times,
)

from nanotron_ext.schedule.simulator import StageTimes, simulate  # noqa: E402


def _record(step: float, busy: float, pipeline: float, pipeline_idle: float) -> dict[str, float]:
    return {"step": step, "busy": busy, "pipeline": pipeline, "pipeline_idle": pipeline_idle}


#: Two ranks, three timed steps; rank 1 ran no W (a 1F1B-like rank), rank 0 ran W under zb.
RUN = {
    "ops": [
        [
            {"F": [1.0, 3.0], "B": [2.0], "W": [0.5]},
            {"F": [2.0], "B": [4.0, 6.0], "W": [0.7]},
            {"F": [9.0], "B": [5.0], "W": [0.6]},
        ],
        [{"F": [1.5], "B": [2.5], "W": []}, {"F": [1.5], "B": [2.5], "W": []}, {"F": [1.0], "B": [9.0], "W": []}],
    ],
    "records": [
        [_record(10.0, 8.0, 7.0, 1.0), _record(12.0, 9.0, 8.0, 2.0), _record(11.0, 8.0, 6.0, 0.5)],
        [_record(10.5, 7.0, 6.5, 1.5), _record(11.5, 7.5, 7.0, 1.0), _record(13.0, 9.0, 7.5, 0.0)],
    ],
}


def test_each_kind_is_the_mean_of_every_op_of_the_run_on_that_rank() -> None:
    # rank 0: F over 1, 3, 2, 9 -> 3.75; B over 2, 4, 6, 5 -> 4.25; W over 0.5, 0.7, 0.6 -> 0.6
    assert op_means(RUN, 0) == pytest.approx({"F": 3.75, "B": 4.25, "W": 0.6})
    assert op_means(RUN, 1) == pytest.approx({"F": 4 / 3, "B": 14 / 3, "W": 0.0})  # no W ran: 0
    assert op_fastest(RUN, 0) == {"F": 1.0, "B": 2.0, "W": 0.5}
    assert op_fastest(RUN, 1) == {"F": 1.0, "B": 2.5, "W": 0.0}


def test_a_stage_is_its_ops_and_its_busy_time_after_the_pipeline_plus_the_tied_sync() -> None:
    stages = in_run_stages(RUN, synced=0.25)
    # rank 0 after the pipeline: 8 - (7 - 1) = 2, 9 - (8 - 2) = 3, 8 - (6 - 0.5) = 2.5 -> mean 2.5; + 0.25
    assert stages[0] == pytest.approx(StageTimes(forward=3.75, backward=4.25 + 0.6, weight=0.6, update=2.75))
    # rank 1: 7 - 5 = 2, 7.5 - 6 = 1.5, 9 - 7.5 = 1.5 -> mean 5 / 3; + 0.25
    assert stages[1] == pytest.approx(StageTimes(forward=4 / 3, backward=14 / 3, weight=0.0, update=5 / 3 + 0.25))


def test_the_step_and_the_pipeline_are_the_slowest_rank_s_each_step_then_the_median() -> None:
    assert step_times(RUN) == [10.5, 12.0, 13.0]
    assert measured_pipeline(RUN) == 7.5  # per step max(7, 6.5), max(8, 7), max(6, 7.5) -> median of 7, 8, 7.5


def test_zero_bubble_b_is_the_backward_less_its_w_and_1f1b_has_no_w() -> None:
    sim = {"stages": [{"forward": 1.0, "backward": 3.0, "weight": 1.25, "update": 0.0}]}
    assert calibrated_ops(sim, "zb2p") == [{"F": 1.0, "B": 1.75, "W": 1.25}]
    assert calibrated_ops(sim, "zb1p") == [{"F": 1.0, "B": 1.75, "W": 1.25}]
    assert calibrated_ops(sim, "1f1b") == [{"F": 1.0, "B": 3.0, "W": 0.0}]


def test_the_in_run_profile_replays_through_the_simulator_by_hand() -> None:
    # 1F1B, pp = 2, m = 2, no p2p; stage 0 (F 3.75, B 4.85), stage 1 (F 4/3, B 14/3): stage 0 F0 [0, 3.75]
    # F1 [3.75, 7.5]; stage 1 F0 [3.75, 5.083] B0 [5.083, 9.75] F1 [9.75, 11.083] B1 [11.083, 15.75];
    # stage 0 B0 [9.75, 14.6] B1 [15.75, 20.6]; the pipeline ends at 20.6, the step adds stage 0's 2.75.
    result = simulate(in_run_stages(RUN, synced=0.25), 2, "1f1b")
    assert result.pipeline_time == pytest.approx(20.6)
    assert result.step_time == pytest.approx(20.6 + 2.75)


def test_one_step_keeps_only_that_steps_ops_and_records_on_every_rank() -> None:
    one = one_step({**RUN, "peaks": [[1, 2, 3], [4, 5, 6]]}, 1)
    assert one["ops"] == [[RUN["ops"][0][1]], [RUN["ops"][1][1]]]
    assert one["records"] == [[RUN["records"][0][1]], [RUN["records"][1][1]]]
    assert one["peaks"] == [[2], [5]]
    assert op_means(one, 0) == pytest.approx({"F": 2.0, "B": 5.0, "W": 0.7})


def test_each_step_is_replayed_under_its_own_ops_against_its_own_slowest_rank() -> None:
    # a stand-in simulator: rank 0's summed ops of the one step it is given; steps 10.5, 12, 13 (the slowest rank)
    def ops_of_rank_0(one: dict[str, Any]) -> float:
        return sum(t for step in one["ops"][0] for times in step.values() for t in times)

    assert per_step_ratios(RUN, ops_of_rank_0) == pytest.approx([6.5 / 10.5, 12.7 / 12.0, 14.6 / 13.0])
