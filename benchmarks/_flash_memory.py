"""Kernels that keep, for backward, what flash-attn's keep: stand-ins for measuring the memory of upstream
Nanotron's GPU path where flash-attn is not installed (the lent GPU machines have none, and this one has no GPU).

:func:`install` puts them in place of the three flash-attn calls upstream's Llama makes in training, on top of the
import stand-ins of ``--cpu-debug`` (``nanotron_ext/integration/cpu_standins/missing_modules/flash_attn``, which
compute the same values with plain torch autograd, and so keep far more):

* ``flash_attn_varlen_func`` (``models/llama.py:290``; the packed form of ``models/qwen.py:309`` too): torch's
  ``scaled_dot_product_attention`` restricted to its flash kernel, which keeps what flash-attn 2 keeps: q, k and v as
  given (views: no copy), the output and an fp32 log-sum-exp per head and token. Sequences of one length only (what
  the trainer's packed data gives).
* ``RotaryEmbedding.forward`` (``flash_attn/layers/rotary.py``, called at ``models/llama.py:683``): q and the k
  half of kv rotated in place, keeping only the cos/sin tables (flash's ``ApplyRotaryEmb`` with
  ``inplace=True``).
* ``layer_norm_fn`` (``flash_attn/ops/triton/layer_norm.py``, behind ``TritonRMSNorm``): RMSNorm keeping its
  input and an fp32 ``rstd`` per row (flash's ``LayerNormFn`` saves ``x``, ``weight``, ``rstd``), computed in
  row chunks so that its fp32 working copies stay small, as in the fused kernel.

The values are flash's up to rounding; the point is what stays alive between forward and backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["install"]

_CHUNK = 1024  # rows per step of the chunked kernels: fp32 working copies of at most 1024 rows


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        y = torch.empty_like(rows)
        rstd = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
        w = weight.float()
        for i in range(0, rows.shape[0], _CHUNK):
            xf = rows[i : i + _CHUNK].float()
            rstd[i : i + _CHUNK] = torch.rsqrt(xf.square().mean(-1) + eps)
            y[i : i + _CHUNK] = (xf * rstd[i : i + _CHUNK, None] * w).to(y.dtype)
        ctx.save_for_backward(rows, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        rows, weight, rstd = ctx.saved_tensors
        g = dy.reshape(-1, dy.shape[-1])
        dx = torch.empty_like(rows)
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        w = weight.float()
        for i in range(0, rows.shape[0], _CHUNK):
            xhat = rows[i : i + _CHUNK].float() * rstd[i : i + _CHUNK, None]
            gf = g[i : i + _CHUNK].float()
            dw += (gf * xhat).sum(0)
            wg = gf * w
            dx[i : i + _CHUNK] = (rstd[i : i + _CHUNK, None] * (wg - xhat * (wg * xhat).mean(-1, keepdim=True))).to(
                dx.dtype
            )
        return dx.view(dy.shape), dw.to(weight.dtype), None


def layer_norm_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: Any = None,
    eps: float = 1e-6,
    dropout_p: float = 0.0,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    is_rms_norm: bool = False,
    return_dropout_mask: bool = False,
    **_: Any,
) -> torch.Tensor:
    """flash-attn's ``layer_norm_fn`` for what ``TritonRMSNorm`` asks of it: RMSNorm, no residual, no dropout."""
    if not is_rms_norm or bias is not None or residual is not None or dropout_p or prenorm or return_dropout_mask:
        raise NotImplementedError("the memory stand-in of layer_norm_fn does RMSNorm only (TritonRMSNorm's call)")
    return _RMSNorm.apply(x, weight, eps)


def _rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, conjugate: bool) -> None:
    """Rotate ``x`` (batch, seqlen, heads, dim) in place by position, a chunk of positions at a time."""
    half = cos.shape[-1]
    for i in range(0, x.shape[1], _CHUNK):
        part = x[:, i : i + _CHUNK, :, : 2 * half]
        c = cos[i : i + part.shape[1]].float()[None, :, None, :]
        s = sin[i : i + part.shape[1]].float()[None, :, None, :]
        if conjugate:
            s = -s
        a, b = (part[..., 0::2], part[..., 1::2]) if interleaved else (part[..., :half], part[..., half:])
        af, bf = a.float(), b.float()
        a.copy_(af * c - bf * s)
        b.copy_(af * s + bf * c)


