"""``Fiber`` (``nanotron_ext.zero_bubble.fiber``): a call run in pieces, one side running at a time."""

from __future__ import annotations

import threading

import pytest

from nanotron_ext.zero_bubble.fiber import Fiber, FiberCancelled, current_fiber


def test_a_fiber_runs_to_each_pause_and_then_to_its_end() -> None:
    seen: list[str] = []

    def body() -> int:
        seen.append("first piece")
        current_fiber().pause()
        seen.append("second piece")
        return 42

    fiber = Fiber(body, "test")
    assert current_fiber() is None  # the caller's thread runs no fiber
    fiber.switch()
    assert seen == ["first piece"] and not fiber.done and fiber.pauses == 1
    seen.append("caller")
    fiber.switch()
    assert seen == ["first piece", "caller", "second piece"]
    assert fiber.done and fiber.result == 42
    with pytest.raises(RuntimeError, match="has already ended"):
        fiber.switch()


def test_an_exception_inside_is_raised_by_the_switch_that_ran_it() -> None:
    def body() -> None:
        current_fiber().pause()
        raise ValueError("boom in the second piece")

    fiber = Fiber(body, "test")
    fiber.switch()
    with pytest.raises(ValueError, match="boom in the second piece"):
        fiber.switch()
    assert fiber.done


def test_a_cancelled_fiber_unwinds_from_its_pause_and_its_thread_ends() -> None:
    cleaned: list[bool] = []
    past: list[str] = []

    def body() -> None:
        try:
            current_fiber().pause()
            past.append("ran past its pause")
        finally:
            cleaned.append(True)

    fiber = Fiber(body, "test-cancel")
    fiber.switch()
    fiber.cancel()
    assert cleaned == [True] and fiber.done and past == []
    fiber._thread.join(timeout=5)
    assert not fiber._thread.is_alive()
    assert "test-cancel" not in {t.name for t in threading.enumerate()}
    never = Fiber(lambda: cleaned.append(False), "never started")
    never.cancel()  # one not started never runs its body
    assert never.done and cleaned == [True]


def test_the_cancellation_is_not_an_ordinary_exception() -> None:
    """A forward's ``except Exception`` (Nanotron's, a user's) must not swallow the unwinding."""
    assert not issubclass(FiberCancelled, Exception)
