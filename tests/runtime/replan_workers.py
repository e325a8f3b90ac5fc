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


def trained_under_a_transient_load(config: str, steps: int, metrics_out: str) -> None:
    """Train ``config`` with rank r on core r and two CPU hogs on rank 0's core from the start until the re-plan
    decides: the profile sees rank 0 at a third of its speed (one hog, half, did not always show beside CI's other
    pass, which loads both cores), the trial runs on a quiet machine."""
    import subprocess
    import sys

    from nanotron_ext.integration.replan_session import ReplanSession
    from nanotron_ext.runtime.train import run_training

    rank = int(os.environ["RANK"])
    os.sched_setaffinity(0, {rank})
    hogs = []
    if rank == 0:
        spin = "import os; os.sched_setaffinity(0, {0})\nwhile True: pass"
        hogs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2)]
    decide = ReplanSession.decide

    def quiet_first(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        for hog in hogs:
            hog.kill()
            hog.wait()
        return decide(self, *args, **kwargs)

    ReplanSession.decide = quiet_first
    try:
        run_training(config, steps=steps, metrics_out=metrics_out)
    finally:
        for hog in hogs:
            if hog.poll() is None:
                hog.kill()
