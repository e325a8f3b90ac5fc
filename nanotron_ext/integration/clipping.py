"""Gradient clipping whose norm does not depend on the split, so that a resume under another split or pp is exact.

Nanotron's ``clip_grad_norm`` sums each rank's squared gradient norms, then adds the ranks' partial sums with an
all-reduce. Which gradients go into which partial sum follows the split, so the rounding of the total norm, and with
it the clipping factor of every gradient, changes with the split: a checkpoint resumed at pp=1 (or on another split)
drifted from the same run resumed on its own plan by 8.6e-7 after two steps (tiny Llama, ``clip_grad: 1.0``), while
without clipping it stayed bit-identical.

Here every rank takes each gradient's own norm (the same bits wherever the parameter lives), gathers all of them over
the model-parallel group, and adds them in one order fixed by parameter name (tensor-parallel shards of one parameter
by their rank in the group), the same at every split, pp and engine. The total differs from Nanotron's in rounding
only; the clipping itself (factor, clamp at 1, which gradients are scaled) is Nanotron's. The infinity norm, a max,
never depended on the order and stays Nanotron's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from nanotron_ext.integration.upstream_fixes import Patches

__all__ = ["install_split_independent_clipping", "split_independent_clip_grad_norm"]


@dataclass(frozen=True)
class _Order:
    """Where each gathered norm goes: ``index[k]`` is the k-th norm in name order, in the flat gather of
    ``world`` rows of ``width`` norms (one row per rank of the group)."""

    local_names: tuple[str, ...]
    width: int
    index: torch.Tensor


def _owns(param: Any, world_rank: int) -> bool:
    # Nanotron's rule: a tied parameter's gradient counts once, on the first rank of its tie.
    return not getattr(param, "is_tied", False) or world_rank == param.get_tied_info().global_ranks[0]


def _comm_device(group: Any) -> torch.device:
    """Where the group's collectives take tensors: the current GPU for NCCL, else the CPU (gloo)."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _order(group: Any, local_names: tuple[str, ...], device: torch.device) -> _Order:
    """Every rank's owned parameter names (one gather of names), and the name order of their norms."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, list(local_names), group=group)
    width = max(len(names) for names in everyone)
    entries = sorted((name, rank, i) for rank, names in enumerate(everyone) for i, name in enumerate(names))
    index = torch.tensor([rank * width + i for _, rank, i in entries], dtype=torch.long, device=device)
    return _Order(local_names, width, index)


def split_independent_clip_grad_norm(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Nanotron's ``clip_grad_norm`` (same signature and result up to rounding) with the total norm added in name
    order, so that it is the same at every split; ``original`` still does the infinity norm."""
    orders: dict[int, _Order] = {}

    def clip_grad_norm(
        mp_pg: Any,
        named_parameters: Iterable[tuple[str, Any]],
        max_norm: float,
        grad_accumulator: Any,
        norm_type: float = 2.0,
    ) -> torch.Tensor:
        named = list(named_parameters)
        if math.isinf(norm_type):
            return original(
                mp_pg=mp_pg,
                named_parameters=named,
                max_norm=max_norm,
                grad_accumulator=grad_accumulator,
                norm_type=norm_type,
            )

        def grad(name: str, param: Any) -> torch.Tensor:
            return param.grad if grad_accumulator is None else grad_accumulator.get_grad_buffer(name)

        world_rank = dist.get_rank()
        owned = [(name, param) for name, param in named if _owns(param, world_rank)]
        device = _comm_device(mp_pg)
        local_names = tuple(name for name, _ in owned)
        # The trainer clips the same parameters every step: their names are gathered once per group.
        order = orders.get(id(mp_pg))
        if order is None:
            order = orders[id(mp_pg)] = _order(mp_pg, local_names, device)
        if order.local_names != local_names:
            raise RuntimeError(
                f"the parameters to clip changed during the run ({len(order.local_names)} -> "
                f"{len(local_names)} on this rank); split-independent clipping gathers their names once"
            )
        mine = torch.zeros(order.width, dtype=torch.float, device=device)
        if owned:
            norms = [
                torch.linalg.vector_norm(grad(name, p).detach(), ord=norm_type, dtype=torch.float) for name, p in owned
            ]
            mine[: len(owned)] = torch.stack(norms).to(device)
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(mp_pg))]
        dist.all_gather(rows, mine, group=mp_pg)
        total_norm = torch.linalg.vector_norm(torch.cat(rows)[order.index], ord=norm_type, dtype=torch.float)
        # Nanotron's clipping from here on: one factor, clamped at 1, applied to every gradient (tied copies too).
        clip_coef = torch.clamp(max_norm / (total_norm + 1.0e-6), max=1.0)
        for name, param in named:
            g = grad(name, param)
            g.detach().mul_(clip_coef.to(g.device))
        return total_norm

    return clip_grad_norm


def install_split_independent_clipping(patches: Patches, trainer: Any) -> None:
    """Nanotron's trainer clips with :func:`split_independent_clip_grad_norm` (the name its module imported)."""
    patches.set(trainer, "clip_grad_norm", split_independent_clip_grad_norm(trainer.clip_grad_norm))
