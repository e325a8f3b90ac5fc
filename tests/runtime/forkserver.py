"""A fork server for the suite's rank launches: each rank forked from a Python that has imported torch already.

A rank's process spends 2-5 s of CPU importing torch and numpy before it does a second of work, and the process
tests start several hundred ranks (about half of CI's CPU time). :func:`start` is the ``start`` of
``nanotron_ext.procs.run_local_ranks`` for the suite's own launches (``runtime/spawn.py``, ``runtime/train_workers.py``,
``upstream/e2e.py``): it forks the rank from a *server*, a fresh ``python`` that imported only the third-party modules
of :data:`PRELOAD`, so the rank runs our code and Nanotron's as a fresh interpreter would, on torch (and the
libraries Nanotron imports) already in memory.

What a rank sees is what ``python ARGV`` would give it: its own session (``killpg`` of its pid kills what it
started), its environment, working directory, argv, ``sys.path[0]``, output files and exit status (a signal's as
``-N``); at its end the interpreter's own steps (non-daemon threads joined, ``atexit``, output flushed). Each rank
index has its own server, so the ranks of one launch have different hash seeds, as separate interpreters do. A
server is started per environment of what it imported (the variables those modules read at import: ``OMP_*``,
``TORCH*``, ``HF_*``, ``MALLOC_*``, ``PYTHON*`` ...); Nanotron and this package are never preloaded (the launcher's
CPU stand-ins must be installed before Nanotron's first import, as in a fresh rank).

Anything else (another interpreter, interpreter flags, a server that could not start or has threads) starts as
before, with ``subprocess.Popen``. ``NANOTRON_EXT_TEST_FORKSERVER=0`` turns it off. The launcher's own tests
(``test_procs.py``, ``test_faults.py``, ``test_parent_death.py``) keep plain processes: they test how a real
process tree behaves when a parent dies.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from nanotron_ext.procs import RENDEZVOUS_VARIABLES, popen_rank

#: What every server imports before it forks a rank (those missing are left out): the third-party modules every rank
#: imports anyway. Upstream Nanotron's ranks import transformers, datasets, pandas and aiohttp through
#: ``nanotron.config``: preloaded, a rank's own imports take 0.9 s of CPU instead of 2.2 s (measured on the 2-core VM);
#: none of them looks for flash_attn or triton when imported (the stand-ins' names), nor starts a Python thread.
PRELOAD = ("torch", "numpy", "yaml", "safetensors", "pandas", "aiohttp", "datasets", "transformers")
#: Environment variables whose names start so are read when those modules import (or by the C library at start):
#: servers differ when they differ.
_IMPORT_TIME_PREFIXES = (
    "OMP_",
    "MKL_",
    "KMP_",
    "OPENBLAS",
    "TORCH",
    "PYTORCH",
    "CUDA",
    "NCCL",
    "GLOO",
    "HF_",
    "MALLOC",
    "GLIBC",
    "LD_",
    "PYTHON",
    "TRANSFORMERS",
    "DATASETS",
    "HUGGINGFACE",
    "TOKENIZERS",
    "XDG_",
)
#: The most servers alive at once (a server holds about 300 MB, mostly shared with its ranks).
_MOST_SERVERS = 8
ENABLED = os.environ.get("NANOTRON_EXT_TEST_FORKSERVER", "1") != "0"

_SERVER = r"""
import json, os, select, signal, sys, tempfile, threading, traceback
for name in json.loads(sys.argv[1]):
    try:
        __import__(name)
    except Exception:
        pass
out = os.fdopen(os.dup(1), "w", buffering=1)
if threading.active_count() != 1:  # a thread could hold a lock the forked rank would wait on forever
    out.write(f"threads {threading.active_count()}\n")
    sys.exit(0)
out.write("ready\n")

def exit_code(e):
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1

def rank(req):
    out.close()  # the server's answers are not the rank's to hold open
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(req["out"], os.O_WRONLY | os.O_APPEND)
    err = log if req["err"] is None else os.open(req["err"], os.O_WRONLY | os.O_APPEND)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(err, 2)
    os.chdir(req["cwd"] or os.getcwd())
    os.environ.clear()
    os.environ.update(req["env"])
    tempfile.tempdir = None  # torch's import made tempfile read the server's TMPDIR: the rank reads its own
    argv = req["argv"]
    code = 0
    try:
        if "numpy" in sys.modules:  # a fresh interpreter seeds numpy's global generator anew
            sys.modules["numpy"].random.seed()
        if argv[1] == "-c":
            sys.argv, sys.path[0] = ["-c", *argv[3:]], ""
            main = type(sys)("__main__")
            sys.modules["__main__"] = main
            exec(compile(argv[2], "<string>", "exec"), main.__dict__)
        elif argv[1] == "-m":
            import runpy
            sys.argv, sys.path[0] = [argv[2], *argv[3:]], os.getcwd()
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        else:
            import runpy
            sys.argv, sys.path[0] = argv[1:], os.path.dirname(os.path.abspath(argv[1]))
            runpy.run_path(argv[1], run_name="__main__")
    except SystemExit as e:
        code = exit_code(e)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()
        import atexit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)

