"""The memory every stage of a plan must fit in: ``memory_cap_gib`` when set, else the device memory of the
config's machine profile (:attr:`~nanotron_ext.machine.MachineProfile.device_memory_bytes`: what ``calibrate``
read from the GPU, or the analytic H100's). A CPU has none, and neither does a config whose ``memory_runtime``
is ``cpu`` and that names no profile: the analytic GPU is not where that run goes.

One home for the limit: the partitioner's cap (``constrained``), the validator's verdict and the memory table
read it here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from nanotron_ext.config import PlannerConfig
from nanotron_ext.costs.analytic import GIB
from nanotron_ext.machine.analytic import ANALYTIC_GPU
from nanotron_ext.machine.profile import load_machine

__all__ = ["MemoryLimit", "memory_limit"]


@dataclass(frozen=True)
class MemoryLimit:
    """The memory each stage must fit in: ``bytes``, and where it comes from (a cap the user set, or a device)."""

    bytes: float
    kind: Literal["cap", "device"]
    source: str

    def __str__(self) -> str:
        """``memory_cap_gib=70`` or ``79.18 GiB per GPU (H100 SXM (analytic))``."""
        return self.source if self.kind == "cap" else f"{self.bytes / GIB:.4g} GiB per GPU ({self.source})"


def memory_limit(cfg: PlannerConfig) -> MemoryLimit | None:
    """The limit every stage of ``cfg``'s plan must fit in, or None when none is known.

    Raises:
        ConfigError: the config's machine profile cannot be read.
    """
    cap = cfg.ext.memory_cap_gib
    if cap is not None:
        return MemoryLimit(cap * GIB, "cap", f"memory_cap_gib={cap:g}")
    if cfg.ext.machine is not None:
        machine = load_machine(cfg.ext.machine)
    elif cfg.ext.memory_runtime == "cpu":
        return None
    else:
        machine = ANALYTIC_GPU
    if machine.device_memory_bytes is None:
        return None
    return MemoryLimit(machine.device_memory_bytes, "device", machine.name)
