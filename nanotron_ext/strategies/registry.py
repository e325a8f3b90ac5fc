"""The strategy registry: a dict, a decorator, and the ``Strategy`` protocol every entry follows."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.config import PlannerConfig
from nanotron_ext.errors import ConfigError, suggest

__all__ = [
    "MEASURING",
    "Assignment",
    "Strategy",
    "available_strategies",
    "comparable_strategies",
    "get_strategy",
    "register_strategy",
]


@dataclass(frozen=True)
class Assignment:
    """A strategy's answer: the stage of each block and the per-block costs it balanced."""

    ranks: list[int]
    costs: list[float]
    unit: str
    #: The faster split the device's memory ruled out
    #: (:func:`~nanotron_ext.strategies.memory_fit.within_device_memory`); None when the chosen split is the fastest.
    over_memory: list[int] | None = None


@runtime_checkable
class Strategy(Protocol):
    """What a cost strategy provides."""

    name: str

    def assign(self, blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> Assignment:
        """Stage of each block for ``cfg.run.pp`` stages."""
        ...


_REGISTRY: dict[str, Callable[[], Strategy]] = {}

#: Strategies that time blocks on this machine: left out of side-by-side comparisons unless asked for.
MEASURING = frozenset({"profiled"})


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
        return _import_strategy(name)
    raise ConfigError(
        f"unknown cost strategy {name!r}; {suggest(name, available_strategies())}known strategies: "
        f"{', '.join(available_strategies())} (or give 'package.module:attr')"
    )


def _import_strategy(name: str) -> Strategy:
    """``package.module:Attr`` → a strategy, checked to *be* one before anything is constructed.

    A class is instantiated only when it defines ``assign`` and ``name`` itself (so ``subprocess:Popen`` is
    refused, never run); an object is used as it is when it has both.
    """
    module_name, _, attr = name.partition(":")
    fix = (
        "give 'package.module:ClassName', e.g. 'my_pkg.strategies:MyStrategy' (a class with `name` and "
        "`assign(blocks, cfg)`)"
    )
    if (
        not module_name
        or not attr
        or module_name.startswith(".")
        or not all(part.isidentifier() for part in module_name.split("."))
        or not attr.isidentifier()
    ):
        raise ConfigError(
            f"cost_strategy {name!r} is not an import path: {fix}, or a registered name: "
            f"{', '.join(available_strategies())}"
        )
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cost_strategy {name!r} cannot be imported ({exc}); {fix}") from None
    if isinstance(obj, type):
        if not (
            callable(getattr(obj, "assign", None))
            and (isinstance(getattr(obj, "name", None), str) or "name" in getattr(obj, "__annotations__", {}))
        ):
            raise ConfigError(
                f"cost_strategy {name!r} is the class {obj.__module__}.{obj.__qualname__}, which "
                f"is not a strategy (it has no `name` and `assign(blocks, cfg)`), so it was not "
                f"constructed; {fix}"
            )
        try:
            obj = obj()
        except TypeError as exc:
            raise ConfigError(
                f"cost_strategy {name!r}: the class cannot be constructed without arguments "
                f"({exc}); give it a constructor without required arguments"
            ) from None
    if not isinstance(obj, Strategy):
        raise ConfigError(
            f"cost_strategy {name!r} is a {type(obj).__name__}, not a strategy (it has no `name` "
            f"and `assign(blocks, cfg)`); {fix}"
        )
    return obj
