"""The blocks of the config's model (any family of :mod:`nanotron_ext.inventory.family_blocks`), computed from the
config alone (a dry run).

Parameter counts equal what :func:`nanotron_ext.inventory.model.inventory_from_model` reads from a built
model; nothing is built here, no torch, no process group.
"""

from __future__ import annotations

from collections.abc import Sequence

from nanotron_ext.blocks import BlockInfo, ParamInfo, role_of
from nanotron_ext.config import DTYPE_BYTES, ModelShape, PlannerConfig, RunShape
from nanotron_ext.inventory.family_blocks import block_layout, class_costs
from nanotron_ext.inventory.flops import block_flops
from nanotron_ext.inventory.freeze import apply_config_freeze

__all__ = ["inventory_from_config", "make_block"]


def make_block(
    index: int,
    name: str,
    builder: str,
    parameters: Sequence[ParamInfo],
    m: ModelShape,
    run: RunShape,
    nanotron_cost: float = 0.0,
) -> BlockInfo:
    """Price one block from its parameters and role."""
    role = role_of(name)
    params = sum(p.numel for p in parameters)
    flops = block_flops(role, m, run, params, layer=int(name.rsplit(".", 1)[-1]) if role == "decoder" else None)
    return BlockInfo(
        index=index,
        name=name,
        role=role,
        builder=builder,
        params=params,
        trainable=sum(p.numel for p in parameters if p.trainable),
        param_bytes=params * DTYPE_BYTES[run.dtype],
        flops_fwd=flops.forward,
        flops_bwd_input=flops.backward_input,
        flops_bwd_weight=flops.backward_weight,
        nanotron_cost=float(nanotron_cost),
        parameters=tuple(parameters),
    )


def inventory_from_config(cfg: PlannerConfig) -> list[BlockInfo]:
    """Blocks of the config's model, computed from its shape alone (nothing is built).

    Parameter counts are per TP shard, as on a GPU rank: column/row-parallel matmuls and the vocabulary are
    split ``tp`` ways, norms are replicated.

    Args:
        cfg: a loaded config (:func:`nanotron_ext.config.load_config`).

    Returns:
        One :class:`BlockInfo` per PipelineBlock in forward order, with the config's freeze spec applied.

    Raises:
        ConfigError: ``vocab_shards: auto`` not yet resolved (:func:`nanotron_ext.plan.resolve_vocab_shards`).
    """
    m, run = cfg.model, cfg.run
    costs = class_costs(m)
    blocks = []
    layout = block_layout(m, projector=cfg.ext.projector, vocab_shards=cfg.vocab_shards)
    for i, (name, builder, params) in enumerate(layout):
        shards = [ParamInfo(f"{name}.pp_block.{p}", _tp_shard(p, n, run.tp, name)) for p, n in params]
        blocks.append(make_block(i, name, builder, shards, m, run, costs.get(builder, 0.0)))
    return apply_config_freeze(blocks, cfg)


# Column- and row-parallel matmuls, column-parallel biases, experts and the vocabulary are split across TP
# ranks; norms, row-parallel biases, routers, Starcoder2's shared kv head and the projector are replicated.
_TP_SHARDED = (
    "qkv_proj.weight",
    "qkv_proj.bias",
    "o_proj.weight",
    "gate_up_proj.weight",
    "down_proj.weight",
    "token_embedding.weight",
    "query_key_value.weight",
    "query_key_value.bias",
    "dense.weight",
    "qkv.q.weight",
    "qkv.q.bias",
    "attn.o.weight",
    "c_fc.weight",
    "c_fc.bias",
    "c_proj.weight",
    "merged_gate_up_proj",
    "merged_down_proj",
    "w1.module.weight",
    "w2.module.weight",
)


def _tp_shard(param: str, numel: int, tp: int, block: str) -> int:
    sharded = param.endswith(_TP_SHARDED) or block.endswith("lm_head") or role_of(block) == "vocab_shard"
    return numel // tp if sharded else numel
