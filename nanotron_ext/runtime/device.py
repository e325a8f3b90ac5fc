"""Where the runtime's tensors live, and how they cross gloo from there.

The device follows the one device rule (:mod:`nanotron_ext.devices`): ``--device``, else ``NANOTRON_EXT_DEVICE``
(``cpu`` or ``cuda``), else CUDA when torch sees a GPU, else the CPU, read on every rank; ``cuda`` puts rank r on
``cuda:{LOCAL_RANK % device_count}`` (every rank of a one-GPU machine on that GPU). Any other value, or ``cuda``
without CUDA, is a :class:`~nanotron_ext.errors.ConfigError` naming the value, the reason and the fix.

The process groups stay gloo on every device (NCCL refuses two ranks on one GPU). gloo sends and receives host
memory only and has no CUDA ``all_reduce_coalesced``, so on CUDA two paths go through the host, named
``host-staged`` wherever the runtime reports its transport:

* the pipeline's P2P (:class:`~nanotron_ext.runtime.p2p.CPUP2P`): a copy to the host before each send, a host
  receive buffer copied to the device after each receive;
* the tied-weight gradient sync (:func:`sync_tied_gradients`): the gradients are copied to the host, reduced
  there and copied back.

gloo's own CUDA all-reduce and broadcast (gradient norm, dp gradients, DDP, the initial weight sync) stage
through pinned host memory inside gloo. ``NANOTRON_EXT_HOST_STAGING=1`` forces the runtime's staging on CPU too,
where the copies change nothing: a CPU run with it must give bit-identical losses, which is how the tests
exercise the CUDA path's code on a machine without a GPU.
"""

from __future__ import annotations

import os

import torch
from nanotron import distributed as dist
from nanotron.optim.gradient_accumulator import GradientAccumulator
from nanotron.parallel.context import ParallelContext
from nanotron.parallel.tied_parameters import get_tied_id_to_param, sync_tied_weights_gradients
from torch import nn

from nanotron_ext.devices import DEVICE_ENV, device_type, synchronize
from nanotron_ext.errors import ConfigError

__all__ = [
    "CPU",
    "DEVICE_ENV",
    "HOST_STAGED",
    "STAGING_ENV",
    "describe_transport",
    "device_from_env",
    "host_staging",
    "sync_tied_gradients",
    "synchronize",
    "to_host",
]

#: Environment variable that forces host staging on CPU (``1``; a test of the CUDA path's copies).
STAGING_ENV = "NANOTRON_EXT_HOST_STAGING"
#: How the runtime names a transport that copies through the host.
HOST_STAGED = "host-staged"
CPU = torch.device("cpu")


def device_from_env() -> torch.device:
    """This rank's device under the one device rule (:func:`nanotron_ext.devices.device_type`: ``--device``, else
    ``$NANOTRON_EXT_DEVICE``, else CUDA when torch sees a GPU), CUDA as ``cuda:{LOCAL_RANK % n}``.

    Raises:
        ConfigError: an unknown value, or ``cuda`` where torch sees no CUDA device.
    """
    if device_type() == "cpu":
        return CPU
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def host_staging(device: torch.device) -> bool:
    """Whether tensors on ``device`` cross gloo through host copies: on any device but the CPU, and on the CPU
    too when ``$NANOTRON_EXT_HOST_STAGING`` is ``1``.

    Raises:
        ConfigError: ``$NANOTRON_EXT_HOST_STAGING`` is neither unset, ``0`` nor ``1``.
    """
    raw = os.environ.get(STAGING_ENV, "").strip()
    if raw not in ("", "0", "1"):
        raise ConfigError(
            f"{STAGING_ENV}={raw!r} must be 1 (force host-staged P2P and tied-gradient sync on CPU, "
            f"a test of the CUDA path) or 0; unset it for the default (staging only on CUDA)"
        )
    return device.type != "cpu" or raw == "1"


def describe_transport(device: torch.device) -> str:
    """``gloo`` or ``gloo, host-staged``: how the runtime's pipeline tensors travel from ``device``."""
    return f"gloo, {HOST_STAGED}" if host_staging(device) else "gloo"


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` in host memory, detached (always a copy, on the CPU too)."""
    return tensor.detach().to(CPU, copy=True)


def sync_tied_gradients(
    module: nn.Module, parallel_context: ParallelContext, grad_accumulator: GradientAccumulator | None
) -> None:
    """Nanotron's ``sync_tied_weights_gradients``; host-staged where the gradients need it (:func:`host_staging`).

    gloo's ``all_reduce_coalesced`` takes CPU tensors only, so on CUDA each group's gradients are copied to the
    host, reduced there with the same call, in the same order as Nanotron's, and copied back. On the CPU without
    forced staging this is Nanotron's function itself.
    """
    params = [p for p in module.parameters() if p.requires_grad]
    if not any(host_staging(p.device) for p in params):
        sync_tied_weights_gradients(module=module, parallel_context=parallel_context, grad_accumulator=grad_accumulator)
        return
    groups: dict[tuple, list[torch.Tensor]] = {}
    tied = get_tied_id_to_param(parameters=params, root_module=module)
    for (name, group_ranks), param in sorted(tied.items(), key=lambda x: x[0]):
        reduce_op = param.get_tied_info().reduce_op
        if reduce_op is None:  # replicated by construction: nothing to reduce (as Nanotron)
            continue
        grad = grad_accumulator.get_grad_buffer(name=name) if grad_accumulator is not None else param.grad
        groups.setdefault((group_ranks, reduce_op), []).append(grad)
    for (group_ranks, reduce_op), grads in groups.items():
        host = [to_host(g) for g in grads]
        dist.all_reduce_coalesced(host, op=reduce_op, group=parallel_context.world_ranks_to_pg[group_ranks])
        for grad, reduced in zip(grads, host):
            grad.copy_(reduced)
