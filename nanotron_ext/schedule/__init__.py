"""Nanotron's two pipeline engines by name, and the one rule on micro-batches they share.

``1f1b`` is ``OneForwardOneBackwardPipelineEngine``, ``afab`` ``AllForwardAllBackwardPipelineEngine``
(``nanotron/parallel/pipeline_parallel/engine.py``). The 1F1B engine asserts ``nb_microbatches >= pp - 1``;
at exactly ``pp - 1`` it runs, but the pipeline never fills.

The event simulator of both engines' programs lives in :mod:`nanotron_ext.schedule.simulator` (pure Python,
planner layer: the schedule-aware partitioner evaluates splits with it; ``nanotron_ext.simulate`` re-exports it).
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["ENGINES", "Engine", "fills_pipeline", "min_micro_batches", "too_few_micro_batches"]

Engine = Literal["1f1b", "afab"]
ENGINES: tuple[str, ...] = get_args(Engine)


def min_micro_batches(engine: str, pp: int) -> int:
    """The fewest micro-batches per step Nanotron's ``engine`` accepts on ``pp`` stages."""
    return max(1, pp - 1) if engine == "1f1b" else 1


def fills_pipeline(engine: str, pp: int, n_micro_batches: int) -> bool:
    """Whether 1F1B reaches its steady phase on every stage (AFAB always does what it can)."""
    return engine != "1f1b" or n_micro_batches >= pp


def too_few_micro_batches(engine: str, pp: int, n_micro_batches: int) -> str | None:
    """Why Nanotron's engine would refuse ``n_micro_batches`` on ``pp`` stages, with the fix; None if it runs.

    Example:
        >>> too_few_micro_batches("1f1b", 4, 2) is not None
        True
    """
    need = min_micro_batches(engine, pp)
    if n_micro_batches >= need:
        return None
    return (
        f"1f1b needs at least pp - 1 = {need} micro-batches, got {n_micro_batches} (Nanotron's engine asserts "
        f"this); raise the number of micro-batches (batch_accumulation_per_replica) or use engine='afab'"
    )
