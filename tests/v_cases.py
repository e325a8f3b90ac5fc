"""The small models the V's split tests share: blocks priced as 2·pp chunks, and which splits keep a block with
weights on every chunk (tests/test_v_split.py, tests/test_v_search.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.config import PlannerConfig, bundled_config, load_config
from nanotron_ext.inventory import inventory_from_config


def v_case(
    name: str, pp: int, layers: int | None = None, **overrides: object
) -> tuple[PlannerConfig, list[BlockInfo], Callable[[Sequence[int]], bool]]:
    """The bundled config ``name`` at 2·pp stages under zb1p, m = 2·pp (``overrides`` on top), optionally cut to
    ``layers`` decoder layers; its blocks; and whether a split keeps a block with weights on every chunk."""
    cfg = load_config(bundled_config(name), pp=2 * pp).with_overrides(
        engine="zb1p", n_micro_batches=2 * pp, **overrides
    )
    if layers is not None:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_hidden_layers=layers))
    blocks = inventory_from_config(cfg)
    weights = [b.params > 0 for b in blocks]

    def valid(bounds: Sequence[int]) -> bool:
        return all(any(weights[s:e]) for s, e in zip(bounds, bounds[1:]))

    return cfg, blocks, valid
