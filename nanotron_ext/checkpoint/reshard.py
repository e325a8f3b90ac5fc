"""Fill the new plan's tensors from a checkpoint saved under another plan: weights, optimizer states (Adam's
moments and step, Nanotron's fp32 master weights, each parameter group's hyperparameters) and the learning-rate
schedule. Plain torch: the live optimizer is described by :class:`LiveOptimizer`, which the launcher builds from
Nanotron's optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nanotron_ext.checkpoint.boxes import Box, intersect, volume
from nanotron_ext.checkpoint.placement import Need
from nanotron_ext.checkpoint.saved import SavedCheckpoint, Slot
from nanotron_ext.errors import CheckpointError

__all__ = ["LiveEntry", "LiveOptimizer", "fill_weight", "optimizer_state_dict", "scheduler_state_dict"]


def _shift(box: Box, origin: Box, to: Box) -> Box:
    return tuple((a - f + t, b - f + t) for (a, b), (f, _), (t, _) in zip(box, origin, to))


def _index(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def _fill(out: torch.Tensor, need: Need, slots: Sequence[Slot], read: Callable[[Slot, Box], torch.Tensor]) -> None:
    """Copy every element ``need`` holds from the saved slot that holds it; check that each was copied once."""
    copied = 0
    for slot in slots:
        for mine in need.pieces:
            for theirs in slot.pieces:
                common = intersect(mine.whole, theirs.whole)
                if common is None:
                    continue
                out[_index(_shift(common, mine.whole, mine.local))] = read(
                    slot, _shift(common, theirs.whole, theirs.local)
                ).to(out.dtype)
                copied += volume(common)
    wanted = sum(volume(p.whole) for p in need.pieces)
    if copied != wanted:  # placement_problems rules this out; a mismatch here is a bug, never silent state
        raise RuntimeError(f"{need.local_name}: {copied} of {wanted} element(s) copied from the checkpoint")


def fill_weight(saved: SavedCheckpoint, need: Need, out: torch.Tensor) -> None:
    """Load ``need``'s weight into ``out`` (its live tensor), reading only the bytes it holds."""
    _fill(out, need, saved.parameters[need.name].slots, saved.read_weight)


def _optimizer_tensor(saved: SavedCheckpoint, need: Need, key: str) -> torch.Tensor:
    """One optimizer state tensor (or the fp32 master, ``key="fp32"``) of ``need``, in its live (tp-local) shape."""
    sources = saved.optimizer_sources()
    parts: dict[int | None, torch.Tensor] = {}

    def read(slot: Slot, box: Box) -> torch.Tensor:
        if slot.key not in parts:
            parts[slot.key] = saved.optimizer_part(sources[(need.name, slot.key)], key, slot.local_shape)
        return parts[slot.key][_index(box)]

    out = torch.empty(need.local_shape, dtype=torch.float32)
    _fill(out, need, saved.parameters[need.name].slots, read)
    return out


def _step(saved: SavedCheckpoint, need: Need) -> Any:
    """Adam's step of ``need``: every saved part it is assembled from must have taken the same number."""
    sources = saved.optimizer_sources()
    steps = {
        float(saved.step_of(sources[(need.name, s.key)]))
        for s in saved.parameters[need.name].slots
        if (need.name, s.key) in sources and any(intersect(a.whole, b.whole) for a in need.pieces for b in s.pieces)
    }
    if len(steps) != 1:
        raise CheckpointError(
            f"{need.name}: its saved parts have taken different numbers of optimizer steps ({sorted(steps)}); "
            f"the checkpoint mixes files of different steps"
        )
    slot = next(s for s in saved.parameters[need.name].slots if (need.name, s.key) in sources)
    return saved.step_of(sources[(need.name, slot.key)]).clone()


@dataclass(frozen=True)
class LiveEntry:
    """One parameter of the live optimizer: its index in the optimizer's ``state_dict``, the name the optimizer
    gives it, the :class:`Need` it is, and (under ZeRO-1) the flat range ``[start, end)`` this dp rank updates."""

    index: int
    name: str
    need: Need
    flat_range: tuple[int, int] | None = None


