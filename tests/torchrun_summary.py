"""What torchrun's failure summary must say of a job that stopped with one of our errors (docs/cli.md,
one job, one message): the rule both passes' tests read, in one place."""

from __future__ import annotations

import re
from pathlib import Path

import nanotron_ext

#: Where our code runs from: a traceback frame in it is ours (a clone's own folder may be named nanotron_ext too, and
#: torchrun's frames in a virtual environment inside it are not ours).
PACKAGE = Path(nanotron_ext.__file__).resolve().parent
ROOT_CAUSE = "Root Cause (first observed failure):"


def exit_code(code: int) -> str:
    """A pattern for a failed rank's ``exitcode`` line: ours (``code``), or -15 where torchrun's agent stopped the rank
    (SIGTERM, once a peer had exited) while it still waited for the others' reports, seen under CI's load; the
    message is ours either way."""
    return rf"exitcode\s*: ({code}|-15) \(pid"


def root_cause(out: str, code: int) -> str:
    """The summary's root-cause part of ``out``, checked to name a rank that exited with ``code`` (:func:`exit_code`)
    and its error file; no failed rank in ``out`` is without one (``<N/A>``).

    Raises:
        AssertionError: no root cause, another exit code, or an error file missing.
    """
    assert ROOT_CAUSE in out and "error_file: <N/A>" not in out, out[-4000:]
    root = out[out.index(ROOT_CAUSE) :]
    assert re.search(exit_code(code), root) and re.search(r"error_file: \S+error\.json", root), root
    return root


def no_traceback_of_ours(out: str) -> None:
    """``out`` shows no traceback frame of our package (torchrun's own traceback may be there).

    Raises:
        AssertionError: a frame in our package.
    """
    assert f'File "{PACKAGE}/' not in out, out[-4000:]
