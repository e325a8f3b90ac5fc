"""zb1p (ZB-H1, Qi et al. 2024): the program of each rank (issue 23).

The expected programs are written out by hand from the rule: 1F1B's program (warm-up of ``pp - stage - 1``
forwards, steady 1F1B, cool-down backwards, Nanotron's deferred sends), with ``W`` added: rank ``r`` defers the W
of its first ``r`` backwards; after backward ``i >= r`` (and after the sends issued right after that backward) it
runs the oldest deferred W (micro-batch ``i - r``); after the last backward, every W left.
"""

from __future__ import annotations

import doctest

import pytest

import nanotron_ext.schedule as schedule
import nanotron_ext.schedule.simulator as simulator
from nanotron_ext.schedule import micro_batch_shortfall, min_micro_batches, too_few_micro_batches
from nanotron_ext.schedule.simulator import Action, engine_order, engine_program


def _prog(text: str) -> list[tuple[str, int]]:
    out = []
    for word in text.split():
        head = word.rstrip("0123456789")
        out.append((head, int(word[len(head):])))
    return out


HAND = {
    # pp = 2, m = 3. Rank 0 defers nothing: W right after each B. Rank 1 defers B0's W until after B1.
    (2, 0, 3): "F0 send_act0 F1 send_act1 recv_grad0 B0 W0 F2 send_act2 recv_grad1 B1 W1 recv_grad2 B2 W2",
    (2, 1, 3): "recv_act0 F0 B0 recv_act1 send_grad0 F1 B1 W0 recv_act2 send_grad1 F2 B2 send_grad2 W1 W2",
    # pp = 3, m = 4.
    (3, 0, 4): "F0 send_act0 F1 send_act1 F2 send_act2 recv_grad0 B0 W0 F3 send_act3 recv_grad1 B1 W1 "
               "recv_grad2 B2 W2 recv_grad3 B3 W3",
    (3, 1, 4): "recv_act0 F0 send_act0 recv_act1 F1 send_act1 recv_grad0 B0 recv_act2 send_grad0 F2 send_act2 "
               "recv_grad1 B1 W0 recv_act3 send_grad1 F3 send_act3 recv_grad2 B2 send_grad2 W1 "
               "recv_grad3 B3 send_grad3 W2 W3",
    (3, 2, 4): "recv_act0 F0 B0 recv_act1 send_grad0 F1 B1 recv_act2 send_grad1 F2 B2 W0 recv_act3 send_grad2 "
               "F3 B3 send_grad3 W1 W2 W3",
    # pp = 4, m = 5.
    (4, 0, 5): "F0 send_act0 F1 send_act1 F2 send_act2 F3 send_act3 recv_grad0 B0 W0 F4 send_act4 recv_grad1 B1 W1 "
               "recv_grad2 B2 W2 recv_grad3 B3 W3 recv_grad4 B4 W4",
    (4, 1, 5): "recv_act0 F0 send_act0 recv_act1 F1 send_act1 recv_act2 F2 send_act2 recv_grad0 B0 "
               "recv_act3 send_grad0 F3 send_act3 recv_grad1 B1 W0 recv_act4 send_grad1 F4 send_act4 recv_grad2 B2 "
               "send_grad2 W1 recv_grad3 B3 send_grad3 W2 recv_grad4 B4 send_grad4 W3 W4",
    (4, 2, 5): "recv_act0 F0 send_act0 recv_act1 F1 send_act1 recv_grad0 B0 recv_act2 send_grad0 F2 send_act2 "
               "recv_grad1 B1 recv_act3 send_grad1 F3 send_act3 recv_grad2 B2 W0 recv_act4 send_grad2 F4 send_act4 "
               "recv_grad3 B3 send_grad3 W1 recv_grad4 B4 send_grad4 W2 W3 W4",
    (4, 3, 5): "recv_act0 F0 B0 recv_act1 send_grad0 F1 B1 recv_act2 send_grad1 F2 B2 recv_act3 send_grad2 F3 B3 W0 "
               "recv_act4 send_grad3 F4 B4 send_grad4 W1 W2 W3 W4",
    # pp = 4, m = pp - 1 = 3: no steady phase on rank 0, one steady pair on rank 1.
    (4, 1, 3): "recv_act0 F0 send_act0 recv_act1 F1 send_act1 recv_act2 F2 send_act2 recv_grad0 B0 send_grad0 "
               "recv_grad1 B1 send_grad1 W0 recv_grad2 B2 send_grad2 W1 W2",
    (4, 3, 3): "recv_act0 F0 B0 recv_act1 send_grad0 F1 B1 recv_act2 send_grad1 F2 B2 send_grad2 W0 W1 W2",
}


