"""Stand-in for `flash_attn.flash_attn_interface`: flash-attention 2.x attention entry points in plain torch.

Upstream Nanotron calls `flash_attn_varlen_func` in Llama's CoreAttention (`models/llama.py:290`),
`flash_attn_varlen_kvpacked_func` in Qwen2 (`models/qwen.py:309`) and `flash_attn_func` for
`_attn_implementation: flash_attention_2` (`nn/attention.py:166`). Here each packed sequence is attended
with `torch.nn.functional.scaled_dot_product_attention`, with flash's conventions: tensors are
(total_tokens, heads, head_dim), sequences are delimited by `cu_seqlens`, grouped-query heads map q head i
to kv head i // (heads_q / heads_kv), causal masks are aligned to the bottom-right when q and k lengths
differ, `window_size=(left, right)` with -1 meaning unbounded, rows with no visible key give 0.
With `return_attn_probs=True` it returns (out, softmax_lse, None), softmax_lse of shape (heads, total_q).

Attention has no parameters: it cannot change the PipelineBlocks, their build or rank assignment, what is
frozen, what DDP/the optimizer see, or the engine's schedule; it only has to give the right numbers so
that a CPU forward/backward is meaningful. The other names (ring attention internals, KV-cache inference)
only have to exist for imports and raise NotImplementedError.
"""

import math

import torch
import torch.nn.functional as F


def _visible(sq, sk, causal, window_size, device):
    """Bool (sq, sk) mask of the keys each query sees, or None when all are visible."""
    left, right = window_size
    if causal:
        right = 0
    if left < 0 and right < 0:
        return None
    i = torch.arange(sq, device=device)[:, None] + (sk - sq)  # bottom-right alignment
    j = torch.arange(sk, device=device)[None, :]
    mask = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if right >= 0:
        mask &= j <= i + right
    if left >= 0:
        mask &= j >= i - left
    return mask


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q=None,
    max_seqlen_k=None,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    if softcap or alibi_slopes is not None or block_table is not None:
        raise NotImplementedError("flash_attn stand-in: softcap / alibi / paged KV are not supported")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    outs, lses = [], []
    bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for (q0, q1), (k0, k1) in zip(zip(bq[:-1], bq[1:]), zip(bk[:-1], bk[1:])):
        qi, ki, vi = (t.transpose(0, 1) for t in (q[q0:q1], k[k0:k1], v[k0:k1]))  # (heads, len, dim)
        mask = _visible(q1 - q0, k1 - k0, causal, window_size, q.device)
        blind = None if mask is None else ~mask.any(-1, keepdim=True)  # rows that see no key: flash writes 0
        oi = F.scaled_dot_product_attention(
            qi,
            ki,
            vi,
            attn_mask=None if mask is None else mask | blind,
            dropout_p=dropout_p,
            scale=scale,
            enable_gqa=qi.shape[0] != ki.shape[0],
        )
        if blind is not None:
            oi = oi.masked_fill(blind, 0.0)
        outs.append(oi.transpose(0, 1))
        if return_attn_probs:
            kr = ki.repeat_interleave(qi.shape[0] // ki.shape[0], dim=0).float()
            s = (qi.float() @ kr.transpose(1, 2)) * scale
            lses.append(torch.logsumexp(s if mask is None else s.masked_fill(~mask, float("-inf")), dim=-1))
    tail = q.shape[0] - bq[-1]  # rows past cu_seqlens_q[-1] (padding): flash leaves them unwritten, here 0
    out = torch.cat(outs + [q.new_zeros(tail, *q.shape[1:])])
    if return_attn_probs:
        lse = torch.cat(lses + [q.new_zeros(q.shape[1], tail, dtype=torch.float32)], dim=1)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q=None,
    max_seqlen_k=None,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """kv: (total_k, 2, heads_kv, head_dim)."""
    return flash_attn_varlen_func(
        q,
        kv[:, 0],
        kv[:, 1],
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """q: (batch, seqlen_q, heads, dim), k/v: (batch, seqlen_k, heads_kv, dim): the varlen case with equal lengths."""
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=q.device)
    cu_k = torch.arange(0, (b + 1) * sk, sk, dtype=torch.int32, device=q.device)
    res = flash_attn_varlen_func(
        q.reshape(b * sq, *q.shape[2:]),
        k.reshape(b * sk, *k.shape[2:]),
        v.reshape(b * sk, *v.shape[2:]),
        cu_q,
        cu_k,
        sq,
        sk,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )
    if return_attn_probs:
        return res[0].view(q.shape), res[1].view(q.shape[2], b, sq).transpose(0, 1), None
    return res.view(q.shape)


def _not_here(name):
    def fn(*args, **kwargs):
        raise NotImplementedError(f"flash_attn stand-in: {name} (ring attention / KV-cache inference) is not available")

    fn.__name__ = name
    return fn


flash_attn_with_kvcache = _not_here("flash_attn_with_kvcache")
_flash_attn_varlen_forward = _not_here("_flash_attn_varlen_forward")
_flash_attn_varlen_backward = _not_here("_flash_attn_varlen_backward")
