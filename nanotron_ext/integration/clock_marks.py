"""The marks the engine's clock (:mod:`nanotron_ext.integration.op_clock`) takes, and the tensors it marks: a wall clock
on CPU, CUDA events on a GPU."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["EventClock", "WallClock", "nbytes", "tensors_in"]


class WallClock:
    """Marks on the host's monotonic clock (one clock for every process of the host)."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        return end - start


class EventClock:
    """CUDA events: a mark is recorded on the current stream, read after the step's kernels are done."""

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1e3


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a block's inputs or outputs (a tensor, a dict, or a sequence of them)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors_in(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from tensors_in(v)


def nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
