"""``pp_engine: zbv``: ZB-V on Nanotron's pipeline machinery, two chunks per rank, driven by the simulator's order.

In a V over ``pp`` ranks the model is cut into ``2 pp`` virtual stages; stage ``s`` runs on rank ``v_rank(pp, s)``
(down the ranks, then back up), so rank ``r`` holds stage ``r`` (its *down* chunk) and stage ``2 pp - 1 - r`` (its
*up* chunk). Each block carries its stage (:func:`mark_v_stages`). The engine runs, on each rank,
``zbv_order(pp, m)[rank]`` (:mod:`nanotron_ext.schedule.zbv`, the order the simulator schedules), op by op:

* ``F`` of the down chunk starts Nanotron's ``PipelineEngine.forward`` of the next micro-batch in a
  :class:`~nanotron_ext.zero_bubble.fiber.Fiber`; the first block of the rank's up chunk pauses it there. ``F`` of the
  up chunk resumes it to its end. At the V's bottom (rank ``pp - 1``, where the two chunks meet on one rank) the
  pause also cuts the autograd graph between them: the up chunk starts from detached copies of its inputs, and the
  down chunk's ``B`` carries their gradients on (:class:`_Carry`);
* ``B`` is Nanotron's ``PipelineEngine.backward`` of that chunk's roots (its sends' dummies, the loss, or the carried
  gradients) while the model's :class:`WeightGradStore` defers the linears' weight gradients; ``W`` pops them, as
  in zb1p (oldest first: the order's ``W``s follow its ``B``s);
* a receive happens when its op needs it; a send is posted as soon as made, or, where the P2P's send waits for its
  receive (``sends_wait``: Nanotron's on a GPU), once every transfer before it in the rank's one order of transfers
  is done (:func:`~nanotron_ext.schedule.v_replay.transfer_order`), so that no two ranks wait on each other's.
  Activations and gradients travel on two tags: between two ranks each kind crosses one cut, in micro-batch order
  on both ends. The step's pipeline state, which holds the sends, is :mod:`nanotron_ext.zero_bubble.v_state`'s.

Gradients end as in zb1p: added into Nanotron's fp32 buffers after every ``B`` and ``W``, in micro-batch order for
each parameter (each chunk's ops run in micro-batch order), and reduced over dp once after the last ``W``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from nanotron import distributed as dist
from nanotron.parallel.pipeline_parallel.block import PipelineBlock
from nanotron.parallel.pipeline_parallel.context_manager import attach_pipeline_state_to_model
from nanotron.parallel.pipeline_parallel.engine import PipelineEngine
from nanotron.parallel.pipeline_parallel.tensor_pointer import TensorPointer
from nanotron.utils import ContextManagers
from torch import nn

from nanotron_ext.schedule import Engine
from nanotron_ext.schedule.v_replay import Transfer, transfer_order
from nanotron_ext.schedule.zbv import VOp, v_rank, zbv_order
from nanotron_ext.zero_bubble.engine import _check_accumulator, accumulate_into_fp32, sync_data_parallel
from nanotron_ext.zero_bubble.fiber import Fiber, current_fiber
from nanotron_ext.zero_bubble.store import (
    WeightGradStore,
    accumulate_weight_gradients,
    install_store,
    store_of,
)
from nanotron_ext.zero_bubble.v_state import ACTIVATION_TAG, GRADIENT_TAG, _VState

__all__ = ["ACTIVATION_TAG", "GRADIENT_TAG", "ZeroBubbleVPipelineEngine", "mark_v_stages", "v_stages_of"]


def _blocks(model: nn.Module) -> list[PipelineBlock]:
    """The model's pipeline blocks, in the order its forward runs them."""
    return [m for m in getattr(model, "module", model).modules() if isinstance(m, PipelineBlock)]


def mark_v_stages(model: nn.Module, stages: Sequence[int], pp: int) -> None:
    """Put on each pipeline block (in forward order) its virtual stage of a V over ``pp`` ranks.

    Raises:
        ValueError: one stage per block is not given, the stages go back down, skip one of the ``2 pp``, or put a
            block on another rank than the one it was built on.
    """
    blocks = _blocks(model)
    stages = list(stages)
    if len(stages) != len(blocks):
        raise ValueError(
            f"a V plan gives {len(stages)} virtual stages for {len(blocks)} pipeline blocks; give one "
            f"per block, in the model's order"
        )
    if sorted(set(stages)) != list(range(2 * pp)) or stages != sorted(stages):
        raise ValueError(
            f"virtual stages {stages}: a V over pp={pp} ranks needs every stage 0..{2 * pp - 1}, in "
            f"order (each chunk at least one block)"
        )
    for block, stage in zip(blocks, stages):
        if block.rank != v_rank(pp, stage):
            raise ValueError(
                f"a block of virtual stage {stage} is built on PP rank {block.rank}; in a V over "
                f"pp={pp} it runs on rank {v_rank(pp, stage)}: build the model with the V's ranks"
            )
        block.v_stage = stage


