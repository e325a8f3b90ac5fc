"""The engine's own clock: every block's forward, backward and W, timed inside Nanotron's engine during real
training steps, with the waits on peers left out (issue 41's in-run profile).

:class:`OpClock` installs, on one rank's built model (Nanotron's engines or ours, in the CPU runtime or in Nanotron's
own trainer under the launcher):

* a forward pre-hook and a forward hook on each of its blocks' modules (``PipelineBlock.pp_block``): a block's
  forward is the time inside its module, so the receive ``PipelineBlock`` does before it is never counted;
* a gradient hook on every tensor a block takes in and hands on that needs a gradient: a block's backward runs from
  the gradient reaching its output to the gradient leaving its input (the gradient's receive from the next stage
  happens before the first; where nothing before a block needs a gradient, its backward ends with the engine's op);
* ``zero_bubble.engine.accumulate_weight_gradients``: each deferred weight gradient of a ``W`` timed and put on its
  block (one home for W: the engine's and calibration's function, which takes the clock's ``timed``);
* Nanotron's ``PipelineEngine.forward`` / ``backward``: the op less its blocks and its waits is the engine's
  bookkeeping around them (its overhead), kept per op with the number of blocks it ran, where the step timer
  measures the waits (``overhead=True``).

It runs inside a step timer of its own (:class:`StepTiming`: aligned steps, the waits so far, each step's busy time
after the pipeline, the update). The CPU runtime's clock (:mod:`nanotron_ext.runtime.op_clock`) adds its P2P's
transfers and the tied-gradient all-reduce, from which links and the tied sync are priced; in Nanotron's trainer
(:mod:`nanotron_ext.integration.replan`) those keep the base profile's figures. On CPU every mark is the wall clock;
on CUDA the blocks' marks are CUDA events read once the step's kernels are done (the engine's overhead, a host-side
figure, is then not measured).

Usage::

    with OpClock(model, ctx, timer=timer, engine_name=name_of) as clock:
        for i in range(n):
            with clock.step(record=i >= warmup):
                train_step(...)
        steps = clock.gather()  # per global rank, its RankSteps (on rank 0; None elsewhere)
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as torch_dist
from nanotron import distributed as dist
from nanotron.parallel.context import ParallelContext
from nanotron.parallel.pipeline_parallel.engine import PipelineEngine
from torch.nn.parallel import DistributedDataParallel

import nanotron_ext.zero_bubble.engine as zb_engine
from nanotron_ext.devices import synchronize
from nanotron_ext.integration.adapter import pipeline_blocks
from nanotron_ext.integration.clock_marks import EventClock, WallClock, tensors_in
from nanotron_ext.machine.in_run_records import BlockOps, RankStep, Receive, Send

__all__ = ["OpClock", "StepTiming", "TimedStep"]


class TimedStep(Protocol):
    """One timed step of one rank, as the clock reads it (seconds)."""

    @property
    def busy(self) -> float: ...  # the step less its waits on peers
    @property
    def pipeline(self) -> float: ...  # from the start until this rank's engine finished
    @property
    def pipeline_idle(self) -> float: ...  # the waits within ``pipeline``


class StepTiming(Protocol):
    """The step timer a clock runs inside: installed as a context manager, one ``step`` per training step."""

    records: list[Any]  # a TimedStep per recorded step

    def __enter__(self) -> Any: ...
    def __exit__(self, *exc: object) -> None: ...
    def step(self, record: bool = True) -> contextlib.AbstractContextManager[None]: ...
    def waited(self) -> float: ...


@dataclasses.dataclass
class _Step:
    """The marks of the step being timed on this rank (resolved into a RankStep when it ends)."""

    forward: dict[str, list[tuple[Any, Any]]] = dataclasses.field(default_factory=lambda: defaultdict(list))
    backward: dict[str, list[tuple[Any, Any]]] = dataclasses.field(default_factory=lambda: defaultdict(list))
    weight: dict[str, list[list[tuple[Any, Any]]]] = dataclasses.field(default_factory=lambda: defaultdict(list))
    forwards: list[tuple[Any, Any]] = dataclasses.field(default_factory=list)  # every block forward, in order
    ops: list[tuple[float, list[tuple[Any, Any]]]] = dataclasses.field(default_factory=list)  # F and B: own, blocks
    sends: list[Send] = dataclasses.field(default_factory=list)
    receives: list[Receive] = dataclasses.field(default_factory=list)
    tied: tuple[float, float] | None = None
    engine: str = ""


class OpClock:
    """Time every block's ops on this rank inside the engine; a context manager that installs the hooks.

    Args:
        model: the built model (DDP-wrapped or not); parallel_context: its context.
        timer: the step timer it runs inside (not yet installed); engine_name: an engine's name (``"1f1b"``, ...).
        overhead: record the engine's own time per op (the timer measures the waits it must leave out).

    Raises:
        RuntimeError: another ``OpClock`` (or the timer's kind) is installed in this process.
    """

    _installed: OpClock | None = None

    def __init__(
        self,
        model: torch.nn.Module,
        parallel_context: ParallelContext,
        *,
        timer: StepTiming,
        engine_name: Callable[[PipelineEngine], str],
        overhead: bool = True,
    ) -> None:
        self.model = model.module if isinstance(model, DistributedDataParallel) else model
        self.parallel_context = parallel_context
        self.timer = timer
        self.engine_name = engine_name
        self.pp_rank = dist.get_rank(parallel_context.pp_pg)
        on_cuda = any(p.device.type == "cuda" for p in self.model.parameters())
        self.clock: WallClock | EventClock = EventClock() if on_cuda else WallClock()
        # The engine's bookkeeping is host time: measured on the wall clock only, and only where waits are known.
        self.host_overhead = overhead and not on_cuda
        self.records: list[RankStep] = []
        self.step_records: list[Any] = []  # the timer's record of each recorded step
        self._step: _Step | None = None
        self._open: dict[str, Any] = {}
        self._marks: list[tuple[str, str, Any]] = []
        self._last_mark: tuple[torch.Tensor, Any] | None = None  # the last gradient marked, and its mark
        self._weights: list[tuple[str, Any, Any]] | None = None
        self._own = 0.0  # this step's seconds inside the clock's own hooks: what it costs the step
        self._owner: dict[str, str] = {}
        self._undo: list[Callable[[], None]] = []
        self._blocks = [(name, block) for name, block in pipeline_blocks(self.model) if block.rank == self.pp_rank]

    # -- installation --------------------------------------------------------------------------------

    def __enter__(self) -> OpClock:
        if OpClock._installed is not None:
            raise RuntimeError("an OpClock is already installed in this process; time steps, not clocks, in it")
        self.timer.__enter__()
        OpClock._installed = self
        for name, block in self._blocks:
            if isinstance(block.pp_block, torch.nn.Module):
                pre = block.pp_block.register_forward_pre_hook(self._before(name), with_kwargs=True)
                post = block.pp_block.register_forward_hook(self._after(name))
                self._undo += [pre.remove, post.remove]
            else:  # a plain function (Nanotron's cast_to_fp32): the same two hooks around it
                self._patch_instance(block, "pp_block", self._around(name))
        self._patch(PipelineEngine, "forward", self._engine_op("F"))
        self._patch(PipelineEngine, "backward", self._engine_op("B"))
        self._patch(zb_engine, "accumulate_weight_gradients", self._weight_op)
        self._install_links()
        return self

    def _install_links(self) -> None:
        """Where a clock also times the transfers and the tied sync (the CPU runtime's): nothing here."""

    def __exit__(self, *exc: object) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        OpClock._installed = None
        self.timer.__exit__(*exc)

    def _patch(self, owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        original = getattr(owner, name)
        setattr(owner, name, make(original))
        self._undo.append(lambda: setattr(owner, name, original))

    def _patch_instance(self, obj: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        # Instance attributes shadow the class's methods; the StepTimer's wrapper (installed first) stays inside ours.
        before = obj.__dict__.get(name)
        setattr(obj, name, make(getattr(obj, name)))
        self._undo.append(lambda: setattr(obj, name, before) if before is not None else obj.__dict__.pop(name, None))

    # -- the hooks ----------------------------------------------------------------------------------------

    def _before(self, name: str) -> Callable[..., None]:
        def hook(module: Any, args: Any, kwargs: Any) -> None:
            if self._step is None:
                return
            t0 = time.perf_counter()
            if torch.is_grad_enabled():
                for t in tensors_in(kwargs):
                    if t.requires_grad:
                        t.register_hook(self._grad_mark(name, "end"))
            self._own += time.perf_counter() - t0
            self._open[name] = self.clock.mark()

        return hook

    def _after(self, name: str) -> Callable[..., None]:
        def hook(module: Any, args: Any, output: Any) -> None:
            if self._step is None or name not in self._open:
                return
            span = (self._open.pop(name), self.clock.mark())
            t0 = time.perf_counter()
            self._step.forward[name].append(span)
            self._step.forwards.append(span)
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(self._grad_mark(name, "start"))
            self._own += time.perf_counter() - t0

        return hook

    def _around(self, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        before, after = self._before(name), self._after(name)

        def make(fn: Callable[..., Any]) -> Callable[..., Any]:
            def timed(**kwargs: Any) -> Any:
                before(fn, (), kwargs)
                output = fn(**kwargs)
                after(fn, (), output)
                return output

            return timed

        return make

    def _grad_mark(self, name: str, kind: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if self._step is not None:
                t0 = time.perf_counter()
                # A gradient is marked once, when first seen: the hooks on one tensor (a block's output, the next one's
                # input) share its mark. A mark each overlapped the two spans by the hooks' time, ms when the OS
                # suspended the process (an op's own time was -2 ms); so did tensors given one gradient by a sum.
                if self._last_mark is None or self._last_mark[0] is not grad:
                    self._last_mark = (grad, self.clock.mark())
                self._marks.append((name, kind, self._last_mark[1]))
                self._own += time.perf_counter() - t0

        return hook

    def _engine_op(self, kind: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def op(*args: Any, **kwargs: Any) -> Any:
                step = self._step
                if step is None:
                    return original(*args, **kwargs)
                if not step.engine and args and isinstance(args[0], PipelineEngine):
                    step.engine = self.engine_name(args[0])
                t0, w0, first = time.perf_counter(), self.timer.waited(), self.clock.mark()
                n_marks, n_forwards = len(self._marks), len(step.forwards)
                try:
                    return original(*args, **kwargs)
                finally:
                    # Marked before the op's time is read: a span run to the op's end stays inside the op even if the
                    # OS suspends this process between the two (on a loaded host, by 1-7 ms: blocks outgrew their op).
                    last = self.clock.mark()
                    t1 = time.perf_counter()
                    own = t1 - t0 - (self.timer.waited() - w0)
                    if kind == "F":
                        spans = step.forwards[n_forwards:]  # this op's blocks
                    else:
                        marks, self._marks[n_marks:] = self._marks[n_marks:], []
                        self._last_mark = None  # holds a gradient: let it go with its op
                        spans = self._backward_spans(step, marks, first, last)
                    step.ops.append((own, spans))
                    self._own += time.perf_counter() - t1

            return op

        return make

    def _backward_spans(
        self, step: _Step, marks: list[tuple[str, str, Any]], first: Any, last: Any
    ) -> list[tuple[Any, Any]]:
        """One backward op's blocks: each from its first ``start`` to its last ``end`` (the op's end where nothing
        before it needs a gradient, so no gradient leaves it)."""
        starts: dict[str, Any] = {}
        ends: dict[str, Any] = {}
        for name, kind, mark in marks:
            if kind == "start":
                starts.setdefault(name, mark)
            else:
                ends[name] = mark
        spans = []
        for name, start in starts.items():
            span = (start, ends.get(name, last))
            step.backward[name].append(span)
            spans.append(span)
        return spans

    def _weight_op(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def op(products: Any, timed: Any = None) -> Any:
            step = self._step
            if step is None:
                return original(products, timed=timed)
            self._weights = []
            try:
                return original(products, timed=self._timed_weight)
            finally:
                per_block: dict[str, list[tuple[Any, Any]]] = defaultdict(list)
                for block, start, end in self._weights:
                    per_block[block].append((start, end))
                for block, spans in per_block.items():
                    step.weight[block].append(spans)
                self._weights = None

        return op

    @contextlib.contextmanager
    def _timed_weight(self, module: str) -> Iterator[None]:
        start = self.clock.mark()
        yield
        if self._weights is not None:
            self._weights.append((self._block_of(module), start, self.clock.mark()))

    def _block_of(self, module: str) -> str:
        """The block whose module path is the longest prefix of ``module`` (a linear inside it)."""
        if module not in self._owner:
            names = [n for n, _ in self._blocks if module == n or module.startswith(n + ".")]
            self._owner[module] = max(names, key=len) if names else module
        return self._owner[module]

    # -- timing ---------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self, record: bool = True) -> Iterator[None]:
        """Time one training step (collective: every rank enters it); ``record=False`` for warm-up steps."""
        self._step, self._marks, self._open, self._own, self._last_mark = _Step(), [], {}, 0.0, None
        try:
            with self.timer.step(record=record):
                yield
        finally:
            step, self._step = self._step, None
        if record:
            synchronize()  # CUDA events are read once the step's kernels are done
            self.step_records.append(self.timer.records[-1])
            self.records.append(self._resolve(step, self.timer.records[-1]))

    def _resolve(self, step: _Step, record: TimedStep) -> RankStep:
        def seconds(start: Any, end: Any) -> float:
            # A block that hands on its input itself (cast_to_fp32 of an fp32 tensor) has its two gradient marks on
            # one tensor, the end's first: it took no time.
            return max(self.clock.seconds(start, end), 0.0)

        blocks = []
        for name, _ in self._blocks:
            blocks.append(
                BlockOps(
                    block=name,
                    forward=tuple(seconds(a, b) for a, b in step.forward.get(name, ())),
                    backward=tuple(seconds(a, b) for a, b in step.backward.get(name, ())),
                    weight=tuple(sum(seconds(a, b) for a, b in spans) for spans in step.weight.get(name, ())),
                )
            )
        calls = ()
        if self.host_overhead:
            calls = tuple((own - sum(seconds(a, b) for a, b in spans), len(spans)) for own, spans in step.ops)
        return RankStep(
            pp_rank=self.pp_rank,
            engine=step.engine or "1f1b",
            blocks=tuple(blocks),
            calls=calls,
            update=record.busy - (record.pipeline - record.pipeline_idle),
            sends=tuple(step.sends),
            receives=tuple(step.receives),
            tied_sync=step.tied,
            clock=self._own,
        )

    def gather(self, dst: int = 0) -> list[list[RankStep]] | None:
        """Every rank's recorded steps, on global rank ``dst`` (collective; None elsewhere)."""
        out: list[Any] | None = [None] * torch_dist.get_world_size() if torch_dist.get_rank() == dst else None
        torch_dist.gather_object(self.records, out, dst=dst, group=self.parallel_context.world_pg)
        return out
