"""A block's module built standalone for :mod:`nanotron_ext.costs.profiled` to time: by the factory it is given (by
default the CPU Llama's, :mod:`nanotron_ext.models.profiled_blocks`) on the device in the config's dtype, its
parameters trainable as the block's are; the groups of blocks that fit in memory together; the one-process group
Nanotron's tensor-parallel layers are built on where no process group exists."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.config import PlannerConfig
from nanotron_ext.costs.timing_cache import _trainable_flags

__all__ = ["HELD_BYTES_PER_PARAM", "ModuleFactory"]

#: ``factory(block, cfg, tp_pg)`` builds the module (or callable) that one block runs, for timing.
ModuleFactory = Callable[[BlockInfo, PlannerConfig, Any], Callable[..., Any]]


def _module_factory(factory: ModuleFactory | None) -> ModuleFactory:
    """``factory``, or the CPU Llama's blocks (torch SDPA attention runs on CPU and GPU).

    Imported here, not at the top: they need torch and Nanotron, which planning loads only when it measures.
    """
    if factory is not None:
        return factory
    from nanotron_ext.models.profiled_blocks import build_block_module

    return build_block_module


def _standalone_module(
    block: BlockInfo, cfg: PlannerConfig, tp_pg: Any, device: Any, factory: ModuleFactory | None
) -> Any:
    """The block's module on ``device`` in the config's dtype, its parameters trainable as the block's are."""
    import torch

    module = _module_factory(factory)(block, cfg, tp_pg)
    if isinstance(module, torch.nn.Module):
        module = module.to(device=device, dtype=getattr(torch, cfg.run.dtype))
        trainable = dict(_trainable_flags(block))
        for name, param in module.named_parameters():
            param.requires_grad_(trainable.get(name, trainable.get("*", block.trainable > 0)))
    return module


#: Bytes a block's parameter holds while it is timed: the weight, its gradient and AdamW's two moments.
HELD_BYTES_PER_PARAM = 4 * 4


def _groups(blocks: Sequence[BlockInfo], device: Any) -> list[list[int]]:
    """Indices of ``blocks`` in consecutive groups whose parameters' :data:`HELD_BYTES_PER_PARAM` fit in half of
    the device's free memory (one group when they all do; a block larger than that alone)."""
    budget = _free_bytes(device) / 2
    groups: list[list[int]] = [[]]
    held = 0.0
    for i, b in enumerate(blocks):
        need = b.params * HELD_BYTES_PER_PARAM
        if groups[-1] and held + need > budget:
            groups.append([])
            held = 0.0
        groups[-1].append(i)
        held += need
    return groups


def _free_bytes(device: Any) -> float:
    """Free memory on ``device``: CUDA's free bytes, or Linux's MemAvailable (unbounded where unknown)."""
    import torch

    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    return math.inf


@contextlib.contextmanager
def _local_group() -> Iterator[Any]:
    """A one-process gloo group when no process group exists; torn down afterwards."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("_local_group is only for processes without a process group")
    dist.init_process_group(backend="gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
