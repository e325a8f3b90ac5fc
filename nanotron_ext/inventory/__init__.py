"""Inventory: one :class:`~nanotron_ext.blocks.BlockInfo` per Nanotron ``PipelineBlock``, in forward order,
from a config alone (``inventory_from_config``) or from a real model (``inventory_from_model``), with what
the freeze spec leaves trainable."""

from nanotron_ext.inventory.family_blocks import block_layout, class_costs, llama_class_costs
from nanotron_ext.inventory.freeze import FreezeSpec, apply_config_freeze, apply_freeze, frozen_names
from nanotron_ext.inventory.from_config import inventory_from_config
from nanotron_ext.inventory.model import inventory_from_model

__all__ = [
    "FreezeSpec",
    "apply_config_freeze",
    "apply_freeze",
    "frozen_names",
    "block_layout",
    "class_costs",
    "inventory_from_config",
    "inventory_from_model",
    "llama_class_costs",
]
