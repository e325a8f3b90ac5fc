"""The in-run profile as the ranks of a run share it: built on global rank 0 from every rank's timed steps, the same
on each (``calibrate --in-run`` and a re-plan after K steps, in the CPU runtime and in Nanotron's trainer)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nanotron_ext.config import PlannerConfig
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.machine.calibrate import calibrate
from nanotron_ext.machine.in_run import InRunSplit, in_run_profile
from nanotron_ext.machine.profile import MachineProfile
from nanotron_ext.machine.profile_share import profile_source, share_profile

__all__ = ["REPLAN_CALIBRATE_REPEATS", "run_profiles", "shared_in_run_profile", "split_steps"]

#: Repeats of the standalone calibration a re-plan takes where the config names no machine profile: it prices only
#: the links, the all-reduces and what the run's own steps did not time.
REPLAN_CALIBRATE_REPEATS = 1


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


def run_profiles(
    cfg: PlannerConfig, block_ranks: Sequence[int], gathered: Any, n_timed: int, rank: int, folder: Path
) -> list[Path]:
    """The in-run profile of a run's timed steps, then (from two timed steps) those of their first and second halves,
    for the gain's noise; written to ``folder`` on every rank, the same on each (collective).

    Args:
        cfg: the run's config; its ``machine`` profile is the base, else a standalone calibration taken now.
        block_ranks: the split the steps ran on; gathered: the clock's ``gather()`` (None off rank 0).
        n_timed: the steps every rank timed; rank: this process's global rank.
    """
    from nanotron_ext.machine import load_machine

    base = (
        load_machine(cfg.ext.machine)
        if cfg.ext.machine is not None
        else calibrate(cfg, warmup=1, repeats=REPLAN_CALIBRATE_REPEATS, progress=False)
    )
    half = n_timed // 2  # every rank timed the same steps: the same calls on each
    parts = [slice(None)] + ([slice(None, half), slice(half, None)] if n_timed >= 2 else [])
    paths = []
    for i, part in enumerate(parts):
        steps = None if gathered is None else [rank_steps[part] for rank_steps in gathered]
        profile = shared_in_run_profile(cfg, [split_steps(block_ranks, steps)], base, rank, what="replan")
        paths.append(folder / f"in_run_profile_{i}.json")
        paths[-1].write_text(profile.to_json())
    return paths
