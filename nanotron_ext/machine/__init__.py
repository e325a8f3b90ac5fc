"""The machine model: one profile (plain data, versioned JSON) that prices every block, transfer and sync for
planning and simulation alike; the analytic H100 default; and the one place that reads time
(:func:`machine_for`, :func:`price_blocks`)."""

from nanotron_ext.machine.analytic import ANALYTIC_GPU
from nanotron_ext.machine.memory_limit import MemoryLimit, memory_limit
from nanotron_ext.machine.pricing import BlockPrices, machine_for, measured_blocks, price_blocks, weight_part
from nanotron_ext.machine.profile import (
    FORMAT_VERSION,
    POSITIONS,
    BlockCost,
    Collective,
    EngineOverhead,
    Link,
    MachineKey,
    MachineProfile,
    PositionCost,
    block_signature,
    key_for,
    load_machine,
    stage_position,
)

__all__ = [
    "ANALYTIC_GPU",
    "FORMAT_VERSION",
    "POSITIONS",
    "BlockCost",
    "BlockPrices",
    "Collective",
    "EngineOverhead",
    "Link",
    "MachineKey",
    "MachineProfile",
    "MemoryLimit",
    "PositionCost",
    "block_signature",
    "key_for",
    "load_machine",
    "machine_for",
    "measured_blocks",
    "memory_limit",
    "price_blocks",
    "stage_position",
    "weight_part",
]
