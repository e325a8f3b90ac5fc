"""Stage-cost strategies: a registry (a dict and a decorator) of ways to assign blocks to stages.

Each strategy prices *each block instance* (Nanotron prices each class) and returns a block→stage map.
Built in:

* ``nanotron`` — the model's ``get_block_compute_costs()`` and Nanotron's greedy threshold rule (baseline);
* ``uniform`` — the same number of weighted blocks per stage;
* ``flops`` — training FLOPs per block (DESIGN.md cost model), optimal split;
* ``memory`` — weights + grads + optimizer state + activations × micro-batches in flight, optimal split;
* ``constrained`` — ``base_strategy`` (``flops`` by default) plus a trainable block on every stage;
* ``layout`` — an explicit layout string (see :mod:`nanotron_ext.layout`).

Your own::

    @register_strategy("mine")
    class Mine:
        name = "mine"
        def assign(self, blocks, cfg): ...

or, in YAML, ``cost_strategy: my_package.my_module:MyStrategy``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from nanotron_ext.config import PlannerConfig
from nanotron_ext.costs import GIB, in_flight, static_bytes, training_flops
from nanotron_ext.errors import ConfigError, PlanningError
from nanotron_ext.inventory import BlockInfo
from nanotron_ext.layout import layout_ranks
from nanotron_ext.partition import MemoryCap, Requirement, partition


@dataclass(frozen=True)
class Assignment:
    """A strategy's answer: the stage of each block and the per-block costs it balanced."""

    ranks: list[int]
    costs: list[float]
    unit: str


@runtime_checkable
class Strategy(Protocol):
    """What a cost strategy provides."""

    name: str

    def assign(self, blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> Assignment:
        """Stage of each block for ``cfg.run.pp`` stages."""
        ...


_REGISTRY: dict[str, Callable[[], Strategy]] = {}


def register_strategy(name: str) -> Callable[[Any], Any]:
    """Class decorator: make a strategy available by ``name``.

    Raises:
        ConfigError: ``name`` is already taken.
    """

    def deco(cls: Any) -> Any:
        if name in _REGISTRY:
            raise ConfigError(f"strategy {name!r} is already registered; pick another name")
        _REGISTRY[name] = cls
        return cls

    return deco


def available_strategies() -> list[str]:
    """Registered strategy names, in registration order."""
    return list(_REGISTRY)


#: Strategies that time blocks on this machine: left out of side-by-side comparisons unless asked for.
MEASURING = frozenset({"profiled"})


def comparable_strategies(selected: str | None = None) -> list[str]:
    """Registered strategies for a side-by-side table: every analytic one, plus ``selected``."""
    return [n for n in available_strategies() if n not in MEASURING or n == selected]


def get_strategy(name: str) -> Strategy:
    """A strategy by registered name or ``package.module:attr``.

    Raises:
        ConfigError: unknown name (lists the known ones), or an import path that does not resolve to a
        strategy.
    """
    if name in _REGISTRY:
        return _REGISTRY[name]()
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            obj = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"cost_strategy {name!r} cannot be imported: {exc}") from exc
        strategy = obj() if isinstance(obj, type) else obj
        if not isinstance(strategy, Strategy):
            raise ConfigError(f"cost_strategy {name!r} has no `name` and `assign(blocks, cfg)`; see Strategy")
        return strategy
    raise ConfigError(
        f"unknown cost strategy {name!r}; known strategies: {', '.join(available_strategies())} "
        f"(or give 'package.module:attr')"
    )


def has_params(blocks: Sequence[BlockInfo]) -> Requirement:
    return Requirement(
        "blocks with parameters",
        tuple(b.params > 0 for b in blocks),
        fix="add decoder layers or lower pp",
    )


def has_trainable(blocks: Sequence[BlockInfo]) -> Requirement:
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
) -> Assignment:
    """Optimal split of ``costs`` with the shared constraints (weights on every stage, memory cap)."""
    run = cfg.run
    flight = in_flight(run.engine, run.pp, run.n_micro_batches)
    reqs = [has_params(blocks)]
    if trainable_per_stage:
        reqs.append(has_trainable(blocks))
    memory = None
    if cfg.ext.memory_cap_gib is not None:
        memory = MemoryCap(
            static=tuple(static_bytes(b, run) for b in blocks),
            activation=tuple(b.activation_bytes for b in blocks),
            in_flight=tuple(flight),
            cap=cfg.ext.memory_cap_gib * GIB,
        )
    part = partition(
        costs,
        run.pp,
        per_in_flight=per_in_flight,
        in_flight=flight if per_in_flight is not None else None,
        requirements=reqs,
        memory=memory,
        names=[b.short for b in blocks],
    )
    return Assignment(part.ranks(), list(map(float, costs)), unit)