@pytest.mark.parametrize(("pp", "stage", "m"), sorted(HAND))
def test_zb1p_program_matches_the_hand_written_order(pp: int, stage: int, m: int) -> None:
    assert engine_program("zb1p", pp, stage, m) == _prog(HAND[(pp, stage, m)])


def _without_w(program: list) -> list:
    return [step for step in program if step.action is not Action.WEIGHT]


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("extra", [-1, 0, 1, 3, 9])
@pytest.mark.parametrize(("grad_in", "grad_out"), [(True, True), (False, True), (True, False), (False, False)])
def test_zb1p_is_1f1b_plus_w_one_per_micro_batch_fifo(pp: int, extra: int, grad_in: bool, grad_out: bool) -> None:
    m = max(1, pp + extra)
    for stage in range(pp):
        zb = engine_program("zb1p", pp, stage, m, grad_in=grad_in, grad_out=grad_out)
        one = engine_program("1f1b", pp, stage, m, grad_in=grad_in, grad_out=grad_out)
        assert _without_w(zb) == one  # same F/B, same sends and receives at the same places
        ws = [j for a, j in zb if a is Action.WEIGHT]
        assert ws == list(range(m))  # one W per micro-batch, oldest first
        for j in range(m):  # each W after its own B; W of micro-batch j never before backward j + stage
            w_at = zb.index((Action.WEIGHT, j))
            assert zb.index((Action.BACKWARD, j)) < w_at
            later = min(j + stage, m - 1)
            assert zb.index((Action.BACKWARD, later)) < w_at
        # at most ``stage`` deferred W's pending after any step, and a W never sits between a backward and a
        # send the 1F1B program issues right after it
        pending = 0
        for k, (action, _) in enumerate(zb):
            pending += {Action.BACKWARD: 1, Action.WEIGHT: -1}.get(action, 0)
            if action is Action.WEIGHT:
                assert pending <= stage
                assert k + 1 == len(zb) or zb[k + 1][0] is not Action.SEND_GRAD
            assert action is Action.WEIGHT or pending <= stage + 1


def test_engine_order_of_zb1p_lists_w() -> None:
    assert engine_order("zb1p", 2, 1, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("W", 0), ("W", 1)]


def test_weight_is_compute_and_not_communication() -> None:
    assert Action.WEIGHT == "W" and Action.WEIGHT.is_compute
    assert not Action.WEIGHT.is_send and not Action.WEIGHT.carries_gradient and Action.WEIGHT.peer == 0


def test_zb1p_micro_batch_rule_is_1f1b_s() -> None:
    for pp in range(1, 9):
        assert min_micro_batches("zb1p", pp) == min_micro_batches("1f1b", pp)
        for m in range(1, 2 * pp + 1):
            assert (micro_batch_shortfall("zb1p", pp, m) is None) == (micro_batch_shortfall("1f1b", pp, m) is None)


def test_zb1p_with_too_few_micro_batches_is_refused_with_the_rule_and_the_fix() -> None:
    why = too_few_micro_batches("zb1p", 4, 2)
    assert why is not None and why.startswith("zb1p")
    assert "at least pp - 1 = 3 micro-batches, got 2" in why
    assert "batch_accumulation_per_replica >= 4" in why and "pp_engine: afab" in why
    with pytest.raises(ValueError, match=r"zb1p .*needs at least pp - 1 = 3 micro-batches, got 2.*>= 4"):
        engine_program("zb1p", 4, 0, 2)
    warning = micro_batch_shortfall("zb1p", 4, 3)
    assert warning is not None and not warning.fatal and "zb1p" in str(warning) and "never fills" in str(warning)


def test_docstring_examples_run() -> None:
    for module in (schedule, simulator):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted > 0, module.__name__
