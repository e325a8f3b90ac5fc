"""Which checkpoint folder a resume loads, found as Nanotron's trainer finds it, and refused before anything loads
when it was cut off while being written.

Nanotron (``serialize/main.py:parse_ckpt_path``) reads ``checkpoints.resume_checkpoint_path``: a folder with
``latest.txt`` resumes from the step it names; a folder with ``model_config.json`` is a checkpoint itself; anything
else starts from scratch without a word. Nanotron writes a checkpoint's files in place, then ``latest.txt``
(truncating it first), then ``model_config.json``. So a run killed while saving leaves a folder without
``model_config.json`` (which Nanotron would silently ignore if pointed at), or an empty ``latest.txt``. The
launcher also marks each folder it writes with a plan record that says ``complete: true`` only once every rank has
written every file (:mod:`nanotron_ext.checkpoint.record`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from nanotron_ext.checkpoint.files import MODEL_CONFIG
from nanotron_ext.checkpoint.record import RECORD_FILE, PlanRecord, read_record
from nanotron_ext.errors import CheckpointError

__all__ = ["ResumeSource", "complete_checkpoints", "last_complete", "locate_checkpoint", "record_or_none"]


@dataclass(frozen=True)
class ResumeSource:
    """The checkpoint a resume loads.

    Attributes:
        folder: the checkpoint folder.
        step: its step (from the folder name; None when the name is not a number).
        record: its plan record, None for a checkpoint Nanotron wrote alone.
    """

    folder: Path
    step: int | None
    record: PlanRecord | None

    @property
    def label(self) -> str:
        return f"checkpoint {self.step}" if self.step is not None else f"checkpoint {self.folder}"


def _is_complete(folder: Path) -> bool:
    record = record_or_none(folder)
    if record is not None:
        return record.complete
    return (folder / MODEL_CONFIG).is_file()


def record_or_none(folder: Path) -> PlanRecord | None:
    """A folder's plan record; None when it has none or it cannot be read."""
    try:
        return read_record(folder)
    except CheckpointError:
        return None


def complete_checkpoints(root: Path, *, before: int | None = None) -> Iterator[Path]:
    """The complete checkpoint folders under a checkpoints root, newest first (below step ``before`` if given)."""
    steps = (
        sorted((int(p.name) for p in Path(root).iterdir() if p.is_dir() and p.name.isdigit()), reverse=True)
        if Path(root).is_dir()
        else []
    )
    for step in steps:
        if (before is None or step < before) and _is_complete(Path(root) / str(step)):
            yield Path(root) / str(step)


def last_complete(root: Path, *, before: int | None = None) -> Path | None:
    """The newest complete checkpoint folder under a checkpoints root (below step ``before`` if given)."""
    return next(complete_checkpoints(root, before=before), None)


def _instead(root: Path, before: int | None = None) -> str:
    found = last_complete(root, before=before)
    if found is None:
        return "no complete checkpoint is left beside it: start again without checkpoints.resume_checkpoint_path"
    return f"resume from the last complete one instead: checkpoints.resume_checkpoint_path: {found}"


def locate_checkpoint(resume_path: str | Path | None) -> ResumeSource | None:
    """The checkpoint that ``checkpoints.resume_checkpoint_path`` resumes, as Nanotron's trainer finds it.

    Returns:
        None where Nanotron starts from scratch (no path; a path that does not exist yet, as in a run that
        resumes itself; a remote path, which Nanotron downloads itself).

    Raises:
        CheckpointError: ``latest.txt`` is empty or names no folder; the checkpoint was cut off while being
            written (its record says so, or it has weights but no ``model_config.json``). Each message names the
            last complete checkpoint to resume from.
    """
    if resume_path is None or "://" in str(resume_path):
        return None
    root = Path(resume_path)
    latest = root / "latest.txt"
    if latest.is_file():
        text = latest.read_text().strip()
        if not text.isdigit():
            raise CheckpointError(
                f"{latest} holds {text!r}, not a step: a save was cut off while writing it (Nanotron rewrites it in "
                f"place after each checkpoint); {_instead(root)}"
            )
        folder = root / text
        if not folder.is_dir():
            raise CheckpointError(f"{latest} names step {text}, but {folder} does not exist; {_instead(root)}")
    elif (root / MODEL_CONFIG).is_file() or (root / RECORD_FILE).is_file() or (root / "model").is_dir():
        folder = root
    else:
        return None
    step = int(folder.name) if folder.name.isdigit() else None
    record = read_record(folder)
    if record is not None and not record.complete:
        raise CheckpointError(
            f"{folder} was being written when its run stopped (its {RECORD_FILE} says complete: false), so it is not "
            f"loaded; {_instead(folder.parent, before=step)}"
        )
    if record is None and not (folder / MODEL_CONFIG).is_file():
        raise CheckpointError(
            f"{folder} has weights but no {MODEL_CONFIG}: it was cut off while being written (Nanotron writes that "
            f"file last, and would start from scratch without a word if pointed at this folder); "
            f"{_instead(folder.parent, before=step)}"
        )
    return ResumeSource(folder, step, record)
