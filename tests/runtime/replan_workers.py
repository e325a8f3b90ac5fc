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
