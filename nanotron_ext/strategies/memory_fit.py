"""Splits that fit the memory: the device's memory as a cap when the config sets none, and a stage priced by its
full estimate when the estimate's additive part (what the partitioners cap cheaply) is not enough."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import TypeVar

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.config import PlannerConfig
from nanotron_ext.costs.analytic import GIB
from nanotron_ext.costs.memory_estimate import config_stage_memory
from nanotron_ext.errors import PlanningError
from nanotron_ext.machine import memory_limit
from nanotron_ext.partition import MemoryCap, Partition, bounds_from_ranks
from nanotron_ext.partition.schedule_aware import StepTimeSplit
from nanotron_ext.strategies.registry import Assignment

__all__ = ["only_whether_it_fits", "under_full_estimate", "within_device_memory"]

_Split = TypeVar("_Split", Partition, StepTimeSplit)
#: Whether a search under a cap that no split meets raises with the full estimate's least memory (one estimate
#: per segment and stage: seconds on a large model) or with the additive part's (:func:`only_whether_it_fits`).
_EXACT_ERRORS: ContextVar[bool] = ContextVar("nanotron_ext_exact_errors", default=True)


@contextlib.contextmanager
def only_whether_it_fits() -> Iterator[None]:
    """Inside it, a split search under a cap that no split meets fails fast, its error giving the additive
    part's least memory: for callers that only ask whether a split fits (the device's memory, the fixes)."""
    token = _EXACT_ERRORS.set(False)
    try:
        yield
    finally:
        _EXACT_ERRORS.reset(token)


def under_full_estimate(search: Callable[[MemoryCap | None], _Split], memory: MemoryCap | None,
                        blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> _Split:
    """``search`` under ``memory``'s additive terms, then, if its split is over the cap by the full estimate
    (temporaries and held tensors added), again with the full estimate of every segment
    (:attr:`MemoryCap.exact`): so a split under the cap is found whenever one exists, and when none does the
    error's least memory is the full estimate's. Without a cap, ``search(None)``."""
    if memory is None:
        return search(None)

    def full(k: int, s: int, e: int) -> float:
        return config_stage_memory(blocks[s:e], cfg, k).peak

    exact = dataclasses.replace(memory, exact=full)
    try:
        found = search(memory)
    except PlanningError:
        if not _EXACT_ERRORS.get():  # the caller only asks whether a split fits (within_device_memory)
            raise
        return search(exact)  # raises too (the additive part is a lower bound), with the full estimate's figure
    if _fits(found.bounds, blocks, cfg, memory.cap):
        return found
    return search(exact)


def within_device_memory(split: Callable[[PlannerConfig], Assignment], blocks: Sequence[BlockInfo],
                         cfg: PlannerConfig) -> Assignment:
    """``split(cfg)`` with the device's memory as the cap when the config sets none
    (:func:`nanotron_ext.machine.memory_limit`): the fastest split that fits it, with the faster one it ruled
    out (``over_memory``). When none fits, the split without it; the validator then names the stage over and
    the fixes. The capped search runs only when the fastest split does not fit by the full estimate."""
    limit = memory_limit(cfg)
    fastest = split(cfg)
    if cfg.ext.memory_cap_gib is not None or limit is None:
        return fastest
    if _fits(bounds_from_ranks(fastest.ranks, cfg.run.pp), blocks, cfg, limit.bytes):
        return fastest
    try:
        with only_whether_it_fits():
            fits = split(cfg.with_overrides(memory_cap_gib=limit.bytes / GIB))
    except PlanningError:
        return fastest
    return dataclasses.replace(fits, over_memory=list(fastest.ranks))


def _fits(bounds: Sequence[int], blocks: Sequence[BlockInfo], cfg: PlannerConfig, cap: float) -> bool:
    """Whether every stage of the split ``bounds`` fits ``cap`` bytes by its full estimate."""
    return all(config_stage_memory(blocks[s:e], cfg, k).peak <= cap * (1 + 1e-9)
               for k, (s, e) in enumerate(zip(bounds, bounds[1:])))
