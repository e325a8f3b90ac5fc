"""Proof, before anything loads, that a checkpoint's files are the ones its save wrote.

The complete plan record lists every file the save wrote with its size and checksum
(:mod:`nanotron_ext.checkpoint.digest`). A resume checks each one: present, of the recorded size, of the recorded
checksum. The work is shared out (each file is read by one rank, the largest first to the least loaded), the
problems are gathered, and every rank raises the same message: which file, what it holds, what is wrong with it,
and the last checkpoint beside it that verifies. A checkpoint whose record lists no files (saved before records
did, or by Nanotron alone) cannot be verified; the resume goes on and says so.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from nanotron_ext.checkpoint.digest import CHECKSUM, SavedFile, file_checksum, known_checksum
from nanotron_ext.checkpoint.files import describe_file
from nanotron_ext.checkpoint.locate import ResumeSource, complete_checkpoints, record_or_none
from nanotron_ext.errors import CheckpointError

__all__ = [
    "Damage",
    "FileProblem",
    "Gather",
    "Verdict",
    "check_files",
    "hash_owners",
    "instead_of",
    "last_verified",
    "verify_checkpoint",
]

#: ``gather(this rank's list) -> every rank's list, in rank order`` (one process: ``lambda x: [x]``).
Gather = Callable[[Any], list[Any]]
#: Problems listed in a message before "... and N more".
SHOWN_PROBLEMS = 12
#: A rank's share of reading above which rank 0 shows a progress bar.
PROGRESS_BYTES = 1 << 30


class Damage(Enum):
    """What is wrong with a file."""

    MISSING = "missing"
    SIZE = "size"
    CHECKSUM = "checksum"
    UNREADABLE = "unreadable"


@dataclass(frozen=True)
class FileProblem:
    """One file that is not what its save wrote: ``found`` is its size (SIZE), its checksum (CHECKSUM) or the
    error reading it raised (UNREADABLE)."""

    file: SavedFile
    damage: Damage
    found: int | str | None = None

    def __str__(self) -> str:
        if self.damage is Damage.MISSING:
            what = "missing"
        elif self.damage is Damage.SIZE:
            assert isinstance(self.found, int)
            cut = "cut short" if self.found < self.file.size else "longer than written"
            what = f"{self.found} bytes where the save wrote {self.file.size} ({cut})"
        elif self.damage is Damage.UNREADABLE:
            what = f"cannot be read here ({self.found})"
        else:
            what = (
                f"its bytes differ from those the save wrote, at the same size ({self.found} where the save "
                f"recorded {self.file.checksum})"
            )
        return f"{self.file.path} ({describe_file(self.file.path)}): {what}"


@dataclass(frozen=True)
class Verdict:
    """A checkpoint that passed :func:`verify_checkpoint`: how many files and bytes were proved (none: it lists no
    files, so nothing could be)."""

    source: ResumeSource
    files: int
    size: int

    @property
    def verified(self) -> bool:
        return self.files > 0

    def line(self) -> str:
        """One line for the user."""
        if not self.verified:
            who = (
                "was saved by Nanotron alone"
                if self.source.record is None
                else "was saved before nanotron_ext recorded its files' checksums"
            )
            return (
                f"{self.source.label} could not be verified: it {who}, so a damaged file would show only when "
                f"it is read"
            )
        return (
            f"{self.source.label}: {self.files} files verified against the sizes and {CHECKSUM} checksums its save "
            f"recorded ({self.size / 2**20:.1f} MiB)"
        )


def hash_owners(files: Sequence[SavedFile], world: int) -> list[int]:
    """The rank that checks each file: the largest first, each to the rank with the fewest bytes so far (ties to
    the lowest rank), so every rank reads about as much and each file is read once."""
    load = [0] * world
    owners = [0] * len(files)
    for i in sorted(range(len(files)), key=lambda i: (-files[i].size, files[i].path)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += files[i].size
    return owners


def check_files(folder: Path, files: Sequence[SavedFile], *, rank: int = 0, world: int = 1) -> list[FileProblem]:
    """The problems of the files this rank checks (:func:`hash_owners`): missing, another size, another checksum.
    Rank 0 shows a progress bar on stderr when its share is over :data:`PROGRESS_BYTES`."""
    from tqdm import tqdm

    mine = [f for f, owner in zip(files, hash_owners(files, world)) if owner == rank]
    share = sum(f.size for f in mine)
    with tqdm(
        total=share,
        desc="verifying the checkpoint's files",
        unit="B",
        unit_scale=True,
        file=sys.stderr,
        disable=rank != 0 or share < PROGRESS_BYTES,
    ) as bar:
        return _check(Path(folder), mine, bar.update)


def _check(folder: Path, files: Sequence[SavedFile], progress: Callable[[int], Any]) -> list[FileProblem]:
    out = []
    for file in files:
        path = folder / file.path
        if not path.is_file():
            out.append(FileProblem(file, Damage.MISSING))
            continue
        try:
            size = path.stat().st_size
            if size != file.size:
                out.append(FileProblem(file, Damage.SIZE, size))
            elif file.checksum is not None:
                found = file_checksum(path, file.checksum, progress)
                if found != file.checksum:
                    out.append(FileProblem(file, Damage.CHECKSUM, found))
        except OSError as exc:  # one rank raising alone would leave the others waiting in the gather
            out.append(FileProblem(file, Damage.UNREADABLE, f"{type(exc).__name__}: {exc.strerror or exc}"))
    return out


def _problems(folder: Path, files: Sequence[SavedFile], rank: int, world: int, gather: Gather) -> list[FileProblem]:
    every = gather(check_files(folder, files, rank=rank, world=world))
    return sorted({p for problems in every for p in problems}, key=lambda p: p.file.path)


def last_verified(
    source: ResumeSource, *, rank: int = 0, world: int = 1, gather: Gather = lambda x: [x]
) -> tuple[Path | None, bool]:
    """The newest complete checkpoint older than ``source`` beside it whose files verify: ``(folder, True)``; or
    one that lists no files, so cannot be verified: ``(folder, False)``; or ``(None, False)``. Collective when
    ``gather`` is: every rank walks the same folders and gets the same answer."""
    for folder in complete_checkpoints(source.folder.parent, before=source.step):
        record = record_or_none(folder)
        if record is None or record.files is None:
            return folder, False
        if not _problems(folder, record.files, rank, world, gather):
            return folder, True
    return None, False


def verify_checkpoint(
    source: ResumeSource, *, rank: int = 0, world: int = 1, gather: Gather = lambda x: [x]
) -> Verdict:
    """Prove every file the record lists: present, of its recorded size and checksum.

    Args:
        source: the checkpoint (:func:`nanotron_ext.checkpoint.locate_checkpoint`).
        rank, world: this rank and how many share the reading (one process: 0 and 1).
        gather: collects every rank's findings (see :data:`Gather`).

    Returns:
        What was proved (nothing, where the record lists no files).

    Raises:
        CheckpointError: a file is missing, of another size or of another checksum; the same message on every
            rank, naming each such file, what it holds, and the last checkpoint beside it that verifies.
    """
    files = source.record.files if source.record is not None else None
    if files is None:
        return Verdict(source, 0, 0)
    for file in files:  # on every rank alike, before any rank reads
        if file.checksum is not None:
            known_checksum(source.folder / file.path, file.checksum)
    problems = _problems(source.folder, files, rank, world, gather)
    if not problems:
        return Verdict(source, len(files), sum(f.size for f in files))
    listed = "\n  ".join(str(p) for p in problems[:SHOWN_PROBLEMS])
    if len(problems) > SHOWN_PROBLEMS:
        listed += f"\n  ... and {len(problems) - SHOWN_PROBLEMS} more"
    raise CheckpointError(
        f"{source.label} ({source.folder}) does not hold the files its save wrote, so nothing was loaded:\n  {listed}\n"
        f"  a file that differs from what was written (a copy cut short, a disk or transfer error, an edit) cannot be "
        f"trusted; {instead_of(source, rank=rank, world=world, gather=gather)}"
    )


def instead_of(source: ResumeSource, *, rank: int = 0, world: int = 1, gather: Gather = lambda x: [x]) -> str:
    """Where to resume from instead of ``source`` (:func:`last_verified`), as the end of a message."""
    folder, verified = last_verified(source, rank=rank, world=world, gather=gather)
    if folder is None:
        return (
            "no checkpoint beside it verifies: restore these files from a copy, or start again without "
            "checkpoints.resume_checkpoint_path"
        )
    if verified:
        return f"resume from the last checkpoint that verifies instead: checkpoints.resume_checkpoint_path: {folder}"
    return (
        f"resume from the last complete checkpoint instead (saved without checksums, so it cannot be verified): "
        f"checkpoints.resume_checkpoint_path: {folder}"
    )
