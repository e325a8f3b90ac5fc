"""nanotron_ext: decide which Nanotron PipelineBlocks go to which pipeline stage.

The pure core runs without a GPU or a process group::

    from nanotron_ext import load_config, inventory_from_config, make_plan
    cfg = load_config("examples/configs/tiny_llama_large_vocab.yaml")
    plan = make_plan(inventory_from_config(cfg), cfg, strategy="constrained")
    print(plan.table())
"""

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.config import ExtConfig, PlannerConfig, load_config
from nanotron_ext.errors import ConfigError, LayoutError, NanotronExtError, PlanningError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.plan import Finding, Plan, StagePlan, make_plan, validate_plan
from nanotron_ext.strategies import available_strategies, get_strategy, register_strategy

__all__ = [
    "BlockInfo",
    "ConfigError",
    "ExtConfig",
    "Finding",
    "LayoutError",
    "NanotronExtError",
    "Plan",
    "PlannerConfig",
    "PlanningError",
    "StagePlan",
    "available_strategies",
    "get_strategy",
    "inventory_from_config",
    "load_config",
    "make_plan",
    "register_strategy",
    "validate_plan",
]
__version__ = "0.1.0"
