"""Two helpers for starting ranks on this machine: a free port for the rendezvous, and killing one rank.

Used by ``nanotron-ext train`` (a single process standing in for torchrun), the test suite's process launchers
and ``benchmarks/measured_cpu.py``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess

__all__ = ["free_port", "kill_process_group"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the usual bind-to-0 trick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def kill_process_group(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s process group and reap it, if it still runs.

    ``proc`` must have been started with ``start_new_session=True``: its process group id is then its pid, so
    this kills that process and whatever it spawned, never unrelated processes.
    """
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
