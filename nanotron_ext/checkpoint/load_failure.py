"""A load that fails after the checks passed: what each rank saw, gathered, and the one message every rank stops
with (a runtime failure, exit code 3), naming the file being read, never a peer lost later in the step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from nanotron_ext.checkpoint.files import path_inside
from nanotron_ext.checkpoint.locate import ResumeSource
from nanotron_ext.errors import RunFailure

__all__ = ["CheckpointLoadFailure", "LoadFailure", "load_failure_message"]


class CheckpointLoadFailure(RunFailure):
    """Loading a checkpoint failed on some rank; raised on every rank with the same message (exit code 3)."""


@dataclass(frozen=True)
class LoadFailure:
    """What one rank saw fail while it loaded part of a checkpoint (plain data, gathered from every rank).

    Attributes:
        rank: the world rank.
        what: what was being loaded, as the message says it (``its weights``).
        file: the file being read, inside the checkpoint folder where it lies there; None when nothing says.
        error: ``Type: message`` of the error.
        refusal: the message of a nanotron_ext refusal (raised alike on every rank), else None.
    """

    rank: int
    what: str
    file: str | None
    error: str
    refusal: str | None = None


def relative_file(path: Path | str | None, folder: Path) -> str | None:
    """``path`` inside ``folder`` as the record lists it, or as given when it lies elsewhere."""
    if path is None:
        return None
    return path_inside(folder, path) or str(path)


def load_failure_message(source: ResumeSource, failures: Sequence[LoadFailure], *, verified: bool, instead: str) -> str:
    """The message every rank stops with when ``failures`` (one or more ranks') happened while loading ``source``.

    Args:
        verified: whether the files were proved against their checksums before loading.
        instead: where to resume from instead (:func:`nanotron_ext.checkpoint.verify.instead_of`).
    """
    lines = "\n  ".join(
        f"rank {f.rank}, reading {f.what}: {f.file or '(the error names no file)'}: {f.error}" for f in failures
    )
    if verified:
        why = (
            "its files matched the sizes and checksums its save recorded before loading began, so the file changed "
            "since or cannot be read here (permissions, memory)"
        )
    else:
        why = (
            "its record lists no checksums (saved before nanotron_ext recorded them, or by Nanotron alone), so it "
            "was not verified before loading: the file is most likely damaged"
        )
    return (
        f"loading {source.label} ({source.folder}) failed, so every rank stops before training on a partly loaded "
        f"state:\n  {lines}\n  {why}; {instead}"
    )
