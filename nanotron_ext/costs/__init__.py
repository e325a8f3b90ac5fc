"""Costs: what each block costs to run, from the analytic FLOP and byte model (``analytic``) or measured on
this machine (``measured``, imported on demand: it needs torch), and a stage's peak memory by term (``memory``)."""

from nanotron_ext.costs.analytic import (
    GIB,
    BlockWork,
    ParamBytes,
    block_work,
    in_flight,
    param_bytes,
    stage_memory_bytes,
    static_bytes,
    trainable_before,
    training_flops,
)
from nanotron_ext.costs.memory import (
    BlockMemory,
    StageMemory,
    block_memory,
    config_stage_memory,
    stage_memory,
)

__all__ = [
    "GIB",
    "BlockMemory",
    "BlockWork",
    "ParamBytes",
    "StageMemory",
    "block_memory",
    "block_work",
    "config_stage_memory",
    "in_flight",
    "param_bytes",
    "stage_memory",
    "stage_memory_bytes",
    "static_bytes",
    "trainable_before",
    "training_flops",
]
