"""The analytic cost model: FLOPs and bytes per block and micro-batch.

With ``t = b·s`` tokens per micro-batch, ``h`` hidden, ``s`` sequence, ``V`` vocabulary:

* a linear layer with ``P`` weights: forward ``2·t·P``, input-gradient ``2·t·P``, weight-gradient ``2·t·P``;
* attention scores and weighted sum: forward ``4·t·s·h``, input-gradient ``8·t·s·h``, no weights
  (full, not causal-halved: torch SDPA on CPU computes the whole square);
* lm_head forward ``2·t·h·V``; cast ``t·V``; cross-entropy about ``5·t·V`` forward, ``3·t·V`` backward;
* a vocabulary shard of ``V_i`` rows (``nanotron_ext.vocab_shards``): the three above on its slice, keeping its
  fp32 logits for backward, and sending the hidden state plus three fp32 statistics per token.

Training work of a block depends on what is trainable: a frozen block pays no weight-gradient
work, and a block with nothing trainable before it pays no input-gradient work (autograd never asks for
it), so a fully frozen prefix costs forward only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nanotron_ext.blocks import BlockInfo, Role
from nanotron_ext.config import DTYPE_BYTES, ModelShape, RunShape
from nanotron_ext.schedule import Engine

__all__ = [
    "GIB",
    "BlockWork",
    "ParamBytes",
    "block_work",
    "decoder_linear_params",
    "in_flight",
    "mlp_saved_width",
    "param_bytes",
    "stage_memory_bytes",
    "static_bytes",
    "trainable_before",
    "training_flops",
]

GIB = float(1 << 30)


@dataclass(frozen=True)
class BlockWork:
    """Analytic work of one block for one micro-batch."""

    flops_fwd: float
    flops_bwd_input: float
    flops_bwd_weight: float
    activation_bytes: float  # kept for backward, per micro-batch in flight
    output_bytes: float  # sent to the next stage per micro-batch


def decoder_linear_params(m: ModelShape, layer: int | None = None) -> int:
    """Matmul weights one token runs through in a decoder layer (attention, then the MLP or its routed
    experts), norms and biases excluded.

    A dense MLP is gated (three matrices) except Starcoder2's (two). A mixture-of-experts layer counts the
    router, the ``top_k`` experts a token is sent to and the shared expert, not every expert.
    """
    d, h = m.head_dim, m.hidden_size
    attention = h * d * (m.num_attention_heads + 2 * m.num_key_value_heads) + m.num_attention_heads * d * h
    return attention + _mlp_active(m, layer)[0]


def _mlp_active(m: ModelShape, layer: int | None) -> tuple[int, int]:
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


def mlp_saved_width(m: ModelShape, layer: int | None = None) -> float:
    """Elements per token a layer's MLP saves for backward: the matmul outputs (gate|up and down's input: 3f;
    Starcoder2's up: 2f), plus the gate's activation in a gated MLP (4f in all)."""
    width = float(_mlp_active(m, layer)[1])
    gated = m.moe.glu if m.moe_layer(layer) and m.moe is not None else m.family != "starcoder2"
    return width + width / 3 if gated else width


def block_work(role: Role, m: ModelShape, run: RunShape, params: int = 0, layer: int | None = None) -> BlockWork:
    """Work of a block by role.

    Args:
        role: the block's role (see ``nanotron_ext.blocks.Role``).
        m: model shape.
        run: batch shape and dtype.
        params: the block's parameter count; prices ``projector``/``other`` blocks as a linear layer.
        layer: a decoder block's layer index (MoE models mix dense and expert layers).

    Returns:
        FLOPs of forward / input-gradient / weight-gradient, activation and output bytes.
    """
    t, s, h, v = run.tokens_per_micro_batch, run.sequence_length, m.hidden_size, m.vocab_size
    w = DTYPE_BYTES[run.dtype]
    if role == "embedding":
        # A gather: no matmul; the weight gradient is a scatter-add of t rows.
        return BlockWork(t * h, 0.0, t * h, 8.0 * t, w * t * h)
    if role == "decoder":
        lin = decoder_linear_params(m, layer)
        kv = m.num_key_value_heads * m.head_dim
        attn = 4.0 * t * s * h
        norms = 2 * 4.0 * t * h
        act = w * t * (7 * h + 2 * kv + _mlp_active(m, layer)[1])
        return BlockWork(2.0 * t * lin + attn + norms, 2.0 * t * lin + 2 * attn + 2 * norms,
                         2.0 * t * lin + norms / 2, act, w * t * h)
    if role == "final_norm":
        return BlockWork(4.0 * t * h, 8.0 * t * h, 2.0 * t * h, w * t * h, w * t * h)
    if role == "lm_head":
        mm = 2.0 * t * h * v
        return BlockWork(mm, mm, mm, w * t * h, w * t * v)
    if role == "cast":
        return BlockWork(1.0 * t * v, 1.0 * t * v, 0.0, 0.0, 4.0 * t * v)
    if role == "loss":
        # Cross-entropy keeps fp32 logits (or their softmax) alive until backward.
        return BlockWork(5.0 * t * v, 3.0 * t * v, 0.0, 4.0 * t * v, 4.0)
    if role == "vocab_shard":
        # lm_head + cast + loss on the shard's rows (params = rows x h on this TP rank, priced like the lm_head,
        # whose FLOPs count the whole vocabulary); it keeps its input and its fp32 logits slice for backward
        # and sends the hidden state plus running max, running sum-exp and target logit (fp32) per token.
        vi = params * run.tp / h
        mm = 2.0 * t * h * vi
        return BlockWork(mm + 6.0 * t * vi, mm + 4.0 * t * vi, mm, w * t * h + 4.0 * t * vi, w * t * h + 12.0 * t)
    # projector / other: a linear layer of the given size.
    return BlockWork(2.0 * t * params, 2.0 * t * params, 2.0 * t * params, w * t * h, w * t * h)


def trainable_before(blocks: Sequence[BlockInfo]) -> list[bool]:
    """Entry ``i``: does any of ``blocks[:i]`` train? One entry per block, plus one for after the last.

    A block's input asks autograd for a gradient only then, so this decides whether a block pays input-gradient
    work, whether the profiler times its backward, and whether a gradient crosses a pipeline cut back.

    Example:
        Frozen embedding, trainable decoder, frozen head: ``[False, False, True, True]``.
    """
    out, before = [False], False
    for b in blocks:
        before = before or b.trainable > 0
        out.append(before)
    return out


def training_flops(blocks: Sequence[BlockInfo]) -> list[float]:
    """FLOPs of one micro-batch's forward and backward per block, aware of what is trainable.

    A block pays weight-gradient work in proportion to its trainable share, and input-gradient work
    only when some block before it is trainable.

    Example:
        Frozen embedding, frozen decoder, trainable lm_head: the first two cost forward only, the head
        forward + weight-gradient.
    """
    out: list[float] = []
    for b, input_grad in zip(blocks, trainable_before(blocks)):
        cost = b.flops_fwd
        if input_grad:
            cost += b.flops_bwd_input
        if b.params:
            cost += b.flops_bwd_weight * (b.trainable / b.params)
        out.append(cost)
    return out


def in_flight(engine: Engine, pp: int, n_micro_batches: int) -> list[int]:
    """Micro-batches whose activations a stage holds at its peak.

    AFAB runs every forward first, so each stage holds all ``m``; 1F1B holds at most ``pp − stage``.
    """
    if engine == "afab":
        return [n_micro_batches] * pp
    return [min(n_micro_batches, pp - stage) for stage in range(pp)]


@dataclass(frozen=True)
class ParamBytes:
    """Bytes per trainable parameter (``weights`` also per frozen one).

    Attributes:
        weights: the parameter in the model dtype.
        gradients: ``.grad`` (plus the fp32 accumulation buffer, plus DDP's bucket when dp > 1).
        optimizer: Adam's two moments, plus fp32 master weights when a 16-bit model accumulates in fp32
            (divided by dp under ZeRO-1).
        state: bytes of one optimizer-state element (the dtype Adam's temporaries are made in).
        gradients_allocated: the part of ``gradients`` allocated before training and kept (the fp32
            accumulation buffer, DDP's buckets); the rest, ``.grad``, appears during the backward.
    """

    weights: float
    gradients: float
    optimizer: float
    state: float
    gradients_allocated: float = 0.0


def param_bytes(run: RunShape) -> ParamBytes:
    """Bytes per parameter under ``run``'s dtype, gradient accumulation, ZeRO stage and dp.

    * fp32: weights 4, ``.grad`` 4, Adam 8.
    * 16-bit with ``accumulate_grad_in_fp32``: weights 2; gradients: the fp32 buffer 4 plus the 16-bit ``.grad``
      that lives until the accumulator adds it (2); optimizer: fp32 master weights 4 + Adam 8 in fp32.
    * 16-bit without it: Nanotron runs AdamW on the 16-bit parameters themselves: weights 2, ``.grad`` 2,
      Adam 2 + 2.
    * dp > 1: DDP's gradient buckets, one more gradient in the model dtype.
    * ZeRO-1: the optimizer column (master weights and Adam) divided by dp.
    """
    w = DTYPE_BYTES[run.dtype]
    allocated = 0.0
    if w == 4:
        grads, state, master = 4.0, 4.0, 0.0
    elif run.accumulate_grad_in_fp32:
        # FP32GradientAccumulator allocates its contiguous fp32 buffer when it is built.
        grads, state, master, allocated = 4.0 + w, 4.0, 4.0, 4.0
    else:
        grads, state, master = float(w), float(w), 0.0
    if run.dp > 1:
        grads += w  # DDP keeps its own bucket copy of every gradient (gradient_as_bucket_view is off)
        allocated += w  # ... allocated when DDP wraps the model
    optimizer = 2 * state + master
    if run.zero_stage >= 1:
        optimizer /= run.dp
    return ParamBytes(weights=float(w), gradients=grads, optimizer=optimizer, state=state,
                      gradients_allocated=allocated)


def static_bytes(block: BlockInfo, run: RunShape) -> float:
    """Weights + gradients + optimizer state (+ fp32 master weights) of a block, ZeRO-1 and DDP aware.

    Bytes per parameter are :func:`param_bytes`'s. Frozen weights carry no gradient or
    optimizer state.
    """
    per = param_bytes(run)
    return block.params * per.weights + block.trainable * (per.gradients + per.optimizer)


def stage_memory_bytes(blocks: Sequence[BlockInfo], run: RunShape, stage: int, pp: int | None = None) -> float:
    """Static bytes + the blocks' ``activation_bytes`` × micro-batches in flight: an additive approximation.

    The estimate ``plan`` prints and checks the cap against is :func:`nanotron_ext.costs.memory.stage_memory`.
    """
    pp = run.pp if pp is None else pp
    n = in_flight(run.engine, pp, run.n_micro_batches)[stage]
    return sum(static_bytes(b, run) for b in blocks) + n * sum(b.activation_bytes for b in blocks)
