"""Strategies: named ways to price blocks and split them into stages, in a registry users can extend::

    @register_strategy("mine")
    class Mine:
        name = "mine"
        def assign(self, blocks, cfg): ...

or, in YAML, ``cost_strategy: my_package.my_module:MyStrategy``.
"""

from nanotron_ext.strategies import registry
from nanotron_ext.strategies.builtin import optimal_assignment, require_trainable_per_stage  # registers them
from nanotron_ext.strategies.registry import *  # noqa: F403

__all__ = [*registry.__all__, "optimal_assignment", "require_trainable_per_stage"]
