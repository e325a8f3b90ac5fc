"""Starting ranks on this machine and waiting for them with a deadline: :func:`run_local_ranks` (the one launcher
of the test suite and the benchmarks), a free port for the rendezvous, killing one rank with whatever it spawned,
and making a rank exit when its launcher dies.

Used by ``nanotron-ext train`` (a single process standing in for torchrun) and the torchrun workers of
``python -m nanotron_ext.run``, ``tests/runtime`` (``spawn.py``, ``train_workers.py``), ``tests/upstream/e2e.py``
and the measured benchmarks. A leaf (standard library only): the launcher imports it without the CPU runtime.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

__all__ = [
    "LocalRun",
    "RankExit",
    "RENDEZVOUS_VARIABLES",
    "exit_with_parent",
    "exit_with_torchrun",
    "exit_without_teardown",
    "free_port",
    "kill_process_group",
    "local_env",
    "peak_rss_mib",
    "popen_rank",
    "rendezvous_env",
    "run_local_ranks",
]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
#: Seconds between two looks at the parent pid (the fallback where prctl is missing).
PARENT_POLL_S = 0.5
#: Command-line words of torch's launchers: a process 1 showing one is torchrun itself, run as the first
#: process of a container (``docker run IMAGE torchrun ...``, a Kubernetes pod's command), not init.
_LAUNCHERS = ("torchrun", "torch.distributed.run", "torch.distributed.launch")


#: Where :func:`free_port` looks first: below Linux's default ephemeral range, above most services' ports.
_PORTS_BELOW_EPHEMERAL = (20_000, 32_768)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for a rendezvous a rank binds a moment later.

    Not the usual bind-to-0 trick: that hands out a port of the kernel's ephemeral range, which every outgoing
    connection and every gloo listener of any process also draws from, so one of them can take it before the rank
    binds it (CI, two passes side by side: ``EADDRINUSE`` on rank 0's store, four tests lost). A random port below
    that range (``/proc/sys/net/ipv4/ip_local_port_range``) is handed to nobody unasked; bind-to-0 only when none
    there is free.
    """
    low, high = _PORTS_BELOW_EPHEMERAL
    with contextlib.suppress(OSError, ValueError):
        high = min(high, int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]))
    pick = random.SystemRandom()
    for _ in range(64 if high > low else 0):
        port = pick.randrange(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def kill_process_group(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s process group, and reap ``proc``.

    ``proc`` must have been started with ``start_new_session=True``: its process group id is then its pid, so
    this kills that process and whatever it spawned, never unrelated processes. The group is killed even when
    ``proc`` itself has exited: a child it left behind is still in it (and Linux reuses no pid while a group of
    that id exists).
    """
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # nothing left in the group
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


# --- launching local ranks ---------------------------------------------------------------------------------


def local_env(
    pythonpath_first: str | Path | None = None, base: Mapping[str, str] | None = None, **extra: str
) -> dict[str, str]:
    """The environment a local rank gets: ``base`` (default ``os.environ``) with one thread per rank and
    unbuffered output, ``pythonpath_first`` put first on ``PYTHONPATH``, then ``extra``.

    One thread per rank: ranks share this machine's cores, and oversubscribed BLAS threads make CPU timings and
    gloo timeouts erratic.
    """
    env = dict(os.environ if base is None else base)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if pythonpath_first is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(pythonpath_first), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


#: The variables a rank needs to join its world (torchrun sets them).
RENDEZVOUS_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def exit_with_torchrun() -> None:
    """Under torchrun (``TORCHELASTIC_RUN_ID`` set), die with it: never train on as an orphan."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        exit_with_parent()


def rendezvous_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun gives rank ``rank`` of a one-machine world (``MASTER_*`` on 127.0.0.1:``port``)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


@dataclass
class RankExit:
    """How one rank ended.

    Attributes:
        rank: its rank.
        returncode: its exit status; None when the launcher killed it (deadline, or a peer failed and the grace
            period passed).
        stdout: its output (with stderr merged in, unless the launch kept them apart).
        stderr: its error output when kept apart, else "".
    """

    rank: int
    returncode: int | None
    stdout: str
    stderr: str = ""

    @property
    def killed(self) -> bool:
        """The launcher killed it (it did not exit by itself)."""
        return self.returncode is None


@dataclass
class LocalRun:
    """Every rank of one launch, in rank order, and how long it took."""

    ranks: list[RankExit]
    elapsed_s: float
    #: The deadline passed with ranks still running (they were killed).
    deadline_hit: bool

    @property
    def ok(self) -> bool:
        """Every rank exited with status 0."""
        return all(r.returncode == 0 for r in self.ranks)

    def describe(self, tail: int = 30) -> str:
        """Every rank's exit status and last ``tail`` output lines, for error and assertion messages."""
        parts = []
        for r in self.ranks:
            status = "killed by the launcher" if r.killed else f"exit {r.returncode}"
            lines = "\n".join((r.stdout + "\n" + r.stderr).strip().splitlines()[-tail:])
            parts.append(f"--- rank {r.rank} ({status}):\n{lines}")
        return "\n".join(parts)


def run_local_ranks(
    command: Sequence[str] | Callable[[int], Sequence[str]],
    world_size: int,
    *,
    timeout: float,
    grace: float | None = None,
    env: Mapping[str, str] | None = None,
    rendezvous: bool = True,
    merge_output: bool = True,
    cwd: str | Path | None = None,
    poll_s: float = 0.05,
    start: Callable[..., Any] | None = None,
) -> LocalRun:
    """Start ``world_size`` processes on this machine and wait for them, never longer than ``timeout`` seconds.

    Each process leads its own session, so killing it (:func:`kill_process_group`) also kills whatever it
    started (a torchrun's workers, a rank's helpers); none outlives this call, whatever happens here.

    Args:
        command: the argv of every rank, or a function ``rank -> argv``. ``python`` is not added.
        world_size: number of processes.
        timeout: wall-clock limit in seconds; ranks still running then are killed (``returncode`` None).
        grace: seconds the others get after the first rank fails; 0 stops them at once (a benchmark), None
            waits for every rank until the deadline (a test that checks *every* rank's error message).
        env: the environment (default: ``os.environ``); see :func:`local_env`.
        rendezvous: add torchrun's variables (:func:`rendezvous_env`, one free port); False for a torchrun.
        merge_output: stderr into stdout (one interleaved log per rank); False keeps them apart.
        cwd: working directory of the processes.
        poll_s: seconds between two looks at the processes.
        start: starts one rank, ``(argv, env, cwd, stdout file, stderr file or None)`` -> a process with ``pid``
            (the leader of its own session), ``poll()``, ``wait()`` and ``returncode``; default
            :func:`popen_rank` (the test suite forks its ranks from a server, ``tests/runtime/forkserver.py``).

    Returns:
        Every rank's exit status and output, in rank order.

    Raises:
        ValueError: ``world_size`` < 1 or ``timeout`` <= 0.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: start at least one process")
    if not timeout > 0:
        raise ValueError(f"timeout={timeout}: give a positive number of seconds (a launch never waits forever)")
    argv_of = command if callable(command) else (lambda rank: command)
    start_rank = start or popen_rank
    base = dict(os.environ if env is None else env)
    port = free_port() if rendezvous else None
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="nanotron_ext_ranks_") as tmp, contextlib.ExitStack() as files:
        logs = _log_files(files, Path(tmp), world_size, merge_output)
        start = time.monotonic()
        deadline, killed, deadline_hit = start + timeout, set[int](), False
        try:
            for rank in range(world_size):
                rank_env = dict(base, **rendezvous_env(rank, world_size, port)) if port is not None else base
                procs.append(start_rank(argv_of(rank), rank_env, cwd, *logs[rank]))
            killed, deadline_hit = _wait(procs, deadline, grace, poll_s)
        finally:
            for proc in procs:  # also on an exception here (KeyboardInterrupt): no rank outlives the launch
                kill_process_group(proc)
        elapsed = time.monotonic() - start
        ranks = [
            RankExit(rank, None if rank in killed else proc.returncode, _read(out), "" if err is None else _read(err))
            for rank, (proc, (out, err)) in enumerate(zip(procs, logs))
        ]
    return LocalRun(ranks, elapsed, deadline_hit)


def _log_files(
    files: contextlib.ExitStack, folder: Path, world_size: int, merge_output: bool
) -> list[tuple[IO[bytes], IO[bytes] | None]]:
    """(stdout, stderr or None when merged) file of every rank. Files, not pipes: a rank that writes more than a
    pipe holds would block until read."""
    return [
        (
            files.enter_context(open(folder / f"rank{r}.out", "w+b")),
            None if merge_output else files.enter_context(open(folder / f"rank{r}.err", "w+b")),
        )
        for r in range(world_size)
    ]


def popen_rank(
    argv: Sequence[str], env: Mapping[str, str], cwd: str | Path | None, out: IO[bytes], err: IO[bytes] | None
) -> subprocess.Popen:
    """One rank, leading its own session (so that its group can be killed whole), its output in files."""
    return subprocess.Popen(
        [str(a) for a in argv],
        env=env,
        cwd=None if cwd is None else str(cwd),
        stdout=out,
        stderr=subprocess.STDOUT if err is None else err,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def _wait(procs: list[subprocess.Popen], deadline: float, grace: float | None, poll_s: float) -> tuple[set[int], bool]:
    """Wait until every process has exited, the deadline passes, or ``grace`` seconds after the first failure;
    returns (the ranks still running then, whether the deadline was hit). Killing them is the caller's."""
    first_failure: float | None = None
    while None in (codes := [p.poll() for p in procs]):  # every rank polled (any() would stop early)
        now = time.monotonic()
        if first_failure is None and any(c not in (None, 0) for c in codes):
            first_failure = now
        deadline_hit = now >= deadline
        if deadline_hit or (grace is not None and first_failure is not None and now - first_failure >= grace):
            return {r for r, p in enumerate(procs) if p.poll() is None}, deadline_hit
        time.sleep(poll_s)
    return set(), False


def _read(log: IO[bytes]) -> str:
    log.seek(0)
    return log.read().decode("utf-8", errors="replace")


def exit_without_teardown(code: int) -> None:
    """End the rank as the interpreter would (its threads joined, its atexit handlers run, its output flushed), then
    with ``code`` before C++'s static destructors: with its groups destroyed a rank was still aborted there once in
    about three CI runs ("terminate called without an active exception", a gloo or store thread still joinable)."""
    import atexit

    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def peak_rss_mib() -> float:
    """This process's peak resident memory so far (MiB; Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
