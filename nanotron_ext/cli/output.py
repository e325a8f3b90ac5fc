"""Where a command's standard output goes: all of it in one write at the end, and a reader that left is exit 141.

A pipe's writer learns that its reader left only when a write fails. Written line by line (``PYTHONUNBUFFERED=1``,
common in containers) or in 8 KiB pieces, ``nanotron-ext plan | head -2`` raced ``head``'s exit against the next
write and ended 0 or 141 from run to run. A report (``plan``, ``simulate``, ``--help``, ``--version``) is held
whole and written once, at the end, so the outcome depends on what the reader did, never on who ran first:

* the reader closed before the write (``| true`` that already ended; a closed descriptor): 141;
* the reader took the output and left after reading part of it (``| head -2``): the pipe had taken all of it,
  so the command ends with its own code (0 or 1: the verdict), every time;
* the output is larger than the pipe holds (64 KiB on Linux) and the reader left before reading the rest: 141.

``train`` and ``calibrate`` stream their progress as it comes (a line per step): the first line written after
their reader left ends them with 141.
"""

from __future__ import annotations

import io
import os
import select
import sys
from typing import TextIO

__all__ = ["OUTPUT_BUFFER_BYTES", "WholeOutput", "drop_output", "reader_left", "whole_output"]

#: Output held before a write: more than any table prints (a pp=64 plan is about 30 KiB), so one write at the end.
OUTPUT_BUFFER_BYTES = 1 << 22


class WholeOutput:
    """While it is entered, ``sys.stdout`` is held (up to :data:`OUTPUT_BUFFER_BYTES`) and written when it is
    flushed or when the block ends; a terminal, or a stream with no file under it (a test's capture), is left as it
    is. :meth:`release` ends the holding early, for a command whose output streams (``train``, ``calibrate``).

    Raises (on leaving the block, or from :meth:`release`):
        BrokenPipeError: the reader closed the output before the write (the caller exits 141).
        OSError: the output could not be written (a full disk).
    """

    def __init__(self) -> None:
        self._original: TextIO | None = None
        self._held: io.TextIOWrapper | None = None

    def __enter__(self) -> WholeOutput:
        original = sys.stdout
        try:
            fd = original.fileno()
            interactive = os.isatty(fd)
        except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
            fd, interactive = -1, True
        if not interactive:
            original.flush()
            buffered = io.BufferedWriter(io.FileIO(fd, "wb", closefd=False), buffer_size=OUTPUT_BUFFER_BYTES)
            self._original, self._held = (
                original,
                io.TextIOWrapper(buffered, encoding=original.encoding, errors=original.errors),
            )
            sys.stdout = self._held
        return self

    def release(self) -> None:
        """Write what is held and give ``sys.stdout`` back: what follows goes out as it is printed."""
        held, self._held = self._held, None
        if held is not None and self._original is not None:
            sys.stdout = self._original
            held.flush()  # the whole output in one write; a reader that already left raises BrokenPipeError here

    def __exit__(self, *_: object) -> None:
        self.release()


def whole_output() -> WholeOutput:
    """A command's output held and written once (:class:`WholeOutput`): ``with whole_output() as output: ...``."""
    return WholeOutput()


def reader_left() -> bool:
    """Whether standard output is a pipe whose reader has closed it: a ``BrokenPipeError`` from anything else (a
    socket to a peer rank) is a failure, not a reader that left."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        events = poller.poll(0)
    except (AttributeError, OSError, ValueError):  # no poll (Windows), or stdout is no file (a test's capture)
        return False
    return any(mask & (select.POLLERR | select.POLLHUP) for _, mask in events)


def drop_output() -> None:
    """Send whatever standard output still holds nowhere: it would fail again when the interpreter (or the garbage
    collector) flushes it, and print a traceback after the command's last word."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # stdout is no file (a test's capture): nothing flushes it at exit
        pass
    finally:
        os.close(devnull)
