"""The engine clock's gradient marks (``nanotron_ext.runtime.op_clock``), on a real autograd graph in one process:
where one block's backward starts and the next one's ends, on one tensor, both read one mark, so the blocks' spans
tile the op without overlapping however long the hooks between them take."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from nanotron_ext.runtime.op_clock import OpClock, _Step


class _CountingClock:
    """Every mark is the next integer: two marks taken apart can never be equal."""

    def __init__(self) -> None:
        self._next = itertools.count()

    def mark(self) -> int:
        return next(self._next)

    def seconds(self, start: Any, end: Any) -> float:
        return float(end - start)


def _clock() -> OpClock:
    clock = object.__new__(OpClock)  # the hooks only: no model, no process group
    clock._step, clock._marks, clock._open, clock._own, clock._last_mark = _Step(), [], {}, 0.0, None
    clock.clock = _CountingClock()
    return clock


def test_a_blocks_start_and_the_next_blocks_end_on_one_tensor_read_one_mark() -> None:
    clock = _clock()
    x = torch.ones(3, requires_grad=True)
    clock._before("a")(None, (), {"x": x})
    y = x * 2  # block a
    clock._after("a")(None, (), {"y": y})
    clock._before("b")(None, (), {"y": y})
    z = y * 3  # block b
    clock._after("b")(None, (), z)
    z.sum().backward()
    marks = {(name, kind): mark for name, kind, mark in clock._marks}
    assert set(marks) == {("b", "start"), ("b", "end"), ("a", "start"), ("a", "end")}
    assert marks[("a", "start")] == marks[("b", "end")]  # y: one instant, so the two spans meet without overlap
    assert marks[("b", "start")] < marks[("b", "end")] < marks[("a", "end")]  # other tensors: marks of their own
    assert len({m for m in marks.values()}) == 3


def test_two_tensors_given_one_gradient_by_a_sum_read_its_first_mark() -> None:
    """Block b adds block a's two outputs: both get b's output gradient, the second only after the first's node ran
    (part of a's backward). Its hooks read the gradient's first mark: b's backward ends where a's starts."""
    clock = _clock()
    x = torch.ones(3, requires_grad=True)
    clock._before("a")(None, (), {"x": x})
    p, q = x * 2, x * 3  # block a
    clock._after("a")(None, (), {"p": p, "q": q})
    clock._before("b")(None, (), {"p": p, "q": q})
    out = p + q  # block b
    clock._after("b")(None, (), out)
    out.sum().backward()
    starts = [m for name, kind, m in clock._marks if (name, kind) == ("a", "start")]
    ends = [m for name, kind, m in clock._marks if (name, kind) == ("b", "end")]
    assert len(starts) == len(ends) == 2
    assert set(starts) == set(ends) and len(set(starts)) == 1
