"""Which calibrated figures are too uncertain for two calibrations to agree: the one home of that rule.

A calibration keeps each figure over its rounds (a block's fastest, a link's median) and how far it could move
between two calibrations (its spread: :func:`nanotron_ext.stats.fastest_spread`,
:func:`nanotron_ext.stats.relative_spread`). Two calibrations of one machine agree within 3 % on a step when
neither moves it by more than half of that, so a figure is flagged when its uncertainty alone could move a stage's step,
taken as the config's whole training work ÷ pp, by more than :data:`STEP_SHARE_LIMIT`: each block's forward and
backward count once per micro-batch and block with that signature, its update once per block; a link carries
the largest tensor a block sends once per micro-batch.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from nanotron_ext.config import PlannerConfig
from nanotron_ext.costs.analytic import trainable_before
from nanotron_ext.costs.block_memory import largest_output
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.machine.profile import MachineProfile, block_signature
from nanotron_ext.report import compact_names

__all__ = ["STEP_SHARE_LIMIT", "Uncertain", "uncertain_figures"]

#: Half of the 3 % within which two calibrations of one machine must agree.
STEP_SHARE_LIMIT = 0.015
FIGURES = ("forward", "backward", "update")


@dataclass(frozen=True)
class Uncertain:
    """One calibrated figure too uncertain for two calibrations to agree within 3 %."""

    what: str  # e.g. "lm_head forward", "link 0 -> 1"
    spread: float  # how far the figure could move, a fraction of it
    step_share: float  # how far that could move a stage's step, a fraction of it

    def message(self) -> str:
        return (
            f"{self.what} could move by ±{self.spread:.1%} (its spread over the calibration's rounds), a "
            f"stage's step by ±{self.step_share:.1%}: over the {STEP_SHARE_LIMIT:.1%} that keeps two calibrations "
            f"within {2 * STEP_SHARE_LIMIT:.0%} of each other. Calibrate again on an idle machine, or with more "
            f"rounds (--repeats)"
        )


def uncertain_figures(cfg: PlannerConfig, profile: MachineProfile) -> list[Uncertain]:
    """The figures of ``profile`` whose spread could move a stage's step of ``cfg`` by over
    :data:`STEP_SHARE_LIMIT`, largest first (none for a profile without spreads)."""
    blocks = inventory_from_config(cfg)
    m = cfg.run.n_micro_batches
    names: dict[str, list[str]] = defaultdict(list)
    for b, grad in zip(blocks, trainable_before(blocks)):
        names[block_signature(b, input_grad=grad)].append(b.short)
    weighted: list[tuple[str, float, float]] = []  # (what, spread, seconds per step it stands for)
    for sig, shorts in names.items():
        cost = profile.block(sig)
        if cost is None:
            continue
        for field, per_step, spread in zip(FIGURES, (m, m, 1), cost.spread or (0.0, 0.0, 0.0)):
            weighted.append((f"{compact_names(shorts)} {field}", spread, per_step * len(shorts) * getattr(cost, field)))
    largest = largest_output(blocks, cfg.model, cfg.run)
    for link in profile.links:
        if link.spread is not None and link.src >= 0:
            weighted.append((f"link {link.src} -> {link.dst}", link.spread, m * link.time(largest)))
    stage = sum(seconds for _, _, seconds in weighted) / cfg.run.pp
    if stage <= 0:
        return []
    found = [
        Uncertain(what, spread, spread * seconds / stage)
        for what, spread, seconds in weighted
        if spread * seconds > STEP_SHARE_LIMIT * stage
    ]
    return sorted(found, key=lambda u: -u.step_share)
