"""Costs: what blocks cost to train, from the analytic model (``analytic``: training FLOPs, bytes per parameter)
or measured on this machine (``profiled``, imported on demand: it needs torch), what one block holds in memory
(``block_memory``; ``gpu_memory`` where Nanotron's GPU code keeps other tensors), and a stage's peak memory by term
(``memory_estimate``)."""

from nanotron_ext.costs.analytic import (
    GIB,
    ParamBytes,
    in_flight,
    param_bytes,
    static_bytes,
    trainable_before,
    training_flops,
)
from nanotron_ext.costs.block_memory import block_memory
from nanotron_ext.costs.block_terms import BlockMemory
from nanotron_ext.costs.memory_estimate import StageMemory, config_stage_memory, stage_memory

__all__ = [
    "GIB",
    "BlockMemory",
    "ParamBytes",
    "StageMemory",
    "block_memory",
    "config_stage_memory",
    "in_flight",
    "param_bytes",
    "stage_memory",
    "static_bytes",
    "trainable_before",
    "training_flops",
]
