"""The ``profiled`` timings' records and their on-disk cache: what a block's time depends on (its key), and one
small JSON file per measurement, keyed by that key's hash (see :mod:`nanotron_ext.costs.profiled`)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.config import PlannerConfig
from nanotron_ext.costs.block_inputs import flush_bytes
from nanotron_ext.devices import device_type

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_CACHE_DIR", "PROFILE_VERSION", "BlockTiming", "CacheWarning", "cache_dir_for", "profile_key"]

#: Bump when the way blocks are measured changes, so that older cache entries are not reused.
# 2: the optimizer step is timed too; 3: with cold caches; 4: blocks interleaved, with a spread; 5: the fastest round;
# 6: zero-bubble's W of the blocks whose backward zb1p and zb2p split
PROFILE_VERSION = 6
DEFAULT_CACHE_DIR = Path("~/.cache/nanotron_ext")


@dataclass(frozen=True)
class BlockTiming:
    """Measured time of one block for one micro-batch, in seconds.

    Attributes:
        forward: fastest forward time over the rounds (:func:`nanotron_ext.stats.fastest`).
        backward: fastest backward time (0 when no gradient flows through the block).
        optimizer: fastest time of an AdamW step over the block's trainable parameters (0 when none train);
            once per training step, not per micro-batch.
        spread: how far each of the three could move between two calibrations, a fraction of it
            (:func:`nanotron_ext.stats.fastest_spread`); 0 where the figure is 0.
        weight: fastest time of the block's W as zb1p and zb2p run it (its weight gradients deferred, then computed
            alone: :mod:`nanotron_ext.costs.split_backward`); None for a block whose backward they do not split.
    """

    forward: float
    backward: float
    optimizer: float = 0.0
    spread: tuple[float, float, float] = (0.0, 0.0, 0.0)
    weight: float | None = None

    @property
    def total(self) -> float:
        """Forward + backward: the per-micro-batch pipeline work the planner balances."""
        return self.forward + self.backward


# --- keys and cache ------------------------------------------------------------------------------------


def _trainable_flags(block: BlockInfo) -> list[tuple[str, bool]]:
    """``(local parameter name, trainable)`` pairs, names relative to the block's module."""
    if not block.parameters:
        return [("*", block.trainable > 0)] if block.params else []
    marker = ".pp_block."
    return sorted(
        (p.name.split(marker, 1)[1] if marker in p.name else p.name, bool(p.trainable)) for p in block.parameters
    )


def _device() -> torch.device:
    """Where blocks are timed: the one device rule (:func:`nanotron_ext.devices.device_type`)."""
    import torch

    return torch.device(device_type())


def profile_key(block: BlockInfo, cfg: PlannerConfig, *, input_grad: bool) -> dict[str, Any]:
    """Everything a block's measured time depends on, as a JSON-able dict (its hash is the cache key).

    The layer count is left out (one decoder layer does not depend on how many there are), so is the block's
    name: identical decoder layers share one key.

    Args:
        block: the block.
        cfg: the config (model shape, batch shape, dtype).
        input_grad: whether the block's input needs a gradient (something before it trains).

    Returns:
        The key's fields.
    """
    import torch

    shape = dataclasses.asdict(cfg.model)
    shape.pop("num_hidden_layers")
    return {
        "version": PROFILE_VERSION,
        "role": block.role,
        "params": block.params,
        "model": shape,
        "micro_batch_size": cfg.run.micro_batch_size,
        "sequence_length": cfg.run.sequence_length,
        "dtype": cfg.run.dtype,
        "torch": torch.__version__,
        "device": _device().type,
        "threads": torch.get_num_threads(),
        # How cold a timed call starts: a timing taken after a smaller flush is not the same figure.
        "flush_bytes": flush_bytes(_device().type),
        "trainable": _trainable_flags(block),
        "input_grad": bool(input_grad),
    }


def _hash(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode("utf-8")).hexdigest()[:32]


def cache_dir_for(cfg: PlannerConfig) -> Path:
    """The timing cache directory: ``nanotron_ext.profile_cache`` or ``~/.cache/nanotron_ext``."""
    return Path(cfg.ext.profile_cache or DEFAULT_CACHE_DIR).expanduser()


#: A cached time above this (seconds per block and micro-batch) is corrupt, not slow.
MAX_CACHED_SECONDS = 1e4


def _read_cache(path: Path) -> BlockTiming | None:
    """A cache entry, or None when there is none or it is unusable (then it is measured again).

    An entry that exists but cannot be used (not a file, not JSON, a missing field, a time that is not a
    finite number in ``[0, MAX_CACHED_SECONDS]``, or a zero forward time) gets a warning naming the file.
    """
    if not path.exists() and not path.is_symlink():
        return None
    try:
        data = json.loads(path.read_text())
        values = {k: data[k] for k in ("forward", "backward", "optimizer")}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return _bad_entry(path, f"{type(exc).__name__}: {exc}")
    for name, value in values.items():
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not (math.isfinite(value) and 0 <= value <= MAX_CACHED_SECONDS)
        ):
            return _bad_entry(path, f"{name}={value!r} is not a time in seconds (finite, 0 to {MAX_CACHED_SECONDS:g})")
    if values["forward"] <= 0:
        return _bad_entry(path, f"forward={values['forward']!r}: a block's forward always takes some time")
    spread = data.get("spread", (0.0, 0.0, 0.0))
    if not (
        isinstance(spread, list)
        and len(spread) == 3
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0 for x in spread)
    ):
        return _bad_entry(path, f"spread={spread!r} is not three relative uncertainties (finite, >= 0)")
    weight = data.get("weight")
    if weight is not None and (
        isinstance(weight, bool)
        or not isinstance(weight, (int, float))
        or not (math.isfinite(weight) and 0 <= weight <= MAX_CACHED_SECONDS)
    ):
        return _bad_entry(path, f"weight={weight!r} is not a time in seconds (finite, 0 to {MAX_CACHED_SECONDS:g})")
    return BlockTiming(
        float(values["forward"]),
        float(values["backward"]),
        float(values["optimizer"]),
        tuple(float(x) for x in spread),  # type: ignore[arg-type]
        None if weight is None else float(weight),
    )


def _bad_entry(path: Path, why: str) -> None:
    warnings.warn(
        f"profiled timing cache entry {path} is unusable ({why}); measuring that block again and replacing it",
        CacheWarning,
        stacklevel=3,
    )
    return None


class CacheWarning(UserWarning):
    """A ``profiled`` cache entry was unusable and is measured again."""


def _write_cache(path: Path, key: dict[str, Any], timing: BlockTiming) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write then rename, so a concurrent reader never sees half a file; the temporary file never outlives a
    # failure (e.g. the entry's path is a folder, so the rename fails).
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(dataclasses.asdict(timing) | {"key": key}, f, indent=1)
        if path.is_dir() and not path.is_symlink():
            raise IsADirectoryError(f"{path} is a directory")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
