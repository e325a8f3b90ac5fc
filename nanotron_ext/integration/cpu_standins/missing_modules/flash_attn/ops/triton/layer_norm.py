"""Stand-in for `flash_attn.ops.triton.layer_norm`: `layer_norm_fn` in plain torch instead of a Triton kernel.

Upstream's `TritonRMSNorm` / `TritonLayerNorm` (`nn/layer_norm.py`) call it for every norm of Llama (input,
post-attention and final norms) and for Qwen2 with `_fused_rms_norm`. Same contract as flash's kernel:
optional dropout on x, then x + residual, then RMSNorm (`is_rms_norm=True`: x / sqrt(mean(x^2) + eps)) or
LayerNorm ((x - mean) / sqrt(var + eps)), times weight (+ bias); computed in fp32, output in x's dtype;
with `prenorm=True` also returns the pre-norm sum (residual's dtype, or fp32 with `residual_in_fp32`).

It is a pure function: the norm's parameter (`weight`) is created by upstream's module, so block split,
build, freezing, DDP/optimizer construction and the engine schedule are unchanged.
"""

import torch
import torch.nn.functional as F


def layer_norm_fn(
    x,
    weight,
    bias,
    residual=None,
    x1=None,
    weight1=None,
    bias1=None,
    eps=1e-6,
    dropout_p=0.0,
    rowscale=None,
    prenorm=False,
    residual_in_fp32=False,
    is_rms_norm=False,
    return_dropout_mask=False,
):
    if x1 is not None or weight1 is not None or rowscale is not None or return_dropout_mask:
        raise NotImplementedError("flash_attn stand-in: x1 / weight1 / rowscale / return_dropout_mask")
    res_dtype = residual.dtype if residual is not None else (torch.float32 if residual_in_fp32 else x.dtype)
    h = F.dropout(x.float(), p=dropout_p) if dropout_p > 0 else x.float()
    if residual is not None:
        h = h + residual.float()
    if is_rms_norm:
        y = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)
    else:
        y = (h - h.mean(-1, keepdim=True)) * torch.rsqrt(h.var(-1, unbiased=False, keepdim=True) + eps)
    y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype)
    return (y, h.to(res_dtype)) if prenorm else y
