"""Does a plan fit the memory it has? The limit a config names, the verdict on a stage, and fixes, computed.

The limit is :func:`nanotron_ext.machine.memory_limit` (``memory_cap_gib``, else the device's memory).

A stage whose estimated peak is above a cap, or above a device's memory, is an error: under ``memory_runtime: gpu``
a Llama or a Qwen2 is counted for Nanotron's GPU code (:func:`nanotron_ext.costs.gpu_memory.gpu_path`). Starcoder2
and LlaMoE are counted there as the CPU runtime runs them, which saves more than flash-attn and fused RMSNorm
(:data:`GPU_ACTIVATION_OVERCOUNT`): such a stage is an error only when it is over even with its in-flight
activations cut by that share, and a warning ("may still fit") between the two. Each fix is a changed config
planned again (by ``make_plan``), with the largest stage peak it gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from nanotron_ext.config import PlannerConfig
from nanotron_ext.costs.analytic import GIB
from nanotron_ext.costs.gpu_memory import gpu_path
from nanotron_ext.costs.memory_estimate import StageMemory
from nanotron_ext.machine.memory_limit import MemoryLimit
from nanotron_ext.report import human_bytes
from nanotron_ext.schedule import too_few_micro_batches

__all__ = [
    "FIT_POINTER",
    "GPU_ACTIVATION_OVERCOUNT",
    "MemoryFix",
    "Overrun",
    "fix_candidates",
    "fix_text",
    "heads_split",
    "overrun",
]

#: The share of a stage's in-flight activations the CPU runtime's count may put above Nanotron's GPU path, for the
#: families not counted for that path (Starcoder2, LlaMoE): the counted families' decoder layers keep 13–22.5 % less
#: on the GPU path (docs/memory.md). A stage over its device's memory by less than this share of them may still fit.
GPU_ACTIVATION_OVERCOUNT = 0.23


@dataclass(frozen=True)
class Overrun:
    """A stage over its limit: by how much, and whether that is certain (``error``) or within the estimate's
    over-count on a GPU (``warning``)."""

    stage: int
    peak: float
    limit: MemoryLimit
    severity: Literal["error", "warning"]

    @property
    def margin(self) -> float:
        """Limit − peak, bytes (negative: over)."""
        return self.limit.bytes - self.peak

    def message(self) -> str:
        text = (
            f"stage {self.stage} needs about {human_bytes(self.peak)}, over {self.limit} by {human_bytes(-self.margin)}"
        )
        if self.severity == "warning":
            text += (
                f"; it may still fit: the estimate counts the CPU runtime's activations, about "
                f"{GPU_ACTIVATION_OVERCOUNT:.0%} more than Nanotron's GPU path (flash-attn) keeps"
            )
        return text


@dataclass(frozen=True)
class MemoryFix:
    """One change to the config, in its own terms, and the largest stage peak the plan then has; or, with
    ``any_split``, a lower bound of the largest stage of every split (none fits: no plan to price)."""

    change: str
    peak: float
    fits: bool
    any_split: bool = False

    def __str__(self) -> str:
        if self.any_split:
            return (
                f"{self.change} (still over with any split: its largest stage needs at least {human_bytes(self.peak)})"
            )
        return f"{self.change} (largest stage {human_bytes(self.peak)}{'' if self.fits else ', still over'})"


def overrun(stage: int, memory: StageMemory, limit: MemoryLimit | None, cfg: PlannerConfig) -> Overrun | None:
    """The stage's :class:`Overrun`, or None when its peak fits ``limit`` (or there is none)."""
    if limit is None or memory.peak <= limit.bytes:
        return None
    severity: Literal["error", "warning"] = "error"
    counted_high = cfg.ext.memory_runtime == "gpu" and not gpu_path(cfg.model, cfg.ext.memory_runtime)
    if limit.kind == "device" and counted_high and memory.peak_at == "pipeline":
        if memory.peak - GPU_ACTIVATION_OVERCOUNT * memory.pipeline_activations <= limit.bytes:
            severity = "warning"
    return Overrun(stage, memory.peak, limit, severity)


