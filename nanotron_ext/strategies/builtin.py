"""The built-in strategies, registered in the order tables list them.

* ``nanotron`` — the model's ``get_block_compute_costs()`` and Nanotron's greedy threshold rule (baseline);
* ``uniform`` — the same number of weighted blocks per stage;
* ``flops`` — training FLOPs per block (:mod:`nanotron_ext.costs.analytic`), optimal split;
* ``memory`` — weights + grads + optimizer state + activations × micro-batches in flight, optimal split;
* ``constrained`` — ``base_strategy`` (``flops`` by default) plus a trainable block on every stage; with
  ``flops`` and ``objective: step_time`` (the defaults) it minimises the simulated step time instead of the
  slowest stage (:mod:`nanotron_ext.partition.schedule_aware`);
* ``layout`` — an explicit layout string (see :mod:`nanotron_ext.partition.layout_string`);
* ``profiled`` — ``constrained`` under a measured machine (the config's ``machine`` profile, or blocks measured
  here now, :mod:`nanotron_ext.costs.profiled`); under ``objective: step_time`` it minimises the simulated step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.config import PlannerConfig
from nanotron_ext.costs.analytic import GIB, in_flight, static_bytes, training_flops
from nanotron_ext.costs.block_memory import block_memory, deferred_at_once, weight_pending
from nanotron_ext.errors import ConfigError, PlanningError, suggest
from nanotron_ext.machine import machine_for, price_blocks
from nanotron_ext.partition import (
    MemoryCap,
    Requirement,
    bounds_from_ranks,
    layout_ranks,
    nanotron_greedy_ranks,
    partition,
)
from nanotron_ext.partition.schedule_aware import step_time_partition
from nanotron_ext.report import compact_names
from nanotron_ext.schedule import ZERO_BUBBLE, too_few_micro_batches
from nanotron_ext.strategies.fixes import memory_cap_fix
from nanotron_ext.strategies.memory_fit import (
    refuse_when_none_fits,
    under_full_estimate,
    within_device_memory,
)
from nanotron_ext.strategies.registry import Assignment, register_strategy
from nanotron_ext.strategies.step_time import schedule_problem

__all__ = [
    "Constrained",
    "Flops",
    "Layout",
    "Memory",
    "NanotronRule",
    "Profiled",
    "Uniform",
    "layout_of",
    "optimal_assignment",
    "require_trainable_per_stage",
    "step_time_assignment",
]


def _has_params(blocks: Sequence[BlockInfo]) -> Requirement:
    return Requirement(
        "blocks with parameters",
        tuple(b.params > 0 for b in blocks),
        fix="add decoder layers or lower pp",
    )


def _has_trainable(blocks: Sequence[BlockInfo]) -> Requirement:
    return Requirement(
        "trainable blocks",
        tuple(b.trainable > 0 for b in blocks),
        fix="unfreeze more blocks, lower pp, or set `allow_frozen_stages: true` under nanotron_ext",
    )


def optimal_assignment(
    blocks: Sequence[BlockInfo],
    cfg: PlannerConfig,
    costs: Sequence[float],
    unit: str,
    *,
    per_in_flight: Sequence[float] | None = None,
    trainable_per_stage: bool = False,
    strategy: str | None = None,
) -> Assignment:
    """Optimal split of ``costs`` with the shared constraints (weights on every stage, memory cap); ``strategy``
    (default: the config's) names the one asking, for the fixes its errors suggest."""
    run = cfg.run
    flight = in_flight(run.engine, run.pp, run.n_micro_batches)
    reqs, memory = _constraints(blocks, cfg, trainable_per_stage, strategy)
    refuse_when_none_fits(len(blocks), run.pp, reqs, memory)
    part = under_full_estimate(
        lambda mem: partition(
            costs,
            run.pp,
            per_in_flight=per_in_flight,
            in_flight=flight if per_in_flight is not None else None,
            requirements=reqs,
            memory=mem,
            names=[b.short for b in blocks],
        ),
        memory,
        blocks,
        cfg,
    )
    return Assignment(part.ranks(), list(map(float, costs)), unit)


def _constraints(
    blocks: Sequence[BlockInfo], cfg: PlannerConfig, trainable_per_stage: bool, strategy: str | None = None
) -> tuple[list[Requirement], MemoryCap | None]:
    """The shared constraints: weights on every stage, a trainable block too if asked, the memory cap."""
    reqs = [_has_params(blocks)]
    if trainable_per_stage:
        reqs.append(_has_trainable(blocks))
    memory = None
    if cfg.ext.memory_cap_gib is not None:
        # The additive part of each stage's estimate (weights, gradients, optimizer, buffers, saved activations
        # × in flight, zb1p's deferred weight-gradient state) plus the overhead: a lower bound of the full
        # estimate, so no split that fits is lost. The validator then checks the chosen split's full estimate
        # (temporaries, held tensors) against the cap.
        memory = dataclasses.replace(
            stage_memory_terms(blocks, cfg, cap=cfg.ext.memory_cap_gib * GIB),
            fix=memory_cap_fix(cfg, strategy or cfg.ext.cost_strategy, len(blocks)),
        )
    return reqs, memory


def stage_memory_terms(blocks: Sequence[BlockInfo], cfg: PlannerConfig, cap: float = math.inf) -> MemoryCap:
    """The additive part of every stage's memory estimate as :class:`MemoryCap` terms, under ``cap`` bytes."""
    run = cfg.run
    static, saved = _memory_terms(blocks, cfg)
    return MemoryCap(
        static=tuple(static),
        activation=tuple(saved),
        in_flight=tuple(in_flight(run.engine, run.pp, run.n_micro_batches)),
        cap=cap,
        overhead=cfg.ext.overhead_gib * GIB,
        pending=tuple(weight_pending(b, cfg.model, run) for b in blocks) if run.engine in ZERO_BUBBLE else (),
        deferred=tuple(deferred_at_once(run.engine, run.pp, run.n_micro_batches)),
    )


def _memory_terms(blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> tuple[list[float], list[float]]:
    """Per block: bytes held for the whole step (static + buffers), and bytes saved per micro-batch."""
    mems = [block_memory(b, cfg.model, cfg.run, cfg.ext.memory_runtime) for b in blocks]
    return ([static_bytes(b, cfg.run) + x.persistent for b, x in zip(blocks, mems)], [x.saved for x in mems])


def step_time_assignment(
    blocks: Sequence[BlockInfo],
    cfg: PlannerConfig,
    costs: Sequence[float],
    unit: str,
    *,
    trainable_per_stage: bool,
    strategy: str | None = None,
) -> Assignment:
    """The split with the smallest simulated step time under the shared constraints
    (:func:`nanotron_ext.partition.schedule_aware.step_time_partition`); ``costs`` are only reported.

    Every time comes from the config's machine (:func:`nanotron_ext.machine.machine_for`). Nanotron's own split
    seeds the search, so the answer is never slower than it.
    """
    reqs, memory = _constraints(blocks, cfg, trainable_per_stage, strategy)
    refuse_when_none_fits(len(blocks), cfg.run.pp, reqs, memory)
    if too_few_micro_batches(cfg.run.engine, cfg.run.pp, cfg.run.n_micro_batches) is not None:
        # Nanotron's engine would refuse this schedule, so there is no step to time: split by FLOPs, and
        # leave the complaint to whatever runs or simulates it.
        return optimal_assignment(blocks, cfg, costs, unit, trainable_per_stage=trainable_per_stage, strategy=strategy)
    if _infeasible_quickly(blocks, cfg, reqs):
        # Let the FLOP partitioner raise its message (which constraint, and what to change).
        optimal_assignment(blocks, cfg, costs, unit, trainable_per_stage=trainable_per_stage, strategy=strategy)
    problem = schedule_problem(blocks, cfg)
    greedy = nanotron_greedy_ranks([b.nanotron_cost for b in blocks], cfg.run.pp)
    seed = bounds_from_ranks(greedy, cfg.run.pp)
    try:
        # Ties in step time go to the split whose largest stage holds the least memory (under the additive
        # terms: when the full estimate decides, ties keep the search's own order).
        found = under_full_estimate(
            lambda mem: step_time_partition(
                problem,
                requirements=reqs,
                memory=mem,
                seeds=[seed],
                least_memory=None if mem is not None and mem.exact is not None else stage_memory_terms(blocks, cfg),
            ),
            memory,
            blocks,
            cfg,
        )
    except PlanningError:
        # The min-max split raises the error that names the least memory any split needs. When it finds a split
        # instead, the step-time search lost it: its stages may start only where every later start fits too,
        # and a stage that starts at the cast or the loss holds the logits (more than one that starts before).
        return optimal_assignment(blocks, cfg, costs, unit, trainable_per_stage=trainable_per_stage, strategy=strategy)
    return Assignment(found.ranks(), list(map(float, costs)), unit)


def _infeasible_quickly(blocks: Sequence[BlockInfo], cfg: PlannerConfig, reqs: Sequence[Requirement]) -> bool:
    return cfg.run.pp > len(blocks) or any(sum(r.flags) < cfg.run.pp for r in reqs)


def require_trainable_per_stage(blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> bool:
    """Whether a trainable block must go on every stage: yes when the model has ``pp`` of them.

    Raises:
        PlanningError: fewer trainable blocks than stages and ``allow_frozen_stages`` is off (the message
        gives both ways out).
    """
    n_trainable = sum(b.trainable > 0 for b in blocks)
    if n_trainable < cfg.run.pp and not cfg.ext.allow_frozen_stages:
        trainable = compact_names([b.short for b in blocks if b.trainable], empty="none")
        if all(b.trainable == b.params for b in blocks):  # nothing is frozen: the cause is blocks without weights
            weightless = compact_names([b.short for b in blocks if not b.params], empty="none")
            raise PlanningError(
                f"pp={cfg.run.pp} but only {n_trainable} blocks have parameters ({trainable}); {weightless} have "
                f"none, so with {cfg.run.pp} stages some stage would hold no parameters and have no gradient. "
                f"Lower pp to {max(n_trainable, 1)} or less, or use a model with more decoder layers"
            )
        raise PlanningError(
            f"pp={cfg.run.pp} but only {n_trainable} blocks are trainable ({trainable}), so some stage would "
            f"hold only frozen weights and have no gradient. Two ways out: (1) lower pp to {max(n_trainable, 1)} "
            f"or unfreeze more blocks; (2) set `allow_frozen_stages: true` under `nanotron_ext:` to run "
            f"frozen stages without optimizer or DDP"
        )
    # The user who allows frozen stages gets the fastest split, frozen stages included (one may be faster: no
    # gradient crosses a cut behind a frozen prefix).
    return n_trainable >= cfg.run.pp and not cfg.ext.allow_frozen_stages


@register_strategy("nanotron")
class NanotronRule:
    """Upstream behaviour: class costs from ``get_block_compute_costs()``, greedy thresholds."""

    name = "nanotron"

    def assign(self, blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> Assignment:
        costs = [b.nanotron_cost for b in blocks]
        return Assignment(nanotron_greedy_ranks(costs, cfg.run.pp), costs, "nanotron units")


_Pricing = tuple[list[float], str, "list[float] | None"]


def _price_uniform(blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> _Pricing:
    return [1.0 if b.params else 0.0 for b in blocks], "blocks", None


def _price_flops(blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> _Pricing:
    return training_flops(blocks), "FLOPs", None


def _price_memory(blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> _Pricing:
    # Activations are priced per micro-batch in flight, which depends on the stage.
    static, saved = _memory_terms(blocks, cfg)
    return static, "bytes", saved


_PRICERS: dict[str, Callable[[Sequence[BlockInfo], PlannerConfig], _Pricing]] = {
    "uniform": _price_uniform,
    "flops": _price_flops,
    "memory": _price_memory,
}


class _Optimal:
    name = ""

    def assign(self, blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> Assignment:
        costs, unit, per_in_flight = _PRICERS[self.name](blocks, cfg)
        return optimal_assignment(blocks, cfg, costs, unit, per_in_flight=per_in_flight, strategy=self.name)


@register_strategy("uniform")
class Uniform(_Optimal):
    """The same number of weighted blocks per stage; weightless blocks ride along for free."""

    name = "uniform"


@register_strategy("flops")
class Flops(_Optimal):
    """Training FLOPs per block: forward + input-gradient + weight-gradient, freeze-aware."""

    name = "flops"


@register_strategy("memory")
class Memory(_Optimal):
    """Peak memory per stage: static bytes plus activations × micro-batches in flight at that stage."""

    name = "memory"


@register_strategy("constrained")
class Constrained:
    """``base_strategy``'s costs, split so every stage holds a trainable block (when there are ``pp`` of them)."""

    name = "constrained"

    def assign(self, blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> Assignment:
        base = cfg.ext.base_strategy
        if base not in _PRICERS:
            raise ConfigError(
                f"nanotron_ext.base_strategy={base!r} cannot be constrained; {suggest(base, _PRICERS)}use one of "
                f"{', '.join(_PRICERS)}"
            )
        each = require_trainable_per_stage(blocks, cfg)
        costs, unit, per_in_flight = _PRICERS[base](blocks, cfg)

        def split(c: PlannerConfig) -> Assignment:
            if c.ext.objective == "step_time" and base == "flops":
                return step_time_assignment(blocks, c, costs, unit, trainable_per_stage=each, strategy=self.name)
            return optimal_assignment(
                blocks, c, costs, unit, per_in_flight=per_in_flight, trainable_per_stage=each, strategy=self.name
            )

        return within_device_memory(split, blocks, cfg)


def layout_source(cfg: PlannerConfig) -> str:
    """Where the config's ``layout`` came from, named first in its errors: ``c.yaml: nanotron_ext.layout``."""
    return f"{cfg.source}: nanotron_ext.layout"


def layout_of(cfg: PlannerConfig) -> str:
    """The config's ``layout`` string.

    Raises:
        ConfigError: ``cost_strategy: layout`` without one.
    """
    if not cfg.ext.layout:
        raise ConfigError("cost_strategy 'layout' needs `layout:` under `nanotron_ext:`, e.g. 'E,t*5|t*6,L'")
    return cfg.ext.layout


@register_strategy("layout")
class Layout:
    """An explicit layout string (``nanotron_ext.partition.layout_string``, Megatron-style)."""

    name = "layout"

    def assign(self, blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> Assignment:
        ranks = layout_ranks(layout_of(cfg), [b.role for b in blocks], source=layout_source(cfg))
        if max(ranks) + 1 != cfg.run.pp:
            raise ConfigError(
                f"{layout_source(cfg)}: layout {cfg.ext.layout!r} has {max(ranks) + 1} stages but pp={cfg.run.pp}; "
                f"give one '|'-separated stage per pipeline rank, or set pp to {max(ranks) + 1}"
            )
        return Assignment(ranks, training_flops(blocks), "FLOPs")


@register_strategy("profiled")
class Profiled:
    """``constrained`` planned under a measured machine: the config's profile when it has measured blocks, else
    every block measured here now (rank 0 measures, every rank plans; cached on disk).

    Under ``objective: step_time`` it minimises the step simulated on that machine (optimizer step included),
    under ``slowest_stage`` the slowest stage's measured forward + backward.
    """

    name = "profiled"

    def assign(self, blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> Assignment:
        each = require_trainable_per_stage(blocks, cfg)
        cfg = cfg.with_overrides(cost_strategy=self.name)  # named by make_plan's argument: machine_for measures
        prices = price_blocks(machine_for(cfg, blocks), blocks, cfg)
        costs = [f + b for f, b in zip(prices.forward, prices.backward)]

        def split(c: PlannerConfig) -> Assignment:
            if c.ext.objective == "step_time":
                return step_time_assignment(blocks, c, costs, "seconds", trainable_per_stage=each, strategy=self.name)
            return optimal_assignment(blocks, c, costs, "seconds", trainable_per_stage=each, strategy=self.name)

        return within_device_memory(split, blocks, cfg)
