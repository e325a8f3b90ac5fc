"""The pipeline state of one ZB-V step on one rank (:mod:`nanotron_ext.zero_bubble.v_engine`): Nanotron's, with each
chunk's roots kept apart and the rank's transfers held to their one order, so that no two ranks wait on each other's
sends where a send waits for its receive. Activations and gradients travel on two tags."""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence
from typing import Any

import torch
from nanotron.parallel.pipeline_parallel.state import PipelineTrainBatchState

from nanotron_ext.schedule.v_replay import Transfer
from nanotron_ext.schedule.zbv import VOp

__all__ = ["ACTIVATION_TAG", "GRADIENT_TAG"]

ACTIVATION_TAG = 1
GRADIENT_TAG = 2


class _VState(PipelineTrainBatchState):
    """Nanotron's pipeline state with each chunk's roots kept apart, and its transfers in ``transfers``' order
    (:func:`~nanotron_ext.schedule.v_replay.transfer_order`; empty: sends go at once): receives as the ops need them,
    each send held until every transfer before it there is done. Activations and gradients travel on their own
    tags."""

    def __init__(self, transfers: Sequence[Transfer], pp: int, rank: int) -> None:
        # Nanotron declares its queues on the class (one deque shared by every state); these are this step's own.
        self.microbatches_activations_to_send: deque = deque()
        self.microbatches_activations_to_recv: deque = deque()
        self.microbatches_grads_to_send: deque = deque()
        self.microbatches_grads_to_recv: deque = deque()
        self.activations_buffer: deque = deque()
        self.grads_buffer: deque = deque()
        self.microbatches_activations_requiring_backward: deque = deque()
        self.nb_forwards = self.nb_backwards = 0
        self.roots: dict[tuple[int, int], list[torch.Tensor]] = defaultdict(list)
        self.forward_of: tuple[int, int] = (0, 0)  # (chunk: 0 down, 1 up; micro-batch) whose forward runs
        self.backward_of: tuple[int, int] = (0, 0)
        self.pp, self.rank = pp, rank
        self.turn = {t: i for i, t in enumerate(transfers)}  # each transfer's place in this rank's order
        self.done = [False] * len(transfers)
        self.open = 0  # the first transfer not done: those up to it may go
        self.outbox: list[tuple[Transfer, int, Any, torch.Tensor]] = []  # sends made and held, in the order made

    def op(self, kind: str) -> VOp:
        """The op running now: the forward (``F``) or backward (``B``) this state is in."""
        half, j = self.forward_of if kind == "F" else self.backward_of
        return VOp(kind, j, self.rank if half == 0 else 2 * self.pp - 1 - self.rank)  # type: ignore[arg-type]

    def register_activation_requiring_backward(self, activation: torch.Tensor) -> None:
        self.roots[self.forward_of].append(activation)

    def new_micro_batch_forward(self) -> None:
        pass  # the roots are keyed by chunk and micro-batch

    def pop_last_activations_requiring_backward(self) -> list[torch.Tensor]:
        return self.roots.pop(self.backward_of, [])

    def run_communication(self, send_only_activation: bool = False) -> None:
        self.flush()
        if send_only_activation:
            return
        for queue, buffer, tag in (
            (self.microbatches_activations_to_recv, self.activations_buffer, ACTIVATION_TAG),
            (self.microbatches_grads_to_recv, self.grads_buffer, GRADIENT_TAG),
        ):
            while queue:
                recv = queue.popleft()
                buffer.append(recv.p2p.recv_tensors(1, from_rank=recv.from_rank, tag=tag)[0])

    def inputs_received(self) -> None:
        """A block of the running forward starts: its inputs are in (Nanotron receives a block's inputs one call
        each), so the forward's receives are done and the sends after them may go. A backward's are done when it
        ends: which of its receives is the last is not known before."""
        for t in [t for t in self.turn if t.kind == "recv" and t.op == self.op("F")]:
            self._finish(t)
        self._post()

    def flush(self) -> None:
        """Take the sends Nanotron queued (made by the op running now), and post those whose turn has come."""
        while self.microbatches_activations_to_send:
            send = self.microbatches_activations_to_send.popleft()
            self.outbox.append(
                (Transfer("send", self.op("F"), send.to_rank), ACTIVATION_TAG, send.p2p, send.activation)
            )
        while self.microbatches_grads_to_send:
            send = self.microbatches_grads_to_send.popleft()
            self.outbox.append((Transfer("send", self.op("B"), send.to_rank), GRADIENT_TAG, send.p2p, send.grad))
        self._post()

    def end_op(self, op: VOp) -> None:
        """After ``op``: its transfers are done (a frozen chunk's, which never happen, included), then post."""
        for t in [t for t in self.turn if t.op == op]:
            self._finish(t)
        self.flush()

    def _post(self) -> None:
        """Post the held sends whose turn has come, in the rank's order (one op's, in the order made)."""
        place = [self.turn.get(t, -1) for t, *_ in self.outbox]  # a send outside the order goes at once
        due = sorted((i for i, at in enumerate(place) if at <= self.open), key=lambda i: place[i])
        for i in due:
            t, tag, p2p, tensor = self.outbox[i]
            p2p.send_tensors([tensor], to_rank=t.peer, tag=tag)
        self.outbox = [send for i, send in enumerate(self.outbox) if place[i] > self.open]

    def _finish(self, t: Transfer) -> None:
        i = self.turn.get(t)
        if i is None:
            return
        self.done[i] = True
        while self.open < len(self.done) and self.done[self.open]:
            self.open += 1

    def check_buffers_empty(self) -> None:
        super().check_buffers_empty()
        if self.roots:
            raise RuntimeError(f"zbv left the backward of (chunk, micro-batch) {sorted(self.roots)} undone")
        if self.outbox:
            raise RuntimeError(f"zbv held sends it never posted: {[str(t) for t, *_ in self.outbox]}")
