"""What the launcher's tests run their scripts with (tests/test_launcher_cli.py,
tests/runtime/test_launcher_exit.py)."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STUBS = ROOT / "tests" / "upstream_stubs"

#: What a child script starts with: the environment of a one-rank torchrun world on a free port.
ONE_RANK = textwrap.dedent(
    """
    import os
    import sys

    from nanotron_ext.procs import free_port

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    """
)


def script_env() -> dict[str, str]:
    """The environment of a script run under the launcher: our stubs and the project on its import path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(STUBS), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("NANOTRON_EXT_CPU_TRAINER", None)
    return env
