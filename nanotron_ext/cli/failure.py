"""How a command ends on an error: its exit code and its one message, and under torchrun one message a job.

Exit codes, the same for every command and the launcher (this module is their one home):

* ``0`` (``EXIT_OK``): done; the plan can train (and, for ``train``, it trained);
* ``1`` (``EXIT_INVALID``): the plan cannot train (a stage without a gradient, no split under the constraints);
* ``2`` (``EXIT_USAGE``): bad usage or config: a flag, a YAML key or value, a layout string, an output path;
* ``3`` (``EXIT_RUNTIME``): a runtime failure: a peer rank died or timed out, or an unexpected error;
* ``141`` (``EXIT_CLOSED_PIPE``): the reader closed the output before the command could write it; nothing is
  printed, and the code is the shell's for a tool that SIGPIPE stopped (128 + 13), so ``set -o pipefail`` sees an
  output cut short and never mistakes it for a verdict. The output is written in one piece at the end
  (:mod:`nanotron_ext.cli.output`), so which of 141 and the verdict a reader gets depends on the reader, never on
  timing.

On a rank of a job (torchrun's ``TORCHELASTIC_RUN_ID``, or ``WORLD_SIZE`` above 1), :func:`report_rank_error`:

* writes the message to the rank's torchelastic error file (``TORCHELASTIC_ERROR_FILE``), in the JSON torch's own
  ``ErrorHandler.record_exception`` writes, so that torchrun's summary names it as the root cause (instead of
  ``error_file: <N/A>``); every rank writes its own, before anything that can block;
* prints it once a job: the first rank to claim it on torchrun's store prints, the others print nothing; with no
  store to share (ranks started without torchrun) every rank prints its own. One rank's lines go out in one write,
  so ranks never print over each other. Where an error file was written, the printed message is its first line (the
  rest, a list of files or a stage table, is in torchrun's summary below it); without one, the whole message;
* waits, a few seconds at most, until every rank has reported, so that torchrun, which ends the others as soon as
  one rank exits, finds every rank's error file.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import time
import traceback
from typing import Any

from nanotron_ext.cli.output import reader_left
from nanotron_ext.errors import (
    ConfigError,
    LayoutError,
    NanotronExtError,
    PipelineValidationError,
    PlanningError,
    RunFailure,
)
from nanotron_ext.outputs import atomic_write_text

__all__ = [
    "ERROR_FILE_ENV",
    "EXIT_CLOSED_PIPE",
    "EXIT_INVALID",
    "EXIT_OK",
    "EXIT_RUNTIME",
    "EXIT_USAGE",
    "PEER_REPORT_BARRIER_S",
    "TRACEBACK_ENV",
    "error_message",
    "exit_code_for",
    "on_a_job",
    "report_error",
    "report_once_a_job",
    "report_rank_error",
    "wait_for_peers_to_report",
]

EXIT_OK, EXIT_INVALID, EXIT_USAGE, EXIT_RUNTIME = 0, 1, 2, 3
EXIT_CLOSED_PIPE = 128 + 13  # SIGPIPE
#: Set to 1 to see the traceback of an unexpected error (otherwise one line is printed).
TRACEBACK_ENV = "NANOTRON_EXT_TRACEBACK"
#: Where torchrun's agent reads a rank's error (``torch.distributed.elastic.multiprocessing``; empty: none).
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
#: Seconds a rank that stops with our error waits, where it has no way to hear from its peers (neither torchrun's
#: store nor gloo process groups), before exiting, so that their reports are out too.
PEER_REPORT_GRACE_S = 0.5
#: The most seconds a rank that stops with our error waits for its peers to report theirs.
PEER_REPORT_BARRIER_S = 3.0


def exit_code_for(exc: BaseException) -> int:
    """The exit code of an error: 2 for config/usage (layout strings included), 1 for a plan that cannot
    train, 3 for everything else (runtime failures, unexpected errors)."""
    if isinstance(exc, (ConfigError, LayoutError)):
        return EXIT_USAGE
    if isinstance(exc, (PlanningError, PipelineValidationError)):
        return EXIT_INVALID
    if isinstance(exc, NanotronExtError) and not isinstance(exc, RunFailure):
        return EXIT_INVALID
    return EXIT_RUNTIME


def error_message(exc: BaseException, prefix: str = "nanotron-ext: ", *, tag: bool = True) -> str:
    """``exc`` as the user reads it, after ``prefix``: our own errors as they are (with ``tag``, ``error: `` first
    for usage and runtime errors); an unexpected one as its type and message in one line, with how to see its
    traceback."""
    if isinstance(exc, NanotronExtError):
        word = "error: " if tag and exit_code_for(exc) != EXIT_INVALID else ""
        return f"{prefix}{word}{exc}"
    detail = " ".join(str(exc).split()) or "(no message)"
    return (
        f"{prefix}{'error: ' if tag else ''}unexpected {type(exc).__name__}: {detail}; "
        f"rerun with {TRACEBACK_ENV}=1 for the traceback and report it if it is not an environment problem"
    )


def report_error(exc: BaseException, prefix: str = "nanotron-ext: ", *, tag: bool = True) -> int:
    """Print ``exc`` as one message on stderr (:func:`error_message`), in one write; returns its exit code.

    An unexpected error's traceback is printed first only when ``NANOTRON_EXT_TRACEBACK=1``. A broken pipe on
    standard output whose reader left prints nothing: 141.
    """
    if isinstance(exc, BrokenPipeError) and reader_left():  # a command's own catch-all met a reader that left
        return EXIT_CLOSED_PIPE
    if not isinstance(exc, NanotronExtError) and os.environ.get(TRACEBACK_ENV) == "1":
        traceback.print_exception(exc, file=sys.stderr)
    _say(error_message(exc, prefix, tag=tag))
    return exit_code_for(exc)


def on_a_job() -> bool:
    """Whether this process is one rank of a job: under torchrun, or given a world of more than one rank."""
    return "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1") or "1") > 1


def report_rank_error(exc: BaseException, prefix: str, *, tag: bool = True) -> int:
    """:func:`report_error` on a rank of a job (:func:`report_once_a_job`); alone, :func:`report_error`. Returns the
    exit code."""
    if not on_a_job() or (isinstance(exc, BrokenPipeError) and reader_left()):
        return report_error(exc, prefix, tag=tag)
    callstack = None
    if not isinstance(exc, NanotronExtError) and os.environ.get(TRACEBACK_ENV) == "1":
        callstack = "".join(traceback.format_exception(exc))
    return report_once_a_job(error_message(exc, prefix, tag=tag), exit_code_for(exc), callstack=callstack)


def report_once_a_job(message: str, code: int, *, callstack: str | None = None) -> int:
    """On a rank of a job: ``message`` in the rank's error file (``callstack``, the traceback torchrun shows, is the
    message itself unless given), printed once a job, then a wait for the peers' reports (the module docstring).
    Returns ``code``."""
    written = _write_error_file(message, callstack or message)
    store = _agent_store()
    if store is None or _first_to_say(store):
        head, *rest = message.splitlines() or [""]
        if written and rest:
            _say(f"{head} [{len(rest)} more line{'s' if len(rest) > 1 else ''}: torchrun's summary below]")
        else:
            _say(message)
    wait_for_peers_to_report(store)
    return code


def wait_for_peers_to_report(store: Any = None) -> None:
    """After our error, before exiting: let every peer report its own. Each rank stops with the same message (the
    YAML, the checkpoint, the plan, the collective gradient check), but torchrun ends the others as soon as one
    exits: a refused plan, and in CI a refused resume, were reported by rank 1 alone, rank 0 ended before it reached
    its report.

    Under torchrun each rank counts itself in on the agent's own store (``store``, else one opened here) and waits
    until all have (any backend, before or after the process groups exist); elsewhere, on gloo process groups, a
    monitored barrier. Either gives up after :data:`PEER_REPORT_BARRIER_S` (a peer that stopped otherwise never
    comes); with neither, a moment (:data:`PEER_REPORT_GRACE_S`).
    """
    world = int(os.environ.get("WORLD_SIZE", "1") or "1")
    if world < 2:
        return
    import torch.distributed as dist

    deadline = time.monotonic() + PEER_REPORT_BARRIER_S
    store = store if store is not None else _agent_store()
    if store is not None:
        with contextlib.suppress(Exception):  # the agent gone or slow: this rank's own report is out, exit anyway
            key = _job_key("reported")
            reported = store.add(key, 1)
            while reported < world and time.monotonic() < deadline:
                time.sleep(0.05)
                reported = store.add(key, 0)
            return
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        with contextlib.suppress(Exception):
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=PEER_REPORT_BARRIER_S), wait_all_ranks=True)
        return
    time.sleep(PEER_REPORT_GRACE_S)


def _say(text: str) -> None:
    """``text`` and its newline on stderr in one write: another rank's line never lands inside it (``print`` writes
    the text and the newline apart, and two ranks' lines once ran together between them)."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _write_error_file(message: str, callstack: str) -> bool:
    """Write ``message`` where torchrun reads this rank's error, as torch's ``ErrorHandler.record_exception`` does
    (``{"message": {"message", "extraInfo": {"py_callstack", "timestamp"}}}``; torchrun prints ``py_callstack`` as
    the failure's traceback). Returns whether it was written."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return False
    extra = {"py_callstack": callstack, "timestamp": str(int(time.time()))}
    try:
        atomic_write_text(path, json.dumps({"message": {"message": message, "extraInfo": extra}}))
    except OSError:
        return False  # the summary then says <N/A>; the message is still printed
    return True


def _job_key(what: str) -> str:
    """A key of this launch of the job on torchrun's store: a torchrun restart starts a fresh one."""
    return (
        f"nanotron_ext/{what}/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
        f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    )


def _agent_store() -> Any:
    """A client of torchrun's own store (the agent's: it is up before, during and after the process groups), or
    None where there is none or it does not answer."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        import torch.distributed as dist

        return dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=PEER_REPORT_BARRIER_S),
        )
    except Exception:  # the agent gone or slow: every rank then prints its own
        return None


def _first_to_say(store: Any) -> bool:
    """Whether this rank is the first of the job to claim the message (a count on ``store``); True if the store
    fails (better said twice than never)."""
    try:
        return int(store.add(_job_key("said"), 1)) == 1
    except Exception:
        return True
