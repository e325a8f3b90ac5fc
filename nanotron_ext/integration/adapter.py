"""Nanotron's ``build_model`` with a planned split: plan from the model's own blocks, validate before any
weight is allocated, then build each block on its rank exactly as Nanotron does; and ``patch_nanotron()``,
which makes Nanotron's own code call it."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from nanotron.models.base import init_on_device_and_dtype
from nanotron.parallel.pipeline_parallel.block import PipelineBlock
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from nanotron_ext.blocks import BlockInfo, short_name
from nanotron_ext.config import PlannerConfig
from nanotron_ext.errors import ConfigError, NanotronExtError, PlanningError
from nanotron_ext.inventory import inventory_from_model
from nanotron_ext.machine import machine_for
from nanotron_ext.plan import Plan, cannot_train_message, make_plan
from nanotron_ext.plan.v_plan import VPlan, make_v_plan
from nanotron_ext.report import compact_names
from nanotron_ext.schedule import V_ENGINE
from nanotron_ext.zero_bubble.v_engine import mark_v_stages

__all__ = [
    "assign_blocks",
    "build_model",
    "patch_nanotron",
    "patched_nanotron",
    "pipeline_blocks",
    "plan_for_model",
]

_ACTIVE: dict[str, Any] = {}
_CUDA = torch.device("cuda")  # Nanotron's default device for build_model
_CPU = torch.device("cpu")


def build_model(
    model_builder: Callable[[], Any],
    parallel_context: Any,
    dtype: torch.dtype,
    target_pp_ranks: list[int] | None = None,
    device: torch.device | None = _CUDA,
    *,
    config: PlannerConfig | None = None,
    strategy: str | None = None,
    plan: Plan | None = None,
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
        plan: build this plan instead of planning (a run's re-plan chose it, under prices the config does not
            hold); it must be a plan of this model's blocks.

    Returns:
        The model with its blocks built on their ranks.

    Raises:
        ConfigError: no config, unknown strategy.
        PlanningError: the plan is infeasible or invalid (every rank raises the same message: the plan is
            deterministic).
    """
    cfg = config or _ACTIVE.get("config")
    if cfg is None:
        raise ConfigError(
            "nanotron_ext.build_model needs the planner config: pass config=load_config(...) "
            "or call patch_nanotron(config) first"
        )
    strategy = strategy or _ACTIVE.get("strategy")
    ranks = list(target_pp_ranks) if target_pp_ranks is not None else list(range(parallel_context.pp_pg.size()))
    if cfg.run.pp != len(ranks):
        cfg = cfg.with_overrides(pp=len(ranks))
    if cfg.ext.machine is not None:  # a profile from another device or backend would misprice this run
        machine_for(cfg, device=(device or _CPU).type, backend=dist.get_backend(parallel_context.world_pg))
    model = model_builder()
    if _ACTIVE.get("model_transform") is not None:
        model = _ACTIVE["model_transform"](model)
    blocks = inventory_from_model(model, cfg)
    if plan is None:
        plan = plan_for_model(model, cfg, strategy, blocks=blocks)
    elif list(plan.block_names) != [b.name for b in blocks]:
        raise PlanningError(
            f"the plan to build names blocks {list(plan.block_names)}, the model has {[b.name for b in blocks]}"
        )
    if _ACTIVE.get("choose_plan") is not None:  # a resume: the checkpoint's recorded split, by default
        plan = _ACTIVE["choose_plan"](plan, blocks, cfg)
    assign_blocks(
        model,
        parallel_context,
        [ranks[s] for s in plan.block_ranks],
        dtype=dtype,
        device=device if device is not None else _CPU,
        v_stages=plan.stages if isinstance(plan, VPlan) else None,
    )
    model.nanotron_ext_plan = plan
    model.nanotron_ext_blocks = blocks
    if _ACTIVE.get("after_build") is not None:
        _ACTIVE["after_build"](model, parallel_context)
    return model


def plan_for_model(
    model: Any, cfg: PlannerConfig, strategy: str | None = None, *, blocks: list[BlockInfo] | None = None
) -> Plan | VPlan:
    """Plan and statically validate a model's split; raise with every finding if it cannot train.

    ``blocks``: the model's inventory when the caller has it already (default: taken from the model). Under
    ``pp_engine: zbv`` the plan is a V (:func:`~nanotron_ext.plan.v_plan.make_v_plan`), which ``strategy`` does not
    choose.
    """
    blocks = blocks if blocks is not None else inventory_from_model(model, cfg)
    if cfg.run.engine == V_ENGINE:
        return make_v_plan(blocks, cfg)
    plan = make_plan(blocks, cfg, strategy)
    if not plan.ok:
        raise PlanningError(cannot_train_message(plan))
    return plan


def pipeline_blocks(model: nn.Module) -> list[tuple[str, PipelineBlock]]:
    """The model's ``PipelineBlock``s in ``named_modules()`` order, which Nanotron assumes is forward order.

    Args:
        model: a Nanotron model (DDP-wrapped or not).

    Returns:
        ``[(module path, block), ...]``, e.g. ``("model.decoder.0", block)``.
    """
    if isinstance(model, DistributedDataParallel):
        model = model.module
    return [(name, module) for name, module in model.named_modules() if isinstance(module, PipelineBlock)]


