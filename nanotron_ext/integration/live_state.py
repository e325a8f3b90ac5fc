"""This rank's live model and optimizer as the checkpoint code describes them: each parameter as the checkpoint
must fill it (:class:`nanotron_ext.checkpoint.Need`), the optimizer's entries by name
(:class:`nanotron_ext.checkpoint.reshard.LiveOptimizer`), and the vocabulary chain's shards."""

from __future__ import annotations

from typing import Any

from nanotron_ext.checkpoint import Need, canonical_name
from nanotron_ext.checkpoint.boxes import Piece, full_box, pieces_of
from nanotron_ext.checkpoint.reshard import LiveEntry, LiveOptimizer
from nanotron_ext.errors import CheckpointError
from nanotron_ext.models.vocab_chain import VocabShard

__all__ = ["chain_of", "live_optimizer", "local_needs", "vocab_bounds"]


def chain_of(model: Any) -> list[Any]:
    """The vocabulary chain's ``PipelineBlock``s of a built model, in order (every rank's, built or not)."""
    return list(getattr(getattr(getattr(model, "module", model), "model", None), "vocab_shards", None) or [])


def vocab_bounds(model: Any) -> tuple[tuple[int, int], ...]:
    return tuple((b.module_kwargs["lo"], b.module_kwargs["hi"]) for b in chain_of(model))


def local_needs(model: Any, parallel_context: Any) -> list[tuple[Need, Any]]:
    """This rank's live parameters, each as the checkpoint must fill it."""
    import torch.distributed as dist

    prefixes = {id(m): f"{n}." for n, m in model.named_modules()}
    prefixes[id(model)] = ""
    shards = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, VocabShard)}
    rows = max((hi for _, hi in vocab_bounds(model)), default=0)
    rank, dp = dist.get_rank(parallel_context.world_pg), dist.get_rank(parallel_context.dp_pg)
    out = []
    for local_name, param in model.named_parameters():
        shape = tuple(param.shape)
        tied = bool(getattr(param, "is_tied", False))
        # Nanotron saves a tied parameter under its tied name; a vocabulary shard as rows of the lm_head.
        name = canonical_name(
            param.get_tied_info().get_full_name_from_module_id_to_prefix(module_id_to_prefix=prefixes)
            if tied
            else local_name
        )
        if local_name in shards:
            module = shards[local_name]
            whole = (rows, *shape[1:])
            pieces: tuple[Piece, ...] = (Piece(full_box(shape), ((module.lo, module.hi), *full_box(shape[1:]))),)
        elif getattr(param, "is_sharded", False):
            info = param.get_sharded_info()
            whole = tuple(int(n) for n in info.unsharded_shape)
            pieces = pieces_of(
                [(p.local_slices, p.global_slices) for p in info.local_global_slices_pairs], shape, whole
            )
        else:
            whole, pieces = shape, (Piece(full_box(shape), full_box(shape)),)
        out.append((Need(name, local_name, rank, dp, shape, whole, pieces, param.requires_grad, tied), param))
    return out


def live_optimizer(optimizer: Any, needs: dict[str, Need], parallel_context: Any) -> LiveOptimizer:
    """The live Nanotron optimizer as :class:`LiveOptimizer`: torch numbers its state by parameter, group after
    group; Nanotron's ``id_to_name`` names each (the tied name for a tied parameter); ZeRO-1 keeps, per name, the
    flat range each dp rank updates."""
    import torch.distributed as dist

    params = [p for g in optimizer.param_groups for p in g["params"]]
    offsets = getattr(optimizer, "param_name_to_dp_rank_offsets", None)
    dp = dist.get_rank(parallel_context.dp_pg)
    entries = []
    for index, param in enumerate(params):
        name = optimizer.id_to_name[id(param)]
        need = needs.get(name)
        if need is None:
            raise CheckpointError(f"the optimizer holds {name}, which is no parameter of this rank's model")
        span = None if offsets is None else tuple(int(x) for x in offsets[name][dp])
        entries.append(LiveEntry(index, name, need, span))  # type: ignore[arg-type]
    template = optimizer.state_dict()
    return LiveOptimizer(tuple(entries), tuple(template["param_groups"]), "gradient_accumulator" in template)
