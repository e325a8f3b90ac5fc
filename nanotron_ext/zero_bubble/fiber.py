"""A call run in pieces: Nanotron's forward of one micro-batch, paused between a rank's two chunks of a V.

Nanotron's model forward walks every block in order on every rank. In a V a rank holds two chunks, and the forward
of a micro-batch's second chunk waits for the other ranks' chunks between them: run whole, a rank's second chunk
would hold up its first chunk of the next micro-batches. A :class:`Fiber` runs the forward on a thread of its own
that hands control back at :meth:`Fiber.pause` (called by the block that starts the rank's second chunk) and takes
it again at the next :meth:`Fiber.switch`. Exactly one of the caller and the fiber runs at any time, so Nanotron's
state, autograd and the process groups see one sequence of calls, as in a plain forward.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Fiber", "FiberCancelled", "current_fiber"]

_local = threading.local()


class FiberCancelled(BaseException):
    """Raised at a fiber's pause when its caller gives up on it (a failed step): the forward unwinds and ends."""


def current_fiber() -> Fiber | None:
    """The fiber running on this thread, None on the caller's."""
    return getattr(_local, "fiber", None)


class Fiber:
    """``fn()`` run in pieces: :meth:`switch` runs it until it pauses or returns; :meth:`pause` (inside) hands back."""

    def __init__(self, fn: Callable[[], Any], name: str) -> None:
        self._fn = fn
        self._go = threading.Semaphore(0)
        self._back = threading.Semaphore(0)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._cancelled = False
        self.started = self.done = False
        self.pauses = 0
        self.result: Any = None
        self._error: BaseException | None = None

    def _run(self) -> None:
        _local.fiber = self
        self._go.acquire()
        try:
            if not self._cancelled:
                self.result = self._fn()
        except FiberCancelled:
            pass
        except BaseException as exc:  # handed to the caller, which raises it
            self._error = exc
        finally:
            self.done = True
            self._back.release()

    def switch(self) -> None:
        """Run the fiber until it pauses or ends; its exception, if it raised one, is raised here.

        Raises:
            RuntimeError: the fiber has already ended.
        """
        if self.done:
            raise RuntimeError(f"{self._thread.name} has already ended; nothing is left of it to run")
        if not self.started:
            self.started = True
            self._thread.start()
        self._go.release()
        self._back.acquire()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def pause(self) -> None:
        """Inside the fiber: hand control back to the caller until its next :meth:`switch`.

        Raises:
            FiberCancelled: the caller cancelled the fiber while it was paused.
        """
        self.pauses += 1
        self._back.release()
        self._go.acquire()
        if self._cancelled:
            raise FiberCancelled()

    def cancel(self) -> None:
        """End a fiber that will not be resumed: a paused one unwinds from its pause, one not started never runs."""
        if self.done:
            return
        self._cancelled = True
        if not self.started:
            self.started = True
            self._thread.start()
        self._go.release()
        self._back.acquire()
