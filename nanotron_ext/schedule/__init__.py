"""Nanotron's two pipeline engines by name, and the one rule on micro-batches they share.

``1f1b`` is ``OneForwardOneBackwardPipelineEngine``, ``afab`` ``AllForwardAllBackwardPipelineEngine``
(``nanotron/parallel/pipeline_parallel/engine.py``). The 1F1B engine asserts ``nb_microbatches >= pp - 1``;
at exactly ``pp - 1`` it runs, but the pipeline never fills.

The event simulator of both engines' programs lives in :mod:`nanotron_ext.schedule.simulator` (pure Python,
planner layer: the schedule-aware partitioner evaluates splits with it; ``nanotron_ext.simulate`` re-exports it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

__all__ = [
    "ENGINES",
    "Engine",
    "MicroBatchShortfall",
    "fills_pipeline",
    "ideal_bubble_fraction",
    "micro_batch_shortfall",
    "min_micro_batches",
    "too_few_micro_batches",
]

Engine = Literal["1f1b", "afab"]
ENGINES: tuple[str, ...] = get_args(Engine)


def ideal_bubble_fraction(pp: int, m: int) -> float:
    """Bubble fraction ``(pp - 1) / (m + pp - 1)`` of ``pp`` equal stages and ``m`` micro-batches.

    Raises:
        ValueError: if ``pp`` or ``m`` is below 1.
    """
    if pp < 1 or m < 1:
        raise ValueError(f"ideal_bubble_fraction needs pp >= 1 and m >= 1, got pp={pp}, m={m}")
    return (pp - 1) / (m + pp - 1)


def min_micro_batches(engine: str, pp: int) -> int:
    """The fewest micro-batches per step Nanotron's ``engine`` accepts on ``pp`` stages."""
    return max(1, pp - 1) if engine == "1f1b" else 1


def fills_pipeline(engine: str, pp: int, n_micro_batches: int) -> bool:
    """Whether 1F1B reaches its steady phase on every stage (AFAB always does what it can)."""
    return engine != "1f1b" or n_micro_batches >= pp


@dataclass(frozen=True)
class MicroBatchShortfall:
    """1F1B with fewer micro-batches than stages: ``fatal`` when Nanotron's engine refuses it (fewer than
    ``pp - 1``), otherwise it runs with a pipeline that never fills."""

    fatal: bool
    reason: str
    fix: str

    def __str__(self) -> str:
        return f"{self.reason}; {self.fix}"


def micro_batch_shortfall(engine: str, pp: int, n_micro_batches: int) -> MicroBatchShortfall | None:
    """What is wrong with ``n_micro_batches`` on ``pp`` stages under ``engine``, with the fix; None if nothing.

    Example:
        >>> print(micro_batch_shortfall("1f1b", 4, 2))
        1F1B needs at least pp - 1 = 3 micro-batches, got 2: Nanotron's engine asserts nb_microbatches >= pp - 1 \
and stops; set tokens.batch_accumulation_per_replica >= 4 (>= pp fills the pipeline), or pp_engine: afab
    """
    if fills_pipeline(engine, pp, n_micro_batches):
        return None
    fix = f"set tokens.batch_accumulation_per_replica >= {pp} (>= pp fills the pipeline), or pp_engine: afab"
    need = min_micro_batches(engine, pp)
    if n_micro_batches < need:
        return MicroBatchShortfall(True, f"1F1B needs at least pp - 1 = {need} micro-batches, got {n_micro_batches}: "
                                         f"Nanotron's engine asserts nb_microbatches >= pp - 1 and stops", fix)
    bubble = ideal_bubble_fraction(pp, n_micro_batches)
    return MicroBatchShortfall(False, f"1F1B with {n_micro_batches} micro-batches on {pp} stages: the pipeline "
                                      f"never fills (bubble at least {bubble:.0%})", fix)


def too_few_micro_batches(engine: str, pp: int, n_micro_batches: int) -> str | None:
    """Why Nanotron's engine would refuse ``n_micro_batches`` on ``pp`` stages, with the fix; None if it runs."""
    shortfall = micro_batch_shortfall(engine, pp, n_micro_batches)
    return str(shortfall) if shortfall is not None and shortfall.fatal else None
