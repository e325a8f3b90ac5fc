"""Helpers for starting ranks on this machine: a free port for the rendezvous, killing one rank, and making a
rank exit when its launcher dies.

Used by the torchrun workers of ``nanotron-ext train`` and ``python -m nanotron_ext.run``, the test suite's
process launchers and the benchmarks. A leaf (standard library only): the launcher imports it without the CPU
runtime.
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
from pathlib import Path

__all__ = ["exit_with_parent", "free_port", "kill_process_group"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
#: Seconds between two looks at the parent pid (the fallback where prctl is missing).
PARENT_POLL_S = 0.5
#: Command-line words of torch's launchers: a process 1 showing one is torchrun itself, run as the first
#: process of a container (``docker run IMAGE torchrun ...``, a Kubernetes pod's command), not init.
_LAUNCHERS = ("torchrun", "torch.distributed.run", "torch.distributed.launch")


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


def _init_is_a_launcher() -> bool:
    """Whether process 1 is torchrun (a container's first process) rather than the init that adopts orphans.

    A parent pid of 1 then means "started by torchrun", not "the launcher already died". Unreadable counts as
    a launcher: wrongly killing every rank at start is worse than the rare race it guards against (and a rank
    whose torchrun is gone fails at the rendezvous anyway, the store lived in torchrun).
    """
    try:
        cmdline = Path("/proc/1/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return True
    return any(word in cmdline for word in _LAUNCHERS)


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
    if os.getppid() != parent or (parent == 1 and not _init_is_a_launcher()):  # the parent died before the hook
        os.kill(os.getpid(), signal.SIGKILL)

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="nanotron-ext-parent-watchdog", daemon=True).start()
    return kernel
