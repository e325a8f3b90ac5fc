"""zb2p (ZB-H2-style, issue 31): each rank's program, its timing and its memory terms.

zb1p's program with twice 1F1B's warm-up forwards (stage ``s``: ``2(pp - s - 1)``, at most ``m``) and twice its
deferred W's (``2s``). The engine that runs it on Nanotron's machinery is checked in
``tests/runtime/test_zero_bubble.py`` (gradients equal to 1F1B's) and ``test_runtime_pipeline.py`` (the order,
call by call, and every program of the family at pp 2-4 to completion).
"""

from __future__ import annotations

import random

import pytest

from nanotron_ext.schedule import ZERO_BUBBLE, micro_batch_shortfall, too_few_micro_batches
from nanotron_ext.schedule.programs import deferred_weights, warmup_forwards
from nanotron_ext.schedule.simulator import Action, StageTimes, engine_program, simulate


def _compute(program) -> list[tuple[str, int]]:
    return [(str(a), j) for a, j in program if a.is_compute]


@pytest.mark.parametrize(("pp", "m"), [(2, 1), (2, 4), (3, 2), (3, 5), (4, 3), (4, 12), (5, 7)])
def test_each_stage_runs_its_warmup_then_defers_two_ws_per_rank(pp: int, m: int) -> None:
    for stage in range(pp):
        ops = _compute(engine_program("zb2p", pp, stage, m))
        kinds = [k for k, _ in ops]
        # every micro-batch once per kind, each kind first-in-first-out, a W after its own B
        for kind in "FBW":
            assert [j for k, j in ops if k == kind] == list(range(m)), (stage, kind)
        assert all(ops.index(("B", j)) < ops.index(("W", j)) for j in range(m))
        assert kinds.index("B") == min(m, 2 * (pp - stage - 1) + 1)  # forwards before the first backward
        assert kinds[: kinds.index("W")].count("B") == min(m, 2 * stage + 1)  # backwards before the first W


def test_warmup_and_deferral_counts() -> None:
    assert [warmup_forwards("zb2p", 4, s, 12) for s in range(4)] == [6, 4, 2, 0]
    assert [warmup_forwards("zb2p", 4, s, 3) for s in range(4)] == [3, 3, 2, 0]  # at most m
    assert [warmup_forwards("zb1p", 4, s, 12) for s in range(4)] == [3, 2, 1, 0]
    assert warmup_forwards("afab", 4, 0, 5) == 5
    assert [deferred_weights("zb2p", s) for s in range(4)] == [0, 2, 4, 6]
    assert [deferred_weights("zb1p", s) for s in range(4)] == [0, 1, 2, 3]
    assert deferred_weights("1f1b", 2) is None and deferred_weights("afab", 2) is None


def test_pp2_m4_by_hand() -> None:
    """F = 1, B = 1.5 (input gradient), W = 0.5 on two stages, m = 4 (the backward is 2, W its quarter).

    Stage 1 (two W's deferred): F0 1-2, B0 2-3.5; Nanotron sends gradient 0 at its next communication point, the
    receive of activation 1: 3.5. F1 3.5-4.5, B1 4.5-6 (sent at 6), F2 6-7, B2 7-8.5, W0 8.5-9 (gradient 2 sent at
    9), F3 9-10, B3 10-11.5 (sent at once: the last), W1 W2 W3 11.5-13.
    Stage 0 (warm-up F0 F1): F2 2-3, B0 3.5-5, W0 5-5.5, F3 5.5-6.5, B1 6.5-8, W1 8-8.5, B2 9-10.5, W2 10.5-11,
    B3 11.5-13, W3 13-13.5: a step of 13.5 against zb1p's 14 and 1F1B's 15; the floor (p - 1)F + m(F + B + W)
    is 13."""
    stages = [StageTimes(1.0, 2.0, weight=0.5)] * 2
    r = simulate(stages, 4, "zb2p")
    stage0 = [(op.kind, op.micro_batch, op.start) for op in r.ops if op.stage == 0]
    assert stage0 == [
        ("F", 0, 0.0),
        ("F", 1, 1.0),
        ("F", 2, 2.0),
        ("B", 0, 3.5),
        ("W", 0, 5.0),
        ("F", 3, 5.5),
        ("B", 1, 6.5),
        ("W", 1, 8.0),
        ("B", 2, 9.0),
        ("W", 2, 10.5),
        ("B", 3, 11.5),
        ("W", 3, 13.0),
    ]
    stage1 = [(op.kind, op.micro_batch, op.start) for op in r.ops if op.stage == 1]
    assert stage1[6:] == [("W", 0, 8.5), ("F", 3, 9.0), ("B", 3, 10.0), ("W", 1, 11.5), ("W", 2, 12.0), ("W", 3, 12.5)]
    assert (r.step_time, simulate(stages, 4, "zb1p").step_time, simulate(stages, 4, "1f1b").step_time) == (
        13.5,
        14.0,
        15.0,
    )
    assert r.peak_in_flight == [3, 1]


