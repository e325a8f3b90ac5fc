"""Nanotron's own trainer with the plan: what ``python -m nanotron_ext.run SCRIPT ...`` installs before it runs
the user's unchanged training script (upstream's ``run_train.py`` or one like it).

* Nanotron's config loader gets the YAML without our keys (``nanotron_ext:``, ``parallelism.cost_strategy``),
  so the user keeps one file.
* ``build_model`` (by every name Nanotron imports it under) plans, validates and builds the split; rank 0
  prints the plan table once; right after the build the freeze spec is applied and the collective check runs
  on every rank, before DDP and the optimizer exist.
* The optimizer is given the trainable parameters only, so a frozen weight is never stepped (weight decay
  would move it even with a zero gradient).
* With ``allow_frozen_stages``, a rank with nothing to train skips DDP (and Nanotron's
  ``check_model_has_grad``) and gets an optimizer over no parameters; every other step of the trainer runs
  as it is. DP replicas of a stage are frozen alike, so DDP's collectives stay within matching ranks.
* ``pp_engine: zb1p``: Nanotron's config casts know the name, so its trainer runs
  :class:`nanotron_ext.zero_bubble.ZeroBubblePipelineEngine` (Nanotron has no zero-bubble engine) and a checkpoint's
  saved config names it. ``pp_engine: zbv`` likewise runs
  :class:`~nanotron_ext.zero_bubble.v_engine.ZeroBubbleVPipelineEngine` with the order of the V the model was built
  on, its sends held to their one order (Nanotron's send waits for its receive on a GPU).
* Gradient clipping adds its norm in one order at every split (:mod:`nanotron_ext.integration.clipping`), so that a
  resume under another split or pp is bit-identical with ``clip_grad`` set.
* Upstream bugs that stop any run, on GPUs too, are fixed while they are present in the installed Nanotron
  (:data:`nanotron_ext.integration.upstream_fixes.UPSTREAM_FIXES`: each is detected, and skipped once upstream
  has its own fix).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from nanotron_ext.checkpoint import ResumeSource
from nanotron_ext.config import EXT_SECTION, PlannerConfig, split_ext_keys
from nanotron_ext.errors import RunFailure
from nanotron_ext.integration.adapter import patch_nanotron
from nanotron_ext.integration.checkpoint_hooks import install_checkpoints
from nanotron_ext.integration.checkpoints import ResumeState
from nanotron_ext.integration.checks import apply_freeze_to_model, check_every_rank_trains
from nanotron_ext.integration.clipping import install_split_independent_clipping
from nanotron_ext.integration.dummy_data import install_dummy_data
from nanotron_ext.integration.replan import LauncherReplan
from nanotron_ext.integration.upstream_fixes import Patches, present_upstream_fixes
from nanotron_ext.models.vocab_chain import VocabShard, label_pp_ranks, replace_lm_head_with_vocab_chain
from nanotron_ext.schedule import ENGINE_AUTO, V_ENGINE
from nanotron_ext.zero_bubble import ZERO_BUBBLE_ENGINES, ZeroBubblePipelineEngine
from nanotron_ext.zero_bubble.v_engine import ZeroBubbleVPipelineEngine

__all__ = ["install_launcher", "strip_ext_keys"]


def strip_ext_keys(config_dict: Any) -> Any:
    """The dict Nanotron's strict loader accepts: ``config_dict`` without our keys (unchanged if it has none)."""
    parallelism = config_dict.get("parallelism") if isinstance(config_dict, dict) else None
    if not isinstance(config_dict, dict) or (
        EXT_SECTION not in config_dict and not (isinstance(parallelism, dict) and "cost_strategy" in parallelism)
    ):
        return config_dict
    return split_ext_keys(config_dict)[0]


