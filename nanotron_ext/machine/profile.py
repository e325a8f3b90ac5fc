"""A machine profile: what one training step costs on one machine, as plain data (versioned JSON).

It holds, for one model shape, dtype, device, backend and world layout (:class:`MachineKey`):

* ``blocks``: measured forward, backward and update seconds of each distinct block (:class:`BlockCost`, found
  by its :func:`block_signature`; :mod:`nanotron_ext.machine.block_cost`), and ``rates``: training FLOP/s per block
  role, for blocks not measured;
* ``links``: p2p between pipeline neighbours as latency + bytes ÷ bandwidth (:class:`Link`); ``overhead``: the
  engine's per-call costs (:class:`EngineOverhead`); ``dp_allreduce`` / ``tied_allreduce``: the gradient syncs.

A profile made for one key is refused for another (:meth:`MachineKey.differences` names what differs). The
analytic default (:mod:`nanotron_ext.machine.analytic`) has a key of wildcards (``None``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from nanotron_ext.errors import ConfigError
from nanotron_ext.machine.block_cost import (
    POSITIONS,
    BlockCost,
    PositionCost,
    block_signature,
    nonnegative,
    stage_position,
)
from nanotron_ext.machine.key import MachineKey, jsonable, key_for, to_lists

__all__ = [
    "FORMAT_VERSION",
    "METHODS",
    "POSITIONS",
    "BlockCost",
    "Collective",
    "EngineOverhead",
    "Link",
    "MachineKey",
    "MachineProfile",
    "PositionCost",
    "block_signature",
    "key_for",
    "load_machine",
    "stage_position",
]

#: Bump when the JSON layout changes; older files are refused with the command that re-measures them.
FORMAT_VERSION = 1

Method = Literal["standalone", "in-run"]
#: How a profile's blocks were timed: alone (``calibrate``) or inside the engine's steps (``calibrate --in-run``).
METHODS: tuple[str, ...] = get_args(Method)


@dataclass(frozen=True)
class Link:
    """p2p from pipeline stage ``src`` to ``dst`` (``-1``: any): ``latency + bytes / bytes_per_second``.
    ``spread``: how far the largest transfer calibrated could move, as a fraction (None: not measured)."""

    src: int
    dst: int
    latency: float
    bytes_per_second: float
    spread: float | None = None

    def time(self, n_bytes: float) -> float:
        return self.latency + n_bytes / self.bytes_per_second


@dataclass(frozen=True)
class Collective:
    """An all-reduce over ``n`` ranks: ``latency + 2 (n − 1) / n × bytes / bus_bytes_per_second`` (a ring's
    traffic; ``bus`` bandwidth in NCCL-tests' sense, so one figure fits every ``n``)."""

    latency: float
    bus_bytes_per_second: float

    def time(self, n_bytes: float, n: int) -> float:
        if n <= 1:
            return 0.0
        return self.latency + 2.0 * (n - 1) / n * n_bytes / self.bus_bytes_per_second


@dataclass(frozen=True)
class EngineOverhead:
    """Seconds the engine spends around the compute: per ``PipelineBlock`` forward or backward call, and per
    send or receive it posts (metadata, buffers, bookkeeping)."""

    block_call: float = 0.0
    send: float = 0.0
    recv: float = 0.0


@dataclass(frozen=True)
class MachineProfile:
    """What one step costs on one machine (see the module docstring). Plain data: prints, compares, saves.

    Attributes:
        name: what a table header shows, e.g. ``H100 SXM (analytic)`` or ``calibrated: cpu, gloo``.
        source: where the numbers come from (a citation, or the command that measured them).
        key: what the times depend on; pricing another key is refused.
        flops_per_second: training FLOP/s of a block whose role has no rate in ``rates``.
        rates: training FLOP/s per block role, fitted from the measured blocks.
        blocks: measured blocks by signature.
        links: p2p between stages; empty: not measured (transfers cost nothing, and headers say so).
        overhead: the engine's per-call costs.
        dp_allreduce / tied_allreduce: the gradient syncs; None: not priced.
        memory_bytes_per_second: device memory bandwidth that prices the optimizer step of a block that was not
            measured (:func:`~nanotron_ext.costs.analytic.update_bytes` per trainable parameter); None: not priced.
        device_memory_bytes: each rank's device memory, as CUDA reports its total; a stage whose estimated peak
            is above it does not fit (:mod:`nanotron_ext.plan.fit`). None: unknown (a CPU), no limit.
        notes: what was overridden after measuring (``--tflops``, ``--p2p-gbps``), shown in headers.
        method: how the blocks were timed: ``standalone`` (``calibrate``: each block alone, its fastest round) or
            ``in-run`` (``calibrate --in-run``: inside the engine's training steps, the mean op, waits left out).
    """

    name: str
    source: str
    key: MachineKey = field(default_factory=MachineKey)
    flops_per_second: float = 400e12
    rates: tuple[tuple[str, float], ...] = ()
    blocks: tuple[BlockCost, ...] = ()
    links: tuple[Link, ...] = ()
    overhead: EngineOverhead = field(default_factory=EngineOverhead)
    dp_allreduce: Collective | None = None
    tied_allreduce: Collective | None = None
    memory_bytes_per_second: float | None = None
    device_memory_bytes: float | None = None
    notes: tuple[str, ...] = ()
    method: Method = "standalone"
    version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(
                f"machine profile: method={self.method!r} must be one of {', '.join(METHODS)} (how its "
                f"blocks were timed)"
            )
        _positive("flops_per_second", self.flops_per_second)
        for name in ("memory_bytes_per_second", "device_memory_bytes"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        for role, rate in self.rates:
            _positive(f"rates[{role}]", rate)
        for b in self.blocks:
            b.check()
        for link in self.links:
            nonnegative(f"link {link.src}->{link.dst} latency", link.latency)
            _positive(f"link {link.src}->{link.dst} bytes_per_second", link.bytes_per_second)
            if link.spread is not None:
                nonnegative(f"link {link.src}->{link.dst} spread", link.spread, "a fraction")
        for name in ("block_call", "send", "recv"):
            nonnegative(f"overhead.{name}", getattr(self.overhead, name))
        for name in ("dp_allreduce", "tied_allreduce"):
            c = getattr(self, name)
            if c is not None:
                nonnegative(f"{name}.latency", c.latency)
                _positive(f"{name}.bus_bytes_per_second", c.bus_bytes_per_second)

    # --- lookups -----------------------------------------------------------------------------------------

    def block(self, signature: str) -> BlockCost | None:
        return next((b for b in self.blocks if b.signature == signature), None)

    def rate(self, role: str) -> float:
        """Training FLOP/s of a block of ``role`` that was not measured."""
        return dict(self.rates).get(role, self.flops_per_second)

    def p2p_time(self, n_bytes: float, n_tensors: int = 1, cut: int | None = None) -> float:
        """One micro-batch's transfer across a cut: ``n_bytes`` in ``n_tensors`` tensors, each tensor paying the
        latency and its posting (Nanotron moves them one communication at a time); 0 when no link is known.

        The link is that of ``cut`` (between stages ``cut`` and ``cut + 1``: the slower of its two directions, the
        activation going forward and its gradient coming back), else any link that names no stage (``-1``); with
        neither, or ``cut=None``, the slowest link.
        """
        if not self.links or n_tensors < 1:
            return 0.0
        links = self.cut_links(cut)
        slowest = max(links, key=lambda link: link.time(n_bytes))
        per_tensor = slowest.latency + self.overhead.send + self.overhead.recv
        return n_tensors * per_tensor + n_bytes / slowest.bytes_per_second

    def cut_links(self, cut: int | None) -> tuple[Link, ...]:
        """The links a transfer across ``cut`` may take (see :meth:`p2p_time`)."""
        if cut is None:
            return self.links
        pair = {cut, cut + 1}
        own = tuple(link for link in self.links if {link.src, link.dst} == pair)
        return own or tuple(link for link in self.links if link.src == link.dst == -1) or self.links

    def check_key(self, expected: MachineKey, *, origin: str) -> None:
        """Raise unless this profile can price ``expected``.

        Raises:
            ConfigError: naming each field that differs and how to get a matching profile.
        """
        diffs = self.key.differences(expected)
        run = [d for d in diffs if d.startswith(("device:", "backend:"))]
        if run:  # measured where this run does not train: blocks timed on a GPU price nothing on a CPU
            where = f"--device {expected.device.split(':')[0]} " if expected.device else ""
            raise ConfigError(
                f"machine profile {origin} was measured on another device or backend than this run ("
                f"{'; '.join(run)}; profile vs run); its times would not predict this run. Measure one where it "
                f"trains with `nanotron-ext calibrate CONFIG {where}--out FILE` (under torchrun for the links), or "
                f"drop --machine / nanotron_ext.machine to plan with the analytic model"
            )
        if diffs:
            raise ConfigError(
                f"machine profile {origin} was measured for another setup ({'; '.join(diffs)}; profile vs "
                f"config); its times would not predict this run. Measure one for this config with "
                f"`nanotron-ext calibrate CONFIG --out FILE` (under torchrun for the links), or drop "
                f"--machine / nanotron_ext.machine to plan with the analytic model"
            )

    # --- overrides and text ------------------------------------------------------------------------------

    def with_flop_rate(self, flops_per_second: float | None) -> MachineProfile:
        """Every block priced by one FLOP rate (the profile's own when None); measured block times dropped."""
        rate = self.flops_per_second if flops_per_second is None else flops_per_second
        _positive("tflops", rate / 1e12, unit="TFLOP/s")
        return dataclasses.replace(
            self,
            flops_per_second=rate,
            rates=(),
            blocks=(),
            notes=(*self.notes, f"compute: FLOP-rate model at {rate / 1e12:g} TFLOP/s"),
        )

    def with_p2p_bandwidth(self, gbps: float) -> MachineProfile:
        """Every link at ``gbps`` GB/s, keeping the slowest link's latency (0 when none was known)."""
        _positive("p2p_gbps", gbps, unit="GB/s")
        latency = max((link.latency for link in self.links), default=0.0)
        return dataclasses.replace(
            self, links=(Link(-1, -1, latency, gbps * 1e9),), notes=(*self.notes, f"p2p overridden: {gbps:g} GB/s")
        )

    def with_blocks(self, blocks: Sequence[BlockCost], note: str) -> MachineProfile:
        """Measured blocks added (replacing any with the same signature)."""
        new = {b.signature: b for b in self.blocks} | {b.signature: b for b in blocks}
        return dataclasses.replace(self, blocks=tuple(new.values()), notes=(*self.notes, note))

    def describe(self) -> str:
        """One line for a table header: the machine, its compute, its p2p."""
        if self.blocks:
            compute = f"{len(self.blocks)} measured blocks" + (" (in-run)" if self.method == "in-run" else "")
        else:
            compute = f"{self.key.dtype or 'bf16'} at {self.flops_per_second / 1e12:.3g} TFLOP/s"
        if self.links:
            slow = max(self.links, key=lambda link: link.time(1e6))
            p2p = f"p2p {slow.bytes_per_second / 1e9:.3g} GB/s + {slow.latency * 1e6:.3g} µs"
        else:
            p2p = "p2p not measured (priced 0: calibrate under torchrun, or --p2p-gbps)"
        if self.memory_bytes_per_second is not None and not self.blocks:
            compute += f", optimizer step at {self.memory_bytes_per_second / 1e12:.3g} TB/s"
        if self.device_memory_bytes is not None:
            p2p += f", {self.device_memory_bytes / 2**30:.4g} GiB per GPU"
        notes = f" [{'; '.join(self.notes)}]" if self.notes else ""
        return f"{self.name}: {compute}, {p2p}{notes}"

    # --- JSON --------------------------------------------------------------------------------------------

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["key"]["model"] = None if self.key.model is None else to_lists(dict(self.key.model))
        data["rates"] = dict(self.rates)
        return json.dumps(data, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, origin: str = "<json>") -> MachineProfile:
        """Parse a profile.

        Raises:
            ConfigError: not JSON, another format version, a missing or malformed field (named).
        """
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ConfigError(
                f"machine profile {origin} is not JSON ({exc}); write it with "
                f"`nanotron-ext calibrate CONFIG --out {origin}`"
            ) from exc
        if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
            found = data.get("version") if isinstance(data, dict) else type(data).__name__
            raise ConfigError(
                f"machine profile {origin} has format version {found!r}, this nanotron_ext reads "
                f"{FORMAT_VERSION}; measure it again with `nanotron-ext calibrate CONFIG --out FILE`"
            )
        try:
            key = dict(data["key"])
            if key.get("model") is not None:
                key["model"] = tuple(sorted((k, jsonable(v)) for k, v in key["model"].items()))
            return cls(
                name=str(data["name"]),
                source=str(data["source"]),
                key=MachineKey(**key),
                flops_per_second=float(data["flops_per_second"]),
                rates=tuple(sorted((str(k), float(v)) for k, v in data["rates"].items())),
                blocks=tuple(
                    BlockCost(
                        **{
                            **b,
                            "spread": None if b.get("spread") is None else tuple(b["spread"]),
                            "positions": tuple(PositionCost(**p) for p in b.get("positions", ())),
                        }
                    )
                    for b in data["blocks"]
                ),
                links=tuple(Link(**link) for link in data["links"]),
                overhead=EngineOverhead(**data["overhead"]),
                dp_allreduce=None if data["dp_allreduce"] is None else Collective(**data["dp_allreduce"]),
                tied_allreduce=None if data["tied_allreduce"] is None else Collective(**data["tied_allreduce"]),
                memory_bytes_per_second=data.get("memory_bytes_per_second"),
                device_memory_bytes=data.get("device_memory_bytes"),
                notes=tuple(data.get("notes", ())),
                method=data.get("method", "standalone"),  # profiles written before in-run ones: timed alone
            )
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise ConfigError(f"machine profile {origin}: {exc}") from exc
            raise ConfigError(
                f"machine profile {origin} is malformed ({type(exc).__name__}: {exc}); write it "
                f"with `nanotron-ext calibrate CONFIG --out FILE`"
            ) from exc

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")


def load_machine(path: str | Path) -> MachineProfile:
    """Read a profile file.

    Raises:
        ConfigError: the file is missing or unreadable, or not a profile (see :meth:`MachineProfile.from_json`).
    """
    p = Path(path).expanduser()
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(
            f"machine profile {str(path)!r} cannot be read ({exc.strerror or exc}); write one with "
            f"`nanotron-ext calibrate CONFIG --out {path}`"
        ) from exc
    return MachineProfile.from_json(text, origin=str(path))


def _positive(name: str, value: float, *, unit: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name}={value!r} must be a positive, finite number{' of ' + unit if unit else ''}")