@pytest.mark.parametrize("seed", range(3))
def test_never_deadlocks_and_holds_what_in_flight_says(seed: int) -> None:
    from nanotron_ext.costs.analytic import in_flight
    from nanotron_ext.costs.block_memory import deferred_at_once

    rng = random.Random(seed)
    for pp in range(2, 6):
        for m in range(pp - 1, 3 * pp + 1):
            stages = [
                StageTimes(rng.uniform(0.5, 2), b := rng.uniform(0.5, 3), weight=rng.uniform(0, b)) for _ in range(pp)
            ]
            cuts = [rng.random() < 0.8 for _ in range(pp - 1)]
            r = simulate(stages, m, "zb2p", rng.uniform(0, 0.3), grad_cuts=cuts)
            assert sum(op.kind == "W" for op in r.ops) == pp * m
            assert r.peak_in_flight == in_flight("zb2p", pp, m)
            for stage in range(pp):  # most W's pending while the stage computes, the running one left out
                pending = most = 0
                for action, _ in engine_program("zb2p", pp, stage, m):
                    if action.is_compute:
                        most = max(most, pending - (action is Action.WEIGHT))
                    pending += {Action.BACKWARD: 1, Action.WEIGHT: -1}.get(action, 0)
                assert most == deferred_at_once("zb2p", pp, m)[stage], (pp, m, stage)


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (4, 12), (8, 16)])
def test_faster_than_zb1p_where_w_is_shorter_than_b(pp: int, m: int) -> None:
    # Equal stages, W a quarter of the backward (attention's backward has no weight gradient): zb1p cannot fill
    # stage 0's wait for its first gradient, zb2p fills it with forwards. With W as long as B they tie.
    short_w = [StageTimes(1.0, 2.0, weight=0.5)] * pp
    assert simulate(short_w, m, "zb2p").step_time < simulate(short_w, m, "zb1p").step_time
    even = [StageTimes(1.0, 2.0, weight=1.0)] * pp
    assert simulate(even, m, "zb2p").step_time == simulate(even, m, "zb1p").step_time == (pp - 1) + 3 * m


def test_too_few_micro_batches_is_refused_with_the_rule_and_the_fix() -> None:
    assert "zb2p" in ZERO_BUBBLE
    why = too_few_micro_batches("zb2p", 4, 2)
    assert why is not None and why.startswith("zb2p (ZB-H2") and "needs at least pp - 1 = 3 micro-batches" in why
    assert "batch_accumulation_per_replica >= 4" in why
    with pytest.raises(ValueError, match=r"zb2p .*needs at least pp - 1 = 3 micro-batches, got 2"):
        engine_program("zb2p", 4, 0, 2)
    warning = micro_batch_shortfall("zb2p", 4, 3)
    assert warning is not None and not warning.fatal and "never fills" in str(warning)


