"""Helpers for starting ranks on this machine: a free port for the rendezvous, killing one rank, and making a
rank exit when its launcher dies.

Used by ``nanotron-ext train`` (a single process standing in for torchrun), the test suite's process launchers
and ``benchmarks/measured_cpu.py``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import socket
import subprocess
import threading
import time

__all__ = ["exit_with_parent", "free_port", "kill_process_group"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
#: Seconds between two looks at the parent pid (the fallback where prctl is missing).
PARENT_POLL_S = 0.5


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


def exit_with_parent(poll_s: float = PARENT_POLL_S) -> bool:
    """Make this process die with SIGKILL as soon as its parent (the launcher, e.g. torchrun) dies.

    Without it a rank whose torchrun was SIGKILLed keeps training with no supervisor, and its peers wait on
    it. Two layers: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` on Linux (the kernel kills us when the parent
    thread exits), and a daemon thread that polls ``os.getppid()`` every ``poll_s`` seconds (other systems, or
    a parent that exits through another thread). Call it once, early.

    Returns:
        Whether the kernel-level hook is set (the polling thread runs either way).
    """
    parent = os.getppid()
    kernel = False
    libc_name = ctypes.util.find_library("c")
    if libc_name and hasattr(signal, "SIGKILL"):
        try:
            kernel = ctypes.CDLL(libc_name, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
        except (OSError, AttributeError):
            kernel = False
    if os.getppid() != parent or parent == 1:  # the parent died before the hook was set
        os.kill(os.getpid(), signal.SIGKILL)

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="nanotron-ext-parent-watchdog", daemon=True).start()
    return kernel
