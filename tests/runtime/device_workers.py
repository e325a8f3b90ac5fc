"""What spawned ranks run for ``test_device.py`` (loaded by path in each rank: no pytest, no relative import)."""

from __future__ import annotations

from typing import Any


def staged_p2p_round_trip() -> dict[str, Any]:
    """Rank 0 sends three tensors through a host-staged ``CPUP2P`` (staging forced on CPU), then changes the
    first in place before its send is waited on; rank 1 reports what it received."""
    import torch
    from nanotron import distributed as dist

    from nanotron_ext.runtime import GlooParallelContext
    from nanotron_ext.runtime.p2p import CPUP2P

    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    with GlooParallelContext(1, 2, 1, timeout_s=30) as ctx:
        p2p = CPUP2P(ctx.pp_pg, compute_device=torch.device("cpu"))
        if dist.get_rank(ctx.pp_pg) == 0:
            sent = [base.clone().requires_grad_(True), base.clone().t(), torch.tensor([True, False, True])]
            p2p.send_tensors(sent, to_rank=1)
            with torch.no_grad():
                sent[0].add_(100.0)  # after posting: the staged host copy was taken already
            p2p.wait_pending()
            return {}
        got = p2p.recv_tensors(3, from_rank=0)
        expected = [base, base.t(), torch.tensor([True, False, True])]
        return {
            "equal": [torch.equal(g.detach(), e) for g, e in zip(got, expected)],
            "shapes": [tuple(g.shape) for g in got],
            "dtypes": [str(g.dtype) for g in got],
            "requires_grad": [g.requires_grad for g in got],
            "leaf": [g.is_leaf for g in got],
        }
