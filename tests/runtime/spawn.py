"""Run a function in N real processes with torchrun's environment, with a hard timeout.

Each rank is a fresh ``python`` subprocess (no fork of the pytest process, so no inherited process group or
thread state) that loads the function's source file by path, calls it, and pickles back the return value or
the traceback. A rank that hangs is killed at the deadline and reported, so a deadlock fails the test instead
of hanging it. When one rank fails, the others usually block in a collective; they are killed after a short
grace period.
"""

from __future__ import annotations

import inspect
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanotron_ext.procs import free_port, kill_process_group

REPO_ROOT = Path(__file__).resolve().parents[2]

_BOOTSTRAP = r"""
import faulthandler, importlib.util, pickle, sys, traceback
payload_path, rank, out_path, dump_after = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
# If this rank is still running shortly before the deadline, print every thread's stack: a hang then shows
# where it is stuck in the test failure output.
faulthandler.dump_traceback_later(dump_after, exit=False)
with open(payload_path, "rb") as f:
    payload = pickle.load(f)
try:
    spec = importlib.util.spec_from_file_location(payload["module_name"], payload["file"])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    target = module
    for part in payload["qualname"].split("."):
        target = getattr(target, part)
    result = {"ok": True, "value": target(*payload["args"], **payload["kwargs"])}
except BaseException as exc:  # report everything, including SystemExit/KeyboardInterrupt
    result = {"ok": False, "error": repr(exc), "traceback": traceback.format_exc()}
with open(out_path, "wb") as f:
    pickle.dump(result, f)
sys.stdout.flush()
sys.stderr.flush()
sys.exit(0 if result["ok"] else 1)
"""


class DistributedRunError(RuntimeError):
    """One or more ranks failed or timed out; the message holds every rank's traceback / output tail."""


@dataclass
class RankOutcome:
    """What one rank produced."""

    rank: int
    returncode: int | None
    ok: bool
    value: Any = None
    error: str | None = None
    traceback: str | None = None
    output: str = ""
    timed_out: bool = False


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float = 50.0,
    grace: float = 5.0,
    extra_env: dict[str, str] | None = None,
) -> list[RankOutcome]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return every rank's outcome (never raises).

    Args:
        fn: a module-level function (it is re-imported from its file in each child).
        world_size: number of processes.
        args: positional arguments (picklable).
        kwargs: keyword arguments (picklable).
        timeout: wall-clock limit for the whole run; ranks still alive then are killed.
        grace: after the first rank fails, how long the others get before being killed.
        extra_env: more environment variables for the children.

    Returns:
        One ``RankOutcome`` per rank, in rank order.

    Raises:
        ValueError: ``fn`` is not a plain module-level function.
    """
    source = inspect.getsourcefile(fn)
    if source is None or "<locals>" in fn.__qualname__:
        raise ValueError(f"{fn!r} must be a module-level function defined in a .py file.")
    with tempfile.TemporaryDirectory(prefix="nanotron_ext_spawn_") as tmp:
        payload_path = Path(tmp) / "payload.pkl"
        with open(payload_path, "wb") as f:
            pickle.dump(
                {
                    "file": source,
                    "module_name": f"_spawned_{Path(source).stem}",
                    "qualname": fn.__qualname__,
                    "args": tuple(args),
                    "kwargs": dict(kwargs or {}),
                },
                f,
            )
        port = free_port()
        base_env = dict(os.environ)
        base_env.update(
            {
                "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(world_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join(
                    [str(REPO_ROOT)] + ([base_env["PYTHONPATH"]] if base_env.get("PYTHONPATH") else [])
                ),
                "PYTHONUNBUFFERED": "1",
            }
        )
        base_env.update(extra_env or {})
        procs: list[subprocess.Popen] = []
        logs = []
        for rank in range(world_size):
            env = dict(base_env, RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0")
            log = open(Path(tmp) / f"rank{rank}.log", "w+b")  # closed after the run
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-c",
                        _BOOTSTRAP,
                        str(payload_path),
                        str(rank),
                        str(Path(tmp) / f"out{rank}.pkl"),
                        str(max(1.0, timeout - 3.0)),
                    ],
                    env=env,
                    cwd=str(REPO_ROOT),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + timeout
        timed_out: set[int] = set()
        first_failure: float | None = None
        try:
            while True:
                codes = [p.poll() for p in procs]
                if all(c is not None for c in codes):
                    break
                now = time.monotonic()
                if first_failure is None and any(c not in (None, 0) for c in codes):
                    first_failure = now
                if now >= deadline or (first_failure is not None and now - first_failure >= grace):
                    for rank, proc in enumerate(procs):
                        if proc.poll() is None:
                            timed_out.add(rank)
                            kill_process_group(proc)
                    break
                time.sleep(0.02)
        finally:
            for proc in procs:
                kill_process_group(proc)
        outcomes = []
        for rank, (proc, log) in enumerate(zip(procs, logs)):
            log.seek(0)
            output = log.read().decode("utf-8", errors="replace")
            log.close()
            out_path = Path(tmp) / f"out{rank}.pkl"
            result: dict[str, Any] = {}
            if out_path.exists():
                with open(out_path, "rb") as f:
                    result = pickle.load(f)
            outcomes.append(
                RankOutcome(
                    rank=rank,
                    returncode=proc.returncode,
                    ok=bool(result.get("ok")) and rank not in timed_out,
                    value=result.get("value"),
                    error=result.get("error")
                    or ("killed at the deadline / after a peer failed" if rank in timed_out else None),
                    traceback=result.get("traceback"),
                    output=output,
                    timed_out=rank in timed_out,
                )
            )
        return outcomes


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float = 50.0,
    grace: float = 5.0,
    extra_env: dict[str, str] | None = None,
) -> list[Any]:
    """Like ``run_ranks`` but returns the per-rank return values and raises if any rank failed or hung.

    Raises:
        DistributedRunError: with every failing rank's error, traceback and last output lines.
    """
    outcomes = run_ranks(
        fn, world_size, args=args, kwargs=kwargs, timeout=timeout, grace=grace, extra_env=extra_env
    )
    failed = [o for o in outcomes if not o.ok]
    if failed:
        parts = []
        for o in failed:
            tail = "\n".join(o.output.splitlines()[-25:])
            parts.append(
                f"--- rank {o.rank} (returncode={o.returncode}, timed_out={o.timed_out}): {o.error}\n"
                f"{o.traceback or ''}\n[output tail]\n{tail}"
            )
        raise DistributedRunError(
            f"{len(failed)}/{world_size} ranks failed running {fn.__qualname__}:\n" + "\n".join(parts)
        )
    return [o.value for o in outcomes]