def fix_candidates(cfg: PlannerConfig, strategy: str, limit: MemoryLimit) -> list[tuple[str, PlannerConfig, str]]:
    """The changes that could bring every stage under ``limit``, in the config's own terms: ``(change, the changed
    config, the strategy that splits it)``. A split chosen under the limit, ZeRO-1, recomputation, the 1F1B
    engine, twice the pp, twice the tp; only what the config has not taken. :func:`nanotron_ext.plan.make.make_plan`
    prices them."""
    run = cfg.run
    tries: list[tuple[str, PlannerConfig, str]] = []
    if limit.kind == "device":
        tries.append(
            (
                f"a split chosen under the memory: `cost_strategy: constrained` with "
                f"`memory_cap_gib: {limit.bytes / GIB:.4g}`",
                cfg.with_overrides(memory_cap_gib=limit.bytes / GIB),
                "constrained",
            )
        )
    if run.zero_stage == 0 and run.dp > 1:  # ZeRO-1 shards the optimizer state over dp: nothing to shard at dp=1
        tries.append(("`optimizer.zero_stage: 1`", _replace_run(cfg, zero_stage=1), strategy))
    if not run.recompute_layer:
        tries.append(
            (
                "`parallelism.recompute_layer: true` (upstream Nanotron: each decoder layer keeps its input)",
                _replace_run(cfg, recompute_layer=True),
                strategy,
            )
        )
    if run.engine != "1f1b":
        tries.append(("`pp_engine: 1f1b` (fewer micro-batches in flight)", cfg.with_overrides(engine="1f1b"), strategy))
    if too_few_micro_batches(run.engine, 2 * run.pp, run.n_micro_batches) is None:
        tries.append((f"`parallelism.pp: {2 * run.pp}`", cfg.with_overrides(pp=2 * run.pp), _resplit(strategy)))
    if heads_split(cfg, 2 * run.tp):
        tries.append((f"`parallelism.tp: {2 * run.tp}`", _replace_run(cfg, tp=2 * run.tp), _resplit(strategy)))
    return tries


def heads_split(cfg: PlannerConfig, tp: int) -> bool:
    """Whether Nanotron's attention splits over ``tp``: it asserts that tp divides the query and key/value heads."""
    m = cfg.model
    return m.num_attention_heads % tp == 0 and m.num_key_value_heads % tp == 0


#: What the fixes add when every one of them is still over alone: ``plan --fit`` plans the changes combined.
FIT_POINTER = (
    "None of these fits alone: `nanotron-ext plan --fit` (same config and flags) plans them combined "
    "and lists those that fit"
)


def fix_text(limit: MemoryLimit, fixes: Sequence[MemoryFix], generic: str) -> str:
    """The priced fixes, those that fit first, then the cap: raised, or set when the estimate is known high;
    ``generic`` (the ways out, unpriced) when none was priced; :data:`FIT_POINTER` when none of them fits."""
    last = (
        "raise `memory_cap_gib`"
        if limit.kind == "cap"
        else "`memory_cap_gib` under `nanotron_ext:` when you know the memory better than the estimate"
    )
    if not fixes:
        return generic if limit.kind == "cap" else last
    ordered = sorted(fixes, key=lambda f: (not f.fits, f.peak))
    text = "; or ".join([str(f) for f in ordered] + [last])
    return text if any(f.fits for f in fixes) else f"{text}. {FIT_POINTER}"


def _replace_run(cfg: PlannerConfig, **changes: int | bool) -> PlannerConfig:
    import dataclasses

    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, **changes))


def _resplit(strategy: str) -> str:
    """The strategy that splits a changed pp or tp: a hand layout names the old one, so ``constrained`` instead."""
    return "constrained" if strategy == "layout" else strategy
