"""Checks that run on every rank after the model is built: freezing what the config names on the blocks this
rank owns, and the collective check that every rank has something to train before DDP or the optimizer."""

from __future__ import annotations

import dataclasses
from typing import Any

from nanotron_ext.blocks import BlockInfo, short_name
from nanotron_ext.config import PlannerConfig
from nanotron_ext.errors import PipelineValidationError
from nanotron_ext.inventory import FreezeSpec, inventory_from_model
from nanotron_ext.inventory.freeze import freeze_module_parameters, frozen_names, tied_embedding_names
from nanotron_ext.report import compact_names, human_count, table

__all__ = ["apply_freeze_to_model", "check_every_rank_trains"]


def apply_freeze_to_model(model: Any, cfg: PlannerConfig, blocks: list[BlockInfo] | None = None) -> int:
    """Freeze, on this rank, the parameters the config's freeze spec names; returns how many were frozen.

    Every rank computes the same frozen set from the whole model's inventory, then touches only the
    parameters it owns, so tied copies on different ranks are frozen alike. The inventory is ``blocks``, else
    the one :func:`build_model` attached, else rebuilt from the model (only names and roles are read).
    """
    spec = FreezeSpec.from_dict(cfg.ext.freeze)
    if spec is None:
        return 0
    unwrapped = getattr(model, "module", model)
    if blocks is None:
        blocks = getattr(unwrapped, "nanotron_ext_blocks", None) or _full_inventory(unwrapped, cfg)
    frozen = frozen_names(spec, blocks, tied=tied_embedding_names(blocks, cfg.model.tie_word_embeddings))
    return freeze_module_parameters(unwrapped.named_parameters(), frozen)


def _full_inventory(model: Any, cfg: PlannerConfig) -> list[BlockInfo]:
    # Names only: blocks other ranks own are rebuilt on `meta`; the spec is applied by the caller.
    return inventory_from_model(model, dataclasses.replace(cfg, ext=dataclasses.replace(cfg.ext, freeze=None)))


def check_every_rank_trains(model: Any, parallel_context: Any, *, allow_frozen_stages: bool = False) -> list[dict]:
    """Collective check, after build and freezing and before DDP or the optimizer.

    Gathers every rank's blocks and parameter counts over the world group; if any rank has no trainable
    parameter (and ``allow_frozen_stages`` is off), *every* rank raises the same table, so none is left
    waiting in a collective.

    Returns:
        One row per world rank: ``world_rank, pp_rank, dp_rank, tp_rank, blocks, params, trainable``.

    Raises:
        PipelineValidationError: some rank would have no gradient.
    """
    import torch.distributed as dist
    from nanotron.parallel.pipeline_parallel.block import PipelineBlock

    unwrapped = getattr(model, "module", model)
    pp_rank = dist.get_rank(parallel_context.pp_pg)
    local = {
        "world_rank": dist.get_rank(),
        "pp_rank": pp_rank,
        "dp_rank": dist.get_rank(parallel_context.dp_pg),
        "tp_rank": dist.get_rank(parallel_context.tp_pg),
        "blocks": [n for n, m in unwrapped.named_modules() if isinstance(m, PipelineBlock) and m.rank == pp_rank],
        "params": sum(p.numel() for p in unwrapped.parameters()),
        "trainable": sum(p.numel() for p in unwrapped.parameters() if p.requires_grad),
    }
    rows: list[dict] = [{} for _ in range(dist.get_world_size(parallel_context.world_pg))]
    dist.all_gather_object(rows, local, group=parallel_context.world_pg)
    bad = [r for r in rows if r["trainable"] == 0]
    if bad and not allow_frozen_stages:
        raise PipelineValidationError(_gradient_report(rows, bad))
    return rows


def _gradient_report(rows: list[dict], bad: list[dict]) -> str:
    body = table(
        ["world", "pp", "dp", "tp", "blocks", "params", "trainable", "verdict"],
        [
            [
                r["world_rank"],
                r["pp_rank"],
                r["dp_rank"],
                r["tp_rank"],
                compact_names([short_name(b) for b in r["blocks"]]),
                human_count(r["params"]),
                human_count(r["trainable"]),
                "NO GRADIENT" if r in bad else "ok",
            ]
            for r in rows
        ],
    )
    stages = sorted({r["pp_rank"] for r in bad})
    weightless = any(r["params"] == 0 for r in bad)
    why = "holds no parameters at all" if weightless else "holds only frozen parameters"
    return (
        f"nanotron_ext: PP rank(s) {stages} would have no gradient — the stage {why}; DDP would stop with "
        f'"Can\'t use DDP because model in PP={stages[0]} has no gradient" and the optimizer with "got an empty '
        f'parameter list".\n{body}\nfix: use `--cost-strategy constrained` (every stage gets a trainable block), '
        f"lower pp, or, for frozen training, set `allow_frozen_stages: true` under `nanotron_ext:`"
    )
