"""Nanotron's ``P2P`` with non-blocking sends, so that its pipeline engines do not deadlock over gloo.

Nanotron 0.2's ``P2P.send_tensors`` sends metadata with ``dist.send`` and waits on the data ``isend``. On NCCL
that only enqueues work, so the host never blocks. Gloo's send is a rendezvous: it returns only once the peer
has posted the matching receive. Nanotron's engines rely on sends not blocking: in 1F1B, stage 0 sends
micro-batch k+1's activations while stage 1 sends micro-batch k's gradient back, and each then waits in
``send`` for the other to receive -- a deadlock as soon as a stage boundary carries more than one tensor (e.g.
a decoder layer's ``hidden_states`` *and* ``sequence_mask``).

``CPUP2P`` keeps Nanotron's wire format (same two metadata messages, same tags, same order) but posts every
send with ``isend`` and keeps the handles (and the tensors they read) alive until ``wait_pending()``. Receives
are unchanged (blocking, as in Nanotron). This restores NCCL's host semantics on CPU.

gloo carries host memory only: with a ``compute_device`` (the runtime passes its CUDA device), the transport is
*host-staged*: each data tensor is copied to the host before it is sent and each received host buffer is copied
to ``compute_device`` (:mod:`nanotron_ext.runtime.device`). Metadata and the bytes on the wire are unchanged.
"""

from __future__ import annotations

import torch
from nanotron import distributed as dist
from nanotron.parallel.pipeline_parallel.p2p import P2P, P2PTensorMetaData, view_as_contiguous

from nanotron_ext.runtime.context import comm_failure
from nanotron_ext.runtime.device import to_host

__all__ = ["CPUP2P", "wait_pending_sends"]

def _global(pg: dist.ProcessGroup, group_rank: int) -> int | None:
    try:
        return int(dist.get_global_rank(group=pg, group_rank=group_rank))
    except Exception:  # only for the message
        return None

CPU = torch.device("cpu")


class CPUP2P(P2P):
    """``P2P`` whose sends never block the host (see module docstring).

    Call ``wait_pending()`` (or ``wait_pending_sends(model)``) after every ``train_batch_iter``;
    ``train_step`` does it. Until then the sent tensors stay referenced.

    Args:
        pg: the pipeline process group.
        device: where metadata and receive buffers live (CPU).
        compute_device: where the model's tensors live, when they must be staged through the host to cross
            gloo (CUDA; or CPU, to test the staging); None sends and returns the tensors themselves.
    """

    def __init__(self, pg: dist.ProcessGroup, device: torch.device = CPU,
                 compute_device: torch.device | None = None) -> None:
        super().__init__(pg=pg, device=device)
        self.compute_device = compute_device
        # (work, tensor, global peer): the tensor must outlive the asynchronous send that reads it; the peer
        # names who stopped answering if the wait times out.
        self._pending: list[tuple[dist.Work, torch.Tensor, int]] = []

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
            if self.compute_device is not None:
                buffer = to_host(buffer)  # host-staged: the same bytes, from host memory
            futures.append(self._isend(buffer, to_rank, tag))
        return futures

    def send_tensors(self, tensors: list[torch.Tensor], to_rank: int, tag: int = 0) -> None:
        """Like Nanotron's, but returns as soon as the sends are posted (NCCL-like host semantics)."""
        # Gloo's send handles never report completion before wait() is called, so they are kept until
        # wait_pending(): callers that drive the engine themselves must call it after each step.
        self.isend_tensors(tensors=tensors, to_rank=to_rank, tag=tag)

    def recv_tensors(self, num_tensors: int, from_rank: int, tag: int = 0) -> list[torch.Tensor]:
        """Nanotron's blocking receive; a peer that died or stopped answering raises :class:`RunFailure`
        naming it (instead of gloo's bare "Timed out waiting ...ms for recv")."""
        try:
            buffers = super().recv_tensors(num_tensors=num_tensors, from_rank=from_rank, tag=tag)
        except RuntimeError as exc:
            failure = comm_failure(exc, peer=_global(self.pg, from_rank), what="activations or gradients")
            if failure is None:
                raise
            raise failure from None
        if self.compute_device is None:
            return buffers
        # Host-staged: each host buffer copied to the device, a leaf that requires a gradient as the sender's did.
        return [b.detach().to(self.compute_device, copy=True).requires_grad_(b.requires_grad) for b in buffers]

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
                failure = comm_failure(exc, peer=peer, what="a pipeline send")
                if failure is None:
                    raise
                raise failure from None


def wait_pending_sends(model: torch.nn.Module) -> None:
    """``wait_pending()`` on every ``CPUP2P`` used by the model's pipeline blocks (no-op for Nanotron's P2P).

    Args:
        model: a Nanotron model, DDP-wrapped or not.
    """
    seen: set[int] = set()
    for module in model.modules():
        p2p = getattr(module, "p2p", None)
        if isinstance(p2p, CPUP2P) and id(p2p) not in seen:
            seen.add(id(p2p))
            p2p.wait_pending()
