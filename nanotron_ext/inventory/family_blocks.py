"""The ``PipelineBlock``s each Nanotron model family builds, and Nanotron's own per-class costs for them.

Names, builders and parameter shapes follow Nanotron's source: ``models/llama.py``, ``models/qwen.py`` (dense and
``moe_config``; no ``cast_to_fp32`` block), ``models/starcoder2.py``, and the LlaMoE example (``examples/moe``).
Counts are at tp = 1; :mod:`nanotron_ext.inventory.from_config` shards them.
"""

from __future__ import annotations

from nanotron_ext.blocks import VOCAB_SHARDS_PATH, vocab_slices
from nanotron_ext.config import ModelShape

__all__ = ["block_layout", "class_costs", "llama_class_costs"]

Layout = list[tuple[str, str, list[tuple[str, int]]]]

_DECODER_BUILDER = {
    "llama": "LlamaDecoderLayer",
    "qwen2": "Qwen2DecoderLayer",
    "starcoder2": "GPTBlock",
    "llamoe": "LlaMoEDecoderLayer",
}


def block_layout(m: ModelShape, projector: bool = False, vocab_shards: int = 1) -> Layout:
    """Blocks of the config's model in forward order: ``(module path, builder class, [(parameter, numel)])``.

    The projector, when asked for (CPU model only), sits right after the embedding, as a VLM's does. With
    ``vocab_shards`` K > 1 the lm_head, cast and loss blocks become K ``VocabShard`` blocks
    (``model.vocab_shards.{i}``), each holding a slice of the lm_head rows (:func:`~nanotron_ext.blocks.vocab_slices`).
    """
    h, v = m.hidden_size, m.vocab_size
    embedding = "model.token_embeddings" if m.family == "starcoder2" else "model.token_position_embeddings"
    blocks: Layout = [(embedding, "Embedding", [("token_embedding.weight", v * h)])]
    if m.family == "starcoder2":
        blocks.append(("model.embeds_dropout", "Dropout", []))
    if projector:
        blocks.append(("model.projector", "Projector", [("proj.weight", h * h)]))
    builder = _DECODER_BUILDER[m.family]
    blocks += [(f"model.decoder.{i}", builder, _decoder_params(m, i)) for i in range(m.num_hidden_layers)]
    if m.family == "starcoder2":
        blocks.append(("model.final_layer_norm", "TritonLayerNorm", [("weight", h), ("bias", h)]))
    else:
        blocks.append(
            ("model.final_layer_norm", "RMSNorm" if m.family == "llama" else "TritonRMSNorm", [("weight", h)])
        )
    if vocab_shards > 1:
        return blocks + [
            (f"{VOCAB_SHARDS_PATH}.{i}", "VocabShard", [("weight", (hi - lo) * h)])
            for i, (lo, hi) in enumerate(vocab_slices(v, vocab_shards))
        ]
    blocks.append(("model.lm_head", "TensorParallelColumnLinear", [("weight", v * h)]))
    if m.family != "qwen2":
        blocks.append(("model.cast_to_fp32", "<lambda>", []))
    blocks.append(("loss", "Loss", []))
    return blocks


def _decoder_params(m: ModelShape, layer: int) -> list[tuple[str, int]]:
    h, d, f = m.hidden_size, m.head_dim, m.intermediate_size
    n, k = m.num_attention_heads, m.num_key_value_heads
    qkv = (n + 2 * k) * d
    if m.family == "starcoder2":
        if k == 1:  # multi-query: q and one shared kv head
            attention = [
                ("attn.qkv.q.weight", h * h),
                ("attn.qkv.q.bias", h),
                ("attn.qkv.kv.weight", 2 * d * h),
                ("attn.qkv.kv.bias", 2 * d),
                ("attn.o.weight", h * h),
                ("attn.o.bias", h),
            ]
        else:
            attention = [
                ("attn.query_key_value.weight", qkv * h),
                ("attn.query_key_value.bias", qkv),
                ("attn.dense.weight", h * h),
                ("attn.dense.bias", h),
            ]
        return (
            [("ln_1.weight", h), ("ln_1.bias", h)]
            + attention
            + [("ln_2.weight", h), ("ln_2.bias", h)]
            + [("ff.c_fc.weight", f * h), ("ff.c_fc.bias", f), ("ff.c_proj.weight", h * f), ("ff.c_proj.bias", h)]
        )
    attention = [("attn.qkv_proj.weight", qkv * h)]
    if m.attention_bias:
        attention.append(("attn.qkv_proj.bias", qkv))
    attention.append(("attn.o_proj.weight", n * d * h))
    norms = [("input_layernorm.weight", h), ("post_attention_layernorm.weight", h)]
    return norms[:1] + attention + norms[1:] + _mlp_params(m, layer)


def _mlp_params(m: ModelShape, layer: int) -> list[tuple[str, int]]:
    h, f = m.hidden_size, m.intermediate_size
    if not m.moe_layer(layer):
        return [("mlp.gate_up_proj.weight", 2 * f * h), ("mlp.down_proj.weight", f * h)]
    moe = m.moe
    assert moe is not None  # moe_layer() checked it
    e, x = moe.num_experts, moe.expert_intermediate_size
    if m.family == "llamoe":
        return [
            ("block_sparse_moe.gate.layer.weight", e * h),
            ("block_sparse_moe.experts.mlp.w1.module.weight", h * x * e),
            ("block_sparse_moe.experts.mlp.w2.module.weight", x * e * h),
        ]
    params = [("mlp.router.weight", e * h)]
    s = moe.shared_expert_intermediate_size
    if s:
        params += [
            ("mlp.shared_expert.gate_up_proj.weight", 2 * s * h),
            ("mlp.shared_expert.down_proj.weight", s * h),
            ("mlp.shared_expert_gate.weight", h),
        ]
    return params + [("mlp.experts.merged_gate_up_proj", e * h * 2 * x), ("mlp.experts.merged_down_proj", e * x * h)]


def llama_class_costs(
    *,
    hidden_size: int,
    num_attention_heads: int,
    intermediate_size: int,
    vocab_size: int,
    decoder: str = "LlamaDecoderLayer",
    mlp_matrices: int = 3,
) -> dict[str, int]:
    """Nanotron's ``get_block_compute_costs()``, keyed by builder class name: ``4·n·d·h + m·f·h`` per decoder
    layer (``m`` = 3, or 2 for Starcoder2's MLP) and ``V·h`` for the lm_head.

    Every other class costs 0 in Nanotron's rule, which is why the embedding, norms, cast and loss are placed
    as if free. Key/value heads, biases and experts are left out, as Nanotron leaves them out.
    """
    d = hidden_size // num_attention_heads
    return {
        decoder: 4 * num_attention_heads * d * hidden_size + mlp_matrices * intermediate_size * hidden_size,
        "TensorParallelColumnLinear": vocab_size * hidden_size,
    }


def class_costs(m: ModelShape) -> dict[str, int]:
    """:func:`llama_class_costs` for the config's family."""
    return llama_class_costs(
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        intermediate_size=m.intermediate_size,
        vocab_size=m.vocab_size,
        decoder=_DECODER_BUILDER[m.family],
        mlp_matrices=2 if m.family == "starcoder2" else 3,
    )