poll = select.poll()
poll.register(0, select.POLLIN)
lines = os.fdopen(0, "r")
while True:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        out.write(f"exit {pid} {os.waitstatus_to_exitcode(status)}\n")
    if not poll.poll(20):
        continue
    line = lines.readline()
    if not line:  # the suite is gone: so is the server (its ranks are the suite's to kill)
        os._exit(0)
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        rank(req)
    out.write(f"pid {pid}\n")
"""


class ForkedRank:
    """What ``run_local_ranks`` needs of a ``subprocess.Popen``: ``pid``, ``poll()``, ``wait()``, ``returncode``."""

    def __init__(self, server: _Server, pid: int) -> None:
        self.server, self.pid = server, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode


class _Server:
    """One server process, its requests (one JSON line each) and its answers (``pid N``, ``exit N CODE``), read
    unbuffered: a buffered reader could hold an answer that ``select`` no longer sees."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER, json.dumps(PRELOAD)],
            env=dict(env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            bufsize=0,
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.fd = self.proc.stdout.fileno()
        self.pending = b""
        self.exits: dict[int, int] = {}
        self.lock = threading.Lock()
        try:
            self.ok = self._line(block=True) == "ready"
        except RuntimeError:  # it could not start: its ranks start as plain processes
            self.ok = False

    def fork(
        self, argv: Sequence[str], env: Mapping[str, str], cwd: str | Path | None, out: str, err: str | None
    ) -> int:
        request = {
            "argv": list(argv),
            "env": dict(env),
            "cwd": None if cwd is None else str(cwd),
            "out": out,
            "err": err,
        }
        with self.lock:
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            while True:
                kind, pid, *code = (self._line(block=True) or "").split()
                if kind == "pid":
                    return int(pid)
                self.exits[int(pid)] = int(code[0])

    def exit_code(self, pid: int) -> int | None:
        with self.lock:
            while (line := self._line(block=False)) is not None:
                kind, got, *code = line.split()
                if kind == "exit":
                    self.exits[int(got)] = int(code[0])
            return self.exits.get(pid)

    def _line(self, *, block: bool) -> str | None:
        """The next answer; None when ``block`` is False and none is complete yet.

        Raises:
            RuntimeError: the server died.
        """
        while b"\n" not in self.pending:
            if not block and not select.select([self.fd], [], [], 0)[0]:
                return None
            data = os.read(self.fd, 65536)
            if not data:
                raise RuntimeError(f"the fork server (pid {self.proc.pid}) died")
            self.pending += data
        line, self.pending = self.pending.split(b"\n", 1)
        return line.decode()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


_SERVERS: dict[tuple[object, ...], _Server] = {}


def _server_for(env: Mapping[str, str]) -> _Server | None:
    """The server of ``env``'s rank index and import-time variables (started on first use); None when none can run."""
    key = (
        env.get("RANK", "0"),
        tuple(sorted((k, v) for k, v in env.items() if k.startswith(_IMPORT_TIME_PREFIXES))),
    )
    server = _SERVERS.get(key)
    if server is None or server.proc.poll() is not None:
        while len(_SERVERS) >= _MOST_SERVERS:
            _SERVERS.pop(next(iter(_SERVERS))).close()
        base = {k: v for k, v in env.items() if k not in RENDEZVOUS_VARIABLES}
        server = _SERVERS[key] = _Server(base)
    return server if server.ok else None


@atexit.register
def _close_all() -> None:
    for server in _SERVERS.values():
        server.close()


def start(
    argv: Sequence[str], env: Mapping[str, str], cwd: str | Path | None, out: IO[bytes], err: IO[bytes] | None
) -> subprocess.Popen | ForkedRank:
    """One rank forked from its server where ``argv`` is ``python -c CODE ...``, ``python -m MODULE ...`` or
    ``python SCRIPT ...`` with this interpreter; else (or disabled) ``nanotron_ext.procs.popen_rank``."""
    argv = [str(a) for a in argv]
    if (
        not ENABLED
        or len(argv) < 2
        or argv[0] != sys.executable
        or (argv[1].startswith("-") and argv[1] not in ("-c", "-m"))
    ):
        return popen_rank(argv, env, cwd, out, err)
    server = _server_for(env)
    if server is None:
        return popen_rank(argv, env, cwd, out, err)
    return ForkedRank(server, server.fork(argv, env, cwd, out.name, None if err is None else err.name))
