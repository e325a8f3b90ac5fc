"""The CPU runtime's pipeline P2P: :class:`~nanotron_ext.integration.gloo_p2p.GlooP2P` (Nanotron's ``P2P`` whose
sends never block the host, so that its engines do not deadlock over gloo), plus what only the runtime needs.

gloo carries host memory only: with a ``compute_device`` (the runtime passes its CUDA device), the transport is
*host-staged*: each data tensor is copied to the host before it is sent and each received host buffer is copied
to ``compute_device`` (:mod:`nanotron_ext.runtime.device`). Metadata and the bytes on the wire are unchanged. A peer
that dies or goes silent is named (:func:`~nanotron_ext.runtime.context.comm_failure`).
"""

from __future__ import annotations

import torch
from nanotron import distributed as dist

from nanotron_ext.integration.gloo_p2p import CPU, GlooP2P, wait_pending_sends
from nanotron_ext.runtime.context import comm_failure
from nanotron_ext.runtime.device import to_host

__all__ = ["CPUP2P", "wait_pending_sends"]


def _global(pg: dist.ProcessGroup, group_rank: int) -> int | None:
    try:
        return int(dist.get_global_rank(group=pg, group_rank=group_rank))
    except Exception:  # only for the message
        return None


class CPUP2P(GlooP2P):
    """:class:`GlooP2P` with host staging and named peers.

    Call ``wait_pending()`` (or ``wait_pending_sends(model)``) after every ``train_batch_iter``;
    ``train_step`` does it. Until then the sent tensors stay referenced.

    Args:
        pg: the pipeline process group.
        device: where metadata and receive buffers live (CPU).
        compute_device: where the model's tensors live, when they must be staged through the host to cross
            gloo (CUDA; or CPU, to test the staging); None sends and returns the tensors themselves.
    """

    def __init__(
        self, pg: dist.ProcessGroup, device: torch.device = CPU, compute_device: torch.device | None = None
    ) -> None:
        super().__init__(pg=pg, device=device)
        self.compute_device = compute_device

    def _on_wire(self, buffer: torch.Tensor) -> torch.Tensor:
        # host-staged: the same bytes, from host memory
        return buffer if self.compute_device is None else to_host(buffer)

    def _failure(self, exc: RuntimeError, peer: int, what: str) -> Exception | None:
        return comm_failure(exc, peer=peer, what=what)

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