def install_launcher(
    cfg: PlannerConfig,
    strategy: str | None = None,
    *,
    say: Callable[[str], None] = print,
    resume: ResumeSource | None = None,
    replan: LauncherReplan | None = None,
    moved: bool = False,
) -> Callable[[], None]:
    """Make Nanotron's own trainer build, freeze, check and train with ``cfg``'s plan; see the module docstring.

    Args:
        cfg: the planner config read from the user's YAML (``load_config``).
        strategy: overrides ``cfg.ext.cost_strategy`` (the launcher's ``--cost-strategy``).
        say: where rank 0 prints the plan and notes (one call per message).
        resume: the checkpoint the run resumes (:func:`nanotron_ext.checkpoint.locate_checkpoint`), if any;
            ``cfg.ext.resume_plan`` says whether its recorded split is kept.
        replan: the run's re-plan after K steps (:mod:`nanotron_ext.integration.replan`), if it has one.
        moved: this launch is a re-plan's move: Nanotron's loader reads ``cfg``'s engine, whatever the YAML says.

    Returns:
        A function that undoes everything installed.

    Raises:
        RunFailure: Nanotron's trainer cannot be imported (flash-attn missing, say); nothing is installed.
    """
    nanotron_config, trainer, NanotronModel = _nanotron_trainer()
    shards = cfg.vocab_shards  # raises while still 'auto'
    checkpoints = ResumeState(cfg, resume, mode=cfg.ext.resume_plan, say=say)

    built: dict[str, Any] = {}

    def after_build(model: Any, ctx: Any) -> None:
        built["plan"] = model.nanotron_ext_plan
        _after_build(model, ctx, say)
        checkpoints.after_build(model, ctx)

    undo_build = patch_nanotron(
        cfg,
        strategy,
        after_build=after_build,
        model_transform=(lambda model: replace_lm_head_with_vocab_chain(model, shards)) if shards > 1 else None,
        choose_plan=checkpoints.choose if resume is not None else None,
    )
    patches = Patches()

    def ready(model: Any) -> Any:
        _freeze_and_check(model, cfg, say)
        return model

    # A move's checkpoint reaches Nanotron through parse_ckpt_path (install_checkpoints); its engine through here.
    _one_config_file(patches, nanotron_config, cfg.run.engine, always=moved)
    if cfg.run.engine in ZERO_BUBBLE_ENGINES or cfg.run.engine == V_ENGINE:
        _zero_bubble_engine(
            patches, say, lambda pp, m: built["plan"].order_for(pp, m), lambda pp, m: built["plan"].transfers_for(pp, m)
        )
    _freeze_and_check_before_ddp(patches, trainer, ready)
    _optimize_trainable_only(patches, NanotronModel)
    _frozen_ranks(patches, trainer)
    if shards > 1:
        _feed_the_vocab_chain(patches, trainer)
    install_checkpoints(patches, trainer, checkpoints)
    install_dummy_data(patches, trainer)
    install_split_independent_clipping(patches, trainer)
    if replan is not None:
        replan.install(patches, trainer, lambda: built["plan"], cfg)
    for fix, target in present_upstream_fixes(trainer):
        fix.apply(patches, target)

    def undo() -> None:
        patches.undo()
        undo_build()

    return undo


def _nanotron_trainer() -> tuple[Any, Any, Any]:
    """Nanotron's config module, its trainer module and ``NanotronModel``, imported.

    Raises:
        RunFailure: any of them cannot be imported, naming what to install or the launcher's ``--cpu-debug``.
    """
    try:
        import nanotron.config.config as nanotron_config
        import nanotron.trainer as trainer
        from nanotron.models.base import NanotronModel
    except Exception as exc:  # ImportError, or upstream's RuntimeError when grouped_gemm is missing
        raise RunFailure(
            f"importing Nanotron's trainer failed ({type(exc).__name__}: {exc}); the launcher runs Nanotron's own "
            f"trainer, which needs what it imports: on a GPU machine `pip install flash-attn` (and grouped_gemm "
            f"for MoE models); without a GPU, add --cpu-debug (python -m nanotron_ext.run --cpu-debug SCRIPT ...) "
            f"to run upstream Nanotron main's trainer on CPU with stand-ins, for debugging, or use "
            f"`nanotron-ext train`, the CPU runtime on Nanotron 0.2"
        ) from exc
    return nanotron_config, trainer, NanotronModel


def _one_config_file(patches: Patches, nanotron_config: Any, engine: str, *, always: bool = False) -> None:
    """Nanotron's strict loader reads the user's YAML without our keys, so the user keeps one file; a
    ``pp_engine: auto`` there reads as ``engine``, the one the planner chose (and the checkpoint's config names), and
    so does any ``pp_engine`` with ``always`` (a re-plan's move, onto the new plan's engine)."""
    load_dict = nanotron_config.get_config_from_dict

    def load(d: Any, *args: Any, **kwargs: Any) -> Any:
        d = strip_ext_keys(d)
        parallelism = d.get("parallelism") if isinstance(d, dict) else None
        if isinstance(parallelism, dict) and (always or str(parallelism.get("pp_engine")).lower() == ENGINE_AUTO):
            d = {**d, "parallelism": {**parallelism, "pp_engine": engine}}
        return load_dict(d, *args, **kwargs)

    patches.set(nanotron_config, "get_config_from_dict", load)


