"""The blocks of a real Nanotron model, each unbuilt block's module made on the ``meta`` device."""

from __future__ import annotations

from typing import Any

from nanotron_ext.blocks import BlockInfo, ParamInfo
from nanotron_ext.config import PlannerConfig
from nanotron_ext.inventory.freeze import apply_config_freeze
from nanotron_ext.inventory.from_config import make_block

__all__ = ["inventory_from_model"]


def inventory_from_model(model: Any, cfg: PlannerConfig) -> list[BlockInfo]:
    """Blocks of a real (unbuilt or built) Nanotron model, in forward order.

    Each block whose module is not yet built is instantiated on the ``meta`` device, so no weight memory is
    allocated; an already built block is read as it is. Trainable counts come from ``requires_grad`` and then
    from the config's freeze spec, as in :func:`nanotron_ext.inventory.inventory_from_config`.

    Args:
        model: a ``NanotronModel`` whose blocks are ``PipelineBlock``s.
        cfg: the config the model was built from (batch shape for FLOPs and activations).

    Returns:
        One :class:`BlockInfo` per PipelineBlock.
    """
    import torch
    from nanotron.parallel.pipeline_parallel.block import PipelineBlock

    raw_costs = model.get_block_compute_costs() if hasattr(model, "get_block_compute_costs") else {}
    costs = {getattr(k, "__name__", str(k)): float(v) for k, v in raw_costs.items()}
    blocks = []
    for name, block in model.named_modules():
        if not isinstance(block, PipelineBlock):
            continue
        module = getattr(block, "pp_block", None)
        if module is None:
            with torch.device("meta"):
                module = block.module_builder(**block.module_kwargs)
        named = module.named_parameters() if isinstance(module, torch.nn.Module) else []
        params = [ParamInfo(f"{name}.pp_block.{p}", p_t.numel(), bool(p_t.requires_grad)) for p, p_t in named]
        builder = getattr(block.module_builder, "__name__", type(block.module_builder).__name__)
        blocks.append(make_block(len(blocks), name, builder, params, cfg.model, cfg.run, costs.get(builder, 0.0)))
    return apply_config_freeze(blocks, cfg)
