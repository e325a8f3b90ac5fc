"""The in-run profile as the ranks of a run share it: built on global rank 0 from every rank's timed steps, the same
on each (``calibrate --in-run`` and a re-plan after K steps, in the CPU runtime and in Nanotron's trainer)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nanotron_ext.config import PlannerConfig
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.machine.calibrate import profile_source, share_profile
from nanotron_ext.machine.in_run import InRunSplit, in_run_profile
from nanotron_ext.machine.profile import MachineProfile

__all__ = ["shared_in_run_profile", "split_steps"]


def shared_in_run_profile(
    cfg: PlannerConfig, runs: Sequence[InRunSplit], base: MachineProfile, rank: int, *, what: str
) -> MachineProfile:
    """:func:`~nanotron_ext.machine.in_run.in_run_profile` of ``runs`` on ``base``, built on global rank 0 and the
    same on every rank (collective; ``what`` names the command in an error)."""
    return share_profile(
        lambda: in_run_profile(cfg, inventory_from_config(cfg), runs, base, source=profile_source(cfg)), rank, what=what
    )


def split_steps(block_ranks: Sequence[int], gathered: Any) -> InRunSplit:
    """A split's timed steps as the in-run profile takes them, from ``OpClock.gather()`` (None off rank 0: an
    empty split there)."""
    return InRunSplit(tuple(block_ranks), () if gathered is None else tuple(zip(*gathered)))
