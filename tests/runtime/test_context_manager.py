"""``with GlooParallelContext(...)``: a clean exit waits for every rank (a barrier), an error does not (a peer
may be dead or stuck), and the error still propagates."""

from __future__ import annotations

import pytest

from . import workers
from .spawn import run_distributed

pytestmark = pytest.mark.slow  # tests/conftest.py: left out of the quick run

HOLD_S = 3.0


def test_clean_exit_waits_for_every_rank() -> None:
    r0, r1 = run_distributed(workers.context_exit_seconds, 2, args=(-1, HOLD_S), timeout=60)
    # Rank 1 left its block at once; its teardown's barrier waits for rank 0, which held on for HOLD_S.
    assert r1["exit_s"] > HOLD_S - 1.0, r1
    assert not r0["raised"] and not r1["raised"]
    assert not r0["initialized"] and not r1["initialized"]


def test_error_exit_tears_down_without_waiting_and_reraises() -> None:
    _, r1 = run_distributed(workers.context_exit_seconds, 2, args=(1, HOLD_S), timeout=60)
    assert r1["raised"], "the error inside the block must propagate out of the with"
    assert r1["exit_s"] < HOLD_S - 1.0, f"the failing rank waited in a barrier for its peer: {r1}"
    assert not r1["initialized"]