def test_memory_estimate_counts_zb2p_s_flight_and_deferred_ws() -> None:
    """The seed config split 3 | 4 blocks at m = 4: stage 0 holds 3 micro-batches in flight under zb2p (2 under
    1F1B and zb1p); stage 1 defers two W's (zb1p one), each keeping the lm_head's products."""
    from nanotron_ext.config import bundled_config, load_config
    from nanotron_ext.costs.memory_estimate import config_stage_memory
    from nanotron_ext.inventory import inventory_from_config

    cfg = load_config(bundled_config())
    blocks = inventory_from_config(cfg)
    parts = [blocks[:3], blocks[3:]]
    mem = {
        e: [config_stage_memory(part, cfg.with_overrides(engine=e), k) for k, part in enumerate(parts)]
        for e in ("1f1b", "zb1p", "zb2p")
    }
    assert [m.in_flight for m in mem["zb2p"]] == [3, 1] and [m.in_flight for m in mem["zb1p"]] == [2, 1]
    assert [m.deferred for m in mem["zb2p"]] == [0, 2] and [m.deferred for m in mem["zb1p"]] == [0, 1]
    assert mem["zb2p"][1].weight_pending == mem["zb1p"][1].weight_pending > 0
    assert mem["zb2p"][0].pipeline_peak > mem["zb1p"][0].pipeline_peak > mem["1f1b"][0].pipeline_peak
    assert mem["zb2p"][1].pipeline_peak - mem["zb1p"][1].pipeline_peak == pytest.approx(mem["zb1p"][1].weight_pending)


def test_config_and_command_line_take_zb2p(tmp_path, capsys) -> None:
    import json

    from nanotron_ext.cli import main
    from nanotron_ext.config import bundled_config, load_config

    cfg = load_config(bundled_config()).with_overrides(engine="zb2p")
    assert cfg.run.engine == "zb2p" and cfg.nanotron["parallelism"]["pp_engine"] == "zb2p"
    assert main(["simulate", "--engine", "zb2p", "--tflops", "0.001", "--json", "--out", str(tmp_path / "t.png")]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["simulation"]["engine"] == "zb2p" and any(op["kind"] == "W" for op in data["simulation"]["ops"])
    assert main(["simulate", "--engine", "zb2p", "--pp", "4", "--micro-batches", "2"]) == 2
    assert "zb2p (ZB-H2" in capsys.readouterr().err


def _deadlocks_when_sends_wait(programs) -> bool:
    """Replay ``programs`` where a send waits until its receive is posted (a P2P that syncs the host after its
    send, as Nanotron's on GPU does after its metadata send): True when every rank ends up waiting."""
    pos, sends, recvs = [0] * len(programs), set(), set()
    while any(p < len(prog) for p, prog in zip(pos, programs)):
        moved = False
        for s, prog in enumerate(programs):
            while pos[s] < len(prog):
                action, j = prog[pos[s]]
                if not action.is_compute:
                    key = (action.carries_gradient, s if action.is_send else s + action.peer, j)
                    (sends if action.is_send else recvs).add(key)
                    if key not in (recvs if action.is_send else sends):
                        break
                pos[s] += 1
                moved = True
        if not moved:
            return True
    return False


@pytest.mark.parametrize("engine", ["afab", "1f1b", "zb1p", "zb2p"])
def test_no_program_deadlocks_when_a_send_waits_for_its_receive(engine: str) -> None:
    """zb2p's warm-ups differ by two between neighbours: the activation of a stage's steady forward is held until
    after its backward (``act_lead``), so each link carries its messages in one order on both sides."""
    for pp in range(2, 9):
        for m in range(max(1, pp - 1), 3 * pp + 1):
            for frozen_prefix in (0, 1):
                cuts = [c >= frozen_prefix for c in range(pp - 1)]
                programs = [
                    engine_program(engine, pp, s, m, grad_in=s == 0 or cuts[s - 1], grad_out=s == pp - 1 or cuts[s])
                    for s in range(pp)
                ]
                assert not _deadlocks_when_sends_wait(programs), (engine, pp, m, frozen_prefix)
