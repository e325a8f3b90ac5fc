"""``pp_engine: zb1p`` and ``zb2p``: Nanotron ``PipelineEngine``s that run ZB-H1 and ZB-H2, driven by the
simulator's own program.

Nanotron has only AFAB and 1F1B. :class:`ZeroBubblePipelineEngine` is a third ``PipelineEngine`` that runs
``engine_program("zb1p", pp, stage, m)`` (:mod:`nanotron_ext.schedule.programs`, the program the simulator
replays), step by step; :class:`ZeroBubbleH2PipelineEngine` runs ``engine_program("zb2p", ...)`` the same way:

* ``F j``: Nanotron's ``PipelineEngine.forward`` on the next micro-batch (its receive is Nanotron's own
  ``run_communication``), exactly as 1F1B does it;
* ``B j``: Nanotron's ``PipelineEngine.backward`` while the model's :class:`WeightGradStore` collects micro-batch
  ``j``'s weight-gradient products: the input gradient (and the gradient sent to the previous stage) is computed,
  the linears' weight gradients are not; embeddings, norms and linears the store does not know get theirs here;
* ``W j``: pops micro-batch ``j``'s products and accumulates their gradients through autograd into the
  parameters (so every gradient hook, DDP's included, sees an ordinary accumulation);
* a send right after a compute step (the warm-up's activation sends, the cool-down's gradient sends) flushes
  the state's queue of that kind, as 1F1B does; every other send and receive of the program is the one
  Nanotron's ``run_communication`` does inside the next ``F`` or ``B``.

Gradients end where 1F1B leaves them (see ``docs/zero-bubble.md``):

* Nanotron's gradient accumulator (fp32 accumulation): after each B and each W, the parameters that got a
  gradient in it are added into their fp32 buffers (``_accumulate_grad``, what the accumulator's ``backward``
  does for every parameter), each micro-batch's gradient once, in micro-batch order;
* DDP: every B and W runs with DDP's reducer unarmed (forwards under ``no_sync``, as 1F1B); after the last W,
  one extra backward under Nanotron's ``ddp_trigger_sync_in_bwd`` adds a zero to every trainable parameter's
  gradient, which fires DDP's hooks once per parameter on the finished sums: the reducer averages them (and,
  with fp32 accumulation, Nanotron's communication hook reduces the fp32 buffers), as in 1F1B's last backward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import nanotron.parallel.pipeline_parallel.engine as nanotron_engine
import torch
from nanotron import distributed as dist
from nanotron.parallel.data_parallel.utils import ddp_trigger_sync_in_bwd
from nanotron.parallel.pipeline_parallel.context_manager import attach_pipeline_state_to_model
from nanotron.parallel.pipeline_parallel.engine import PipelineEngine
from nanotron.parallel.pipeline_parallel.state import PipelineTrainBatchState
from nanotron.parallel.pipeline_parallel.tensor_pointer import TensorPointer
from nanotron.utils import ContextManagers
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from nanotron_ext.schedule import Engine
from nanotron_ext.schedule.programs import Action, Step, engine_program
from nanotron_ext.zero_bubble.store import (
    WeightGradStore,
    accumulate_weight_gradients,
    install_store,
    store_of,
)

__all__ = [
    "ZERO_BUBBLE_ENGINES",
    "ZeroBubbleH2PipelineEngine",
    "ZeroBubblePipelineEngine",
    "accumulate_into_fp32",
    "sync_data_parallel",
]


class ZeroBubblePipelineEngine(PipelineEngine):
    """ZB-H1 on Nanotron's pipeline machinery (``pp_engine: zb1p``); see the module docstring.

    Args:
        say: where to report, once per model on the first TP and DP rank of each PP rank, how many linears
            defer their weight gradient (None: say nothing).

    Attributes:
        schedule: the program it runs (``engine_program``'s engine name).
        trace: the compute steps (``F``, ``B``, ``W``) of the last ``train_batch_iter`` on this rank, in order.
    """

    schedule: Engine = "zb1p"

    def __init__(self, say: Callable[[str], None] | None = None) -> None:
        super().__init__()
        self.trace: list[Step] = []
        self.say = say

    def __str__(self) -> str:
        return self.schedule

    def __format__(self, format_spec: str) -> str:
        return str(self)

    def train_batch_iter(
        self,
        model: nn.Module,
        pg: dist.ProcessGroup,
        batch: Iterable[dict[str, torch.Tensor | TensorPointer]],
        nb_microbatches: int,
        grad_accumulator: Any | None,
    ) -> list[dict[str, torch.Tensor | TensorPointer]]:
        """One step's micro-batches through the schedule's program; same arguments and outputs as Nanotron's
        engines.

        Raises:
            ValueError: fewer than ``pp - 1`` micro-batches (1F1B's rule, which zb1p and zb2p keep).
            TypeError: a gradient accumulator without Nanotron's fp32 buffers (``fp32_grad_buffers``,
                ``_accumulate_grad``).
        """
        self.nb_microbatches = nb_microbatches
        program = engine_program(self.schedule, pg.size(), dist.get_rank(pg), nb_microbatches)
        _check_accumulator(grad_accumulator)
        store = store_of(model) or self._install(model, pg)
        store.clear()  # a step that failed half-way leaves nothing behind
        # The class Nanotron's engines build their state from (the CPU runtime's send order swaps it).
        state = nanotron_engine.PipelineTrainBatchState()
        run = _StepRun(self, model, state, store, grad_accumulator, iter(batch))
        with attach_pipeline_state_to_model(model=model, pipeline_state=run.state):
            run.execute(program)
            run.state.check_buffers_empty()
        if store.pending():
            raise RuntimeError(
                f"{self.schedule} left the weight gradients of micro-batches {store.pending()} deferred after "
                f"the step; the program must end with every W"
            )
        sync_data_parallel(model, grad_accumulator)
        self.trace = run.trace
        return run.outputs

    def _install(self, model: nn.Module, pg: dist.ProcessGroup) -> WeightGradStore:
        store = install_store(model)
        context = getattr(getattr(model, "module", model), "parallel_context", None)
        first = context is None or dist.get_rank(context.tp_pg) == dist.get_rank(context.dp_pg) == 0
        if self.say is not None and first:
            self.say(
                f"nanotron_ext: {self.schedule} on PP rank {dist.get_rank(pg)}: {len(store.modules)} linear(s) defer "
                f"their weight gradient to W"
            )
        return store


class ZeroBubbleH2PipelineEngine(ZeroBubblePipelineEngine):
    """ZB-H2 (``pp_engine: zb2p``): :class:`ZeroBubblePipelineEngine` running ``engine_program("zb2p", ...)``,
    twice 1F1B's warm-up forwards and twice zb1p's deferred W's (:mod:`nanotron_ext.schedule.programs`)."""

    schedule: Engine = "zb2p"


#: Our engines by ``pp_engine`` name (Nanotron knows only ``1f1b`` and ``afab``).
ZERO_BUBBLE_ENGINES: dict[str, type[ZeroBubblePipelineEngine]] = {
    cls.schedule: cls for cls in (ZeroBubblePipelineEngine, ZeroBubbleH2PipelineEngine)
}


def _check_accumulator(grad_accumulator: Any | None) -> None:
    if grad_accumulator is None:
        return
    if not (hasattr(grad_accumulator, "fp32_grad_buffers") and hasattr(grad_accumulator, "_accumulate_grad")):
        raise TypeError(
            f"pp_engine zb1p/zb2p adds each B's and W's gradients into Nanotron's FP32GradientAccumulator buffers; "
            f"{type(grad_accumulator).__name__} has no fp32_grad_buffers/_accumulate_grad. Use Nanotron's "
            f"accumulator (accumulate_grad_in_fp32: true), none, or pp_engine: 1f1b"
        )


@dataclass
class _StepRun:
    """One ``train_batch_iter``: the engine, its model and state, and what the steps produce."""

    engine: ZeroBubblePipelineEngine
    model: nn.Module
    state: PipelineTrainBatchState
    store: WeightGradStore
    grad_accumulator: Any | None
    batch: Iterator[dict[str, torch.Tensor | TensorPointer]]
    outputs: list[dict[str, torch.Tensor | TensorPointer]] = field(default_factory=list)
    trace: list[Step] = field(default_factory=list)

    def execute(self, program: list[Step]) -> None:
        """Run the program's compute steps, and its sends that follow a compute step (see the module docstring).

        The activation sends a backward's ``run_communication`` would make but the program holds back until after
        that backward (``act_lead`` in :mod:`nanotron_ext.schedule.programs`: zb2p) are taken out of Nanotron's
        queue for the backward and put back at its front afterwards, where the program sends them. The engine's
        program assumes every cut carries a gradient; where one does not, nothing is held (the program of
        ``grad_out=False``)."""
        compute = {Action.FORWARD: self.forward, Action.BACKWARD: self.backward, Action.WEIGHT: self.weight}
        after_compute = False
        for i, step in enumerate(program):
            if step.action.is_compute:
                queue = self.state.microbatches_activations_to_send
                held: list[Any] = []
                # An activation without a gradient (a frozen prefix) has no gradient to cross on its link.
                if _holds_activations(program, i) and any(s.activation.requires_grad for s in queue):
                    held = list(queue)
                    queue.clear()
                compute[step.action](step.micro_batch)
                queue.extendleft(reversed(held))
                self.trace.append(step)
                after_compute = True
            elif step.action.is_send and after_compute:
                self.flush(step.action)
            else:  # Nanotron's run_communication does it inside the next forward or backward
                after_compute = False

    def flush(self, action: Action) -> None:
        queue = (
            self.state.microbatches_activations_to_send
            if action is Action.SEND_ACT
            else self.state.microbatches_grads_to_send
        )
        while queue:
            queue.popleft()()

    def forward(self, micro_batch: int) -> None:
        context = self.engine._get_fwd_context(model=self.model)
        output = self.engine.forward(context=context, state=self.state, micro_batch=next(self.batch), model=self.model)
        if not isinstance(output, dict):
            output = {"loss": output}
        if not isinstance(output["loss"], TensorPointer):
            output = {k: v.detach() for k, v in output.items()}
        self.outputs.append(output)

    def backward(self, micro_batch: int) -> None:
        with self.store.backward_of(micro_batch):
            self.engine.backward(context=ContextManagers([]), state=self.state, grad_accumulator=None)
        accumulate_into_fp32(self.grad_accumulator)

    def weight(self, micro_batch: int) -> None:
        """Micro-batch ``micro_batch``'s deferred weight gradients (:func:`accumulate_weight_gradients`)."""
        accumulate_weight_gradients(self.store.pop(micro_batch))
        accumulate_into_fp32(self.grad_accumulator)


def _holds_activations(program: list[Step], i: int) -> bool:
    """Whether backward ``program[i]`` sends no activation at its communication point but one right after it."""
    if program[i].action is not Action.BACKWARD or i + 1 >= len(program):
        return False
    before = []
    for step in reversed(program[:i]):
        if step.action.is_compute:
            break
        before.append(step.action)
    return program[i + 1].action is Action.SEND_ACT and Action.SEND_ACT not in before


def accumulate_into_fp32(grad_accumulator: Any | None) -> None:
    """Add every parameter gradient that a B or W just produced into Nanotron's fp32 buffers, as its
    ``FP32GradientAccumulator.backward`` does after a whole backward (no-op without an accumulator)."""
    if grad_accumulator is None:
        return
    with grad_accumulator.no_sync():  # add now; the dp reduction comes once, after the last W
        for name, entry in grad_accumulator.fp32_grad_buffers.items():
            if entry["half"].grad is not None:
                grad_accumulator._accumulate_grad(name=name, half_param=entry["half"])


class _ZeroGradients(torch.autograd.Function):
    """A scalar whose backward gives every parameter a zero gradient: DDP's hooks fire, the sums stay."""

    @staticmethod
    def forward(ctx: Any, *params: torch.Tensor) -> torch.Tensor:
        ctx.shapes = [(p.new_zeros(()), p.shape) for p in params]
        return params[0].new_zeros((), dtype=torch.float)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(zero.expand(shape) for zero, shape in ctx.shapes)


def sync_data_parallel(model: nn.Module, grad_accumulator: Any | None) -> None:
    """DDP's gradient sync once every W of the step has run (no-op for a model not wrapped in DDP).

    Every trainable parameter gets a zero added through autograd under ``ddp_trigger_sync_in_bwd``, so DDP's
    reducer (and Nanotron's fp32 communication hook) reduces the finished gradients once, as after 1F1B's last
    backward; with an accumulator, its ``backward`` then points the fp32 parameters at the reduced buffers.
    """
    if not isinstance(model, DistributedDataParallel):
        return
    params = [p for p in model.module.parameters() if p.requires_grad]
    if not params:
        return
    root = _ZeroGradients.apply(*params)
    with ddp_trigger_sync_in_bwd(model_ddp=model):
        if grad_accumulator is None:
            root.backward()
        else:
            grad_accumulator.backward(root)
