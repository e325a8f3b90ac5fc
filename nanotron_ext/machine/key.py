"""What a machine profile's times depend on (:class:`MachineKey`), the key a config asks for (:func:`key_for`), and
the key's JSON spelling (dicts as sorted pairs, so a key survives a round trip)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from nanotron_ext.config import PlannerConfig

__all__ = ["MachineKey", "jsonable", "key_for", "to_lists"]


@dataclass(frozen=True)
class MachineKey:
    """What a profile's times depend on. ``None`` is a wildcard (matches anything): the analytic default has
    only wildcards; a compute-only profile (``calibrate`` without torchrun) leaves ``pp`` and ``dp`` open."""

    model: tuple[tuple[str, Any], ...] | None = None  # ModelShape fields, the layer count left out
    micro_batch_size: int | None = None
    sequence_length: int | None = None
    dtype: str | None = None
    tp: int | None = None
    dp: int | None = None
    pp: int | None = None
    device: str | None = None  # "cpu", "cuda" (a name after a colon is shown, not compared)
    backend: str | None = None  # "gloo", "nccl"

    def differences(self, other: MachineKey) -> list[str]:
        """``field: this vs that`` for every field both set and disagree on (the device compared by type)."""
        out = []
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine is None or theirs is None:
                continue
            if f.name == "model":
                a, b = dict(mine), dict(theirs)
                out += [
                    f"model.{k}: {a.get(k)!r} vs {b.get(k)!r}"
                    for k in sorted(a.keys() | b.keys())
                    if a.get(k) != b.get(k)
                ]
            elif f.name == "device":
                if mine.split(":")[0] != theirs.split(":")[0]:
                    out.append(f"device: {mine!r} vs {theirs!r}")
            elif mine != theirs:
                out.append(f"{f.name}: {mine!r} vs {theirs!r}")
        return out


def key_for(
    cfg: PlannerConfig, *, device: str | None = None, backend: str | None = None, world: bool = True
) -> MachineKey:
    """The key a profile must have to price ``cfg`` (``world=False``: leave pp and dp open)."""
    shape = dataclasses.asdict(cfg.model)
    shape.pop("num_hidden_layers")
    model = tuple(sorted((k, jsonable(v)) for k, v in shape.items()))
    return MachineKey(
        model=model,
        micro_batch_size=cfg.run.micro_batch_size,
        sequence_length=cfg.run.sequence_length,
        dtype=cfg.run.dtype,
        tp=cfg.run.tp,
        dp=cfg.run.dp if world else None,
        pp=cfg.run.pp if world else None,
        device=device,
        backend=backend,
    )


def jsonable(value: Any) -> Any:
    """Lists for tuples and dicts as sorted pairs, so a key survives a JSON round trip unchanged."""
    if isinstance(value, dict):
        return tuple(sorted((k, jsonable(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(jsonable(v) for v in value)
    return value


def to_lists(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: to_lists(v) for k, v in value.items()}
    if (
        isinstance(value, tuple)
        and value
        and all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) for x in value)
    ):
        return {k: to_lists(v) for k, v in value}
    if isinstance(value, tuple):
        return [to_lists(v) for v in value]
    return value