@dataclass(frozen=True)
class LiveOptimizer:
    """What the new rank's optimizer expects: its entries, and each parameter group's indices and current
    hyperparameters (``state_dict()["param_groups"]``), and whether it keeps fp32 master weights."""

    entries: tuple[LiveEntry, ...]
    param_groups: tuple[dict[str, Any], ...]
    fp32_master: bool


def _live(tensor: torch.Tensor, entry: LiveEntry) -> torch.Tensor:
    if entry.flat_range is None:
        return tensor
    start, end = entry.flat_range
    return tensor.reshape(-1)[start:end].clone()


def optimizer_state_dict(saved: SavedCheckpoint, live: LiveOptimizer) -> dict[str, Any]:
    """The ``state_dict`` the live optimizer loads: each entry's state from the saved parts it holds, each group's
    hyperparameters from the group its parameters were saved in.

    Raises:
        CheckpointError: two parameters the new plan groups together were saved with different hyperparameters, or
            the optimizer changed kind (its groups name other hyperparameters than the saved ones).
    """
    sources = saved.optimizer_sources()
    keys = sorted(saved.state_keys())
    state: dict[int, dict[str, Any]] = {}
    for entry in live.entries:
        state[entry.index] = {key: _live(_optimizer_tensor(saved, entry.need, key), entry) for key in keys}
        state[entry.index]["step"] = _step(saved, entry.need)
    by_index = {e.index: e for e in live.entries}
    groups = []
    for group in live.param_groups:
        found = []
        for index in group["params"]:
            need = by_index[index].need
            slot = next(s for s in saved.parameters[need.name].slots if (need.name, s.key) in sources)
            found.append(saved.group_of(sources[(need.name, slot.key)]))
        new = dict(group)
        if found:
            if any(f != found[0] for f in found):
                raise CheckpointError(
                    f"parameters the new plan puts in one optimizer group were saved with different "
                    f"hyperparameters ({found[0]} and {next(f for f in found if f != found[0])})"
                )
            # The scheduler adds initial_lr to a group; the live one does not exist yet when the optimizer loads.
            live_keys, saved_keys = set(group) - {"params", "initial_lr"}, set(found[0]) - {"initial_lr"}
            if live_keys != saved_keys:
                raise CheckpointError(
                    f"the optimizer changed kind: its groups hold {sorted(live_keys)}, the "
                    f"checkpoint's {sorted(saved_keys)}; resume with the optimizer it was saved "
                    f"with, or with checkpoints.load_optimizer: false"
                )
            new.update(found[0])
        groups.append(new)
    out: dict[str, Any] = {"state": state, "param_groups": groups, "names": {e.index: e.name for e in live.entries}}
    if live.fp32_master:
        if not saved.has_fp32_master():
            raise CheckpointError(
                "the new run keeps fp32 master weights (optimizer.accumulate_grad_in_fp32: true) but the "
                "checkpoint has none; resume with the setting it was saved with"
            )
        out["gradient_accumulator"] = {e.name: _live(_optimizer_tensor(saved, e.need, "fp32"), e) for e in live.entries}
    return out


def scheduler_state_dict(
    saved: SavedCheckpoint, template: dict[str, Any], group_needs: Sequence[Sequence[Need]]
) -> dict[str, Any]:
    """The live scheduler's ``state_dict``: the saved step, and each group's base and last learning rate from the
    group its parameters were saved in.

    Args:
        template: the live scheduler's own ``state_dict()``.
        group_needs: the parameters of each of the live optimizer's groups, in group order.
    """
    shared, per_name = saved.schedule()
    out = {**template, **shared}
    base, last = list(template["base_lrs"]), list(template["_last_lr"])
    for g, needs in enumerate(group_needs):
        rates = {per_name[n.name] for n in needs if n.name in per_name}
        if len(rates) > 1:
            raise CheckpointError(
                f"parameters the new plan groups together were saved with different learning rates ({sorted(rates)})"
            )
        if rates:
            base[g], last[g] = rates.pop()
    out["base_lrs"], out["_last_lr"] = base, last
    return out
