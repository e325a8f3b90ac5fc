"""The CPU runtime's engine clock: :class:`nanotron_ext.integration.op_clock.OpClock` (the one clock of both ways to
train) plus what only this runtime can hook, its own P2P and tied sync, inside a
:class:`~nanotron_ext.runtime.timing.StepTimer` (aligned steps; receive, send and collective waits), with the
transfers of its ``CPUP2P`` (when posted, when waited for, what crossed) and the tied-gradient all-reduce (when
entered and left), from which the in-run profile prices links and the tied sync.

Usage::

    with OpClock(model, ctx) as clock:
        for i in range(n):
            with clock.step(record=i >= warmup):
                train_step(model, ctx, engine, batches, m, optimizer)
        steps = clock.gather()  # per global rank, its RankSteps (on rank 0; None elsewhere)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from nanotron.parallel.context import ParallelContext

import nanotron_ext.runtime.engine as runtime_engine
from nanotron_ext.devices import synchronize
from nanotron_ext.integration import op_clock
from nanotron_ext.integration.clock_marks import nbytes
from nanotron_ext.integration.op_clock import _Step
from nanotron_ext.machine.in_run_records import Receive, Send
from nanotron_ext.runtime.engine import engine_name_of
from nanotron_ext.runtime.p2p import CPUP2P
from nanotron_ext.runtime.timing import StepTimer

__all__ = ["OpClock", "_Step"]


class OpClock(op_clock.OpClock):
    """Time every block's ops, the P2P transfers and the tied sync on this rank inside the engine (the CPU runtime).

    Args:
        model: the built model (DDP-wrapped or not); parallel_context: its context.

    Raises:
        RuntimeError: another ``OpClock`` (or ``StepTimer``) is installed in this process.
    """

    def __init__(self, model: torch.nn.Module, parallel_context: ParallelContext) -> None:
        super().__init__(model, parallel_context, timer=StepTimer(model, parallel_context), engine_name=engine_name_of)

    def _install_links(self) -> None:
        self._patch(runtime_engine, "sync_tied_gradients", self._tied_sync)
        for p2p in {id(b.p2p): b.p2p for _, b in self._blocks if isinstance(b.p2p, CPUP2P)}.values():
            self._patch_instance(p2p, "send_tensors", self._send(p2p))
            self._patch_instance(p2p, "recv_tensors", self._receive(p2p))

    def _send(self, p2p: CPUP2P) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def send_tensors(tensors: list[torch.Tensor], to_rank: int, tag: int = 0) -> Any:
                if self._step is not None:
                    self._step.sends.append(
                        Send(self.pp_rank, int(to_rank), nbytes(tensors), len(tensors), time.perf_counter())
                    )
                return original(tensors, to_rank=to_rank, tag=tag)

            return send_tensors

        return make

    def _receive(self, p2p: CPUP2P) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def recv_tensors(num_tensors: int, from_rank: int, tag: int = 0) -> list[torch.Tensor]:
                started = time.perf_counter()
                out = original(num_tensors=num_tensors, from_rank=from_rank, tag=tag)
                if self._step is not None:
                    self._step.receives.append(
                        Receive(int(from_rank), self.pp_rank, nbytes(out), len(out), started, time.perf_counter())
                    )
                return out

            return recv_tensors

        return make

    def _tied_sync(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def sync(*args: Any, **kwargs: Any) -> Any:
            entered = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if self._step is not None:
                    synchronize()
                    self._step.tied = (entered, time.perf_counter())

        return sync
