"""The plain data of a plan: stages, findings and the plan itself; they print, compare and serialise."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any, Literal

from nanotron_ext.blocks import role_of
from nanotron_ext.costs.memory_estimate import StageMemory
from nanotron_ext.machine.memory_limit import MemoryLimit
from nanotron_ext.partition.layout_string import split_text
from nanotron_ext.report import human_bytes, human_count, int_ranges, table

__all__ = ["Finding", "Plan", "Severity", "StagePlan"]

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Finding:
    """One problem with a plan.

    Attributes:
        severity: ``error`` (training would fail) or ``warning`` (it would run, badly).
        code: stable identifier, e.g. ``no-params``.
        stage: the PP rank concerned, or ``None`` for the whole plan.
        message: what is wrong and why.
        fix: what to change.
    """

    severity: Severity
    code: str
    stage: int | None
    message: str
    fix: str

    def __str__(self) -> str:
        where = f"stage {self.stage}" if self.stage is not None else "plan"
        return f"{self.severity.upper()} [{where}] {self.message}\n  fix: {self.fix}"


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage of a plan.

    Attributes:
        stage: PP rank.
        blocks: module paths of its blocks, in forward order.
        label: compact form, e.g. ``embedding, decoder.0-11``.
        params / trainable: parameter counts.
        cost: the strategy's cost of the stage (``Plan.unit``).
        share: the stage's fraction of the strategy's total cost.
        flops: training FLOPs per micro-batch (the yardstick every strategy is compared on).
        memory_bytes: estimated peak memory.
        memory: its breakdown (weights, gradients, optimizer, activations × in flight, temporaries, overhead).
    """

    stage: int
    blocks: tuple[str, ...]
    label: str
    params: int
    trainable: int
    cost: float
    share: float
    flops: float
    memory_bytes: float
    memory: StageMemory | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Plan:
    """The block→stage assignment of one strategy, with its stages and findings."""

    strategy: str
    pp: int
    engine: str
    n_micro_batches: int
    unit: str
    block_names: tuple[str, ...]
    block_ranks: tuple[int, ...]
    block_costs: tuple[float, ...] = field(compare=False)
    stages: tuple[StagePlan, ...] = field(compare=False)
    findings: tuple[Finding, ...] = field(compare=False, default=())
    block_flops: tuple[float, ...] = field(compare=False, default=())
    #: The memory each stage must fit in (``memory_cap_gib`` or the device's); None: none known.
    memory_limit: MemoryLimit | None = field(compare=False, default=None)
    #: The faster split that the memory ruled out, block by block; None when this one is the fastest.
    over_memory_ranks: tuple[int, ...] | None = field(compare=False, default=None)

    @cached_property
    def optimum_flops(self) -> float:
        """The smallest slowest stage (training FLOPs) any contiguous split reaches; computed when first asked."""
        from nanotron_ext.partition.schedule_aware import slowest_stage_optimum

        if not self.block_flops or self.pp > len(self.block_flops):
            return 0.0
        return slowest_stage_optimum(self.block_flops, self.pp)

    @property
    def ok(self) -> bool:
        """True when no finding is an error."""
        return not any(f.severity == "error" for f in self.findings)

    @property
    def slowest_flops(self) -> float:
        return max(s.flops for s in self.stages)

    @property
    def vs_optimum(self) -> float:
        """Slowest stage ÷ the best any contiguous split can do (1.0 is optimal)."""
        return self.slowest_flops / self.optimum_flops if self.optimum_flops else float("nan")

    @property
    def spread(self) -> float:
        """(slowest − fastest) ÷ mean stage, in training FLOPs."""
        loads = [s.flops for s in self.stages]
        mean = sum(loads) / len(loads)
        return (max(loads) - min(loads)) / mean if mean else 0.0

    @property
    def bubble_estimate(self) -> float:
        """Idle fraction of a step: ``1 − m·Σt / (p·((m−1)·max t + Σt))``.

        With equal stages this is ``(p−1)/(m+p−1)`` (Narayanan et al. 2021); an unbalanced split stretches
        the steady state to the slowest stage.
        """
        loads = [s.flops for s in self.stages]
        m, p, total = self.n_micro_batches, self.pp, sum(loads)
        step = (m - 1) * max(loads) + total
        return 1.0 - m * total / (p * step) if step else 0.0

    @property
    def verdict(self) -> str:
        """``OK`` or ``INVALID``, with the findings' codes and the stages each names, as ranges:
        ``INVALID (no-params@1)``, ``INVALID (few-micro-batches, empty-stage@4-99)``."""
        stages: dict[str, list[int]] = {}
        for f in self.findings:
            stages.setdefault(f.code, []).extend([] if f.stage is None else [f.stage])
        codes = ", ".join(f"{code}@{int_ranges(ks)}" if ks else code for code, ks in stages.items())
        return ("OK" if self.ok else "INVALID") + (f" ({codes})" if codes else "")

    @property
    def split_text(self) -> str:
        """The split as a layout string (``E,t|t,L``), or stage labels where a block has no layout symbol."""
        return split_text(self.block_names, self.block_ranks, self.pp)

    def stage_map(self) -> str:
        """``0-4|5-6``: the block index range of each stage (``-`` for an empty one)."""
        parts = []
        for k in range(self.pp):
            idx = [i for i, r in enumerate(self.block_ranks) if r == k]
            parts.append("-" if not idx else (f"{idx[0]}" if len(idx) == 1 else f"{idx[0]}-{idx[-1]}"))
        return "|".join(parts)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for stage, out in zip(self.stages, d["stages"]):
            out["memory"] = stage.memory.to_dict() if stage.memory is not None else None
        d.update(
            ok=self.ok,
            optimum_flops=self.optimum_flops,
            slowest_flops=self.slowest_flops,
            vs_optimum=self.vs_optimum,
            spread=self.spread,
            bubble_estimate=self.bubble_estimate,
            vocab_shards=self.vocab_shards,
        )
        return d

    @property
    def vocab_shards(self) -> int:
        """Vocabulary-shard blocks in the model (1: Nanotron's lm_head, cast and loss)."""
        return sum(1 for name in self.block_names if role_of(name) == "vocab_shard") or 1

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def table(self) -> str:
        """Per-stage table: blocks, parameters, trainable, share of cost, memory, verdict."""
        errors = {f.stage for f in self.findings if f.severity == "error"}
        rows = [
            [
                s.stage,
                s.label,
                human_count(s.params),
                human_count(s.trainable),
                f"{100 * s.share:.1f}%",
                human_count(s.flops),
                human_bytes(s.memory_bytes),
                "ERROR" if s.stage in errors else "ok",
            ]
            for s in self.stages
        ]
        head = ["stage", "blocks", "params", "trainable", f"share ({self.unit})", "train FLOPs/mb", "memory", "verdict"]
        return table(head, rows)

    def memory_table(self) -> str:
        """Per-stage peak-memory breakdown: peak = weights + gradients + optimizer + buffers + overhead
        + the larger of (activations × in flight + pipeline temporaries + zb1p's deferred W state × deferred W)
        and the optimizer step's temporaries."""
        rows = [
            [
                s.stage,
                human_bytes(m.weights),
                human_bytes(m.gradients),
                human_bytes(m.optimizer),
                human_bytes(m.buffers),
                human_bytes(m.activations),
                m.in_flight,
                human_bytes(m.temporaries),
                human_bytes(m.overhead),
                human_bytes(m.peak),
                m.peak_at,
            ]
            for s in self.stages
            if (m := s.memory) is not None
        ]
        head = [
            "stage",
            "weights",
            "gradients",
            "optimizer",
            "buffers",
            "activations/mb",
            "in flight",
            "temporaries",
            "overhead",
            "peak",
            "peak at",
        ]
        mems = [m for s in self.stages if (m := s.memory) is not None]
        if any(m.deferred for m in mems):  # zb1p: the deferred weight-gradient passes' state, before the overhead
            head[8:8] = ["W state/mb", "deferred W"]
            for row, m in zip(rows, mems):
                row[8:8] = [human_bytes(m.weight_pending), m.deferred]
        if self.memory_limit is not None:  # each peak against the memory it must fit in
            head += ["of limit", "margin"]
            for row, m in zip(rows, mems):
                margin = self.memory_limit.bytes - m.peak
                row += [
                    f"{m.peak / self.memory_limit.bytes:.0%}",
                    ("+" if margin >= 0 else "-") + human_bytes(abs(margin)),
                ]
        return table(head, rows)
