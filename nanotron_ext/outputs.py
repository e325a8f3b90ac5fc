"""Output files: checked before any work starts, written atomically (a temporary file in the same folder,
then ``os.replace``), so that a reader sees the old file, no file, or the complete new one, never half of one.

A leaf: it imports only :mod:`nanotron_ext.errors` and the standard library.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from nanotron_ext.errors import ConfigError

__all__ = ["PICTURE_SUFFIXES", "atomic_write_bytes", "atomic_write_text", "check_output_path", "picture_format"]

#: Picture files the simulator writes, by suffix (no suffix: PNG).
PICTURE_SUFFIXES = (".png", ".pdf", ".svg", "")


def picture_format(path: str | os.PathLike[str]) -> str:
    """matplotlib's format name for a picture path: its suffix, PNG when it has none.

    Raises:
        ConfigError: a suffix other than .png, .pdf or .svg.
    """
    suffix = Path(path).suffix.lower()
    if suffix not in PICTURE_SUFFIXES:
        raise ConfigError(f"picture {str(path)!r}: cannot write a {suffix} file; name it .png, .pdf or .svg")
    return suffix[1:] or "png"


def check_output_path(
    path: str | os.PathLike[str], flag: str, *, suffixes: Iterable[str] | None = None, default_suffix: str = ".json"
) -> Path:
    """Fail now, before any work, if ``path`` cannot be written later.

    Its folder must exist: a missing one is an error naming it, never made silently (a typo in a folder name would
    otherwise put the output where nobody looks). A probe file is written and removed next to ``path``, which also
    catches read-only folders and full disks that permission bits do not show.

    Args:
        path: the output file.
        flag: the option that named it, for the message (``--metrics-out``).
        suffixes: allowed file suffixes (lower case, with the dot); ``""`` allows none.
        default_suffix: the suffix of the example file name a message suggests.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        ConfigError: the path is a folder, its folder is missing or a file, the folder cannot be written, or the
        suffix is not one of ``suffixes``.
    """
    out = Path(path)
    if suffixes is not None:
        allowed = list(suffixes)
        if out.suffix.lower() not in allowed:
            shown = ", ".join(s for s in allowed if s)
            raise ConfigError(
                f"{flag} {str(out)!r}: cannot write a {out.suffix or 'suffix-less'} file; name it with one of {shown}"
            )
    if out.is_dir():
        raise ConfigError(
            f"{flag} {str(out)!r} is a directory; give a file path in it, e.g. "
            f"{str(out / ('out' + (out.suffix or default_suffix)))!r}"
        )
    parent = out.parent
    blocker = next((p for p in (parent, *parent.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise ConfigError(
            f"{flag} {str(out)!r} cannot be written: {str(blocker)!r} is a file, not a folder; "
            f"choose a path in a folder you can write"
        )
    if not parent.is_dir():
        raise ConfigError(
            f"{flag} {str(out)!r} cannot be written: its folder {str(parent)!r} does not exist; create it first "
            f"(mkdir -p {parent}) or choose a path in an existing folder"
        )
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{out.name}.", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(
            f"{flag} {str(out)!r} cannot be written: {exc.strerror or exc} ({exc.filename or parent}); "
            f"choose a path in a folder you can write"
        ) from None
    return out


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same folder and ``os.replace``.

    The temporary file is removed if anything fails; the file gets the usual permissions (umask applied).
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return out


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """:func:`atomic_write_bytes` of UTF-8 text."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
