"""When the CPU runtime posts a pipeline cut's sends: one tensor per communication point, as Nanotron's
``PipelineTrainBatchState.run_communication`` does (``nanotron``, the default), or all of them at once (``eager``).

Nanotron queues each tensor crossing a cut (a decoder layer hands on ``hidden_states`` and ``sequence_mask``, a
vocabulary shard four tensors) and runs "one communication at a time": each call of ``run_communication``
posts at most one queued send of each kind before it blocks in a receive, so under 1F1B a cut of ``n`` tensors
becomes ``n`` dependent round trips. Timed alone between two gloo ranks, one micro-batch's exchange across the
seed model's K=2 chain cut takes 2.6 ms that way against 2.0 ms with every send posted first.

``EagerSendState`` posts every queued send at its kind's turn, then receives exactly as Nanotron does, so the
ranks' programs (:func:`nanotron_ext.schedule.simulator.engine_program`) are unchanged and a cut's tensors move
as one transfer, which is what the simulator prices. Inside the pipeline it gains nothing on this project's
2-core VM (``benchmarks/predict_vs_measure.py``, same models, same rounds: 1.09×, 0.94× and 0.99× on the seed
model's default split and its K=2 and K=4 chains, 1.00× on the SmolLM shape at m=4, every interval across 1; in
an earlier run the K=4 chain was slower, 0.87× [0.82, 0.99]), so the runtime keeps Nanotron's order by default
and ``eager`` is there to measure it again elsewhere.

``eager`` is safe where sends never block the host and each directed link carries one kind of tensor in order:
the runtime's :class:`~nanotron_ext.runtime.p2p.CPUP2P` posts every send with ``isend``, activations only flow up
the pipeline and gradients only down, so every receive still matches the same send. On NCCL, where a send and a
receive between two ranks share one stream, reordering them could deadlock; the launcher does not install it.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator
from typing import Any, Literal, get_args

import nanotron.parallel.pipeline_parallel.engine as nanotron_engine
from nanotron.parallel.pipeline_parallel.state import PipelineTrainBatchState

__all__ = ["SEND_ORDERS", "EagerSendState", "SendOrder", "send_order", "state_type"]

SendOrder = Literal["eager", "nanotron"]
SEND_ORDERS: tuple[SendOrder, ...] = get_args(SendOrder)


class EagerSendState(PipelineTrainBatchState):
    """Nanotron's train-batch state whose ``run_communication`` posts every queued send of a kind at once."""

    def run_communication(self, send_only_activation: bool = False) -> None:
        """Nanotron's order (send activations, receive an activation, send gradients, receive a gradient), with
        every queued send posted at its turn instead of one."""
        _post_all(self.microbatches_activations_to_send)
        if send_only_activation:
            return
        if self.microbatches_activations_to_recv:
            activation = self.microbatches_activations_to_recv.popleft()()
            self.activations_buffer.append(activation)
            # As Nanotron: an activation without a gradient ends the call (its rank sends no gradient back).
            if not activation.requires_grad:
                return
        _post_all(self.microbatches_grads_to_send)
        if self.microbatches_grads_to_recv:
            self.grads_buffer.append(self.microbatches_grads_to_recv.popleft()())


def _post_all(queue: deque[Any]) -> None:
    while queue:
        queue.popleft()()


def state_type(order: SendOrder) -> type[PipelineTrainBatchState]:
    """The train-batch state class of ``order``.

    Raises:
        ValueError: an unknown order, naming the known ones.
    """
    if order not in SEND_ORDERS:
        raise ValueError(f"send_order {order!r} is unknown; use one of {list(SEND_ORDERS)}")
    return EagerSendState if order == "eager" else PipelineTrainBatchState


@contextlib.contextmanager
def send_order(order: SendOrder) -> Iterator[type[PipelineTrainBatchState]]:
    """Within the block, Nanotron's AFAB and 1F1B engines build their state as ``state_type(order)``; yields
    that class (zb1p takes it as an argument).

    Raises:
        ValueError: an unknown order.
    """
    cls = state_type(order)
    # Nanotron's engines name the class in their module; nothing else there changes.
    original = nanotron_engine.PipelineTrainBatchState
    nanotron_engine.PipelineTrainBatchState = cls
    try:
        yield cls
    finally:
        nanotron_engine.PipelineTrainBatchState = original
