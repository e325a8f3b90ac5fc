"""What upstream Nanotron main's GPU code keeps for backward, block by block, where it differs from the CPU runtime's
(``memory_runtime: gpu``): the decoder layers and the final norm of a Llama (``models/llama.py``) and of a Qwen2
(``models/qwen.py``), lines cited per function. The fused (Triton) RMSNorm keeps its input and an fp32 ``rstd``;
flash-attn keeps q, k and v at their own width, its output and an fp32 log-sum-exp per head; rotary runs in place.
Starcoder2 and LlaMoE keep the CPU runtime's count (:func:`gpu_path`). Measured against upstream's own models:
``benchmarks/gpu_path_memory.py``.
"""

from __future__ import annotations

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.config import DTYPE_BYTES, MemoryRuntime, ModelShape, RunShape
from nanotron_ext.costs.block_terms import BlockMemory, block_layer, mlp_saved_width, norm_saved

__all__ = ["GPU_FAMILIES", "fused_final_norm", "gpu_decoder", "gpu_final_norm", "gpu_path"]

#: The families whose GPU code is counted here.
GPU_FAMILIES = ("llama", "qwen2")


def gpu_path(m: ModelShape, runtime: MemoryRuntime) -> bool:
    """Whether blocks are counted for upstream Nanotron's GPU code (``memory_runtime: gpu``, a Llama or a Qwen2)
    rather than the CPU runtime's."""
    return runtime == "gpu" and m.family in GPU_FAMILIES


def fused_final_norm(m: ModelShape) -> bool:
    """Whether the final norm is the fused ``TritonRMSNorm``: always in Llama (``models/llama.py:875``), under
    ``_fused_rms_norm`` in Qwen2 (``models/qwen.py:735``)."""
    return m.family == "llama" or m.fused_rms_norm


def gpu_final_norm(tn: float, h: int, w: int, grad_temp: float) -> BlockMemory:
    """``TritonRMSNorm`` (flash-attn's ``layer_norm_fn``): keeps its input and an fp32 rstd; backward: dx."""
    return BlockMemory(
        saved=tn * (h * w + 4.0),
        forward_temp=0.0,
        backward_temp=tn * h * w + grad_temp,
        persistent=0.0,
        input=tn * h * w,
        input_saved=True,
        output=tn * h * w,
    )


def gpu_decoder(
    block: BlockInfo, m: ModelShape, run: RunShape, t: int, tn: float, tl: float, grad_temp: float
) -> tuple[BlockMemory, float]:
    """A decoder layer as upstream Nanotron runs it on a GPU, and the larger of what its attention and its MLP
    keep (what a recomputed layer holds for a moment).

    Llama (``models/llama.py``, lines 437-472 and 676-717: ``CausalSelfAttention.forward`` and
    ``_forward_training``; 720-759: ``LlamaDecoderLayer``):

    * each ``TritonRMSNorm`` keeps its input itself and an fp32 ``rstd`` per token; the linear after it keeps
      the norm's output;
    * with GQA, q, k and v are made contiguous one by one (459-467); k and v are concatenated and permuted
      into one ``[b, s, 2, kv_heads, d]`` tensor (679-681), rotated in place (683), and flash-attn keeps q, that
      k|v tensor and its output, plus an fp32 log-sum-exp ``[heads, tokens]``. Without GQA, q, k and v are views
      of one contiguous ``[3, ...]`` copy (469-472): the q flash-attn keeps holds all of it;
    * ``o_proj`` copies its input when the micro-batch holds more than one sequence (``[s, b, q]`` is not
      contiguous then). Forward temporaries: the qkv output, held by ``forward``'s locals until it returns,
      beside the copies and the concatenation.

    Qwen2 (``models/qwen.py``, 221-330: ``Qwen2Attention``, packed q|kv; 580-631: ``Qwen2DecoderLayer``):

    * the input norm is the unfused ``LlamaRMSNorm`` whatever ``_fused_rms_norm`` says (584 replaces 582): the
      CPU runtime's norm count; the post-attention norm is fused under ``_fused_rms_norm``;
    * q and k|v are views of the qkv output (268-269), rotated in place, so flash-attn keeps the whole qkv output,
      its own output (``o_proj``'s input too: ``[tokens, q]`` is contiguous) and the log-sum-exp. Forward
      temporaries: an unfused norm's fp32 working copy (its ``pow``), or ``o_proj``'s output beside the residual.

    Both keep 4f in the MLP; backward temporaries are the larger of the MLP's gradients and flash-attn's (dq, dk,
    dv, the keys' and values' gradients at full head count under GQA, an fp32 dq accumulator and softmax_d), with
    a weight's. flash-attn's rotary caches cos and sin in the model dtype, per layer.
    """
    w = DTYPE_BYTES[run.dtype]
    tp, h, d = run.tp, m.hidden_size, m.head_dim
    heads = m.num_attention_heads / tp
    q, kv = heads * d, m.num_key_value_heads / tp * d
    gqa = m.num_attention_heads != m.num_key_value_heads
    lse = 4.0 * heads
    fused = tn * (h * w + 4.0)
    if m.family == "qwen2":
        attention = t * (w * ((q + 2 * kv) + q) + lse)
        norms = norm_saved(tn, h, w) + (fused if m.fused_rms_norm else norm_saved(tn, h, w))
        forward_temp = tn * h * max(4.0, w)
        input_saved = w == 4
    else:
        q_kept = q if gqa else q + 2 * kv
        o_copy = q if run.micro_batch_size > 1 else 0
        attention = t * (w * (q_kept + 2 * kv + q + o_copy) + lse)
        norms = 2 * fused
        forward_temp = t * w * ((q + 2 * kv) + (2 * kv if gqa else 0) + 2 * kv)
        input_saved = True
    mlp = t * w * mlp_saved_width(m, block_layer(block)) / tp
    saved = norms + 2 * tl * h * w + attention + mlp
    attention_backward = t * (w * (q + 2 * kv + (2 * q if gqa else 0)) + 4.0 * (q + heads))
    backward_temp = grad_temp + max(t * w * 3 * m.intermediate_size / tp, attention_backward)
    rotary = 2 * run.sequence_length * (d // 2) * w  # flash-attn's cos/sin cache, in the model dtype, per layer
    whole = BlockMemory(
        saved=saved,
        forward_temp=forward_temp,
        backward_temp=backward_temp,
        persistent=rotary,
        input=tn * h * w + t,
        input_saved=input_saved,
        output=tn * h * w + t,
    )
    return whole, max(attention, mlp)
