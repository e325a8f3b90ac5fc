"""The bytes of a checkpoint as Nanotron writes and reads them: each file hashed while a save writes it, and the
file being read when a load fails.

Saving: while a rank saves, the writers Nanotron's serializers call are swapped for ones that pass every byte
through a hash on its way to the disk (:class:`nanotron_ext.checkpoint.digest.HashingWriter`), for files inside the
folder being saved; anything else passes through untouched:

* ``open`` (``config.yaml``, ``checkpoint_metadata.json``, ``optimizer_config.json``, ``model_config.json``);
* ``torch.save`` (optimizer, scheduler and random states), handed the hashing file instead of the path;
* ``safetensors.torch.save_file`` as Nanotron's weights module holds it. It writes from Rust straight to the path,
  so no byte of it passes through Python: the same format is streamed from the tensor's memory instead
  (:func:`nanotron_ext.checkpoint.safetensors_writer.write_safetensors`; safetensors' own ``save``, which returns
  the file as bytes, costs twice the file's size in memory: ``benchmarks/checkpoint_checksums.py``).

Resuming: the checkpoint's files are proved on every rank before Nanotron reads one (:func:`verify_on_every_rank`);
each of Nanotron's loaders is then made collective (:func:`guarded_load`): while it runs, the same names note the last
file opened inside the checkpoint, and whatever it raises on one rank, every rank stops with the message naming it.
"""

from __future__ import annotations

import builtins
import contextlib
import io
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from nanotron_ext.checkpoint import (
    RECORD_FILE,
    CheckpointLoadFailure,
    LoadFailure,
    ResumeSource,
    SavedFile,
    Verdict,
    instead_of,
    load_failure_message,
    verify_checkpoint,
)
from nanotron_ext.checkpoint.digest import HashingWriter
from nanotron_ext.checkpoint.files import path_inside
from nanotron_ext.checkpoint.load_failure import relative_file
from nanotron_ext.checkpoint.safetensors_writer import write_safetensors
from nanotron_ext.checkpoint.verify import Gather
from nanotron_ext.errors import NanotronExtError

__all__ = [
    "ReadWatch",
    "SaveRecorder",
    "gathered_files",
    "guarded_load",
    "swapped",
    "verify_on_every_rank",
    "world_gather",
]

_OPEN = builtins.open


@contextlib.contextmanager
def swapped(*swaps: tuple[Any, str, Any]) -> Iterator[None]:
    """Set each ``(owner, name, value)`` for the duration of the block, and put the originals back after it."""
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in swaps]
    try:
        for owner, name, value in swaps:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, original in reversed(originals):
            setattr(owner, name, original)


def _writes(mode: str) -> bool:
    return ("w" in mode or "x" in mode) and "+" not in mode and "a" not in mode