def _zero_bubble_engine(
    patches: Patches,
    say: Callable[[str], None],
    v_order: Callable[[int, int], list[list[Any]]],
    v_transfers: Callable[[int, int], list[list[Any]]],
) -> None:
    """``pp_engine: zb1p``, ``zb2p`` or ``zbv``: Nanotron's string <-> engine casts (its loader's,
    ``ParallelismArgs``', and the serializer that writes a checkpoint's config) know our engines by name; every other
    name is theirs. Each PP rank says once how many linears defer their weight gradient (zb1p, zb2p); zbv runs
    ``v_order``, the built V's order, its sends held to ``v_transfers``, the V's transfers keyed by its own times."""
    import nanotron.config.utils_config as utils_config

    to_engine, to_name = utils_config.cast_str_to_pipeline_engine, utils_config.cast_pipeline_engine_to_str

    def cast_str_to_pipeline_engine(name: Any) -> Any:
        if str(name).lower() == V_ENGINE:  # the order of the V the model is built on; Nanotron's sends wait
            return ZeroBubbleVPipelineEngine(order=v_order, sends_wait=True, transfers=v_transfers)
        engine = ZERO_BUBBLE_ENGINES.get(str(name).lower())
        return engine(say=say) if engine is not None else to_engine(name)

    for module_name in ("utils_config", "config", "parallelism_config"):  # each holds its own reference
        module = importlib.import_module(f"nanotron.config.{module_name}")
        if hasattr(module, "cast_str_to_pipeline_engine"):
            patches.set(module, "cast_str_to_pipeline_engine", cast_str_to_pipeline_engine)
    patches.set(
        utils_config,
        "cast_pipeline_engine_to_str",
        lambda engine: (
            engine.schedule
            if isinstance(engine, (ZeroBubblePipelineEngine, ZeroBubbleVPipelineEngine))
            else to_name(engine)
        ),
    )


def _freeze_and_check_before_ddp(patches: Patches, trainer: Any, ready: Callable[[Any], Any]) -> None:
    """Freeze and check once Nanotron has tied its parameters (tying makes new Parameters, which would thaw a
    frozen norm or embedding), and in any case before DDP or the optimizer sees the model."""
    tie = trainer.mark_tied_parameters
    patches.set(trainer, "mark_tied_parameters", lambda model, *a, **k: (tie(model, *a, **k), ready(model))[0])
    check = trainer.check_model_has_grad
    patches.set(
        trainer,
        "check_model_has_grad",
        lambda model, parallel_context: True if _frozen_rank(ready(model)) else check(model, parallel_context),
    )
    patches.set(trainer, "DistributedDataParallel", _ddp_unless_frozen(trainer.DistributedDataParallel, ready))
    build_optimizer = trainer.init_optimizer_and_grad_accumulator

    def init_optimizer_and_grad_accumulator(*args: Any, model: Any, **kwargs: Any) -> Any:
        return build_optimizer(*args, model=ready(model), **kwargs)

    patches.set(trainer, "init_optimizer_and_grad_accumulator", init_optimizer_and_grad_accumulator)


def _optimize_trainable_only(patches: Patches, NanotronModel: type) -> None:  # noqa: N803 (Nanotron's class)
    """The optimizer steps only what trains: weight decay would move a frozen weight even with a zero gradient."""
    named = NanotronModel.get_named_params_with_correct_tied
    patches.set(
        NanotronModel,
        "get_named_params_with_correct_tied",
        lambda self: ((n, p) for n, p in named(self) if p.requires_grad),
    )


def _frozen_ranks(patches: Patches, trainer: Any) -> None:
    """A rank with nothing to train (``allow_frozen_stages``): no optimizer state to load or move on resume,
    and the trainer's own dp gradient sync sees only parameters that have a gradient."""
    load_optimizer = trainer.load_optimizer

    def load_optimizer_unless_frozen(*args: Any, **kwargs: Any) -> Any:
        # A frozen rank's optimizer is empty and was saved so; Nanotron refuses to load an empty state.
        if _frozen_rank(kwargs.get("model")):
            return None
        return load_optimizer(*args, **kwargs)

    patches.set(trainer, "load_optimizer", load_optimizer_unless_frozen)
    if hasattr(trainer, "state_dict_to_device"):  # upstream main moves a loaded optimizer state to the GPU
        to_device = trainer.state_dict_to_device
        patches.set(
            trainer,
            "state_dict_to_device",
            lambda state_dict, *a, **k: to_device(state_dict, *a, **k) if state_dict.get("state") else None,
        )
    sync = trainer.sync_gradients_across_dp
    patches.set(
        trainer,
        "sync_gradients_across_dp",
        lambda module, *args, **kwargs: sync(_WithGradients(module), *args, **kwargs),
    )


