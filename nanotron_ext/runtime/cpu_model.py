"""Building a Nanotron model on CPU: parameter tying, initialisation, DDP, and Nanotron's own split.

On the device ``NANOTRON_EXT_DEVICE`` names (CPU by default; :mod:`nanotron_ext.runtime.device`).
Blocks are placed by the adapter's ``assign_blocks`` (:mod:`nanotron_ext.integration.adapter`);
``nanotron_block_ranks`` reports what Nanotron's own ``build_model`` would choose, for comparison.
``mark_tied_parameters`` is a copy of the trainer's function of the same name (``nanotron.trainer`` imports flash-attn
and cannot be imported on CPU).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence

import torch
from nanotron import distributed as dist
from nanotron.config import LlamaConfig, ParallelismArgs
from nanotron.models.base import NanotronModel, build_model
from nanotron.parallel.context import ParallelContext
from nanotron.parallel.parameters import NanotronParameter, sanity_check
from nanotron.parallel.pipeline_parallel.utils import get_pp_rank_of
from nanotron.parallel.tensor_parallel.nn import TensorParallelLinearMode, TensorParallelRowLinear
from nanotron.parallel.tied_parameters import create_pg_for_tied_weights, get_tied_id_to_param, tie_parameters
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from nanotron_ext.integration.adapter import assign_blocks, pipeline_blocks
from nanotron_ext.models.llama import CPULlamaForTraining
from nanotron_ext.runtime.device import device_from_env, host_staging
from nanotron_ext.runtime.p2p import CPUP2P
from nanotron_ext.schedule.zbv import v_rank

__all__ = [
    "build_cpu_llama",
    "cpu_llama",
    "init_weights",
    "mark_tied_parameters",
    "nanotron_block_ranks",
    "wrap_ddp",
]

CPU = torch.device("cpu")


def cpu_llama(
    config: LlamaConfig,
    parallel_context: ParallelContext,
    parallel_config: ParallelismArgs | None = None,
    device: torch.device | None = None,
    **kwargs,
) -> CPULlamaForTraining:
    """``CPULlamaForTraining`` whose blocks talk over this runtime's :class:`CPUP2P` (non-blocking sends,
    host-staged when the model is on CUDA: ``device``, or ``$NANOTRON_EXT_DEVICE`` when None)."""
    device = device if device is not None else device_from_env()
    p2p = CPUP2P(parallel_context.pp_pg, device=CPU, compute_device=device if host_staging(device) else None)
    return CPULlamaForTraining(
        config=config, parallel_context=parallel_context, parallel_config=parallel_config, p2p=p2p, **kwargs
    )


def nanotron_block_ranks(config: LlamaConfig, pp: int, parallel_context: ParallelContext | None = None) -> list[int]:
    """The PP rank Nanotron 0.2's own ``build_model`` gives each block of ``CPULlamaForTraining(config)``.

    Must run inside an initialised world whose PP size is ``pp`` (every rank computes the same list).
    Blocks are built on the ``meta`` device, so this allocates no weights whatever the model size.

    Args:
        config: the model config.
        pp: pipeline-parallel size (checked against the context).
        parallel_context: the context to use; when None, a ``GlooParallelContext(1, pp, world/pp)`` is made
            (and left alive, as process groups cannot be cheaply torn down mid-test).

    Returns:
        One rank per pipeline block in ``named_modules()`` order.

    Raises:
        ValueError: the context's PP size differs from ``pp``.
    """
    if parallel_context is None:
        from nanotron_ext.runtime.context import GlooParallelContext

        world = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
        if world % pp != 0:
            raise ValueError(f"World size {world} is not a multiple of pp={pp}.")
        parallel_context = GlooParallelContext(1, pp, world // pp)
    if parallel_context.pp_pg.size() != pp:
        raise ValueError(
            f"pp={pp} but the parallel context has pipeline_parallel_size={parallel_context.pp_pg.size()}."
        )
    model = build_model(
        model_builder=lambda: cpu_llama(config, parallel_context),
        parallel_context=parallel_context,
        dtype=torch.float32,
        device=torch.device("meta"),
    )
    return [block.rank for _, block in pipeline_blocks(model)]


def mark_tied_parameters(
    model: NanotronModel, parallel_context: ParallelContext, parallel_config: ParallelismArgs | None = None
) -> None:
    """Nanotron trainer's ``mark_tied_parameters``: tie embeddings/lm_head and mark replicated params as tied.

    After this every parameter is a ``NanotronParameter`` (Nanotron's ``sanity_check`` passes) and the process
    groups for tied weights exist in ``parallel_context.world_ranks_to_pg``. Collective over the world.

    Args:
        model: a built model (ranks assigned), not DDP-wrapped.
        parallel_context: its context.
        parallel_config: decides whether TP-replicated weights need a gradient reduction (REDUCE_SCATTER).
    """
    if isinstance(model, DistributedDataParallel):
        raise ValueError("mark_tied_parameters must run before the model is wrapped in DDP.")
    tied_names = model.get_embeddings_lm_head_tied_names()
    if len(tied_names) > 0:
        shared_embeddings = [
            (
                target,
                (
                    int(
                        parallel_context.world_rank_matrix[
                            dist.get_rank(parallel_context.expert_pg),
                            get_pp_rank_of(target, module=model),
                            dist.get_rank(parallel_context.dp_pg),
                            dist.get_rank(parallel_context.tp_pg),
                        ]
                    ),
                ),
            )
            for target in tied_names
        ]
        tie_parameters(
            root_module=model,
            ties=shared_embeddings,
            parallel_context=parallel_context,
            reduce_op=dist.ReduceOp.SUM,
        )
    model.tie_custom_params()

    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if isinstance(param, NanotronParameter) and (param.is_sharded or param.is_tied):
                continue
            if isinstance(module, TensorParallelRowLinear) and param_name == "bias":
                continue
            name = f"{module_name}.{param_name}"
            shared_weights = [(name, tuple(sorted(dist.get_process_group_ranks(parallel_context.tp_pg))))]
            if parallel_config is None or parallel_config.tp_mode is TensorParallelLinearMode.ALL_REDUCE:
                reduce_op = None  # replicated across TP by construction, nothing to reduce
            else:
                reduce_op = dist.ReduceOp.SUM
            tie_parameters(
                root_module=model, ties=shared_weights, parallel_context=parallel_context, reduce_op=reduce_op
            )

    create_pg_for_tied_weights(root_module=model, parallel_context=parallel_context)


def _all_reduce_mean(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    # gloo has no ReduceOp.AVG (Nanotron uses AVG, which only NCCL implements): SUM then divide.
    if group.size() == 1:
        return
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    tensor.div_(group.size())


@torch.no_grad()
def init_weights(
    model: NanotronModel | DistributedDataParallel, parallel_context: ParallelContext, std: float = 0.02
) -> None:
    """Initialise like Nanotron's trainer (``RandomInit``): random init, then DP sync, then tied-weight sync.

    Args:
        model: built and tied model (DDP-wrapped or not).
        parallel_context: its context.
        std: normal std; output projections get ``std / sqrt(2 * num_layers)``.
    """
    unwrapped = model.module if isinstance(model, DistributedDataParallel) else model
    # Nanotron 0.2's init_method_normal / scaled_init_method_normal (gone from Nanotron since), same draws.
    n_layers = unwrapped.config.num_hidden_layers
    unwrapped.init_model_randomly(
        init_method=lambda t: torch.nn.init.normal_(t, mean=0.0, std=std),
        scaled_init_method=lambda t: torch.nn.init.normal_(t, mean=0.0, std=std / math.sqrt(2.0 * n_layers)),
    )
    for _, param in sorted(unwrapped.named_parameters(), key=lambda x: x[0]):
        _all_reduce_mean(param.data, parallel_context.dp_pg)
    tied = get_tied_id_to_param(parameters=list(unwrapped.parameters()), root_module=unwrapped)
    for (_, group_ranks), param in sorted(tied.items(), key=lambda x: x[0]):
        _all_reduce_mean(param.data, parallel_context.world_ranks_to_pg[group_ranks])


def wrap_ddp(model: NanotronModel, parallel_context: ParallelContext) -> NanotronModel | DistributedDataParallel:
    """Wrap in DDP over ``dp_pg`` like Nanotron's trainer, only if DP > 1 and the rank trains something.

    A rank whose parameters are all frozen (or absent) is left unwrapped: DDP refuses modules without
    gradients, and the engine then simply skips the DP gradient sync on that rank.

    Returns:
        The DDP-wrapped model, or the model itself.
    """
    if parallel_context.data_parallel_size <= 1 or not any(p.requires_grad for p in model.parameters()):
        return model
    return DistributedDataParallel(model, process_group=parallel_context.dp_pg, broadcast_buffers=False)


def build_cpu_llama(
    config: LlamaConfig,
    parallel_context: ParallelContext,
    block_ranks: Sequence[int] | None = None,
    parallel_config: ParallelismArgs | None = None,
    dtype: torch.dtype = torch.float32,
    std: float = 0.02,
    projector: bool = False,
    freeze: Callable[[str, nn.Parameter], bool] | None = None,
    ddp: bool = True,
    vocab_shards: int = 1,
    device: torch.device | None = None,
    recompute_layer: bool = False,
    v_stages: Sequence[int] | None = None,
) -> NanotronModel | DistributedDataParallel:
    """Everything Nanotron's trainer does to get a trainable model, on CPU (or the device of ``device``).

    Construct ``CPULlamaForTraining``; place blocks (``block_ranks`` via ``assign_blocks``, or Nanotron's
    greedy ``build_model`` when None); tie parameters; initialise; optionally freeze; optionally wrap in DDP.

    Args:
        config: model config.
        parallel_context: the context.
        block_ranks: explicit per-block PP ranks, or None for Nanotron's own split.
        parallel_config: Nanotron ``ParallelismArgs`` or None.
        dtype: parameter dtype.
        std: init std.
        projector: add the ``model.projector`` block.
        freeze: ``freeze(name, param) -> True`` to set ``requires_grad=False`` on that (local) parameter.
        ddp: wrap in DDP when DP > 1 (see ``wrap_ddp``).
        vocab_shards: K > 1 ends the model with K vocabulary-shard blocks instead of lm_head, cast and loss.
        device: where the parameters live; None: ``$NANOTRON_EXT_DEVICE`` (CPU by default).
        recompute_layer: recompute every decoder layer in its backward (``parallelism.recompute_layer``).
        v_stages: a V for ``pp_engine: zbv``: each block's virtual stage, which sets its rank (``block_ranks``
            is then not given).

    Returns:
        The model (DDP-wrapped where applicable).
    """
    device = device if device is not None else device_from_env()

    def builder() -> CPULlamaForTraining:
        return cpu_llama(
            config,
            parallel_context,
            parallel_config,
            device,
            projector=projector,
            vocab_shards=vocab_shards,
            recompute_layer=recompute_layer,
        )

    if v_stages is not None:
        pp = parallel_context.pp_pg.size()
        ranks = [v_rank(pp, s) for s in v_stages]
        model = assign_blocks(builder(), parallel_context, ranks, dtype=dtype, device=device, v_stages=v_stages)
    elif block_ranks is None:
        model = build_model(model_builder=builder, parallel_context=parallel_context, dtype=dtype, device=device)
    else:
        model = assign_blocks(builder(), parallel_context, block_ranks, dtype=dtype, device=device)
    mark_tied_parameters(model, parallel_context, parallel_config)
    sanity_check(root_module=model)
    init_weights(model, parallel_context, std=std)
    if freeze is not None:
        for name, param in model.named_parameters():
            if freeze(name, param):
                param.requires_grad_(False)
    return wrap_ddp(model, parallel_context) if ddp else model
