"""Per-rank compute and idle time of training steps on Nanotron's pipeline engines (CPU runtime).

Idle is wall time a rank spends *blocked on a peer*; everything else in the step is busy (compute, optimizer,
bookkeeping). While a :class:`StepTimer` is installed it measures, on each rank:

* **receive wait** — every ``recv_tensors`` call of the model's ``CPUP2P`` (all activation and gradient
  receives of Nanotron's engines go through it, via ``PipelineTrainBatchState.run_communication``);
* **send wait** — ``CPUP2P.wait_pending()``: sends are posted asynchronously, and at the end of the engine's
  step a rank waits there until its peer has taken them;
* **collective wait** — blocking collectives of ``torch.distributed`` / ``nanotron.distributed`` over a group
  of more than one rank (the loss broadcast, grad-norm and tied-weight all-reduces of ``train_step``): a rank
  that arrives early waits there for the slower one;
* **end wait** — a barrier closing each timed step, so that every rank's step ends when the slowest rank's
  does (the one whose optimizer step is largest, say) and the wait for it counts as idle.

Each step starts after an (untimed) barrier, so the ranks' clocks start together. ``busy = step − idle``.
As an independent check, the main thread's CPU time over the step is recorded too (``cpu``): blocking waits
sleep, so ``cpu`` ≈ ``busy`` when each rank has a core to itself.

Each record also carries ``pipeline``: the time from the step's start until this rank's engine finished
(its pending sends completed, right after ``train_batch_iter``), and the receive and send waits within it.
The pipeline makespan (max over ranks) is what :func:`nanotron_ext.simulate.simulate` models; the full step
adds gradient sync, clipping and the optimizer.

Not measured: DDP's gradient all-reduce inside backward (C++ hooks) and asynchronous collectives; use dp=1.

Usage::

    with StepTimer(model, ctx) as timer:
        for i in range(n):
            with timer.step():
                train_step(model, ctx, "1f1b", batches, m, optimizer)
        per_rank = timer.gather()  # list of per-rank record lists on rank 0, None elsewhere
    print(summarize(per_rank))  # nanotron_ext.runtime.timing_summary
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as torch_dist
from nanotron import distributed as nanotron_dist
from nanotron.parallel.context import ParallelContext
from torch.nn.parallel import DistributedDataParallel

from nanotron_ext.runtime.device import synchronize
from nanotron_ext.runtime.p2p import CPUP2P

__all__ = ["StepRecord", "StepTimer"]

#: Blocking collectives whose wait counts as idle (patched on both torch.distributed and nanotron.distributed).
COLLECTIVES: tuple[str, ...] = (
    "all_reduce",
    "all_reduce_coalesced",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "barrier",
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
)


@dataclass(frozen=True)
class StepRecord:
    """One rank's timing of one training step, in seconds.

    Attributes:
        rank: global rank.
        pp_rank: pipeline rank.
        step: wall time from the aligned start until every rank had finished (the closing barrier).
        idle: time blocked on peers: ``recv_wait + send_wait + collective_wait + end_wait``.
        recv_wait: in P2P receives.
        send_wait: waiting for posted sends to be taken.
        collective_wait: in blocking collectives over more than one rank.
        end_wait: in the closing barrier (waiting for the slowest rank to finish its step).
        pipeline: from the start until this rank's engine finished (after ``train_batch_iter`` and its
            pending sends); NaN when the model has no ``CPUP2P``.
        pipeline_idle: receive and send waits within ``pipeline``.
        cpu: the main thread's CPU time over the step (independent estimate of ``busy``).
    """

    rank: int
    pp_rank: int
    step: float
    idle: float
    recv_wait: float
    send_wait: float
    collective_wait: float
    end_wait: float
    pipeline: float
    pipeline_idle: float
    cpu: float

    @property
    def busy(self) -> float:
        return self.step - self.idle

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "busy": self.busy}


class _Accumulator:
    def __init__(self) -> None:
        self.recv = self.send = self.collective = 0.0
        self.pipeline_end: float | None = None
        self.pipeline_idle = 0.0


def _group_size(args: tuple, kwargs: dict) -> int:
    group = kwargs.get("group")
    if group is None:
        group = next((a for a in args if isinstance(a, torch_dist.ProcessGroup)), None)
    if group is None:
        return torch_dist.get_world_size()
    return group.size()


class StepTimer:
    """Record per-rank busy and idle time of steps; a context manager that installs the wrappers.

    While installed, the model's ``CPUP2P`` receive and send-wait methods and the blocking collectives of
    ``torch.distributed`` and ``nanotron.distributed`` are wrapped with timers (process-wide; restored on
    exit). Waits are counted only inside :meth:`step`, and only the outermost of nested waits.

    Args:
        model: the built model (DDP-wrapped or not) whose pipeline P2P is timed.
        parallel_context: its context; steps are aligned over ``world_pg``.

    Raises:
        RuntimeError: another ``StepTimer`` is already installed in this process.
    """

    _installed: StepTimer | None = None

    def __init__(self, model: torch.nn.Module, parallel_context: ParallelContext) -> None:
        self.model = model.module if isinstance(model, DistributedDataParallel) else model
        self.parallel_context = parallel_context
        self.group = parallel_context.world_pg
        self.records: list[StepRecord] = []
        self._acc: _Accumulator | None = None
        self._depth = 0
        self._p2ps: list[CPUP2P] = []
        self._patched: list[tuple[Any, str, Any]] = []
        self._barrier = torch_dist.barrier  # the original, for aligning steps

    # -- installation --------------------------------------------------------------------------------

    def __enter__(self) -> StepTimer:
        if StepTimer._installed is not None:
            raise RuntimeError("a StepTimer is already installed in this process; nest steps, not timers")
        StepTimer._installed = self
        seen: set[int] = set()
        for module in self.model.modules():
            p2p = getattr(module, "p2p", None)
            if isinstance(p2p, CPUP2P) and id(p2p) not in seen:
                seen.add(id(p2p))
                self._p2ps.append(p2p)
                # Instance attributes shadow the class's methods; Nanotron's RecvActivation/RecvGrad and
                # wait_pending_sends look them up on the instance at call time.
                p2p.recv_tensors = self._wrap(p2p.recv_tensors, "recv")
                p2p.wait_pending = self._wrap(p2p.wait_pending, "send", marks_pipeline_end=True)
        for module in (torch_dist, nanotron_dist):
            for name in COLLECTIVES:
                original = getattr(module, name, None)
                if original is not None:
                    self._patched.append((module, name, original))
                    setattr(module, name, self._wrap(original, "collective", check_group=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for module, name, original in reversed(self._patched):
            setattr(module, name, original)
        self._patched.clear()
        for p2p in self._p2ps:
            for name in ("recv_tensors", "wait_pending"):
                p2p.__dict__.pop(name, None)
        self._p2ps.clear()
        StepTimer._installed = None

    def _wrap(
        self, fn: Callable[..., Any], kind: str, *, check_group: bool = False, marks_pipeline_end: bool = False
    ) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            acc = self._acc
            counted = (
                acc is not None
                and self._depth == 0
                and not kwargs.get("async_op", False)  # an async call returns at once; its wait is elsewhere
                and (not check_group or _group_size(args, kwargs) > 1)  # a 1-rank "collective" waits on nobody
            )
            if not counted:
                return fn(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                end = time.perf_counter()
                self._depth -= 1
                elapsed = end - start
                if kind == "recv":
                    acc.recv += elapsed
                elif kind == "send":
                    acc.send += elapsed
                else:
                    acc.collective += elapsed
                if acc.pipeline_end is None and kind in ("recv", "send"):
                    acc.pipeline_idle += elapsed
                if marks_pipeline_end and acc.pipeline_end is None:
                    acc.pipeline_end = end

        return timed

    # -- timing ---------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self, record: bool = True) -> Iterator[None]:
        """Time one training step on this rank (collective: every rank must enter it).

        Args:
            record: keep the record (False for warm-up steps, which still align the ranks).

        Raises:
            RuntimeError: the timer is not installed (use it as a context manager first).
        """
        if StepTimer._installed is not self:
            raise RuntimeError("StepTimer.step() needs the timer installed: `with StepTimer(...) as timer:`")
        synchronize()
        self._barrier(group=self.group)  # untimed: every rank starts the step together
        acc = self._acc = _Accumulator()
        cpu0 = time.thread_time()
        start = time.perf_counter()
        try:
            yield
        except BaseException:
            self._acc = None  # no closing barrier: a failed peer would leave us hanging in it
            raise
        synchronize()  # on a GPU (NANOTRON_EXT_DEVICE=cuda) the step ends when its kernels do
        before_barrier = time.perf_counter()
        self._acc = None
        self._barrier(group=self.group)  # timed as idle: waiting for the slowest rank to finish
        end = time.perf_counter()
        cpu = time.thread_time() - cpu0
        if not record:
            return
        end_wait = end - before_barrier
        pipeline = (acc.pipeline_end - start) if acc.pipeline_end is not None else math.nan
        self.records.append(
            StepRecord(
                rank=torch_dist.get_rank(),
                pp_rank=torch_dist.get_rank(self.parallel_context.pp_pg),
                step=end - start,
                idle=acc.recv + acc.send + acc.collective + end_wait,
                recv_wait=acc.recv,
                send_wait=acc.send,
                collective_wait=acc.collective,
                end_wait=end_wait,
                pipeline=pipeline,
                pipeline_idle=acc.pipeline_idle,
                cpu=cpu,
            )
        )

    def gather(self, dst: int = 0) -> list[list[StepRecord]] | None:
        """Every rank's records, gathered to global rank ``dst`` (collective).

        Returns:
            On ``dst``: one list of records per global rank, in rank order; elsewhere None.
        """
        rank = torch_dist.get_rank()
        out: list[Any] | None = [None] * torch_dist.get_world_size() if rank == dst else None
        # Called through the saved original so the gather is never counted as a wait.
        with self._paused():
            torch_dist.gather_object(self.records, out, dst=dst, group=self.group)
        return out

    @classmethod
    def installed(cls) -> StepTimer | None:
        """The timer installed in this process, if any (an op timed inside a step asks it for the waits so far)."""
        return cls._installed

    def waited(self) -> float:
        """Seconds this rank has waited on peers so far in the current step (receives, sends, collectives; 0
        outside :meth:`step`): what an op timed inside the step subtracts to keep only its own work."""
        acc = self._acc
        return 0.0 if acc is None else acc.recv + acc.send + acc.collective

    @contextlib.contextmanager
    def _paused(self) -> Iterator[None]:
        acc, self._acc = self._acc, None
        try:
            yield
        finally:
            self._acc = acc