def _after_build(model: Any, parallel_context: Any, say: Callable[[str], None]) -> None:
    import torch.distributed as dist

    plan = model.nanotron_ext_plan
    model.nanotron_ext_context = parallel_context
    model.nanotron_ext_checked = False
    if dist.get_rank() == 0:
        say(
            f"nanotron_ext: {plan.strategy!r} plan for pp={plan.pp}\n{plan.table()}\n\n"
            f"block -> stage: {list(plan.block_ranks)}"
        )


def _freeze_and_check(model: Any, cfg: PlannerConfig, say: Callable[[str], None]) -> None:
    """Once per model: apply the freeze spec to this rank's parameters, then the collective check."""
    import torch.distributed as dist

    model = getattr(model, "module", model)
    if getattr(model, "nanotron_ext_checked", True):  # not built by us, or done already
        return
    model.nanotron_ext_checked = True
    ctx = model.nanotron_ext_context
    apply_freeze_to_model(model, cfg)
    rows = check_every_rank_trains(model, ctx, allow_frozen_stages=cfg.ext.allow_frozen_stages)
    frozen = sorted({r["pp_rank"] for r in rows if r["trainable"] == 0})
    model.nanotron_ext_frozen_rank = dist.get_rank(ctx.pp_pg) in frozen
    if dist.get_rank() == 0 and frozen:
        say(
            f"nanotron_ext: PP rank(s) {frozen} hold nothing trainable and run without DDP and with an empty "
            f"optimizer (allow_frozen_stages: true)"
        )


def _feed_the_vocab_chain(patches: Patches, trainer: Any) -> None:
    """What Nanotron's trainer needs for ``vocab_shards: K > 1``: labels on every rank that holds a shard, and
    an initialiser for the shards' weights."""
    from nanotron.parallel.pipeline_parallel.tensor_pointer import TensorPointer
    from nanotron.scaling.parametrization import Parametrizator

    parametrize = Parametrizator.parametrize

    def parametrize_shards_too(self: Any, param_name: str, module: Any) -> Any:
        # A shard is rows of the lm_head: initialised as the lm_head is (a column-parallel linear).
        if isinstance(module, VocabShard):
            return self._parametrize_column_linear(param_name, module)
        return parametrize(self, param_name, module)

    patches.set(Parametrizator, "parametrize", parametrize_shards_too)
    training_step = trainer.DistributedTrainer.training_step

    def training_step_with_labels(self: Any, dataloader: Any) -> Any:
        # Nanotron's loaders put the labels on the output rank only. Take the step's micro-batches first, then
        # broadcast each one's labels over the pipeline group (every rank calls this at the same point of the
        # step, so the collectives line up), keeping them on the ranks that run a shard.
        import torch.distributed as dist

        model = self.unwrapped_model
        pp_pg = self.parallel_context.pp_pg
        here = dist.get_rank(pp_pg)
        source = dist.get_global_rank(pp_pg, model.output_pp_rank)
        needs = set(label_pp_ranks(model))
        shape = (self.micro_batch_size, self.sequence_length)
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        micro_batches = [dict(next(dataloader)) for _ in range(self.n_micro_batches_per_batch)]
        for mb in micro_batches:
            for key, dtype in (("label_ids", torch.long), ("label_mask", torch.bool)):
                value = mb[key]
                wire = (
                    value.to(device, torch.long)
                    if isinstance(value, torch.Tensor)
                    else torch.empty(shape, dtype=torch.long, device=device)
                )
                dist.broadcast(wire, src=source, group=pp_pg)
                if here in needs:
                    mb[key] = wire.to(dtype)
                elif not isinstance(value, TensorPointer):
                    mb[key] = TensorPointer(group_rank=model.output_pp_rank)
        return training_step(self, iter(micro_batches))

    patches.set(trainer.DistributedTrainer, "training_step", training_step_with_labels)


def _frozen_rank(model: Any) -> bool:
    return bool(getattr(getattr(model, "module", model), "nanotron_ext_frozen_rank", False))


def _ddp_unless_frozen(ddp: type, ready: Callable[[Any], Any]) -> type:
    # A subclass, not a function: the trainer tests `isinstance(model, DistributedDataParallel)` by this name.
    class DistributedDataParallelUnlessFrozen(ddp):  # type: ignore[misc, valid-type]
        def __new__(cls, module: Any, *args: Any, **kwargs: Any) -> Any:
            if _frozen_rank(ready(module)):
                return module  # not an instance of cls, so __init__ is skipped and the model stays unwrapped
            return super().__new__(cls)

    return DistributedDataParallelUnlessFrozen


class _WithGradients:
    """A module seen through the parameters that have a gradient: without DDP, the trainer all-reduces every
    ``param.grad`` over dp itself, and a frozen parameter has none."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        return ((n, p) for n, p in self.module.named_parameters(*args, **kwargs) if p.grad is not None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)
