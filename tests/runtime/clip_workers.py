"""Rank functions for ``test_clipping.py``: the launcher's split-independent clipping on gloo ranks."""

from __future__ import annotations


def clip_owned(owned: dict[int, list[str]], grads: dict[str, list[float]], max_norm: float):
    """This rank's parameters (``owned[rank]``, in that order, with ``grads``) clipped by the launcher's
    ``clip_grad_norm``: the total norm and every owned gradient after it, as Python floats (their exact bits)."""
    import torch
    import torch.distributed as dist

    from nanotron_ext.integration.clipping import split_independent_clip_grad_norm

    def nanotrons(**_: object) -> torch.Tensor:
        raise AssertionError("the 2-norm is the launcher's own; Nanotron's does only the infinity norm")

    dist.init_process_group("gloo")
    try:
        named = []
        for name in owned[dist.get_rank()]:
            param = torch.nn.Parameter(torch.zeros(len(grads[name])))
            param.grad = torch.tensor(grads[name], dtype=torch.float)
            named.append((name, param))
        total = split_independent_clip_grad_norm(nanotrons)(dist.group.WORLD, named, max_norm, None)
        return total.item(), {name: param.grad.tolist() for name, param in named}
    finally:
        dist.destroy_process_group()
