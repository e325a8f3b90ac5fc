"""The modules the ``profiled`` strategy times: one standalone CPU-runtime module per block role.

:mod:`nanotron_ext.costs.profiled` builds each block it times with :func:`build_block_module`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nanotron.config import LlamaConfig
from nanotron.parallel.tensor_parallel.nn import TensorParallelColumnLinear, TensorParallelLinearMode

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.config import PlannerConfig
from nanotron_ext.errors import PlanningError
from nanotron_ext.models.llama import Embedding, LlamaDecoderLayer, Loss, Projector, RMSNorm
from nanotron_ext.models.vocab_chain import VocabShard

__all__ = ["MEASURABLE_ROLES", "build_block_module", "llama_config_from_shape"]

MEASURABLE_ROLES = ("embedding", "projector", "decoder", "final_norm", "lm_head", "cast", "loss", "vocab_shard")


def llama_config_from_shape(cfg: PlannerConfig) -> LlamaConfig:
    """Nanotron's ``LlamaConfig`` for the config's model shape (what ``build_cpu_llama`` takes)."""
    m = cfg.model
    return LlamaConfig(
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_hidden_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads,
        vocab_size=m.vocab_size,
        max_position_embeddings=max(m.max_position_embeddings, cfg.run.sequence_length),
        tie_word_embeddings=m.tie_word_embeddings,
        rms_norm_eps=m.rms_norm_eps,
    )


def build_block_module(block: BlockInfo, cfg: PlannerConfig, tp_pg: Any) -> Callable[..., Any]:
    """The module one block runs, built standalone on ``tp_pg`` (a one-process group).

    Raises:
        PlanningError: a role that is not one of the Llama blocks (:data:`MEASURABLE_ROLES`).
    """
    lcfg = llama_config_from_shape(cfg)
    role = block.role
    if role == "embedding":
        return Embedding(tp_pg=tp_pg, config=lcfg, parallel_config=None)
    if role == "projector":
        return Projector(lcfg.hidden_size)
    if role == "decoder":
        return LlamaDecoderLayer(config=lcfg, parallel_config=None, tp_pg=tp_pg, layer_idx=0)
    if role == "final_norm":
        return RMSNorm(lcfg.hidden_size, eps=lcfg.rms_norm_eps)
    if role == "lm_head":
        return TensorParallelColumnLinear(
            lcfg.hidden_size, lcfg.vocab_size, pg=tp_pg, mode=TensorParallelLinearMode.ALL_REDUCE, bias=False
        )
    if role == "cast":
        return lambda x: x.float()  # Nanotron's cast_to_fp32 builder, exactly
    if role == "loss":
        return Loss(tp_pg=tp_pg)
    if role == "vocab_shard":
        # A middle shard of the chain (statistics in and out); the last one's loss is a few more element-wise ops.
        rows = block.params // lcfg.hidden_size
        return VocabShard(lcfg.hidden_size, 0, rows, first=False, last=False)
    raise PlanningError(
        f"the profiled strategy cannot build block {block.name} (role {role!r}); it measures the Llama blocks "
        f"({', '.join(MEASURABLE_ROLES)}). Use cost_strategy: flops for other architectures"
    )
