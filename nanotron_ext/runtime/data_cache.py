"""Packed token windows kept between runs: reading text with ``datasets`` and packing it costs a rank about 2.4 s on
the bundled corpus (1.5 s of it importing ``datasets``), the same result every time for the same files, window and
tokenizer. Each result is one ``.npy`` file, named by the hash of what it depends on (the files' bytes, the window,
the tokenizer), in ``$NANOTRON_EXT_DATA_CACHE`` or ``~/.cache/nanotron_ext/windows``; ``NANOTRON_EXT_DATA_CACHE=off``
turns it off. A file that cannot be read or is not such an array is built again; a cache that cannot be written is
passed over."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["DATA_CACHE_ENV", "cached_windows", "windows_cache_dir"]

#: Where packed windows are kept (``off``: nowhere).
DATA_CACHE_ENV = "NANOTRON_EXT_DATA_CACHE"
#: Bump when packing changes, so that older files are not reused.
PACKING_VERSION = 1


def windows_cache_dir() -> Path | None:
    """The cache folder, or None where ``$NANOTRON_EXT_DATA_CACHE`` is ``off``."""
    value = os.environ.get(DATA_CACHE_ENV, "")
    if value.lower() == "off":
        return None
    return Path(value or "~/.cache/nanotron_ext/windows").expanduser()


def cached_windows(
    files: Sequence[str | Path], window: int, tokenizer: Any, build: Callable[[], np.ndarray]
) -> np.ndarray:
    """The windows ``build()`` makes of ``files``, read from the cache where an earlier run kept them, else built and
    kept."""
    folder = windows_cache_dir()
    if folder is None:
        return build()
    digest = hashlib.sha256(f"{PACKING_VERSION}:{window}:{dataclasses.asdict(tokenizer)}".encode())
    for f in files:
        digest.update(Path(f).read_bytes())
        digest.update(b"\0")
    path = folder / f"{digest.hexdigest()[:32]}.npy"
    try:
        windows = np.load(path, allow_pickle=False)
        if windows.dtype == np.int64 and windows.ndim == 2 and windows.shape[1] == window and len(windows):
            return windows
    except (OSError, ValueError):
        pass
    windows = build()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, suffix=".npy", delete=False) as tmp:
            np.save(tmp, windows, allow_pickle=False)
        os.replace(tmp.name, path)  # whole or not at all: a rank beside this one reads one or the other
    except OSError:
        pass
    return windows