class SaveRecorder:
    """The files one rank writes into a checkpoint folder during one save, hashed as they are written."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder).resolve()
        self.files: dict[str, SavedFile] = {}

    def writer(self, path: Any) -> HashingWriter:
        """A new binary file at ``path`` (inside the folder) whose size and checksum are recorded when it closes."""
        relative = path_inside(self.folder, path)
        assert relative is not None, f"{path} is not inside {self.folder}"
        raw = _OPEN(path, "wb", buffering=0)

        def done(size: int, checksum: str) -> None:
            self.files[relative] = SavedFile(relative, size, checksum)

        return HashingWriter(raw, done)

    def forget(self, path: Path) -> None:
        """Drop a file the save wrote and then removed."""
        self.files.pop(path_inside(self.folder, path) or "", None)

    def save_safetensors(self, tensors: dict[str, torch.Tensor], path: Any, metadata: dict[str, str] | None) -> None:
        """``safetensors.torch.save_file``, hashed as written: the same format streamed from the tensors' memory."""
        with io.BufferedWriter(self.writer(path)) as out:  # buffered: a raw write may be partial (2 GiB at most)
            write_safetensors(out, tensors, metadata)

    def _open(
        self,
        file: Any,
        mode: str = "r",
        buffering: int = -1,
        encoding: str | None = None,
        errors: str | None = None,
        newline: str | None = None,
        closefd: bool = True,
        opener: Any = None,
    ) -> Any:
        if not _writes(mode) or opener is not None or not closefd or path_inside(self.folder, file) is None:
            return _OPEN(file, mode, buffering, encoding, errors, newline, closefd, opener)
        raw = self.writer(file)
        buffered = io.BufferedWriter(raw) if buffering != 0 else raw
        if "b" in mode:
            return buffered
        return io.TextIOWrapper(
            buffered,
            encoding=encoding,
            errors=errors,
            newline=newline,  # as open() builds it
            line_buffering=buffering == 1,
        )

    def _torch_save(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            if path_inside(self.folder, f) is None:
                return original(obj, f, *args, **kwargs)
            with io.BufferedWriter(self.writer(f)) as out:
                return original(obj, out, *args, **kwargs)

        return save

    def _save_file(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def save_file(tensors: dict[str, torch.Tensor], filename: Any, metadata: dict[str, str] | None = None) -> Any:
            if path_inside(self.folder, filename) is None:
                return original(tensors, filename, metadata=metadata)
            return self.save_safetensors(tensors, filename, metadata)

        return save_file

    @contextlib.contextmanager
    def writing(self) -> Iterator[SaveRecorder]:
        """While the block runs, Nanotron's writers record what they write into the folder."""
        import nanotron.serialize.weights as weights

        with swapped(
            (builtins, "open", self._open),
            (torch, "save", self._torch_save(torch.save)),
            (weights, "save_file", self._save_file(weights.save_file)),
        ):
            yield self

    def unrecorded(self, recorded: dict[str, SavedFile]) -> list[SavedFile]:
        """Files in the folder that no rank's writers recorded (a writer the launcher does not know), with their
        sizes and no checksum (the record itself and temporary files of an atomic write aside)."""
        out = []
        for path in sorted(p for p in self.folder.rglob("*") if p.is_file()):
            relative = path.relative_to(self.folder).as_posix()
            if relative not in recorded and relative != RECORD_FILE and not path.name.startswith(f".{RECORD_FILE}."):
                out.append(SavedFile(relative, path.stat().st_size, None))
        return out


class ReadWatch:
    """The last file opened inside a checkpoint folder while a loader runs (``watching``)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder).resolve()
        self.last: str | None = None

    def _note(self, file: Any) -> None:
        relative = path_inside(self.folder, file)
        if relative is not None:
            self.last = relative

    def _noting(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(file: Any, *args: Any, **kwargs: Any) -> Any:
            self._note(file)
            return original(file, *args, **kwargs)

        return call

    @contextlib.contextmanager
    def watching(self) -> Iterator[ReadWatch]:
        import nanotron.serialize.weights as weights
        import safetensors

        self.last = None
        with swapped(
            (builtins, "open", self._noting(builtins.open)),
            (torch, "load", self._noting(torch.load)),
            (safetensors, "safe_open", self._noting(safetensors.safe_open)),
            (weights, "safe_open", self._noting(weights.safe_open)),
        ):
            yield self


# --- collective: every rank's findings gathered, one verdict ------------------------------------------------------


def world_gather(group: Any) -> Gather:
    """:data:`nanotron_ext.checkpoint.verify.Gather` over a process group (every rank's object, in rank order)."""
    import torch.distributed as dist

    def gather(obj: Any) -> list[Any]:
        out: list[Any] = [None] * group.size()
        dist.all_gather_object(out, obj, group=group)
        return out

    return gather


def verify_on_every_rank(source: ResumeSource, group: Any, say: Callable[[str], None]) -> Verdict:
    """Prove the checkpoint's files, shared out over ``group``; rank 0 says what was proved (or that nothing could
    be). Raises the same :class:`~nanotron_ext.errors.CheckpointError` on every rank where a file is damaged."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    verdict = verify_checkpoint(source, rank=rank, world=group.size(), gather=world_gather(group))
    if rank == 0:
        say(f"nanotron_ext: {verdict.line()}")
    return verdict


def gathered_files(recorder: SaveRecorder, group: Any) -> dict[str, SavedFile]:
    """Every rank's recorded files, by path (a file several ranks wrote alike, ``model_config.json``, once)."""
    merged: dict[str, SavedFile] = {}
    for files in world_gather(group)(list(recorder.files.values())):
        for f in files:
            merged.setdefault(f.path, f)
    return dict(sorted(merged.items()))


def guarded_load(
    load: Callable[..., Any], what: str, source: ResumeSource, group: Callable[[], Any], verified: Callable[[], bool]
) -> Callable[..., Any]:
    """Nanotron's loader ``load`` (of ``what``: ``its weights``), made collective for the resume of ``source``:
    whatever it raises on any rank, every rank stops with the same message naming that rank's file (exit code 3);
    a nanotron_ext refusal that every rank raised alike goes on as it is."""
    import torch.distributed as dist

    def load_or_fail_together(*args: Any, **kwargs: Any) -> Any:
        root = kwargs.get("root_folder")  # Nanotron's trainer passes it by name
        if root is None or Path(root).resolve() != source.folder.resolve():
            return load(*args, **kwargs)  # not the resume (a model initialised from a checkpoint, say)
        pg = group()
        rank = dist.get_rank(pg)
        watch = ReadWatch(source.folder)
        mine: LoadFailure | None = None
        error: BaseException | None = None
        out = None
        try:
            with watch.watching():
                out = load(*args, **kwargs)
        except Exception as exc:  # any failure: the other ranks must hear of it rather than wait for this one
            error = exc
            file = relative_file(getattr(exc, "filename", None), source.folder) or watch.last
            refusal = str(exc) if isinstance(exc, NanotronExtError) else None
            mine = LoadFailure(rank, what, file, f"{type(exc).__name__}: {' '.join(str(exc).split())}", refusal)
        gather = world_gather(pg)
        every = gather(mine)
        failed = [f for f in every if f is not None]
        if not failed:
            return out
        if (
            mine is not None
            and mine.refusal is not None
            and all(f is not None and f.refusal == mine.refusal for f in every)
        ):
            raise error  # type: ignore[misc]  (already the same message on every rank)
        instead = instead_of(source, rank=rank, world=pg.size(), gather=gather)
        raise CheckpointLoadFailure(
            load_failure_message(source, failed, verified=verified(), instead=instead)
        ) from error

    return load_or_fail_together
