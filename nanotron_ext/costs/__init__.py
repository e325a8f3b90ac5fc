"""Costs: what each block costs to run, from the analytic FLOP and byte model (``analytic``) or measured on
this machine (``measured``, imported on demand: it needs torch)."""

from nanotron_ext.costs.analytic import (
    GIB,
    BlockWork,
    block_work,
    in_flight,
    stage_memory_bytes,
    static_bytes,
    trainable_before,
    training_flops,
)

__all__ = [
    "GIB",
    "BlockWork",
    "block_work",
    "in_flight",
    "stage_memory_bytes",
    "static_bytes",
    "trainable_before",
    "training_flops",
]
