"""One block's measured seconds in a machine profile (:class:`BlockCost`), by stage position where an in-run profile
measured it there (:class:`PositionCost`), and the signature that finds a block's figures (:func:`block_signature`)."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Literal, get_args

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.errors import ConfigError

__all__ = ["POSITIONS", "BlockCost", "Position", "PositionCost", "block_signature", "nonnegative", "stage_position"]


def block_signature(block: BlockInfo, *, input_grad: bool) -> str:
    """What a block's time depends on within one key: role, size, which parameters train, whether its input
    needs a gradient. Identical decoder layers share a signature (a readable role, then a short hash)."""
    marker = ".pp_block."
    flags = sorted((p.name.split(marker, 1)[-1], bool(p.trainable)) for p in block.parameters)
    if not flags and block.params:
        flags = [("*", block.trainable > 0)]
    digest = hashlib.sha256(json.dumps([block.role, block.params, flags, bool(input_grad)]).encode()).hexdigest()
    return f"{block.role}:{digest[:12]}"


Position = Literal["first", "middle", "last"]
#: Where a stage sits in the pipeline: an in-run profile prices a block by the position it ran at.
POSITIONS: tuple[str, ...] = get_args(Position)


def stage_position(stage: int, pp: int) -> Position | None:
    """``first``, ``middle`` or ``last`` for stage ``stage`` of ``pp``; None at pp = 1 (no neighbour to have)."""
    if pp <= 1:
        return None
    return "first" if stage == 0 else "last" if stage == pp - 1 else "middle"


@dataclass(frozen=True)
class PositionCost:
    """A block's seconds on a stage of one position, as an in-run profile measured them there: inside a pipeline a
    stage's neighbours run beside it, and how long its activations wait for their backward depends on where it sits
    (measured on the SmolLM shape at pp=2: a decoder layer's forward + backward 52.4 ms on the first stage, 41.2 on
    the last)."""

    position: Position
    forward: float
    backward: float
    backward_weight: float | None = None


@dataclass(frozen=True)
class BlockCost:
    """Measured seconds of one distinct block: forward and backward per micro-batch, update once per step.

    ``backward_weight``: the weight-gradient part of ``backward`` (zb1p's deferred ``W``), when measured;
    None splits ``backward`` by FLOPs (:func:`nanotron_ext.machine.pricing.weight_part`). ``spread``: how far each
    of the three could move, a fraction (:func:`nanotron_ext.stats.fastest_spread`); None: not measured.
    ``positions``: its seconds by stage position where measured there (an in-run profile); a position it did not
    run at takes ``forward``, ``backward`` and ``backward_weight``, its mean over the positions it ran at.
    """

    signature: str
    forward: float
    backward: float
    update: float = 0.0
    backward_weight: float | None = None
    spread: tuple[float, float, float] | None = None
    positions: tuple[PositionCost, ...] = ()

    def at(self, position: str | None) -> tuple[float, float, float | None]:
        """``(forward, backward, backward_weight)`` on a stage of ``position`` (None: the mean)."""
        found = next((p for p in self.positions if p.position == position), None)
        if found is None:
            return self.forward, self.backward, self.backward_weight
        return found.forward, found.backward, found.backward_weight

    def check(self) -> None:
        """Raise unless every time is >= 0, the W within its backward, the spread three fractions, and each
        position figure a known position once.

        Raises:
            ConfigError: naming the figure and what it must be.
        """
        for name in ("forward", "backward", "update"):
            nonnegative(f"blocks[{self.signature}].{name}", getattr(self, name))
        if self.backward_weight is not None:
            nonnegative(f"blocks[{self.signature}].backward_weight", self.backward_weight)
            if self.backward_weight > self.backward:
                raise ConfigError(
                    f"machine profile: blocks[{self.signature}].backward_weight={self.backward_weight!r} "
                    f"exceeds its backward={self.backward!r}; it is the weight-gradient part of the "
                    "backward (null: split by FLOPs)"
                )
        if self.spread is not None and len(self.spread) != 3:
            raise ConfigError(
                f"machine profile: blocks[{self.signature}].spread={list(self.spread)!r} must be three "
                "fractions (forward, backward, update), or null"
            )
        for name, value in zip(("forward", "backward", "update"), self.spread or ()):
            nonnegative(f"blocks[{self.signature}].spread of its {name}", value, "a fraction")
        seen: set[str] = set()
        for p in self.positions:
            where = f"blocks[{self.signature}].positions[{p.position}]"
            if p.position not in POSITIONS or p.position in seen:
                raise ConfigError(
                    f"machine profile: {where}: a position is one of {', '.join(POSITIONS)}, each at most once"
                )
            seen.add(p.position)
            for name in ("forward", "backward"):
                nonnegative(f"{where}.{name}", getattr(p, name))
            if p.backward_weight is not None:
                nonnegative(f"{where}.backward_weight", p.backward_weight)
                if p.backward_weight > p.backward:
                    raise ConfigError(
                        f"machine profile: {where}.backward_weight={p.backward_weight!r} exceeds its "
                        f"backward={p.backward!r}; it is the weight-gradient part of the backward"
                    )


def nonnegative(name: str, value: float, unit: str = "seconds") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"machine profile: {name}={value!r} must be a finite number >= 0 ({unit})")
