"""What one block holds for one micro-batch: what it saves for backward, its temporaries, what it sends across
a cut, and under zb1p what its deferred weight-gradient pass keeps (:func:`pending_tensors`). A stage's peak built
from these is :mod:`nanotron_ext.costs.memory_estimate`.

What a block saves is counted from the code that runs (the CPU runtime's Llama, ``nanotron_ext.models.llama``,
with Nanotron's tensor-parallel linears and ``sharded_cross_entropy``), tensor by tensor, per dtype:

* RMSNorm (normalised in fp32): the fp32 input (the input itself in fp32, an upcast copy in 16-bit), the
  ``rsqrt`` column and the normalised tensor in the model dtype; the linear after it saves the norm's output;
* attention: the rotated q, k and v at full head count after the GQA repeat (without GQA, v stays a view of the
  qkv output and keeps all of it alive), the output and the fp32 log-sum-exp; ``o_proj`` saves a 2D copy of its
  input when the micro-batch holds more than one sequence;
* MLP: 4f — the merged gate|up output (2f), the activation (f) and the product (f);
* rotary cos/sin tables, one pair per layer, fp32, allocated once;
* the loss: the fp32 softmax of the logits (``t·V·4``), the targets and the masks.

Tensor parallelism divides what is sharded: heads, ``f`` and ``V`` by ``tp``. Under ``REDUCE_SCATTER``
(sequence parallel) the norms' tensors are split along the sequence too, while a column-parallel linear saves the
gathered input (the shard only with ``tp_linear_async_communication``).

Under ``memory_runtime: gpu`` the decoder layers and final norm of a Llama or a Qwen2 are counted for what
upstream Nanotron's GPU code keeps instead (:mod:`nanotron_ext.costs.gpu_memory`). The embedding, ``lm_head``, the
fp32 cast and the loss run the same Nanotron code on both paths.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from nanotron_ext.blocks import DEFERS_WEIGHT_GRADIENT, BlockInfo
from nanotron_ext.config import DTYPE_BYTES, MemoryRuntime, ModelShape, RunShape
from nanotron_ext.costs.block_terms import BlockMemory, block_layer, mlp_saved_width, norm_saved
from nanotron_ext.costs.gpu_memory import fused_final_norm, gpu_decoder, gpu_final_norm, gpu_path
from nanotron_ext.inventory.flops import mlp_active
from nanotron_ext.schedule.programs import deferred_weights

__all__ = [
    "BlockMemory",
    "block_memory",
    "deferred_at_once",
    "largest_output",
    "largest_param",
    "mlp_saved_width",
    "output_tensors",
    "pending_tensors",
    "weight_pending",
]


@functools.lru_cache(maxsize=8192)  # a split search prices each block on every segment that holds it
def block_memory(block: BlockInfo, m: ModelShape, run: RunShape, runtime: MemoryRuntime = "cpu") -> BlockMemory:
    """Memory of one block by role (see the module docstring for what each role saves).

    Args:
        block: the block (its role, and its parameters for the gradient temporaries).
        m: model shape.
        run: batch shape, dtype, tp and its mode.
        runtime: the code that runs it: ``cpu`` (the CPU runtime) or ``gpu`` (Nanotron's, see :func:`gpu_path`).

    Returns:
        The block's :class:`BlockMemory`.
    """
    b, s = run.micro_batch_size, run.sequence_length
    t = b * s
    w = DTYPE_BYTES[run.dtype]
    tp = run.tp
    h = m.hidden_size
    gpu = gpu_path(m, runtime)
    seq_parallel = run.tp_mode == "REDUCE_SCATTER" and tp > 1
    tn = t / tp if seq_parallel else t  # tokens of the hidden-sized tensors between the linears
    # Tokens of a column-parallel linear's saved input: the gathered input, or the shard (async; upstream's
    # tp_recompute_allgather, which gathers it again in the backward).
    keeps_shard = run.tp_async or (gpu and run.tp_recompute_allgather)
    tl = tn if (seq_parallel and keeps_shard) else t
    grad_temp = largest_param(block, m, run) * w  # a weight gradient, made fresh before it is added to .grad
    role = block.role
    if role == "decoder":
        whole, largest_part = (gpu_decoder if gpu else _decoder)(block, m, run, t, tn, tl, grad_temp)
        return _recomputed(whole, largest_part) if run.recompute_layer else whole
    if role == "final_norm" and gpu and fused_final_norm(m):
        return gpu_final_norm(tn, h, w, grad_temp)
    if role == "vocab_shard":
        return _vocab_shard(block, m, run, t, tn, tl, grad_temp)
    v = m.vocab_size / tp
    if role == "embedding":
        return _embedding(t, tn, h, w, grad_temp)
    if role == "final_norm":
        return _final_norm(tn, h, w, grad_temp)
    if role == "lm_head":
        return _lm_head(t, tn, tl, h, w, v, grad_temp, input_saved=not seq_parallel or run.tp_async)
    if role == "cast":
        return _cast(t, v, w)
    if role == "loss":
        return _loss(t, v, w, m.family)
    return _linear(t, h, w, grad_temp)  # projector / other: a linear layer on the hidden states


def _embedding(t: int, tn: float, h: int, w: int, grad_temp: float) -> BlockMemory:
    """The token embedding: ``t`` int64 ids in (and the mask), hidden states out."""
    ids = t * 8.0
    # The dense gradient of the table is made fresh (embedding_dense_backward) before it joins .grad, from a
    # contiguous copy of the incoming [seq, batch, hidden] gradient.
    return BlockMemory(
        saved=ids,
        forward_temp=0.0,
        backward_temp=grad_temp + tn * h * w,
        persistent=0.0,
        input=ids + t,
        input_saved=False,
        output=tn * h * w + t,
    )


def _final_norm(tn: float, h: int, w: int, grad_temp: float) -> BlockMemory:
    """The final RMSNorm as the CPU runtime runs it."""
    # Backward: the fp32 gradients of the normalisation (input-sized, twice) and the weight's.
    return BlockMemory(
        saved=norm_saved(tn, h, w),
        forward_temp=tn * h * 4.0,
        backward_temp=2 * tn * h * 4.0 + grad_temp,
        persistent=0.0,
        input=tn * h * w,
        input_saved=w == 4,
        output=tn * h * w,
    )


def _lm_head(
    t: int, tn: float, tl: float, h: int, w: int, v: float, grad_temp: float, *, input_saved: bool
) -> BlockMemory:
    """Nanotron's column-parallel lm_head: ``v`` logits a token on this TP rank."""
    # Saves its input; backward: the weight's fresh gradient, the input gradient in 2D and reshaped back.
    return BlockMemory(
        saved=tl * h * w,
        forward_temp=0.0,
        backward_temp=grad_temp + 2 * tl * h * w,
        persistent=0.0,
        input=tn * h * w,
        input_saved=input_saved,
        output=t * v * w,
    )


def _cast(t: int, v: float, w: int) -> BlockMemory:
    """Nanotron's ``cast_to_fp32`` of the logits."""
    # x.float(): a copy in 16-bit, the tensor itself in fp32; backward: the gradient cast back to 16-bit.
    return BlockMemory(
        saved=0.0,
        forward_temp=0.0,
        backward_temp=t * v * w if w < 4 else 0.0,
        persistent=0.0,
        input=t * v * w,
        input_saved=False,
        output=t * v * 4.0,
    )


def _loss(t: int, v: float, w: int, family: str) -> BlockMemory:
    """``sharded_cross_entropy`` over the logits of this TP rank."""
    # sharded_cross_entropy saves exp(logits - max) normalised in place (fp32), the int64 targets, the
    # target mask; Loss keeps the float label mask. Its backward turns the saved softmax into the logits'
    # gradient in place. Without a cast_to_fp32 block (Qwen2) the logits arrive in the model dtype and
    # its .to(float) copy is alive next to them while it shifts.
    logits = 4.0 if family != "qwen2" else float(w)
    return BlockMemory(
        saved=t * v * 4.0 + t * (8 + 1 + 4),
        forward_temp=t * v * 4.0 if logits < 4 else 0.0,
        backward_temp=0.0,
        persistent=0.0,
        input=t * v * logits,
        input_saved=False,
        output=0.0,
    )


def _linear(t: int, h: int, w: int, grad_temp: float) -> BlockMemory:
    """A linear layer on the hidden states (the projector, any other role)."""
    return BlockMemory(
        saved=t * h * w,
        forward_temp=0.0,
        backward_temp=grad_temp + t * h * w,
        persistent=0.0,
        input=t * h * w,
        input_saved=True,
        output=t * h * w,
    )


#: Tensors a block hands on per micro-batch, by role (``block_memory(...).output`` is their bytes): the hidden
#: states and the sequence mask after the embedding and a decoder layer, the hidden states and three fp32
#: running statistics after a vocabulary shard, one tensor after the others. Nanotron's pipeline state moves
#: them one communication at a time, so each pays its own latency.
_OUTPUT_TENSORS: dict[str, int] = {"embedding": 2, "decoder": 2, "vocab_shard": 4, "loss": 0}


def largest_output(blocks: Sequence[BlockInfo], m: ModelShape, run: RunShape) -> float:
    """Bytes of the largest tensor any of ``blocks`` hands on: what a link must carry at most."""
    return max(block_memory(b, m, run).output for b in blocks)


def output_tensors(block: BlockInfo) -> int:
    """How many tensors ``block`` hands on per micro-batch (see ``_OUTPUT_TENSORS``)."""
    return _OUTPUT_TENSORS.get(block.role, 1)


def _decoder(
    block: BlockInfo, m: ModelShape, run: RunShape, t: int, tn: float, tl: float, grad_temp: float
) -> tuple[BlockMemory, float]:
    """A Llama decoder layer as the CPU runtime runs it (dense MLP; a MoE layer is priced by its active width), and
    the larger of what its attention and its MLP save (what :func:`_recomputed` needs)."""
    w = DTYPE_BYTES[run.dtype]
    tp, h, d = run.tp, m.hidden_size, m.head_dim
    heads, kv_heads = m.num_attention_heads / tp, m.num_key_value_heads / tp
    q, kv = heads * d, kv_heads * d
    if m.num_attention_heads != m.num_key_value_heads:
        keys_values = 2 * q  # repeat_interleave copies k and v to every query head
    else:
        keys_values = kv + (q + 2 * kv)  # rotated k; v is a view that keeps the whole qkv output alive
    o_copy = q if run.micro_batch_size > 1 else 0  # [seq, batch, q] is not contiguous unless batch == 1
    attention = t * (w * (q + keys_values + q + o_copy) + 4.0 * heads)
    mlp = t * w * mlp_saved_width(m, block_layer(block)) / tp
    saved = 2 * norm_saved(tn, h, w) + 2 * tl * h * w + attention + mlp
    f = m.intermediate_size / tp
    # Forward: the qkv output next to rotary's fp32 products; backward: the MLP's gradients (merged 2f and f) next
    # to a weight's fresh gradient.
    forward_temp = t * (w * (q + 2 * kv) + 4.0 * 2 * q)
    backward_temp = grad_temp + t * w * 3 * f
    end = m.max_position_embeddings
    while run.sequence_length > end:
        end *= 2
    rotary = 2 * end * (d // 2) * 4.0  # cos and sin in fp32, per layer (each layer caches its own)
    whole = BlockMemory(
        saved=saved,
        forward_temp=forward_temp,
        backward_temp=backward_temp,
        persistent=rotary,
        input=tn * h * w + t,
        input_saved=w == 4,
        output=tn * h * w + t,
    )
    return whole, max(attention, mlp)


def _recomputed(whole: BlockMemory, largest_part: float) -> BlockMemory:
    """A decoder layer under ``parallelism.recompute_layer``: upstream's ``LlamaDecoderLayer.forward`` runs
    ``_core_forward`` in a reentrant checkpoint, which saves only its inputs (the hidden states and the mask) and
    runs the forward again, with autograd, in the layer's backward.

    Forward (no autograd): its temporaries and, for a moment, the larger of attention's and the MLP's
    intermediates (``largest_part``: what they would have saved). Backward: everything the layer would have saved,
    the recomputed output, then the backward's own temporaries."""
    return BlockMemory(
        saved=whole.input,
        forward_temp=whole.forward_temp + largest_part,
        backward_temp=whole.saved + whole.output + whole.backward_temp,
        persistent=whole.persistent,
        input=whole.input,
        input_saved=True,
        output=whole.output,
    )


def _vocab_shard(
    block: BlockInfo, m: ModelShape, run: RunShape, t: int, tn: float, tl: float, grad_temp: float
) -> BlockMemory:
    """A block of the vocabulary chain (:mod:`nanotron_ext.models.vocab_chain`)."""
    w, h = DTYPE_BYTES[run.dtype], m.hidden_size
    # lm_head rows -> .float() -> exp(logits - max) saved (fp32) with the int64 label index and the mask, the
    # linear's input saved; the statistics are [tokens] fp32. Forward: the fp32 logits and the subtraction before
    # exp (the 16-bit logits are gone by then); backward: the logits gradient is written into the saved exp, cast
    # back to 16-bit, then the linear's gradients.
    rows = block.params / h
    stats = 3 * t * 4.0
    return BlockMemory(
        saved=tl * h * w + t * rows * 4.0 + t * (8 + 1) + 4 * t * 4.0,
        forward_temp=t * rows * 2 * 4.0,
        backward_temp=(t * rows * w if w < 4 else 0.0) + grad_temp + 2 * tl * h * w,
        persistent=0.0,
        input=tn * h * w + stats,
        input_saved=True,
        output=tn * h * w + stats,
    )


def largest_param(block: BlockInfo, m: ModelShape, run: RunShape) -> int:
    """Elements of the block's largest trainable tensor (its parameter list, or the role's shape)."""
    trainable = [p.numel for p in block.parameters if p.trainable]
    if trainable:
        return max(trainable)
    if not block.trainable:
        return 0
    h, tp = m.hidden_size, run.tp
    if block.role in ("embedding", "lm_head"):
        return m.vocab_size // tp * h
    if block.role == "vocab_shard":
        return block.params
    if block.role == "decoder":
        return 2 * m.intermediate_size // tp * h
    return block.trainable


def deferred_at_once(engine: str, pp: int, n_micro_batches: int) -> list[int]:
    """Weight-gradient passes a stage keeps deferred while it computes, the running W left out: a rank that
    defers the W of its first ``d`` backwards (:func:`~nanotron_ext.schedule.programs.deferred_weights`: zb1p's
    rank ``r`` ``r``, zb2p's ``2r``) keeps ``min(d, m - 1)`` (with ``m <= d`` the last backward's W is the first
    to run); AFAB and 1F1B defer none."""
    return [min(deferred_weights(engine, stage) or 0, n_micro_batches - 1) for stage in range(pp)]


def pending_tensors(block: BlockInfo, m: ModelShape, run: RunShape) -> dict[str, float]:
    """What one deferred weight-gradient pass (zb1p's ``W``) of ``block`` keeps alive from its ``B`` until it
    runs, per micro-batch, by tensor (bytes): for each trainable linear weight, the input it multiplies and the
    gradient of its output. Frozen weights keep nothing; nor do blocks whose weight gradient is made in B
    (embeddings, norms: :data:`~nanotron_ext.blocks.DEFERS_WEIGHT_GRADIENT`) or that have no weights.

    Example:
        tiny_llama_large_vocab (h = 16, t = 2 × 32 tokens, fp32): the lm_head keeps its input, 64 × 16 × 4 =
        4096 bytes, and the logits' gradient, 64 × 50277 × 4 = 12870912 bytes.
    """
    t = run.micro_batch_size * run.sequence_length
    w, tp, h = DTYPE_BYTES[run.dtype], run.tp, m.hidden_size
    seq_parallel = run.tp_mode == "REDUCE_SCATTER" and tp > 1
    tn = t / tp if seq_parallel else t
    tl = tn if (seq_parallel and run.tp_async) else t
    role = block.role
    if role not in DEFERS_WEIGHT_GRADIENT:  # embeddings and norms make their weight gradient in B
        tensors = {}
    elif role == "decoder":
        tensors = _decoder_pending(block, m, run, t, tn, tl)
    elif role in ("lm_head", "vocab_shard"):
        rows = m.vocab_size / tp if role == "lm_head" else block.params / h
        tensors = {"weight.input": tl * h * w, "weight.output_grad": t * rows * w}
    elif block.params:  # projector / other: a linear on the hidden states
        tensors = {"weight.input": t * h * w, "weight.output_grad": t * h * w}
    else:
        tensors = {}
    return {k: v for k, v in tensors.items() if _trains(block, k.split(".", 1)[0])}


def weight_pending(block: BlockInfo, m: ModelShape, run: RunShape) -> float:
    """Bytes one deferred ``W`` of ``block`` keeps (the sum of :func:`pending_tensors`)."""
    return float(sum(pending_tensors(block, m, run).values()))


#: Name fragments of a decoder layer's weights, by the tensor group of :func:`pending_tensors`.
_DECODER_WEIGHTS = {
    "input_layernorm": ("input_layernorm",),
    "qkv_proj": ("qkv", "q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "post_attention_layernorm": ("post_attention_layernorm",),
    "gate_up_proj": ("gate_up", "up_proj", "c_fc"),
    "down_proj": ("down_proj", "c_proj"),
}


def _decoder_pending(block: BlockInfo, m: ModelShape, run: RunShape, t: int, tn: float, tl: float) -> dict[str, float]:
    """A decoder layer's deferred-W tensors: qkv, o, the MLP's up (gate|up) and down linears (its norms make
    their weight gradients in B)."""
    w, tp, h = DTYPE_BYTES[run.dtype], run.tp, m.hidden_size
    q, kv = m.num_attention_heads / tp * m.head_dim, m.num_key_value_heads / tp * m.head_dim
    width = mlp_active(m, block_layer(block))[1] / tp
    gated = m.moe.glu if m.moe_layer(block_layer(block)) and m.moe is not None else m.family != "starcoder2"
    down_in = width / (3 if gated else 2)
    return {
        "qkv_proj.input": tl * h * w,
        "qkv_proj.output_grad": t * (q + 2 * kv) * w,
        "o_proj.input": t * q * w,
        "o_proj.output_grad": t * h * w,
        "gate_up_proj.input": tl * h * w,
        "gate_up_proj.output_grad": t * (width - down_in) * w,
        "down_proj.input": t * down_in * w,
        "down_proj.output_grad": t * h * w,
    }


def _trains(block: BlockInfo, group: str) -> bool:
    """Whether the weights of ``group`` (a decoder's linear or norm; any other name: the block's weights) train."""
    fragments = _DECODER_WEIGHTS.get(group) if block.role == "decoder" else None
    named = [p for p in block.parameters if fragments is None or any(f in p.name for f in fragments)]
    if named:
        return any(p.trainable for p in named)
    return block.trainable > 0
