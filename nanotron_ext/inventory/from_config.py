"""The blocks of Nanotron's ``LlamaForTraining``, computed from the config alone (a dry run).

Parameter counts equal what :func:`nanotron_ext.inventory.model.inventory_from_model` reads from a built
model; nothing is built here, no torch, no process group.
"""

from __future__ import annotations

from collections.abc import Sequence

from nanotron_ext.blocks import BlockInfo, ParamInfo, role_of
from nanotron_ext.config import DTYPE_BYTES, ModelShape, PlannerConfig, RunShape
from nanotron_ext.costs.analytic import block_work
from nanotron_ext.inventory.freeze import apply_config_freeze

__all__ = ["inventory_from_config", "llama_block_layout", "llama_class_costs", "make_block"]


def llama_block_layout(m: ModelShape, projector: bool = False) -> list[tuple[str, str, list[tuple[str, int]]]]:
    """Blocks of Nanotron's ``LlamaForTraining`` (and our CPU twin): (name, builder, [(param, numel)]).

    The projector, when asked for, sits right after the embedding, as a VLM's does.
    """
    h, v, d, f = m.hidden_size, m.vocab_size, m.head_dim, m.intermediate_size
    qkv = (m.num_attention_heads + 2 * m.num_key_value_heads) * d * h
    layer = [
        ("input_layernorm.weight", h),
        ("attn.qkv_proj.weight", qkv),
        ("attn.o_proj.weight", m.num_attention_heads * d * h),
        ("post_attention_layernorm.weight", h),
        ("mlp.gate_up_proj.weight", 2 * f * h),
        ("mlp.down_proj.weight", f * h),
    ]
    blocks = [("model.token_position_embeddings", "Embedding", [("token_embedding.weight", v * h)])]
    if projector:
        blocks.append(("model.projector", "Projector", [("proj.weight", h * h)]))
    blocks += [(f"model.decoder.{i}", "LlamaDecoderLayer", list(layer)) for i in range(m.num_hidden_layers)]
    blocks += [
        ("model.final_layer_norm", "RMSNorm", [("weight", h)]),
        ("model.lm_head", "TensorParallelColumnLinear", [("weight", v * h)]),
        ("model.cast_to_fp32", "<lambda>", []),
        ("loss", "Loss", []),
    ]
    return blocks


def llama_class_costs(
    *, hidden_size: int, num_attention_heads: int, intermediate_size: int, vocab_size: int
) -> dict[str, int]:
    """Nanotron's ``LlamaModel.get_block_compute_costs()``, keyed by builder class name.

    Every other class costs 0 in Nanotron's rule, which is why the embedding, norms, cast and loss are
    placed as if free.
    """
    d = hidden_size // num_attention_heads
    return {
        "LlamaDecoderLayer": 4 * num_attention_heads * d * hidden_size + 3 * intermediate_size * hidden_size,
        "TensorParallelColumnLinear": vocab_size * hidden_size,
    }


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
    work = block_work(role, m, run, params)
    return BlockInfo(
        index=index,
        name=name,
        role=role,
        builder=builder,
        params=params,
        trainable=sum(p.numel for p in parameters if p.trainable),
        param_bytes=params * DTYPE_BYTES[run.dtype],
        activation_bytes=work.activation_bytes,
        output_bytes=work.output_bytes,
        flops_fwd=work.flops_fwd,
        flops_bwd_input=work.flops_bwd_input,
        flops_bwd_weight=work.flops_bwd_weight,
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
    """
    m, run = cfg.model, cfg.run
    costs = llama_class_costs(hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
                              intermediate_size=m.intermediate_size, vocab_size=m.vocab_size)
    blocks = []
    for i, (name, builder, params) in enumerate(llama_block_layout(m, projector=cfg.ext.projector)):
        shards = [ParamInfo(f"{name}.pp_block.{p}", _tp_shard(p, n, run.tp, name)) for p, n in params]
        blocks.append(make_block(i, name, builder, shards, m, run, costs.get(builder, 0.0)))
    return apply_config_freeze(blocks, cfg)


_TP_SHARDED = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight", "token_embedding.weight")


def _tp_shard(param: str, numel: int, tp: int, block: str) -> int:
    # Matmul weights and the vocabulary are split across TP ranks; norms and the projector are replicated.
    sharded = param.endswith(_TP_SHARDED) or block.endswith("lm_head")
    return numel // tp if sharded else numel
