"""Partition: block costs in, a contiguous block → stage split out — the optimal one under constraints
(``optimal``), Nanotron's greedy rule (``nanotron_rule``), an explicit layout string (``layout_string``), the
split with the smallest simulated step (``schedule_aware``), and a split's two spellings (``split``)."""

from nanotron_ext.partition.layout_string import layout_ranks, parse_layout
from nanotron_ext.partition.nanotron_rule import nanotron_greedy_ranks
from nanotron_ext.partition.optimal import MemoryCap, Partition, Requirement, partition
from nanotron_ext.partition.split import bounds_from_ranks, ranks_from_bounds

__all__ = [
    "MemoryCap",
    "Partition",
    "Requirement",
    "bounds_from_ranks",
    "layout_ranks",
    "nanotron_greedy_ranks",
    "parse_layout",
    "partition",
    "ranks_from_bounds",
]