def assign_blocks(
    model: nn.Module,
    parallel_context: Any,
    block_ranks: Sequence[int],
    dtype: torch.dtype = torch.float32,
    device: torch.device = _CPU,
    v_stages: Sequence[int] | None = None,
) -> nn.Module:
    """Build each pipeline block on its given PP rank, exactly as ``build_model`` does after choosing ranks.

    Args:
        model: an unbuilt model (no ``build_and_set_rank`` called yet), identical on every rank.
        parallel_context: the context whose ``pp_pg`` the model's P2P uses.
        block_ranks: one PP rank per block, in ``pipeline_blocks(model)`` order. Must be non-decreasing
            (a pipeline is a contiguous split) and within ``[0, pp_size)``.
        dtype: parameter dtype.
        device: parameter device.
        v_stages: for ``pp_engine: zbv``, each block's virtual stage of a V: its rank goes down and back up
            (``block_ranks`` must be those stages' ranks), and each block carries its stage (``mark_v_stages``).

    Returns:
        The same model, with ``input_pp_rank`` / ``output_pp_rank`` set as Nanotron sets them.

    Raises:
        ValueError: wrong number of ranks, a rank out of range, ranks that go backwards outside a V, or a V whose
            stages do not match the ranks.
    """
    blocks = pipeline_blocks(model)
    ranks = [int(r) for r in block_ranks]
    pp_size = parallel_context.pp_pg.size()
    if len(ranks) != len(blocks):
        names = compact_names([short_name(name) for name, _ in blocks])
        raise ValueError(
            f"block_ranks has {len(ranks)} entries but the model has {len(blocks)} pipeline blocks "
            f"({names}); give exactly one PP rank per block, in this order."
        )
    bad = [(name, r) for (name, _), r in zip(blocks, ranks) if not 0 <= r < pp_size]
    if bad:
        raise ValueError(
            f"PP ranks must be in [0, {pp_size}) for pipeline_parallel_size={pp_size}; got "
            + ", ".join(f"{name}->{r}" for name, r in bad)
        )
    backwards = [
        (blocks[i - 1][0], ranks[i - 1], blocks[i][0], ranks[i])
        for i in range(1, len(ranks))
        if ranks[i] < ranks[i - 1]
    ]
    if backwards and v_stages is None:
        a, ra, b, rb = backwards[0]
        raise ValueError(
            f"block_ranks must be non-decreasing (contiguous pipeline stages): {a} is on rank {ra} but the "
            f"next block {b} is on rank {rb}. Full assignment: {ranks}."
        )
    with init_on_device_and_dtype(device=device, dtype=dtype):
        for (_, block), rank in zip(blocks, ranks):
            block.build_and_set_rank(rank)
    # build_model sets input to the first target rank and output to the rank its walk ended on, i.e. the
    # last block's rank; with an explicit contiguous assignment both are simply the ends.
    model.input_pp_rank = ranks[0]
    model.output_pp_rank = ranks[-1]
    if v_stages is not None:
        mark_v_stages(model, v_stages, pp_size)
    return model


@contextmanager
def patched_nanotron(config: PlannerConfig, strategy: str | None = None) -> Iterator[None]:
    """Context manager form of :func:`patch_nanotron`; restores Nanotron's functions on exit."""
    undo = patch_nanotron(config, strategy)
    try:
        yield
    finally:
        undo()


def patch_nanotron(
    config: PlannerConfig,
    strategy: str | None = None,
    *,
    after_build: Callable[[Any, Any], None] | None = None,
    model_transform: Callable[[Any], Any] | None = None,
    choose_plan: Callable[[Plan, list[BlockInfo], PlannerConfig], Plan] | None = None,
) -> Callable[[], None]:
    """Make Nanotron's own code (``DistributedTrainer`` included) build models with nanotron_ext.

    Swaps ``build_model`` in ``nanotron.models.base``, ``nanotron.models`` and ``nanotron.trainer`` (which
    imports it by name). All or nothing: if any of them fails to import, whatever was swapped is put back and
    the error says why. The one exception is a ``nanotron.trainer`` that cannot be imported for lack of a
    package (flash-attn on a CPU machine): nothing can run that trainer, so the other two are patched.

    Args:
        config: the planner config.
        strategy: overrides ``config.ext.cost_strategy``.
        after_build: called as ``after_build(model, parallel_context)`` once the blocks are built (the
            launcher freezes and runs the collective check there, before the trainer wraps the model).
        model_transform: applied to the unbuilt model before it is planned (the launcher puts the
            vocabulary-shard chain in there).
        choose_plan: given the plan the config makes, the blocks and the config, the plan to build (the launcher
            keeps a resumed checkpoint's recorded split there).

    Returns:
        A function that undoes the patch.

    Raises:
        NanotronExtError: a module failed to import; nothing is left patched.
    """
    import importlib

    undo: list[tuple[Any, str, Any]] = []

    def restore() -> None:
        for module, name, original in reversed(undo):
            setattr(module, name, original)
        undo.clear()
        _ACTIVE.clear()

    for module_name in _PATCHED_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            if module_name == "nanotron.trainer" and exc.name != "nanotron":
                continue  # e.g. flash_attn missing: that trainer cannot run on this machine anyway
            restore()
            raise NanotronExtError(_patch_failure(module_name, exc)) from exc
        except Exception as exc:  # upstream's trainer raises RuntimeError without grouped_gemm, for one
            restore()
            raise NanotronExtError(_patch_failure(module_name, exc)) from exc
        undo.append((module, "build_model", module.build_model))
        module.build_model = build_model
    _ACTIVE.update(
        config=config,
        strategy=strategy,
        after_build=after_build,
        model_transform=model_transform,
        choose_plan=choose_plan,
    )
    return restore


_PATCHED_MODULES = ("nanotron.models.base", "nanotron.models", "nanotron.trainer")


def _patch_failure(module_name: str, exc: BaseException) -> str:
    return (
        f"patch_nanotron: importing {module_name} failed ({type(exc).__name__}: {exc}), so nothing was patched. "
        f"Install what it names (on a GPU machine flash-attn, and grouped_gemm for MoE models), or call "
        f"nanotron_ext.integration.build_model yourself where your script builds the model"
    )
