"""``nanotron_ext.procs.run_local_ranks``, the one launcher of the tests and benchmarks: the rendezvous
environment, the deadline, the grace period after a failure, and that nothing it started outlives it."""

from __future__ import annotations

import os
import sys
import time

import pytest

from nanotron_ext.procs import free_port, local_env, run_local_ranks

PY = sys.executable


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purpose.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[-1][0] != "Z"


def test_each_rank_gets_torchrun_variables_and_one_port() -> None:
    code = "import os; print(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['MASTER_PORT'], os.environ['X'])"
    run = run_local_ranks([PY, "-c", code], 3, timeout=30, env=local_env(X="x"))
    assert run.ok and not run.deadline_hit, run.describe()
    fields = [r.stdout.split() for r in run.ranks]
    assert [f[0] for f in fields] == ["0", "1", "2"] and {f[1] for f in fields} == {"3"}
    assert len({f[2] for f in fields}) == 1 and {f[3] for f in fields} == {"x"}


def test_a_free_port_is_bindable_and_outside_the_range_the_kernel_hands_out() -> None:
    # Every outgoing connection and every bind to port 0 draws from the ephemeral range: a rendezvous port there
    # can be taken between its choice and rank 0's bind (EADDRINUSE in CI).
    import socket
    from pathlib import Path

    first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= p < first_ephemeral for p in ports) and len(ports) > 10  # random, not one port for all
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", ports.pop()))


def test_without_rendezvous_the_environment_is_left_alone() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "MASTER_PORT")}
    run = run_local_ranks(
        [PY, "-c", "import os; print('RANK' in os.environ)"], 1, timeout=30, env=env, rendezvous=False
    )
    assert run.ranks[0].stdout.strip() == "False", run.describe()


def test_stdout_and_stderr_kept_apart_or_merged() -> None:
    code = "import sys; print('out'); print('err', file=sys.stderr)"
    apart = run_local_ranks([PY, "-c", code], 1, timeout=30, rendezvous=False, merge_output=False).ranks[0]
    assert (apart.stdout.strip(), apart.stderr.strip()) == ("out", "err")
    merged = run_local_ranks([PY, "-c", code], 1, timeout=30, rendezvous=False).ranks[0]
    assert sorted(merged.stdout.split()) == ["err", "out"] and merged.stderr == ""


def test_deadline_kills_the_rank_and_what_it_started() -> None:
    # The rank starts a grandchild and prints its pid; both must be gone when the launch returns.
    code = (
        "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
        "print(p.pid, flush=True); time.sleep(60)"
    )
    start = time.monotonic()
    run = run_local_ranks([PY, "-c", code], 1, timeout=2, rendezvous=False)
    assert time.monotonic() - start < 10
    assert run.deadline_hit and run.ranks[0].killed and not run.ok
    grandchild = int(run.ranks[0].stdout.split()[0])
    # SIGKILL went to the whole group before the launch returned; the kernel may take a moment to finish the
    # grandchild (not our child, so nothing here can wait on it), so allow it that moment, no more.
    gone_by = time.monotonic() + 2.0
    while _alive(grandchild) and time.monotonic() < gone_by:
        time.sleep(0.01)
    assert not _alive(grandchild), "the rank's own child outlived the launch"


@pytest.mark.parametrize("grace, stops_early", [(0.0, True), (None, False)])
def test_a_failed_rank_stops_the_others_after_the_grace_period(grace: float | None, stops_early: bool) -> None:
    # Rank 1 fails at once; rank 0 would finish after 3 s.
    code = "import os, sys, time; r = int(os.environ['RANK']); sys.exit(3) if r else (time.sleep(3), print('done'))"
    run = run_local_ranks([PY, "-c", code], 2, timeout=30, grace=grace)
    assert run.ranks[1].returncode == 3
    if stops_early:
        # Killed, not finished: with the grace ignored it would print 'done' and exit 0 (no clock is read here:
        # a loaded machine may start the ranks slowly).
        assert run.ranks[0].killed and "done" not in run.ranks[0].stdout and not run.deadline_hit, run.describe()
    else:
        assert run.ranks[0].returncode == 0 and "done" in run.ranks[0].stdout, run.describe()


def test_command_per_rank_and_bad_arguments() -> None:
    run = run_local_ranks(lambda rank: [PY, "-c", f"print({rank} * 10)"], 2, timeout=30)
    assert [r.stdout.strip() for r in run.ranks] == ["0", "10"]
    with pytest.raises(ValueError, match="world_size=0"):
        run_local_ranks([PY], 0, timeout=1)
    with pytest.raises(ValueError, match="timeout=0"):
        run_local_ranks([PY], 1, timeout=0)


def test_a_rank_that_exits_leaves_no_child_behind() -> None:
    # The rank starts a grandchild and exits at once (status 0): the launch must still kill the grandchild.
    code = (
        "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
        "print(p.pid, flush=True)"
    )
    run = run_local_ranks([PY, "-c", code], 1, timeout=30, rendezvous=False)
    assert run.ok, run.describe()
    grandchild = int(run.ranks[0].stdout.split()[0])
    gone_by = time.monotonic() + 2.0  # SIGKILL is sent before the launch returns; let the kernel finish it
    while _alive(grandchild) and time.monotonic() < gone_by:
        time.sleep(0.01)
    assert not _alive(grandchild), "a child of a rank that exited outlived the launch"