def nanotron_greedy_ranks(costs: Sequence[float], pp: int) -> list[int]:
    """Nanotron 0.2's ``build_model`` rule, step for step (``nanotron/models/base.py``).

    Each block is assigned *before* the cumulative cost is compared with ``total·(r+1)/pp``, so one block
    heavier than a stage's share drags everything before it onto the same rank.
    """
    cumulative = np.cumsum(costs)
    thresholds = [cumulative[-1] * ((rank + 1) / pp) for rank in range(pp)]
    ranks, idx = [], 0
    for c in cumulative:
        if idx >= pp:
            raise PlanningError("Nanotron's rule ran past the last stage (it would assert here)")
        ranks.append(idx)
        if c > thresholds[idx]:
            idx += 1
    return ranks


@register_strategy("nanotron")
class NanotronRule:
    """Upstream behaviour: class costs from ``get_block_compute_costs()``, greedy thresholds."""

    name = "nanotron"

    def assign(self, blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> Assignment:
        costs = [b.nanotron_cost for b in blocks]
        return Assignment(nanotron_greedy_ranks(costs, cfg.run.pp), costs, "nanotron units")


Pricing = tuple[list[float], str, "list[float] | None"]


def price_uniform(blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> Pricing:
    return [1.0 if b.params else 0.0 for b in blocks], "blocks", None


def price_flops(blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> Pricing:
    return training_flops(blocks), "FLOPs", None


def price_memory(blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> Pricing:
    # Activations are priced per micro-batch in flight, which depends on the stage.
    return [static_bytes(b, cfg.run) for b in blocks], "bytes", [b.activation_bytes for b in blocks]


_PRICERS: dict[str, Callable[[Sequence[BlockInfo], PlannerConfig], Pricing]] = {
    "uniform": price_uniform,
    "flops": price_flops,
    "memory": price_memory,
}


class _Optimal:
    name = ""

    def assign(self, blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> Assignment:
        costs, unit, per_in_flight = _PRICERS[self.name](blocks, cfg)
        return optimal_assignment(blocks, cfg, costs, unit, per_in_flight=per_in_flight)


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
                f"nanotron_ext.base_strategy={base!r} cannot be constrained; use one of {', '.join(_PRICERS)}"
            )
        n_trainable = sum(b.trainable > 0 for b in blocks)
        if n_trainable < cfg.run.pp and not cfg.ext.allow_frozen_stages:
            trainable = ", ".join(b.short for b in blocks if b.trainable) or "none"
            raise PlanningError(
                f"pp={cfg.run.pp} but only {n_trainable} blocks are trainable ({trainable}), so some stage would "
                f"hold only frozen weights and have no gradient. Two ways out: (1) lower pp to {max(n_trainable, 1)} "
                f"or unfreeze more blocks; (2) set `allow_frozen_stages: true` under `nanotron_ext:` to run "
                f"frozen stages without optimizer or DDP"
            )
        costs, unit, per_in_flight = _PRICERS[base](blocks, cfg)
        return optimal_assignment(
            blocks, cfg, costs, unit, per_in_flight=per_in_flight, trainable_per_stage=n_trainable >= cfg.run.pp
        )


@register_strategy("layout")
class Layout:
    """An explicit layout string from ``nanotron_ext.layout`` (Megatron-style)."""

    name = "layout"

    def assign(self, blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> Assignment:
        if not cfg.ext.layout:
            raise ConfigError("cost_strategy 'layout' needs `layout:` under `nanotron_ext:`, e.g. 'E,t*5|t*6,L'")
        ranks = layout_ranks(cfg.ext.layout, [b.role for b in blocks])
        if max(ranks) + 1 != cfg.run.pp:
            raise ConfigError(f"layout {cfg.ext.layout!r} has {max(ranks) + 1} stages but pp={cfg.run.pp}")
        return Assignment(ranks, training_flops(blocks), "FLOPs")


# Registers "profiled" (imported last: it builds on the names above).
from nanotron_ext import profiled as _profiled  # noqa: E402,F401
