"""What one block computes per micro-batch: its forward, input-gradient and weight-gradient FLOPs.

With ``t = b·s`` tokens per micro-batch, ``h`` hidden, ``s`` sequence, ``V`` vocabulary:

* a linear layer with ``P`` weights: forward ``2·t·P``, input-gradient ``2·t·P``, weight-gradient ``2·t·P``;
* attention scores and weighted sum: forward ``4·t·s·h``, input-gradient ``8·t·s·h``, no weights
  (full, not causal-halved: torch SDPA on CPU computes the whole square);
* lm_head forward ``2·t·h·V``; cast ``t·V``; cross-entropy about ``5·t·V`` forward, ``3·t·V`` backward;
* a vocabulary shard of ``V_i`` rows (``vocab_shards``): the three above on its slice.

These are facts of the block, like its parameter count; what they cost (time, what trains pays for) is
:mod:`nanotron_ext.costs`'. What a block keeps and sends is counted once, in
:func:`nanotron_ext.costs.block_memory.block_memory`.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanotron_ext.blocks import Role
from nanotron_ext.config import ModelShape, RunShape

__all__ = ["BlockFlops", "block_flops", "decoder_linear_params", "mlp_active"]


@dataclass(frozen=True)
class BlockFlops:
    """FLOPs of one block for one micro-batch."""

    forward: float
    backward_input: float
    backward_weight: float


def decoder_linear_params(m: ModelShape, layer: int | None = None) -> int:
    """Matmul weights one token runs through in a decoder layer (attention, then the MLP or its routed
    experts), norms and biases excluded.

    A dense MLP is gated (three matrices) except Starcoder2's (two). A mixture-of-experts layer counts the
    router, the ``top_k`` experts a token is sent to and the shared expert, not every expert.
    """
    d, h = m.head_dim, m.hidden_size
    attention = h * d * (m.num_attention_heads + 2 * m.num_key_value_heads) + m.num_attention_heads * d * h
    return attention + mlp_active(m, layer)[0]


def mlp_active(m: ModelShape, layer: int | None) -> tuple[int, int]:
    """(matmul weights per token, width of the activations kept for backward) of a layer's MLP."""
    h = m.hidden_size
    if m.moe_layer(layer):
        moe = m.moe
        assert moe is not None  # moe_layer() checked it
        matrices = 3 if moe.glu else 2
        shared = moe.shared_expert_intermediate_size
        weights = moe.num_experts * h + moe.top_k * matrices * moe.expert_intermediate_size * h
        weights += 3 * shared * h + h if shared else 0
        return weights, moe.top_k * matrices * moe.expert_intermediate_size + 3 * shared
    matrices = 2 if m.family == "starcoder2" else 3
    return matrices * m.intermediate_size * h, matrices * m.intermediate_size


def block_flops(role: Role, m: ModelShape, run: RunShape, params: int = 0, layer: int | None = None) -> BlockFlops:
    """FLOPs of a block by role.

    Args:
        role: the block's role (see ``nanotron_ext.blocks.Role``).
        m: model shape.
        run: batch shape and dtype.
        params: the block's parameter count; prices ``projector``/``other`` blocks as a linear layer.
        layer: a decoder block's layer index (MoE models mix dense and expert layers).

    Returns:
        FLOPs of forward / input-gradient / weight-gradient.
    """
    t, s, h, v = run.tokens_per_micro_batch, run.sequence_length, m.hidden_size, m.vocab_size
    if role == "embedding":
        # A gather: no matmul; the weight gradient is a scatter-add of t rows.
        return BlockFlops(t * h, 0.0, t * h)
    if role == "decoder":
        lin = decoder_linear_params(m, layer)
        attn = 4.0 * t * s * h
        norms = 2 * 4.0 * t * h
        return BlockFlops(2.0 * t * lin + attn + norms, 2.0 * t * lin + 2 * attn + 2 * norms, 2.0 * t * lin + norms / 2)
    if role == "final_norm":
        return BlockFlops(4.0 * t * h, 8.0 * t * h, 2.0 * t * h)
    if role == "lm_head":
        mm = 2.0 * t * h * v
        return BlockFlops(mm, mm, mm)
    if role == "cast":
        return BlockFlops(1.0 * t * v, 1.0 * t * v, 0.0)
    if role == "loss":
        return BlockFlops(5.0 * t * v, 3.0 * t * v, 0.0)
    if role == "vocab_shard":
        # lm_head + cast + loss on the shard's rows (params = rows x h on this TP rank, priced like the lm_head,
        # whose FLOPs count the whole vocabulary).
        vi = params * run.tp / h
        mm = 2.0 * t * h * vi
        return BlockFlops(mm + 6.0 * t * vi, mm + 4.0 * t * vi, mm)
    # projector / other: a linear layer of the given size.
    return BlockFlops(2.0 * t * params, 2.0 * t * params, 2.0 * t * params)
