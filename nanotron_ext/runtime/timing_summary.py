"""A run's timed steps, summed up: ``warmup + n`` training steps under a :class:`~nanotron_ext.runtime.timing.StepTimer`
(:func:`timed_train_steps`), and every rank's records made into medians over steps (:func:`summarize`)."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from nanotron.parallel.context import ParallelContext

from nanotron_ext.runtime.engine import EngineName, MicroBatch, train_step
from nanotron_ext.runtime.timing import StepRecord, StepTimer

__all__ = ["TimingSummary", "summarize", "timed_train_steps"]


def timed_train_steps(
    model: torch.nn.Module,
    parallel_context: ParallelContext,
    engine: EngineName,
    micro_batches: Iterable[MicroBatch],
    n_micro_batches: int,
    optimizer: Any,
    *,
    n_steps: int,
    warmup: int = 1,
    grad_accumulator: Any = None,
    clip_grad: float | None = None,
) -> tuple[list[float], list[list[StepRecord]] | None]:
    """``warmup + n_steps`` calls of :func:`~nanotron_ext.runtime.engine.train_step`, the last ``n_steps`` timed.

    Collective: every rank calls it with the same counts.

    Args:
        model, parallel_context, engine, n_micro_batches, optimizer, grad_accumulator, clip_grad: as in
            ``train_step``.
        micro_batches: the micro-batch stream; ``(warmup + n_steps) * n_micro_batches`` are consumed.
        n_steps: timed steps.
        warmup: untimed steps first (allocations, first-touch of optimizer state).

    Returns:
        (the loss of every step, per-rank records on global rank 0 / None elsewhere).

    Raises:
        ValueError: ``n_steps < 1`` or ``warmup < 0``.
    """
    if n_steps < 1 or warmup < 0:
        raise ValueError(f"need n_steps >= 1 and warmup >= 0, got n_steps={n_steps}, warmup={warmup}")
    iterator = iter(micro_batches)
    losses = []
    with StepTimer(model, parallel_context) as timer:
        for i in range(warmup + n_steps):
            with timer.step(record=i >= warmup):
                losses.append(
                    train_step(
                        model,
                        parallel_context,
                        engine,
                        iterator,
                        n_micro_batches,
                        optimizer,
                        grad_accumulator=grad_accumulator,
                        clip_grad=clip_grad,
                    )
                )
        return losses, timer.gather()


@dataclass(frozen=True)
class TimingSummary:
    """Medians over steps of a run's per-rank records (seconds, fractions).

    Attributes:
        n_ranks: ranks timed.
        n_steps: steps timed.
        step: step time (slowest rank).
        pipeline: pipeline makespan: the engine's part of the step (slowest rank), what the simulator models.
        idle / busy: per rank (global rank order).
        pipeline_busy: per rank, busy time within the rank's own pipeline part (``pipeline − pipeline_idle``).
        bubble: ``Σ idle / (n_ranks × step)`` — idle share of the whole step.
        pipeline_bubble: the same within the pipeline makespan (a rank that finished early idles until it).
    """

    n_ranks: int
    n_steps: int
    step: float
    pipeline: float
    idle: list[float]
    busy: list[float]
    pipeline_busy: list[float]
    bubble: float
    pipeline_bubble: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def summarize(per_rank: Sequence[Sequence[StepRecord]]) -> TimingSummary:
    """Combine every rank's records (as :meth:`StepTimer.gather` returns them) into medians over steps.

    Raises:
        ValueError: no ranks, no steps, or ranks with different step counts.
    """
    if not per_rank or not per_rank[0]:
        raise ValueError("no timing records to summarise; time at least one step on at least one rank")
    n_steps = len(per_rank[0])
    if any(len(r) != n_steps for r in per_rank):
        raise ValueError(f"ranks recorded different step counts: {[len(r) for r in per_rank]}")
    n = len(per_rank)
    steps, pipes, bubbles, pipe_bubbles = [], [], [], []
    for s in range(n_steps):
        recs = [r[s] for r in per_rank]
        step = max(x.step for x in recs)
        # A rank whose clock stopped earlier (barrier release skew) idles for the difference.
        idle = sum(x.idle + (step - x.step) for x in recs)
        steps.append(step)
        bubbles.append(idle / (n * step) if step > 0 else 0.0)
        pipe = max(x.pipeline for x in recs)
        pipes.append(pipe)
        pipe_idle = sum(x.pipeline_idle + (pipe - x.pipeline) for x in recs)
        pipe_bubbles.append(pipe_idle / (n * pipe) if pipe > 0 else math.nan)
    return TimingSummary(
        n_ranks=n,
        n_steps=n_steps,
        step=statistics.median(steps),
        pipeline=statistics.median(pipes),
        idle=[statistics.median(x.idle for x in r) for r in per_rank],
        busy=[statistics.median(x.busy for x in r) for r in per_rank],
        pipeline_busy=[statistics.median(x.pipeline - x.pipeline_idle for x in r) for r in per_rank],
        bubble=statistics.median(bubbles),
        pipeline_bubble=statistics.median(pipe_bubbles),
    )
