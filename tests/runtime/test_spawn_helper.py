"""The spawn helper itself: environment, error reporting, and that a hang fails fast instead of hanging."""

from __future__ import annotations

import pytest

from . import workers
from .spawn import DistributedRunError, run_distributed, run_ranks


def test_environment_is_torchrun_like() -> None:
    envs = run_distributed(workers.echo_env, 2, timeout=20)
    assert [env["RANK"] for env in envs] == ["0", "1"]
    assert [env["LOCAL_RANK"] for env in envs] == ["0", "1"]
    assert {env["WORLD_SIZE"] for env in envs} == {"2"}
    assert {env["OMP_NUM_THREADS"] for env in envs} == {"1"}
    assert len({env["MASTER_PORT"] for env in envs}) == 1


def test_failure_is_reported_and_peers_are_killed() -> None:
    outcomes = run_ranks(workers.fail_on_rank_one_else_hang, 2, timeout=30, grace=1.0)
    assert not outcomes[1].ok and outcomes[1].error == "RuntimeError('boom on rank 1')"
    assert not outcomes[0].ok and outcomes[0].timed_out
    # Killed after the grace period, not at the deadline: a rank still alive 3 s before the deadline dumps its
    # stack ("Timeout (0:00:27)!", see test_hang_hits_the_deadline), and rank 0 never got there.
    assert "Timeout" not in outcomes[0].output, "a failed peer must not leave the others running until the timeout"
    with pytest.raises(DistributedRunError, match="boom on rank 1"):
        run_distributed(workers.fail_on_rank_one_else_hang, 2, timeout=30, grace=1.0)


def test_hang_hits_the_deadline() -> None:
    outcomes = run_ranks(workers.fail_on_rank_one_else_hang, 1, timeout=3)
    assert outcomes[0].timed_out and outcomes[0].returncode != 0
    assert outcomes[0].error == "killed at the deadline / after a peer failed"
    assert "Timeout (0:00:01)!" in outcomes[0].output  # faulthandler dumped the stack before the kill
