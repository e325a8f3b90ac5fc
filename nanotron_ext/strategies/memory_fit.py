"""Splits that fit the memory: the device's memory as a cap when the config sets none, and a stage priced by its
full estimate when the estimate's additive part (what the partitioners cap cheaply) is not enough."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import TypeVar

import numpy as np

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.config import PlannerConfig
from nanotron_ext.costs.analytic import GIB
from nanotron_ext.costs.memory_estimate import SegmentMemory, estimate_key
from nanotron_ext.errors import PlanningError
from nanotron_ext.machine import memory_limit
from nanotron_ext.partition import MemoryCap, Partition, Requirement, bounds_from_ranks
from nanotron_ext.partition.feasible import any_split_fits
from nanotron_ext.partition.schedule_aware import StepTimeSplit
from nanotron_ext.partition.step_time_bound import Validity
from nanotron_ext.strategies.registry import Assignment

__all__ = ["only_whether_it_fits", "refuse_when_none_fits", "under_full_estimate", "within_device_memory"]

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


def refuse_when_none_fits(n: int, pp: int, requirements: Sequence[Requirement], memory: MemoryCap | None) -> None:
    """Inside :func:`only_whether_it_fits`, a :class:`PlanningError` at once when no split of ``n`` blocks into
    ``pp`` stages fits ``memory``'s additive part, neither by the partitioner's programme nor by the step-time
    search's windows: both searches would raise after all their work (seconds on a large model), and the caller
    reads only that they did. Outside it, or under the full estimate, nothing: the searches raise their own error.

    Raises:
        PlanningError: no split fits.
    """
    if memory is None or memory.exact is not None or _EXACT_ERRORS.get():
        return
    if any_split_fits(n, pp, requirements, memory) or Validity.build(n, requirements, memory).any_split(pp):
        return
    raise PlanningError(
        f"no split into pp={pp} stages fits {memory.cap / GIB:.4g} GiB per stage by the estimate's "
        f"additive part alone; {memory.fix or 'raise the cap or use a larger pp'}"
    )


def under_full_estimate(
    search: Callable[[MemoryCap | None], _Split],
    memory: MemoryCap | None,
    blocks: Sequence[BlockInfo],
    cfg: PlannerConfig,
) -> _Split:
    """``search`` under ``memory``'s additive terms, then, if its split is over the cap by the full estimate
    (temporaries and held tensors added), again with the full estimate of every segment
    (:attr:`MemoryCap.exact`): so a split under the cap is found whenever one exists, and when none does the
    error's least memory is the full estimate's. Without a cap, ``search(None)``."""
    if memory is None:
        return search(None)
    exact = dataclasses.replace(memory, exact=_full_estimate(blocks, cfg))
    try:
        found = search(memory)
    except PlanningError:
        if not _EXACT_ERRORS.get():  # the caller only asks whether a split fits (within_device_memory)
            raise
        return search(exact)  # raises too (the additive part is a lower bound), with the full estimate's figure
    if _fits(found.bounds, blocks, cfg, memory.cap):
        return found
    return search(exact)


def within_device_memory(
    split: Callable[[PlannerConfig], Assignment], blocks: Sequence[BlockInfo], cfg: PlannerConfig
) -> Assignment:
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
    full = _full_estimate(blocks, cfg)
    return all(full(k, s, e) <= cap * (1 + 1e-9) for k, (s, e) in enumerate(zip(bounds, bounds[1:])))


def _full_estimate(blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> _Estimates:
    """``full(k, s, e)``: the peak of ``config_stage_memory(blocks[s:e], cfg, k)``, each segment estimated once
    for every search of the same blocks and estimate (the step-time search under the full estimate, then the
    min-max split that stands in for it, ask for the same segments); ``full.many``: many segments at once. The
    last few kept."""
    key = (tuple(blocks), estimate_key(cfg))
    full = _ESTIMATES.get(key)
    if full is None:
        while len(_ESTIMATES) >= 8:
            _ESTIMATES.pop(next(iter(_ESTIMATES)))
        full = _ESTIMATES[key] = _Estimates(SegmentMemory(blocks, cfg))
    return full


class _Estimates:
    """One segment's peak (remembered), or many segments' at once: :class:`MemoryCap`'s ``exact``."""

    def __init__(self, segments: SegmentMemory) -> None:
        self.segments = segments
        self._known: dict[tuple[int, int, int], float] = {}

    def __call__(self, k: int, s: int, e: int) -> float:
        peak = self._known.get((k, s, e))
        if peak is None:
            peak = self._known[(k, s, e)] = self.segments(k, s, e).peak
        return peak

    def many(self, k: int, s: np.ndarray, e: np.ndarray) -> np.ndarray:
        return self.segments.peaks(k, s, e)


_ESTIMATES: dict[tuple[object, ...], _Estimates] = {}
