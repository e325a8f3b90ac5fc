"""Block inventory: one record per Nanotron ``PipelineBlock``, in forward order.

Two sources that agree exactly on parameter counts:

* :func:`inventory_from_config` computes the blocks of Nanotron's ``LlamaForTraining`` from the shape alone
  (a dry run: no torch model, no process group);
* :func:`inventory_from_model` reads a real model, building each block's module on the ``meta`` device so
  nothing is allocated.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from nanotron_ext.config import DTYPE_BYTES, ModelShape, PlannerConfig, RunShape
from nanotron_ext.costs import block_work

Role = Literal["embedding", "projector", "decoder", "final_norm", "lm_head", "cast", "loss", "other"]
ROLES: tuple[str, ...] = ("embedding", "projector", "decoder", "final_norm", "lm_head", "cast", "loss", "other")


@dataclass(frozen=True)
class ParamInfo:
    """One parameter tensor of a block (name relative to the model, Nanotron's spelling)."""

    name: str
    numel: int
    trainable: bool = True


@dataclass(frozen=True)
class BlockInfo:
    """One pipeline block, as the planner sees it.

    Attributes:
        index: position in forward order.
        name: module path, e.g. ``model.decoder.3``.
        role: embedding, projector, decoder, final_norm, lm_head, cast, loss or other.
        builder: class name of the block's ``module_builder``.
        params: parameter count (this TP shard).
        trainable: parameters that receive gradients.
        param_bytes: bytes of the weights in the model dtype.
        activation_bytes: bytes kept for backward per micro-batch.
        output_bytes: bytes sent to the next block per micro-batch.
        flops_fwd / flops_bwd_input / flops_bwd_weight: FLOPs per micro-batch.
        nanotron_cost: the value Nanotron's ``get_block_compute_costs()`` gives this block (0 if absent).
        parameters: the block's parameter tensors, for freezing by name.
    """

    index: int
    name: str
    role: Role
    builder: str
    params: int
    trainable: int
    param_bytes: int
    activation_bytes: float
    output_bytes: float
    flops_fwd: float
    flops_bwd_input: float
    flops_bwd_weight: float
    nanotron_cost: float = 0.0
    parameters: tuple[ParamInfo, ...] = ()

    @property
    def short(self) -> str:
        """``decoder.7`` for decoder layers, the role for everything else."""
        if self.role == "decoder":
            return f"decoder.{decoder_index(self.name)}"
        return self.role if self.role != "other" else self.name

    def with_trainable(self, trainable_names: Callable[[str], bool]) -> BlockInfo:
        """A copy whose parameters are trainable where ``trainable_names(full_name)`` is true."""
        params = tuple(dataclasses.replace(p, trainable=bool(trainable_names(p.name))) for p in self.parameters)
        return dataclasses.replace(self, parameters=params, trainable=sum(p.numel for p in params if p.trainable))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["parameters"] = [dataclasses.asdict(p) for p in self.parameters]
        return d


def role_of(name: str) -> Role:
    """Role of a block from its module path (Nanotron's Llama naming)."""
    last = name.rsplit(".", 1)[-1]
    if last in ("token_position_embeddings", "embed_tokens") or last.endswith("embeddings"):
        return "embedding"
    if re.search(r"(^|\.)decoder\.\d+$", name):
        return "decoder"
    if last in ("final_layer_norm", "final_norm", "norm"):
        return "final_norm"
    if last == "lm_head":
        return "lm_head"
    if last == "cast_to_fp32":
        return "cast"
    if last == "loss":
        return "loss"
    if last == "projector":
        return "projector"
    return "other"


def decoder_index(name: str) -> int:
    return int(name.rsplit(".", 1)[-1])


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


def nanotron_block_costs(m: ModelShape) -> dict[str, float]:
    """Nanotron's ``get_block_compute_costs()`` for Llama, keyed by builder class name.

    Every other class costs 0 in Nanotron's rule, which is why the embedding, norms, cast and loss are
    placed as if free.
    """
    d = m.head_dim
    return {
        "LlamaDecoderLayer": 4 * m.num_attention_heads * d * m.hidden_size + 3 * m.intermediate_size * m.hidden_size,
        "TensorParallelColumnLinear": m.vocab_size * m.hidden_size,
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
        One :class:`BlockInfo` per PipelineBlock in forward order, everything trainable; apply a freeze
        spec with :func:`nanotron_ext.freeze.apply_freeze`.
    """
    m, run = cfg.model, cfg.run
    costs = nanotron_block_costs(m)
    blocks = []
    for i, (name, builder, params) in enumerate(llama_block_layout(m, projector=cfg.ext.projector)):
        shards = [ParamInfo(f"{name}.pp_block.{p}", _tp_shard(p, n, run.tp, name)) for p, n in params]
        blocks.append(make_block(i, name, builder, shards, m, run, costs.get(builder, 0.0)))
    return with_config_freeze(blocks, cfg)


def with_config_freeze(blocks: list[BlockInfo], cfg: PlannerConfig) -> list[BlockInfo]:
    """Apply ``nanotron_ext.freeze`` from the config, so the planner knows what trains before it splits."""
    from nanotron_ext.freeze import FreezeSpec, apply_freeze, tied_embedding_names

    spec = FreezeSpec.from_dict(cfg.ext.freeze)
    if spec is None:
        return blocks
    return apply_freeze(blocks, spec, tied=tied_embedding_names(blocks, cfg.model.tie_word_embeddings))


_TP_SHARDED = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight", "token_embedding.weight")


def _tp_shard(param: str, numel: int, tp: int, block: str) -> int:
    # Matmul weights and the vocabulary are split across TP ranks; norms and the projector are replicated.
    sharded = param.endswith(_TP_SHARDED) or block.endswith("lm_head")
    return numel // tp if sharded else numel


def inventory_from_model(model: Any, cfg: PlannerConfig) -> list[BlockInfo]:
    """Blocks of a real (unbuilt or built) Nanotron model, in forward order.

    Each block whose module is not yet built is instantiated on the ``meta`` device, so no weight memory is
    allocated; an already built block is read as it is. Trainable counts come from ``requires_grad`` and then
    from the config's freeze spec, as in :func:`inventory_from_config`.

    Args:
        model: a ``NanotronModel`` whose blocks are ``PipelineBlock``s.
        cfg: the config the model was built from (batch shape for FLOPs and activations).

    Returns:
        One :class:`BlockInfo` per PipelineBlock.
    """
    import torch
    from nanotron.parallel.pipeline_parallel.block import PipelineBlock

    raw_costs = model.get_block_compute_costs() if hasattr(model, "get_block_compute_costs") else {}
    costs = {getattr(k, "__name__", str(k)): float(v) for k, v in raw_costs.items()}
    blocks = []
    for name, block in model.named_modules():
        if not isinstance(block, PipelineBlock):
            continue
        module = getattr(block, "pp_block", None)
        if module is None:
            with torch.device("meta"):
                module = block.module_builder(**block.module_kwargs)
        named = module.named_parameters() if isinstance(module, torch.nn.Module) else []
        params = [ParamInfo(f"{name}.pp_block.{p}", p_t.numel(), bool(p_t.requires_grad)) for p, p_t in named]
        builder = getattr(block.module_builder, "__name__", type(block.module_builder).__name__)
        blocks.append(make_block(len(blocks), name, builder, params, cfg.model, cfg.run, costs.get(builder, 0.0)))
    return with_config_freeze(blocks, cfg)
