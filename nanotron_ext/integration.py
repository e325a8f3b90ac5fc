"""The one adapter that touches Nanotron: a drop-in ``build_model``, ``patch_nanotron()``, and the collective
check that every PP rank has something to train before DDP or the optimizer see the model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from nanotron_ext.config import PlannerConfig
from nanotron_ext.errors import ConfigError, NanotronExtError, PlanningError
from nanotron_ext.freeze import FreezeSpec, freeze_module_parameters, frozen_names, tied_embedding_names
from nanotron_ext.inventory import BlockInfo, inventory_from_model, role_of
from nanotron_ext.plan import Plan, make_plan
from nanotron_ext.report import compact_names, human_count, table

_ACTIVE: dict[str, Any] = {}
_CUDA = torch.device("cuda")  # Nanotron's default device for build_model


class PipelineValidationError(NanotronExtError, RuntimeError):
    """Raised on every rank at once when some PP rank would have no gradient."""


def build_model(
    model_builder: Callable[[], Any],
    parallel_context: Any,
    dtype: torch.dtype,
    target_pp_ranks: list[int] | None = None,
    device: torch.device | None = _CUDA,
    *,
    config: PlannerConfig | None = None,
    strategy: str | None = None,
) -> Any:
    """Nanotron's ``build_model`` with the split chosen by a nanotron_ext strategy.

    Plans from the model's own blocks (built on ``meta``, nothing allocated), runs the static validator
    *before* any weight exists, then calls ``build_and_set_rank`` on every block exactly as Nanotron does and
    sets ``input_pp_rank`` / ``output_pp_rank``. The plan is attached as ``model.nanotron_ext_plan`` and the
    inventory it was made from as ``model.nanotron_ext_blocks`` (:func:`apply_freeze_to_model` reuses it).

    Args:
        model_builder: returns the unbuilt ``NanotronModel`` (same on every rank).
        parallel_context: Nanotron's ``ParallelContext`` (or our gloo one).
        dtype: parameter dtype.
        target_pp_ranks: PP ranks to use, default all.
        device: parameter device (Nanotron's default is CUDA).
        config: the planner config; defaults to the one given to :func:`patch_nanotron`.
        strategy: overrides ``config.ext.cost_strategy``.

    Returns:
        The model with its blocks built on their ranks.

    Raises:
        ConfigError: no config, unknown strategy.
        PlanningError: the plan is infeasible or invalid (every rank raises the same message: the plan is
            deterministic).
    """
    from nanotron_ext.runtime.build import assign_blocks

    cfg = config or _ACTIVE.get("config")
    if cfg is None:
        raise ConfigError("nanotron_ext.build_model needs the planner config: pass config=load_config(...) "
                          "or call patch_nanotron(config) first")
    strategy = strategy or _ACTIVE.get("strategy")
    ranks = list(target_pp_ranks) if target_pp_ranks is not None else list(range(parallel_context.pp_pg.size()))
    if cfg.run.pp != len(ranks):
        cfg = cfg.with_overrides(pp=len(ranks))
    model = model_builder()
    blocks = inventory_from_model(model, cfg)
    plan = plan_for_model(model, cfg, strategy, blocks=blocks)
    assign_blocks(model, parallel_context, [ranks[s] for s in plan.block_ranks], dtype=dtype,
                  device=device if device is not None else torch.device("cpu"))
    model.nanotron_ext_plan = plan
    model.nanotron_ext_blocks = blocks
    return model


def plan_for_model(
    model: Any, cfg: PlannerConfig, strategy: str | None = None, *, blocks: list[BlockInfo] | None = None
) -> Plan:
    """Plan and statically validate a model's split; raise with every finding if it cannot train.

    ``blocks``: the model's inventory when the caller has it already (default: taken from the model).
    """
    blocks = blocks if blocks is not None else inventory_from_model(model, cfg)
    plan = make_plan(blocks, cfg, strategy)
    if not plan.ok:
        raise PlanningError(
            f"nanotron_ext: the {plan.strategy!r} plan for pp={plan.pp} cannot train; nothing was allocated.\n"
            + plan.table() + "\n" + "\n".join(str(f) for f in plan.findings if f.severity == "error")
        )
    return plan


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
    def short(name: str) -> str:
        role = role_of(name)
        return f"decoder.{name.rsplit('.', 1)[-1]}" if role == "decoder" else role

    body = table(
        ["world", "pp", "dp", "tp", "blocks", "params", "trainable", "verdict"],
        [[r["world_rank"], r["pp_rank"], r["dp_rank"], r["tp_rank"], compact_names([short(b) for b in r["blocks"]]),
          human_count(r["params"]), human_count(r["trainable"]), "NO GRADIENT" if r in bad else "ok"] for r in rows],
    )
    stages = sorted({r["pp_rank"] for r in bad})
    weightless = any(r["params"] == 0 for r in bad)
    why = ("holds no parameters at all" if weightless else "holds only frozen parameters")
    return (
        f"nanotron_ext: PP rank(s) {stages} would have no gradient — the stage {why}; DDP would stop with "
        f"\"Can't use DDP because model in PP={stages[0]} has no gradient\" and the optimizer with \"got an empty "
        f"parameter list\".\n{body}\nfix: use `--cost-strategy constrained` (every stage gets a trainable block), "
        f"lower pp, or, for frozen training, set `allow_frozen_stages: true` under `nanotron_ext:`"
    )


@contextmanager
def patched_nanotron(config: PlannerConfig, strategy: str | None = None) -> Iterator[None]:
    """Context manager form of :func:`patch_nanotron`; restores Nanotron's functions on exit."""
    undo = patch_nanotron(config, strategy)
    try:
        yield
    finally:
        undo()


def patch_nanotron(config: PlannerConfig, strategy: str | None = None) -> Callable[[], None]:
    """Make Nanotron's own code (``DistributedTrainer`` included) build models with nanotron_ext.

    Swaps ``nanotron.models.base.build_model``, ``nanotron.models.build_model`` and, where importable (it needs
    flash-attn), the name inside ``nanotron.trainer``.

    Returns:
        A function that undoes the patch.
    """
    import importlib

    _ACTIVE.update(config=config, strategy=strategy)
    undo: list[tuple[Any, str, Any]] = []
    for module_name in ("nanotron.models.base", "nanotron.models", "nanotron.trainer"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # nanotron.trainer imports flash_attn, absent on CPU machines
            continue
        undo.append((module, "build_model", module.build_model))
        module.build_model = build_model

    def restore() -> None:
        for module, name, original in reversed(undo):
            setattr(module, name, original)
        _ACTIVE.clear()

    return restore