def v_stages_of(model: nn.Module) -> list[int] | None:
    """Each pipeline block's virtual stage, or None where the model carries no V (:func:`mark_v_stages`)."""
    stages = [getattr(b, "v_stage", None) for b in _blocks(model)]
    return None if any(s is None for s in stages) else [int(s) for s in stages]


class _Carry(torch.autograd.Function):
    """A scalar whose backward hands ``grads`` to ``tensors``: a chunk's ``B`` starting from gradients its next
    chunk left on the same rank (the V's bottom)."""

    @staticmethod
    def forward(ctx: Any, grads: tuple[torch.Tensor, ...], *tensors: torch.Tensor) -> torch.Tensor:
        ctx.grads = grads
        return tensors[0].new_zeros((), dtype=torch.float)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return (None, *ctx.grads)


class ZeroBubbleVPipelineEngine(PipelineEngine):
    """ZB-V (``pp_engine: zbv``); see the module docstring.

    Args:
        order: each rank's ops for ``(pp, m)`` (default :func:`zbv_order`, the simulator's order on equal times).
        sends_wait: the P2P's send waits for its receive (Nanotron's on a GPU): hold each send until its turn in
            the rank's order of transfers (:func:`~nanotron_ext.schedule.v_replay.transfer_order`). The CPU
            runtime's sends do not wait, and are posted as soon as made.
        transfers: each rank's transfers in that order for ``(pp, m)`` (a plan's, keyed by its own times:
            ``VPlan.transfers_for``); default, keyed by unit times.

    Attributes:
        trace: the ops of the last ``train_batch_iter`` on this rank, in the order they ran.
    """

    schedule: Engine = "zbv"  # type: ignore[assignment]

    def __init__(
        self,
        order: Callable[[int, int], list[list[VOp]]] = zbv_order,
        *,
        sends_wait: bool = False,
        transfers: Callable[[int, int], list[list[Transfer]]] | None = None,
    ) -> None:
        super().__init__()
        self.order = order
        self.sends_wait = sends_wait
        self.transfers = transfers
        self.trace: list[VOp] = []

    def __str__(self) -> str:
        return self.schedule

    def train_batch_iter(
        self,
        model: nn.Module,
        pg: dist.ProcessGroup,
        batch: Iterable[dict[str, torch.Tensor | TensorPointer]],
        nb_microbatches: int,
        grad_accumulator: Any | None,
    ) -> list[dict[str, torch.Tensor | TensorPointer]]:
        """One step's micro-batches through the V; same arguments and outputs as Nanotron's engines.

        Raises:
            ValueError: the model carries no V (:func:`mark_v_stages`), or one over another pp.
            TypeError: a gradient accumulator without Nanotron's fp32 buffers.
        """
        pp, rank = pg.size(), dist.get_rank(pg)
        stages = v_stages_of(model)
        if stages is None or max(stages) != 2 * pp - 1:
            raise ValueError(
                f"pp_engine zbv runs a V: each block needs its virtual stage of a V over pp={pp} "
                f"(mark_v_stages; got {stages}). Plan a V split, or use pp_engine zb1p"
            )
        _check_accumulator(grad_accumulator)
        self.nb_microbatches = nb_microbatches
        store = store_of(model) or install_store(model)
        store.clear()  # a step that failed half-way leaves nothing behind
        order = self.order(pp, nb_microbatches)
        held = (
            []
            if not self.sends_wait
            else (  # none in the order: each goes at once
                self.transfers(pp, nb_microbatches) if self.transfers is not None else transfer_order(order)
            )[rank]
        )
        run = _VRun(self, model, _VState(held, pp, rank), store, grad_accumulator, iter(batch), pp, rank)
        with attach_pipeline_state_to_model(model=model, pipeline_state=run.state), run.pauses(stages), run.marks():
            try:
                for op in order[rank]:
                    run.do(op)
            finally:
                run.close()
            run.state.check_buffers_empty()
        if store.pending():
            raise RuntimeError(f"zbv left the weight gradients of {store.pending()} deferred after the step")
        sync_data_parallel(model, grad_accumulator)
        self.trace = run.trace
        return run.outputs


