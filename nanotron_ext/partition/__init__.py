"""Partition: block costs in, a contiguous block → stage split out — the optimal one under constraints
(``optimal``), Nanotron's greedy rule (``nanotron_rule``), or an explicit layout string (``layout``)."""

from nanotron_ext.partition.layout import layout_ranks, parse_layout
from nanotron_ext.partition.nanotron_rule import nanotron_greedy_ranks
from nanotron_ext.partition.optimal import MemoryCap, Partition, Requirement, partition

__all__ = [
    "MemoryCap",
    "Partition",
    "Requirement",
    "layout_ranks",
    "nanotron_greedy_ranks",
    "parse_layout",
    "partition",
]
