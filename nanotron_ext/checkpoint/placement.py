"""Where the new plan puts each saved parameter, and the proof that the mapping is complete: every part of every
live parameter (and of its optimizer state) comes from exactly one saved part, and every saved parameter has a
place. Every rank runs these checks on the same gathered data, so every rank reaches the same verdict before a
tensor is loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nanotron_ext.checkpoint.boxes import Piece, intersect, tiling_gaps
from nanotron_ext.checkpoint.saved import SavedCheckpoint

__all__ = ["Need", "ResumeCount", "count_placements", "placement_problems"]


@dataclass(frozen=True)
class Need:
    """One live parameter of the new plan, as the checkpoint must fill it.

    Attributes:
        name: canonical name (see :func:`nanotron_ext.checkpoint.saved.canonical_name`).
        local_name: its name in the live model on its rank.
        rank: the global rank that holds it; ``dp`` its data-parallel replica.
        local_shape: the live tensor's shape.
        whole_shape: the whole parameter's shape in the new plan.
        pieces: the pieces of the whole parameter the live tensor holds.
        trainable: it will have optimizer state.
        tied: Nanotron ties it to copies on other ranks (a shared embedding, a norm replicated across tp), so
            those copies hold the same parts.
    """

    name: str
    local_name: str
    rank: int
    dp: int
    local_shape: tuple[int, ...]
    whole_shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    trainable: bool
    tied: bool


@dataclass(frozen=True)
class ResumeCount:
    """What a resume under a changed plan placed, counted over the whole new plan.

    Attributes:
        parameters: distinct parameters placed; ``saved_parameters`` the checkpoint's.
        entries: optimizer entries placed (per trainable parameter: each state tensor, the step, the fp32 master);
            ``saved_entries`` the checkpoint holds for parameters that train in the new plan.
        entry_keys: the names of one parameter's entries.
        dropped: optimizer entries of parameters that the new plan freezes.
    """

    parameters: int
    saved_parameters: int
    entries: int
    saved_entries: int
    entry_keys: tuple[str, ...]
    dropped: int = 0

    def line(self) -> str:
        """One line for the log."""
        entries = (
            f" and {self.entries} of {self.saved_entries} optimizer entries ({', '.join(self.entry_keys)})"
            if self.entry_keys
            else ""
        )
        dropped = f"; {self.dropped} entries of parameters the new plan freezes were dropped" if self.dropped else ""
        return (
            f"{self.parameters} of {self.saved_parameters} parameters{entries} placed, each from exactly one "
            f"saved source; nothing missing, twice or left over{dropped}"
        )


def placement_problems(saved: SavedCheckpoint, needs: Sequence[Need], *, optimizer: bool) -> list[str]:
    """Everything that stops ``saved`` from being placed exactly onto ``needs`` (every rank's), one line each.

    Args:
        saved: the checkpoint.
        needs: the live parameters of every rank of the new plan.
        optimizer: the optimizer state will be loaded too.
    """
    problems = [f"the checkpoint's {p}" for p in saved.tiling_problems()]
    for n in needs:
        p = saved.parameters.get(n.name)
        if p is None:
            problems.append(f"{n.local_name} (rank {n.rank}) has no saved weight {n.name!r} in the checkpoint")
        elif p.whole_shape != n.whole_shape:
            problems.append(f"{n.name} is {n.whole_shape} in the new plan but {p.whole_shape} in the checkpoint")
    for d in sorted({n.dp for n in needs}):
        replica = [n for n in needs if n.dp == d]
        for name in sorted({n.name for n in replica}):
            held = [n for n in replica if n.name == name]
            distinct = {n.pieces for n in held}
            if len(distinct) < len(held) and not all(n.tied for n in held):
                ranks = ", ".join(str(n.rank) for n in held)
                problems.append(f"{name} is placed twice in the new plan (ranks {ranks}) without being tied")
            whole = held[0].whole_shape
            overlap, missing = tiling_gaps([p.whole for pieces in distinct for p in pieces], whole)
            if overlap or missing:
                problems.append(f"{name}: the new plan's parts cover {overlap} element(s) twice and miss {missing}")
        left = sorted(set(saved.parameters) - {n.name for n in replica})
        if left and d == 0:
            problems.append(
                f"the new plan has no place for {len(left)} saved parameter(s): {', '.join(left[:6])}"
                f"{' ...' if len(left) > 6 else ''}"
            )
    if optimizer:
        problems += _optimizer_problems(saved, needs)
    return problems


def _optimizer_problems(saved: SavedCheckpoint, needs: Sequence[Need]) -> list[str]:
    sources = saved.optimizer_sources()
    out = []
    orphans = sorted({name for name, _ in sources} - set(saved.parameters))
    if orphans:
        out.append(
            f"the checkpoint's optimizer holds state for {', '.join(orphans[:6])}, which has no saved weight: "
            f"its optimizer and weights do not belong together"
        )
    if not saved.optimizer_files:
        out.append("the checkpoint has no optimizer files")
    for n in needs:
        if not n.trainable or n.name not in saved.parameters:
            continue
        for slot in saved.parameters[n.name].slots:
            if not any(intersect(a.whole, b.whole) for a in n.pieces for b in slot.pieces):
                continue
            if (n.name, slot.key) not in sources:
                out.append(
                    f"{n.name} trains in the new plan but the checkpoint has no optimizer state for it (it was "
                    f"frozen when saved?); freeze it again, or resume with checkpoints.load_optimizer: false"
                )
                break
    return sorted(set(out), key=out.index)


def count_placements(saved: SavedCheckpoint, needs: Sequence[Need], *, optimizer: bool) -> ResumeCount:
    """The counts of :class:`ResumeCount` for a mapping :func:`placement_problems` found complete."""
    placed = {n.name for n in needs}
    trained = {n.name for n in needs if n.trainable}
    keys: tuple[str, ...] = ()
    if optimizer and saved.optimizer_files:
        keys = (*sorted(saved.state_keys()), "step", *(("fp32 master",) if saved.has_fp32_master() else ()))
    saved_trained = {name for name, _ in saved.optimizer_sources()} if keys else set()
    return ResumeCount(
        parameters=len(placed),
        saved_parameters=len(saved.parameters),
        entries=len(trained) * len(keys),
        saved_entries=len(saved_trained & trained) * len(keys),
        entry_keys=keys,
        dropped=len(saved_trained - trained) * len(keys),
    )