class _VRun:
    """One ``train_batch_iter`` of the V on one rank: its fibers, the gradients carried at its bottom, its outputs."""

    def __init__(
        self,
        engine: ZeroBubbleVPipelineEngine,
        model: nn.Module,
        state: _VState,
        store: WeightGradStore,
        grad_accumulator: Any | None,
        batch: Iterator[dict[str, Any]],
        pp: int,
        rank: int,
    ) -> None:
        self.engine, self.model, self.state, self.store = engine, model, state, store
        self.grad_accumulator, self.batch, self.pp, self.rank = grad_accumulator, batch, pp, rank
        self.fibers: dict[int, Fiber] = {}
        self.carried: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # micro-batch: (down's out, up's in)
        self.outputs: list[dict[str, Any]] = []
        self.trace: list[VOp] = []

    @contextlib.contextmanager
    def marks(self) -> Iterator[None]:
        """Where sends are held: tell the state when a block of this rank starts its forward (its inputs are in)."""
        hooks = (
            []
            if not self.state.turn
            else [
                b.pp_block.register_forward_pre_hook(lambda *_: self.state.inputs_received())
                for b in _blocks(self.model)
                if isinstance(getattr(b, "pp_block", None), nn.Module)
            ]
        )
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()

    @contextlib.contextmanager
    def pauses(self, stages: list[int]) -> Iterator[None]:
        """Install the pause on the block that starts this rank's up chunk, for the step."""
        block = _blocks(self.model)[stages.index(2 * self.pp - 1 - self.rank)]
        original = block.forward
        bottom = self.rank == self.pp - 1

        def forward(**kwargs: Any) -> Any:
            fiber = current_fiber()
            if fiber is not None:
                fiber.pause()  # the down chunk's F ends here; the up chunk's F resumes here
                if bottom:
                    kwargs = self._cut(kwargs)
            return original(**kwargs)

        block.forward = forward  # an instance attribute: nn.Module's __call__ finds it first
        try:
            yield
        finally:
            block.__dict__.pop("forward", None)

    def _cut(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """At the V's bottom: the up chunk starts from detached copies of what the down chunk handed it."""
        pairs, out = [], {}
        for name, value in kwargs.items():
            if isinstance(value, torch.Tensor) and value.requires_grad:
                copy = value.detach().requires_grad_(True)
                pairs.append((value, copy))
                out[name] = copy
            else:
                out[name] = value
        self.carried[self.state.forward_of[1]] = pairs
        return out

    def do(self, op: VOp) -> None:
        half = 0 if op.stage < self.pp else 1
        {"F": self.forward, "B": self.backward, "W": self.weight}[op.kind](half, op.micro_batch)
        self.state.end_op(op)
        self.trace.append(op)

    def forward(self, half: int, j: int) -> None:
        self.state.forward_of = (half, j)
        if half == 0:
            micro_batch = next(self.batch)
            fiber = self.fibers[j] = Fiber(
                lambda: self.engine.forward(
                    context=ContextManagers([]), state=self.state, micro_batch=micro_batch, model=self.model
                ),
                name=f"zbv forward of micro-batch {j}",
            )
        else:
            fiber = self.fibers[j]
        # DDP's no_sync is entered and left here, around each piece: fibers pause inside their forward, and a
        # context held across a pause would be left out of order.
        with self.engine._get_fwd_context(model=self.model):
            fiber.switch()
        if half == 0 and fiber.done:
            raise RuntimeError(
                f"micro-batch {j}'s forward ran to its end without reaching PP rank {self.rank}'s up "
                f"chunk: the model's blocks do not form the V"
            )
        if half == 1:
            output = self.fibers.pop(j).result
            output = output if isinstance(output, dict) else {"loss": output}
            if not isinstance(output["loss"], TensorPointer):
                output = {k: v.detach() for k, v in output.items()}
            self.outputs.append(output)

    def backward(self, half: int, j: int) -> None:
        self.state.backward_of = (half, j)
        if half == 0 and j in self.carried:
            pairs = [(a, b.grad) for a, b in self.carried.pop(j) if b.grad is not None]
            if pairs:
                self.state.roots[(0, j)].append(_Carry.apply(tuple(g for _, g in pairs), *(a for a, _ in pairs)))
        with self.store.backward_of(2 * j + half):
            self.engine.backward(context=ContextManagers([]), state=self.state, grad_accumulator=None)
        accumulate_into_fp32(self.grad_accumulator)

    def weight(self, half: int, j: int) -> None:
        accumulate_weight_gradients(self.store.pop(2 * j + half))
        accumulate_into_fp32(self.grad_accumulator)

    def close(self) -> None:
        """End the fibers a failed step left paused (their forwards unwind)."""
        for fiber in self.fibers.values():
            fiber.cancel()
        self.fibers.clear()
