"""The one device rule: where blocks run, for ``calibrate``, ``profiled``, the CPU runtime and the benchmarks.

A ``--device`` flag where a command takes one, else ``$NANOTRON_EXT_DEVICE``, else CUDA when torch sees a GPU,
else the CPU. Before this rule, ``calibrate`` timed blocks on CUDA whenever a GPU was visible while the CPU runtime
trained on the CPU, and a CPU step was priced with GPU blocks (0.10-0.15x of measured, on a GPU host).

A command that takes ``--device`` calls :func:`use_device`, which writes the choice into the environment, so every
part of the process (and every rank it starts) reads the same answer from :func:`device_type`. torch is imported
only to ask whether CUDA is there.
"""

from __future__ import annotations

import os
from typing import Literal, get_args

from nanotron_ext.errors import ConfigError

__all__ = ["DEVICE_ENV", "DEVICE_TYPES", "DeviceType", "device_type", "synchronize", "use_device"]

DeviceType = Literal["cpu", "cuda"]
#: The device types a ``--device`` flag and ``$NANOTRON_EXT_DEVICE`` take.
DEVICE_TYPES: tuple[str, ...] = get_args(DeviceType)
#: The environment variable that carries the choice to every part of a run and to the ranks it starts.
DEVICE_ENV = "NANOTRON_EXT_DEVICE"


def _cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


def device_type(requested: str | None = None) -> DeviceType:
    """Where blocks run: ``requested`` (a ``--device`` flag), else ``$NANOTRON_EXT_DEVICE``, else ``cuda`` when torch
    sees a GPU, else ``cpu``.

    Raises:
        ConfigError: a value other than cpu or cuda, or cuda where torch sees no GPU (naming where it came from).
    """
    origin, raw = "--device", requested
    if raw is None:
        origin, raw = DEVICE_ENV, os.environ.get(DEVICE_ENV, "")
    value = raw.strip().lower()
    if value == "":
        return "cuda" if _cuda_visible() else "cpu"
    flag = origin == "--device"
    if value not in DEVICE_TYPES:
        choices = "--device cpu or --device cuda" if flag else f"{DEVICE_ENV}=cpu or {DEVICE_ENV}=cuda"
        raise ConfigError(
            f"{origin}={raw!r} is not a device nanotron_ext runs on; use {choices} (unset, it is "
            f"cuda when torch sees a GPU, else cpu)"
        )
    if value == "cuda" and not _cuda_visible():
        import torch

        to_cpu = "use --device cpu" if flag else f"unset {DEVICE_ENV} to run on the CPU"
        raise ConfigError(
            f"{origin}={raw!r} asks for CUDA, but torch sees no CUDA device here (torch "
            f"{torch.__version__}, built for CUDA {torch.version.cuda}); run on a machine with an NVIDIA "
            f"GPU and a CUDA build of torch, or {to_cpu}"
        )
    return value  # type: ignore[return-value]


def use_device(requested: str | None) -> DeviceType:
    """Apply a command's ``--device`` (None: keep the rule's answer) to this process and the ranks it starts.

    Raises:
        ConfigError: as :func:`device_type`.
    """
    chosen = device_type(requested)
    if requested is not None:
        os.environ[DEVICE_ENV] = chosen
    return chosen


def synchronize() -> None:
    """Wait for this process's queued CUDA work, if it ever used CUDA (nothing on CPU): a step timed on a GPU
    ends when its kernels do."""
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
