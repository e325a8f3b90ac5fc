"""Test-only fault injection for upstream's trainer on CPU; the CPU stand-ins themselves are the package's
(:mod:`nanotron_ext.integration.cpu_standins`, the launcher's ``--cpu-debug``), re-exported here as :func:`install`.

``NANOTRON_EXT_TEST_PAUSE_IN_SAVE=<step>`` stops every rank in the middle of that step's checkpoint (weights written,
optimizer not) until it is killed, after touching ``PAUSED-<rank>`` in the checkpoint folder, so that
``tests/upstream/test_resume.py`` knows when to SIGKILL torchrun. ``sitecustomize.py`` beside this file installs it in
every rank that has the variable set.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from nanotron_ext.integration.cpu_standins.trainer import install

__all__ = ["PAUSE_IN_SAVE", "install", "install_pause_in_save"]

#: The variable naming the step whose save every rank pauses in.
PAUSE_IN_SAVE = "NANOTRON_EXT_TEST_PAUSE_IN_SAVE"


def install_pause_in_save() -> None:
    """Hold every rank inside the save of step ``$NANOTRON_EXT_TEST_PAUSE_IN_SAVE`` (nothing when it is unset)."""
    step = os.environ.get(PAUSE_IN_SAVE)
    if not step:
        return
    import nanotron.serialize.main as serialize_main

    save_optimizer = serialize_main.save_optimizer

    def paused(*args: Any, root_folder: Any, **kwargs: Any) -> Any:
        if Path(root_folder).name == step:
            (Path(root_folder) / f"PAUSED-{os.environ.get('RANK', '0')}").touch()
            time.sleep(3600)
        return save_optimizer(*args, root_folder=root_folder, **kwargs)

    serialize_main.save_optimizer = paused
