"""Training steps through Nanotron's real pipeline engines, as ``DistributedTrainer`` does them.

``train_step`` mirrors ``DistributedTrainer.training_step``: ``engine.train_batch_iter`` over ``pp_pg``, DP
gradient sync (DDP, or a manual all-reduce when the model is not DDP-wrapped), tied-weight gradient sync,
optional clipping with Nanotron's ``clip_grad_norm``, optimizer step, ``zero_grad``. The optimizer comes from
Nanotron's ``init_optimizer_and_grad_accumulator`` (``NamedOptimizer`` around ``torch.optim.AdamW`` with
``fused=False``).

CPU/gloo workarounds (Nanotron's code is used unmodified otherwise):
- gloo has no ``ReduceOp.AVG``: DP averages are SUM then divide.
- ``clip_grad_norm`` allocates a CUDA tensor when a rank has no gradient; such ranks join the same collective
  with a zero on the runtime's device instead.
- ``FP32GradientAccumulator`` allocates CUDA buffers, so ``accumulate_grad_in_fp32`` is refused.
- Under ``NANOTRON_EXT_DEVICE=cuda`` micro-batches move to the rank's GPU, the tied-weight gradient sync is
  host-staged (gloo's ``all_reduce_coalesced`` is CPU-only) and the step's loss is reduced on the host
  (:mod:`nanotron_ext.runtime.device`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from nanotron import distributed as dist
from nanotron.config import LRSchedulerArgs, OptimizerArgs
from nanotron.helpers import init_optimizer_and_grad_accumulator
from nanotron.models.base import NanotronModel
from nanotron.optim.base import BaseOptimizer
from nanotron.optim.clip_grads import clip_grad_norm
from nanotron.optim.gradient_accumulator import GradientAccumulator
from nanotron.parallel.context import ParallelContext
from nanotron.parallel.pipeline_parallel.engine import (
    AllForwardAllBackwardPipelineEngine,
    OneForwardOneBackwardPipelineEngine,
    PipelineEngine,
)
from nanotron.parallel.pipeline_parallel.tensor_pointer import TensorPointer
from torch.nn.parallel import DistributedDataParallel

from nanotron_ext.integration.clipping import split_independent_clip_grad_norm
from nanotron_ext.models.vocab_chain import label_pp_ranks
from nanotron_ext.plan import Plan
from nanotron_ext.plan.v_plan import VPlan
from nanotron_ext.runtime.device import device_from_env, sync_tied_gradients
from nanotron_ext.runtime.p2p import wait_pending_sends
from nanotron_ext.runtime.send_order import SendOrder, send_order
from nanotron_ext.schedule import Engine, too_few_micro_batches
from nanotron_ext.zero_bubble import ZERO_BUBBLE_ENGINES, ZeroBubblePipelineEngine
from nanotron_ext.zero_bubble.v_engine import ZeroBubbleVPipelineEngine

__all__ = [
    "EngineName",
    "MicroBatch",
    "build_optimizer",
    "engine_for",
    "make_engine",
    "make_micro_batch",
    "train_step",
    "train_steps",
]

EngineName = Engine
MicroBatch = dict[str, torch.Tensor | TensorPointer]

_ENGINES: dict[Engine, type[PipelineEngine]] = {
    "1f1b": OneForwardOneBackwardPipelineEngine,
    "afab": AllForwardAllBackwardPipelineEngine,
    **ZERO_BUBBLE_ENGINES,  # ours: Nanotron has no zero-bubble engine (nanotron_ext.zero_bubble)
    "zbv": ZeroBubbleVPipelineEngine,  # type: ignore[dict-item]  # by name: the order on equal times (engine_for)
}


def make_engine(engine: EngineName | PipelineEngine) -> PipelineEngine:
    """Nanotron pipeline engine from a name.

    Args:
        engine: ``"1f1b"`` (OneForwardOneBackward), ``"afab"`` (AllForwardAllBackward), ``"zb1p"`` or ``"zb2p"``
            (:mod:`nanotron_ext.zero_bubble`), or an engine instance.

    Returns:
        The engine.

    Raises:
        ValueError: unknown name.
    """
    if isinstance(engine, PipelineEngine):
        return engine
    key = str(engine).lower()
    if key not in _ENGINES:
        raise ValueError(f"Unknown pipeline engine {engine!r}; use one of {sorted(_ENGINES)}.")
    return _ENGINES[key]()


def engine_for(plan: Plan | VPlan) -> PipelineEngine:
    """The engine that runs ``plan``: its engine by name, and for a V the order its plan chose."""
    if isinstance(plan, VPlan):
        return ZeroBubbleVPipelineEngine(order=plan.order_for)
    return make_engine(plan.engine)


def engine_name_of(engine: PipelineEngine) -> Engine:
    """``"1f1b"``, ``"afab"``, ``"zb1p"`` or ``"zb2p"`` for an engine instance (its class or a subclass of one)."""
    if isinstance(engine, ZeroBubblePipelineEngine):
        return engine.schedule
    for name, cls in _ENGINES.items():
        if isinstance(engine, cls):
            return name
    return "afab"  # another engine: no micro-batch rule of 1F1B's to check


def _unwrap(model: NanotronModel | DistributedDataParallel) -> NanotronModel:
    return model.module if isinstance(model, DistributedDataParallel) else model


def make_micro_batch(
    model: NanotronModel | DistributedDataParallel,
    parallel_context: ParallelContext,
    input_ids: torch.Tensor,
    label_ids: torch.Tensor,
    input_mask: torch.Tensor | None = None,
    label_mask: torch.Tensor | None = None,
) -> MicroBatch:
    """A micro-batch as Nanotron's data loader hands it to the engine.

    Inputs live only on ``model.input_pp_rank`` and labels only on ``model.output_pp_rank`` (or, with a
    vocabulary-shard chain, on every rank holding a shard: ``nanotron_ext.models.vocab_chain.label_pp_ranks``); every
    other rank gets ``TensorPointer``s (a real tensor on a rank that does not own its block would be *sent* to that
    block).

    Args:
        model: built model (``input_pp_rank`` / ``output_pp_rank`` set).
        parallel_context: its context.
        input_ids: ``[batch, seq]`` token ids.
        label_ids: ``[batch, seq]`` target ids.
        input_mask: bool ``[batch, seq]``; all True when None.
        label_mask: bool ``[batch, seq]``; all True when None.

    Returns:
        ``{"input_ids", "input_mask", "label_ids", "label_mask"}``, on the runtime's device
        (``$NANOTRON_EXT_DEVICE``).
    """
    device = device_from_env()
    input_ids, label_ids = input_ids.to(device), label_ids.to(device)  # no copy when already there
    input_mask = input_mask.to(device) if input_mask is not None else None
    label_mask = label_mask.to(device) if label_mask is not None else None
    unwrapped = _unwrap(model)
    pp_rank = dist.get_rank(parallel_context.pp_pg)
    if input_mask is None:
        input_mask = torch.ones_like(input_ids, dtype=torch.bool)
    if label_mask is None:
        label_mask = torch.ones_like(label_ids, dtype=torch.bool)
    in_rank, out_rank = unwrapped.input_pp_rank, unwrapped.output_pp_rank
    # A vocabulary-shard chain reads the labels on every rank holding a shard (nanotron_ext.models.vocab_chain).
    label_ranks = label_pp_ranks(unwrapped)
    has_labels = pp_rank in label_ranks
    return {
        "input_ids": input_ids if pp_rank == in_rank else TensorPointer(group_rank=in_rank),
        "input_mask": input_mask if pp_rank == in_rank else TensorPointer(group_rank=in_rank),
        "label_ids": label_ids if has_labels else TensorPointer(group_rank=out_rank),
        "label_mask": label_mask if has_labels else TensorPointer(group_rank=out_rank),
    }


def build_optimizer(
    model: NanotronModel | DistributedDataParallel,
    parallel_context: ParallelContext,
    learning_rate: float = 1e-3,
    weight_decay: float = 0.0,
    adam_eps: float = 1e-8,
    adam_betas: tuple[float, float] = (0.9, 0.95),
    zero_stage: int = 0,
    accumulate_grad_in_fp32: bool = False,
) -> tuple[BaseOptimizer | None, GradientAccumulator | None]:
    """Nanotron's optimizer (``init_optimizer_and_grad_accumulator``) with CPU-safe settings.

    A rank with no trainable parameter gets ``(None, None)``: torch refuses an optimizer over an empty
    parameter list, and such a rank has nothing to update.

    Args:
        model: built model, DDP-wrapped or not.
        parallel_context: its context.
        learning_rate: AdamW learning rate (constant; pass an LR scheduler to ``train_step`` to vary it).
        weight_decay: AdamW weight decay.
        adam_eps: AdamW eps.
        adam_betas: AdamW betas.
        zero_stage: 0, or 1 for Nanotron's ZeRO-1 (untested on CPU).
        accumulate_grad_in_fp32: must be False on CPU.

    Returns:
        ``(optimizer, grad_accumulator)``; the accumulator is None as fp32 accumulation is unavailable.

    Raises:
        NotImplementedError: ``accumulate_grad_in_fp32=True`` (Nanotron's FP32 accumulator is CUDA-only).
        ValueError: ``zero_stage`` not 0 or 1.
    """
    if accumulate_grad_in_fp32:
        raise NotImplementedError(
            "accumulate_grad_in_fp32=True uses Nanotron's FP32GradientAccumulator, which allocates CUDA "
            "buffers; use accumulate_grad_in_fp32=False on CPU (parameters are already fp32 here)."
        )
    if zero_stage not in (0, 1):
        raise ValueError(f"zero_stage must be 0 or 1 (Nanotron 0.2 supports ZeRO-1 only), got {zero_stage}.")
    if not any(p.requires_grad for p in _unwrap(model).parameters()):
        return None, None
    optimizer_args = OptimizerArgs(
        zero_stage=zero_stage,
        weight_decay=weight_decay,
        clip_grad=None,
        accumulate_grad_in_fp32=False,
        adam_eps=adam_eps,
        adam_beta1=adam_betas[0],
        adam_beta2=adam_betas[1],
        torch_adam_is_fused=False,  # fused AdamW is CUDA-only
        learning_rate_scheduler=LRSchedulerArgs(
            learning_rate=learning_rate, lr_warmup_style="linear", lr_decay_style="linear"
        ),
    )
    return init_optimizer_and_grad_accumulator(
        model=model, optimizer_args=optimizer_args, parallel_context=parallel_context
    )


def _sync_dp_gradients_manually(model: NanotronModel, parallel_context: ParallelContext) -> None:
    # Nanotron's sync_gradients_across_dp uses ReduceOp.AVG (NCCL-only) and touches frozen params' None grads.
    dp_pg = parallel_context.dp_pg
    if dp_pg.size() == 1:
        return
    for _, param in sorted(model.named_parameters(), key=lambda x: x[0]):
        if not param.requires_grad:
            continue
        if param.grad is None:
            # Every DP replica must join each all-reduce; a missing grad counts as zero.
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=dp_pg)
        param.grad.div_(dp_pg.size())


def _clip_gradients(model: NanotronModel, parallel_context: ParallelContext, max_norm: float) -> torch.Tensor:
    """Nanotron's clipping, its total norm added in one order whatever the split (the launcher's clipping: two
    splits, a V among them, train to the same bits)."""
    named_parameters = [(n, p) for n, p in model.get_named_params_with_correct_tied() if p.requires_grad]
    # Made per step: it gathers the parameters' names once per process group, and tests reuse group ids.
    clip = split_independent_clip_grad_norm(clip_grad_norm)
    return clip(
        mp_pg=parallel_context.mp_pg, named_parameters=named_parameters, max_norm=max_norm, grad_accumulator=None
    )


def train_step(
    model: NanotronModel | DistributedDataParallel,
    parallel_context: ParallelContext,
    engine: EngineName | PipelineEngine,
    micro_batches: Iterable[MicroBatch],
    n_micro_batches: int,
    optimizer: BaseOptimizer | torch.optim.Optimizer | None,
    grad_accumulator: GradientAccumulator | None = None,
    clip_grad: float | None = None,
    lr_scheduler: Any | None = None,
    grad_norms: list[float] | None = None,
    sends: SendOrder = "nanotron",
) -> float:
    """One optimisation step, the way ``DistributedTrainer.training_step`` does it. Collective on every rank.

    Args:
        model: built, tied, initialised model (DDP-wrapped when DP > 1 and the rank trains something).
        parallel_context: its context.
        engine: ``"1f1b"``, ``"afab"``, ``"zb1p"``, ``"zb2p"`` or a Nanotron engine instance.
        micro_batches: micro-batches (``make_micro_batch``); ``n_micro_batches`` of them are consumed.
        n_micro_batches: micro-batches per step (gradient accumulation).
        optimizer: Nanotron/torch optimizer, or None on a rank with nothing trainable (step skipped).
        grad_accumulator: Nanotron gradient accumulator or None.
        clip_grad: max global grad norm, or None for no clipping.
        lr_scheduler: object with ``step()``, called after the optimizer step.
        grad_norms: when given, the global gradient norm (before clipping) is appended to it; every rank of
            the model-parallel group joins the reduction, frozen ones included, so all log the same value.
        sends: ``"nanotron"``: one queued send of each kind per communication point, as Nanotron's pipeline state
            does; ``"eager"``: every queued send at once (:mod:`nanotron_ext.runtime.send_order`).

    Returns:
        The step's loss (mean over micro-batches and DP replicas), identical on every rank.

    Raises:
        ValueError: ``n_micro_batches`` < 1, too few for 1F1B (needs at least ``pp - 1``), or an unknown
            ``sends``.
    """
    pp_pg = parallel_context.pp_pg
    if n_micro_batches < 1:
        raise ValueError(f"n_micro_batches must be >= 1, got {n_micro_batches}.")
    pipeline_engine = make_engine(engine)
    engine_name = engine_name_of(pipeline_engine)
    shortfall = too_few_micro_batches(engine_name, pp_pg.size(), n_micro_batches)
    if shortfall is not None:
        raise ValueError(shortfall)
    unwrapped = _unwrap(model)
    iterator: Iterator[MicroBatch] = iter(micro_batches)
    with send_order(sends):
        outputs = pipeline_engine.train_batch_iter(
            model=model,
            pg=pp_pg,
            batch=(next(iterator) for _ in range(n_micro_batches)),
            nb_microbatches=n_micro_batches,
            grad_accumulator=grad_accumulator,
        )
    # Sends were posted asynchronously (CPUP2P); make sure the peer has taken them before buffers are reused.
    wait_pending_sends(unwrapped)
    _finish_gradients(model, parallel_context, grad_accumulator, clip_grad, grad_norms)
    loss = _step_loss(outputs, parallel_context, unwrapped.output_pp_rank)
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad()
    if lr_scheduler is not None:
        lr_scheduler.step()
    return loss


def _finish_gradients(
    model: NanotronModel | DistributedDataParallel,
    parallel_context: ParallelContext,
    grad_accumulator: GradientAccumulator | None,
    clip_grad: float | None,
    grad_norms: list[float] | None,
) -> None:
    """After the pipeline, as the trainer does: dp average (unless DDP did it), tied weights, clipping."""
    unwrapped = _unwrap(model)
    if not isinstance(model, DistributedDataParallel):
        # DDP already averaged gradients in the last backward; otherwise do it here, as the trainer does.
        _sync_dp_gradients_manually(unwrapped, parallel_context)
    sync_tied_gradients(unwrapped, parallel_context, grad_accumulator)  # host-staged on CUDA
    if clip_grad is not None or grad_norms is not None:
        # max_norm=inf measures without scaling.
        norm = _clip_gradients(unwrapped, parallel_context, clip_grad if clip_grad is not None else math.inf)
        if grad_norms is not None:
            grad_norms.append(float(norm))


def _step_loss(outputs: list[dict[str, Any]], parallel_context: ParallelContext, output_pp_rank: int) -> float:
    """The step's loss on every rank: summed over micro-batches (the engine already divided each by their
    number), averaged over DP, broadcast from the output stage over the pipeline so any rank can log it."""
    loss = torch.zeros([], dtype=torch.float)
    if len(outputs) > 0 and isinstance(outputs[0]["loss"], torch.Tensor):
        loss = torch.stack([output["loss"].detach().float() for output in outputs]).sum().cpu()  # on the host
        dp_pg = parallel_context.dp_pg
        if dp_pg.size() > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=dp_pg)
            loss.div_(dp_pg.size())
    pp_pg = parallel_context.pp_pg
    dist.broadcast(loss, src=dist.get_global_rank(pp_pg, output_pp_rank), group=pp_pg)
    return float(loss.item())


def train_steps(
    model: NanotronModel | DistributedDataParallel,
    parallel_context: ParallelContext,
    engine: EngineName | PipelineEngine,
    batches_iter: Iterable[MicroBatch],
    n_micro_batches: int,
    optimizer: BaseOptimizer | torch.optim.Optimizer | None,
    *,
    n_steps: int = 1,
    **step_kwargs: Any,
) -> list[float]:
    """``n_steps`` calls of :func:`train_step` over one micro-batch stream.

    Args:
        batches_iter: micro-batch stream; ``n_steps * n_micro_batches`` micro-batches are consumed.
        n_steps: number of optimisation steps.
        step_kwargs: passed to every :func:`train_step` (``grad_accumulator``, ``clip_grad``, ``lr_scheduler``).
        Others: as in ``train_step``.

    Returns:
        The loss of every step (identical on every rank).
    """
    pipeline_engine = make_engine(engine)
    iterator = iter(batches_iter)
    return [
        train_step(model, parallel_context, pipeline_engine, iterator, n_micro_batches, optimizer, **step_kwargs)
        for _ in range(n_steps)
    ]
