"""One policy for glibc's malloc wherever this project times or trains on CPU: keep freed memory.

With glibc's defaults a large tensor is mmapped and page-faulted in again on every allocation, or taken from the
heap, depending on thresholds that move with the allocation history (``mallopt(3)``: the mmap threshold rises as
mmapped chunks are freed, and the heap's top is trimmed back to the OS). On the 2-core development VM that made
the same block 1.6× slower in one calibration than in the next (the SmolLM shape's decoder update, 7.4 against
15.5 ms; the loss 15 against 24 ms), and every training step pay for page faults (the embedding's backward 55
ms instead of 12). Calibration and the CPU runtime therefore both run with mmap off, the heap never trimmed and
a 256 MiB top pad: the blocks are timed in the state they train in, and both stay steady.

``NANOTRON_EXT_SYSTEM_MALLOC=1`` leaves glibc's defaults (and :data:`MALLOC_ENV` is the same policy for a child
process, through glibc's environment variables). Elsewhere than glibc nothing is changed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["MALLOC_ENV", "SYSTEM_MALLOC_VARIABLE", "keep_freed_memory", "malloc_policy"]

#: Set to 1 to leave glibc malloc's defaults in calibration and the CPU runtime.
SYSTEM_MALLOC_VARIABLE = "NANOTRON_EXT_SYSTEM_MALLOC"
#: ``mallopt`` parameters (glibc's ``malloc.h``) and the values set.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4
_SETTINGS = ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_TOP_PAD, 1 << 28))
#: The same policy for a child process started with defaults, as glibc's environment variables.
MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1), "MALLOC_TOP_PAD_": str(1 << 28)}

_applied: list[bool] = []


def keep_freed_memory() -> bool:
    """Apply the policy to this process (once; later calls return the first answer).

    Returns:
        Whether glibc malloc now keeps freed memory: False under ``NANOTRON_EXT_SYSTEM_MALLOC=1`` or without glibc.
    """
    if not _applied:
        _applied.append(os.environ.get(SYSTEM_MALLOC_VARIABLE, "") not in ("1", "true", "yes") and _mallopt())
    return _applied[0]


def malloc_policy() -> str:
    """What a report says of this process's malloc: ``freed memory kept`` or ``system defaults``."""
    return "freed memory kept" if _applied and _applied[0] else "system defaults"


def _mallopt() -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to set
        return False
    return all(mallopt(param, value) == 1 for param, value in _SETTINGS)
