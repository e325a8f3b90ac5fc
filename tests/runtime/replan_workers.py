"""What spawned ranks run for ``test_replan.py`` (``tests/runtime/spawn.py`` loads this file by path)."""

from __future__ import annotations

import os
import signal
import tempfile


def killed_during_the_move(config: str, folder: str, steps: int) -> None:
    """Train ``config`` with the move's checkpoint under ``folder``; rank 1 is killed (SIGKILL) once it has written
    its files of the move's checkpoint, before the checkpoint is complete."""
    from nanotron_ext.integration.checkpoints import ResumeState
    from nanotron_ext.runtime.train import run_training

    tempfile.tempdir = folder
    complete = ResumeState.complete

    def die_first(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        return complete(self, *args, **kwargs)

    ResumeState.complete = die_first
    run_training(config, steps=steps)


def _threads_waits_s() -> float:
    """Seconds this process's threads have waited on a run queue, runnable but not running (``schedstat``'s second
    field, in ns): the time another process on the same core took from the rank."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except FileNotFoundError:  # a thread that ended since the listing
            continue
    return total / 1e9


def _on_cores(cores: set[int]) -> None:
    """Let every thread of this process run on ``cores`` (an affinity is a thread's own: gloo's threads, started after
    the rank was pinned, keep its core otherwise)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended since the listing
            continue


def trained_under_a_transient_load(config: str, steps: int, metrics_out: str) -> float:
    """Train ``config`` with rank r on core r and two CPU hogs on rank 0's core from the start until the re-plan
    decides: the profile sees rank 0 at a third of its speed (one hog, half, did not always show beside CI's other
    pass, which loads both cores). From the decision on the hogs are gone and the ranks run on any core, so that other
    work on the machine slows both alike: pinned, a load on rank 0's core through a whole trial makes the move measure
    faster, as it is there.

    Returns:
        The share of the wall time from the decision to the end that the rank's threads waited, runnable, for a core
        (how loaded the machine was during the trial: 8-13 % quiet, their own threads taking turns).
    """
    import subprocess
    import sys
    import time

    from nanotron_ext.integration.replan_session import ReplanSession
    from nanotron_ext.runtime.train import run_training

    rank, cores = int(os.environ["RANK"]), os.sched_getaffinity(0)
    os.sched_setaffinity(0, {rank})
    hogs = []
    if rank == 0:
        spin = "import os; os.sched_setaffinity(0, {0})\nwhile True: pass"
        hogs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2)]
    decide = ReplanSession.decide
    since: dict[str, float] = {}

    def quiet_first(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        for hog in hogs:
            hog.kill()
            hog.wait()
        _on_cores(cores)
        since.update(wall=time.perf_counter(), waits=_threads_waits_s())
        return decide(self, *args, **kwargs)

    ReplanSession.decide = quiet_first
    try:
        run_training(config, steps=steps, metrics_out=metrics_out)
    finally:
        for hog in hogs:
            if hog.poll() is None:
                hog.kill()
    return (_threads_waits_s() - since["waits"]) / (time.perf_counter() - since["wall"])