class _RotaryInPlace(torch.autograd.Function):
    """Rotates ``x[:, :, 0]`` when ``kv`` (the k half of a (b, s, 2, heads, d) tensor), else ``x``; in place."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, kv: bool
    ) -> torch.Tensor:
        # Written behind autograd's back (through .data: no version bump), as flash's Triton kernel writes: q may
        # be an output of unbind (Llama's multi-head path) and q and k|v views of one qkv tensor (Qwen2), which
        # autograd refuses to see modified in place.
        _rotate_((x[:, :, 0] if kv else x).data, cos, sin, interleaved, conjugate=False)
        ctx.save_for_backward(cos, sin)
        ctx.interleaved, ctx.kv = interleaved, kv
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        cos, sin = ctx.saved_tensors
        grad = grad.contiguous()
        _rotate_(grad[:, :, 0] if ctx.kv else grad, cos, sin, ctx.interleaved, conjugate=True)
        return grad, None, None, None, None


def _rotary_forward(
    self: Any, qkv: torch.Tensor, kv: torch.Tensor | None = None, seqlen_offset: int = 0, max_seqlen: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    if kv is None or not isinstance(seqlen_offset, int):
        raise NotImplementedError("the memory stand-in of RotaryEmbedding takes q and kv (Llama's training call)")
    self._update_cos_sin_cache(qkv.shape[1] + seqlen_offset, device=qkv.device, dtype=qkv.dtype)
    cos, sin = self._cos_cached[seqlen_offset:], self._sin_cached[seqlen_offset:]
    return (
        _RotaryInPlace.apply(qkv, cos, sin, self.interleaved, False),
        _RotaryInPlace.apply(kv, cos, sin, self.interleaved, True),
    )


#: Which SDPA kernel ran the attention (the flash kernel keeps flash-attn's tensors; set on the first call).
ATTENTION_KERNEL: dict[str, str] = {}


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    **kwargs: Any,
) -> torch.Tensor:
    """flash-attn 2's varlen attention for sequences of one length (q, k, v: (tokens, heads, dim))."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, s = cu_seqlens_q.numel() - 1, int(max_seqlen_q)
    if q.shape[0] != b * s or k.shape[0] != b * int(max_seqlen_k) or kwargs.get("return_attn_probs"):
        raise NotImplementedError("the memory stand-in of flash_attn_varlen_func takes equal-length sequences")
    qb, kb, vb = (x.view(b, -1, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    out = None
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):  # both keep q, k, v, out, lse
        try:
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(
                    qb, kb, vb, dropout_p=dropout_p, is_causal=causal, scale=softmax_scale, enable_gqa=gqa
                )
            break
        except RuntimeError as err:  # this torch has no such kernel for these inputs: the next, and say so
            ATTENTION_KERNEL.setdefault("refused", f"{backend.name}: {str(err).splitlines()[0][:200]}")
    if out is None:
        raise RuntimeError(f"no SDPA kernel that keeps flash-attn's tensors takes these inputs: {ATTENTION_KERNEL}")
    flat = out.transpose(1, 2).reshape(q.shape[0], q.shape[1], v.shape[-1])
    if "kernel" not in ATTENTION_KERNEL:  # the output it keeps must be the one handed on, not a copy of it
        ATTENTION_KERNEL.update(
            kernel=out.grad_fn.name() if out.grad_fn is not None else "no grad",
            output_copied=str(flat.data_ptr() != out.data_ptr()),
        )
    return flat


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    **kwargs: Any,
) -> torch.Tensor:
    """The packed form Qwen2 calls (``models/qwen.py:309``): kv is (tokens, 2, kv_heads, dim); k and v stay views."""
    return flash_attn_varlen_func(
        q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, **kwargs
    )


def install() -> None:
    """Put the kernels in place of the import stand-ins' (and in ``nanotron.nn.layer_norm``, which binds
    ``layer_norm_fn`` at import)."""
    import flash_attn.flash_attn_interface as interface
    import flash_attn.layers.rotary as rotary
    import flash_attn.ops.triton.layer_norm as layer_norm

    interface.flash_attn_varlen_func = flash_attn_varlen_func  # models/llama.py imports it again in forward
    import nanotron.models.qwen as qwen  # binds the packed entry point at import

    qwen.flash_attn_varlen_kvpacked_func = flash_attn_varlen_kvpacked_func
    rotary.RotaryEmbedding.forward = _rotary_forward
    layer_norm.layer_norm_fn = layer_norm_fn
    import nanotron.nn.layer_norm as nanotron_norms

    nanotron_norms.layer_norm_fn = layer_norm_fn
