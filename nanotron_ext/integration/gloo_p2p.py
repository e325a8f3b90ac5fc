"""Nanotron's ``P2P`` with non-blocking sends, so that its pipeline engines do not deadlock over gloo.

Nanotron's ``P2P.send_tensors`` sends metadata with ``dist.send`` and waits on the data ``isend``. On NCCL that only
enqueues work, so the host never blocks. Gloo's send is a rendezvous: it returns only once the peer has posted the
matching receive. Nanotron's engines rely on sends not blocking: in 1F1B, stage 0 sends micro-batch k+1's
activations while stage 1 sends micro-batch k's gradient back, and each then waits in ``send`` for the other to
receive -- a deadlock as soon as a stage boundary carries more than one tensor (e.g. a decoder layer's
``hidden_states`` *and* ``sequence_mask``).

:class:`GlooP2P` keeps Nanotron's wire format (same two metadata messages, same tags, same order) but posts every
send with ``isend`` and keeps the handles (and the tensors they read) alive until ``wait_pending()``. Receives are
Nanotron's (blocking). This restores NCCL's host semantics on gloo. Two users, one home: the CPU runtime's
``CPUP2P`` (:mod:`nanotron_ext.runtime.p2p`, which adds host staging and names a silent peer) and the launcher's
``--cpu-debug`` stand-ins (:mod:`nanotron_ext.integration.cpu_standins`), which give it to upstream's models.
"""

from __future__ import annotations

import torch
from nanotron import distributed as dist
from nanotron.parallel.pipeline_parallel.p2p import P2P, P2PTensorMetaData, view_as_contiguous

__all__ = ["GlooP2P", "wait_pending_sends"]

CPU = torch.device("cpu")


class GlooP2P(P2P):
    """``P2P`` whose sends never block the host (see the module docstring).

    Call ``wait_pending()`` (or ``wait_pending_sends(model)``) after every ``train_batch_iter``; until then the sent
    tensors stay referenced. Subclasses may change what goes on the wire (:meth:`_on_wire`) and how a failed wait
    is reported (:meth:`_failure`).

    Args:
        pg: the pipeline process group.
        device: where metadata and receive buffers live (the CPU).
    """

    def __init__(self, pg: dist.ProcessGroup, device: torch.device = CPU) -> None:
        super().__init__(pg=pg, device=device)
        # (work, tensor, global peer): the tensor must outlive the asynchronous send that reads it; the peer
        # names who stopped answering if the wait fails.
        self._pending: list[tuple[dist.Work, torch.Tensor, int]] = []

    def _on_wire(self, buffer: torch.Tensor) -> torch.Tensor:
        """The tensor whose bytes are sent for ``buffer`` (itself here)."""
        return buffer

    def _failure(self, exc: RuntimeError, peer: int, what: str) -> Exception | None:
        """What to raise instead of gloo's ``exc`` while waiting on ``peer``; None re-raises ``exc`` as it is."""
        return None

    def _isend(self, tensor: torch.Tensor, to_rank: int, tag: int) -> dist.Work:
        peer = dist.get_global_rank(group=self.pg, group_rank=to_rank)
        work = dist.isend(tensor, dst=peer, group=self.pg, tag=tag)
        self._pending.append((work, tensor, peer))
        return work

    def _send_meta(self, tensor: torch.Tensor, to_rank: int, tag: int) -> None:
        # Fresh metadata tensors per send (Nanotron reuses one buffer, which is only safe for blocking sends).
        self._isend(P2PTensorMetaData.to_first_metadata(tensor=tensor, device=self.device), to_rank, tag)
        self._isend(P2PTensorMetaData.to_second_metadata(tensor=tensor, device=self.device), to_rank, tag)

    def isend_tensors(self, tensors: list[torch.Tensor], to_rank: int, tag: int = 0) -> list[dist.Work]:
        """Post metadata and data sends for each tensor; returns the data sends' handles.

        Raises:
            ValueError: sending to this rank itself (as Nanotron).
        """
        current_rank = dist.get_rank(self.pg)
        futures = []
        for tensor in tensors:
            if to_rank == current_rank:
                raise ValueError("Tried sending tensor to itself")
            self._send_meta(tensor, to_rank=to_rank, tag=tag)
            buffer = tensor if tensor.is_contiguous() else view_as_contiguous(tensor)
            buffer = torch.view_as_real(buffer) if buffer.is_complex() else buffer
            futures.append(self._isend(self._on_wire(buffer), to_rank, tag))
        return futures

    def send_tensors(self, tensors: list[torch.Tensor], to_rank: int, tag: int = 0) -> None:
        """Like Nanotron's, but returns as soon as the sends are posted (NCCL-like host semantics)."""
        # Gloo's send handles never report completion before wait() is called, so they are kept until
        # wait_pending(): callers that drive the engine themselves must call it after each step.
        self.isend_tensors(tensors=tensors, to_rank=to_rank, tag=tag)

    def wait_pending(self) -> None:
        """Block until every posted send has been received by its peer.

        Deadlock-free at the end of a pipeline step: every outstanding send targets a peer whose remaining
        work no longer depends on this rank.
        """
        pending, self._pending = self._pending, []
        for work, _, peer in pending:
            try:
                work.wait()
            except RuntimeError as exc:
                failure = self._failure(exc, peer, "a pipeline send")
                if failure is None:
                    raise
                raise failure from None


def wait_pending_sends(model: torch.nn.Module) -> None:
    """``wait_pending()`` on every :class:`GlooP2P` used by the model's pipeline blocks (no-op for Nanotron's P2P).

    Args:
        model: a Nanotron model, DDP-wrapped or not.
    """
    seen: set[int] = set()
    for module in model.modules():
        p2p = getattr(module, "p2p", None)
        if isinstance(p2p, GlooP2P) and id(p2p) not in seen:
            seen.add(id(p2p))
            p2p.wait_pending()
