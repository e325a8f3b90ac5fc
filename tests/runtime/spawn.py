"""Run a function in N real processes with torchrun's environment, with a hard timeout (through
``nanotron_ext.procs.run_local_ranks``, the launcher the benchmarks and ``train_workers`` use too).

Each rank is a fresh interpreter (forked from the server of ``forkserver.py``, which has imported torch; never a fork
of the pytest process, so no inherited process group, thread or test state) that loads the function's source
file by path, calls it, and pickles back the return value or the traceback. A rank that hangs is killed at the
deadline and reported, so a deadlock fails the test instead of hanging it. When one rank fails, the others usually
block in a collective; they are killed after a short grace period.
"""

from __future__ import annotations

import inspect
import pickle
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanotron_ext.procs import local_env, run_local_ranks

from .forkserver import start as fork_start

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
    #: None when it was killed (deadline, or a peer failed).
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
        env = local_env(REPO_ROOT, **(extra_env or {}))
        dump_after = str(max(1.0, timeout - 3.0))
        run = run_local_ranks(
            lambda rank: [
                sys.executable,
                "-c",
                _BOOTSTRAP,
                str(payload_path),
                str(rank),
                str(Path(tmp) / f"out{rank}.pkl"),
                dump_after,
            ],
            world_size,
            timeout=timeout,
            grace=grace,
            env=env,
            cwd=REPO_ROOT,
            start=fork_start,
        )
        outcomes = []
        for rank_exit in run.ranks:
            out_path = Path(tmp) / f"out{rank_exit.rank}.pkl"
            result: dict[str, Any] = {}
            if out_path.exists():
                with open(out_path, "rb") as f:
                    result = pickle.load(f)
            outcomes.append(
                RankOutcome(
                    rank=rank_exit.rank,
                    returncode=rank_exit.returncode,
                    ok=bool(result.get("ok")) and not rank_exit.killed,
                    value=result.get("value"),
                    error=result.get("error")
                    or ("killed at the deadline / after a peer failed" if rank_exit.killed else None),
                    traceback=result.get("traceback"),
                    output=rank_exit.stdout,
                    timed_out=rank_exit.killed,
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
    outcomes = run_ranks(fn, world_size, args=args, kwargs=kwargs, timeout=timeout, grace=grace, extra_env=extra_env)
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
