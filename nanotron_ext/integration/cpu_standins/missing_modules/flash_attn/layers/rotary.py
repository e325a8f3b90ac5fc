"""Stand-in for `flash_attn.layers.rotary`: flash-attention 2.x rotary embedding in plain torch.

Upstream uses `RotaryEmbedding` in Llama's training attention (`models/llama.py:343`, called at :683 as
`q, kv = rot(q, kv=kv)`), as the base class of `nanotron.nn.rotary.FlashRotaryEmbedding` (Qwen2 with
`_use_qkv_packed`, which overrides `_update_cos_sin_cache` and relies on the attributes below), and
`apply_rotary_emb` in `nanotron.nn.rotary.RotaryEmbedding(fused=True)`. Semantics follow flash's
reference `apply_rotary_emb_torch`: the first 2 * cos.shape[-1] channels are rotated, pairs are
(i, i + d/2) ("rotate half", GPT-NeoX) or, with `interleaved=True`, (2i, 2i + 1) (GPT-J); math in fp32,
result in the input dtype. One difference: results are returned as new tensors even when flash would
write in place; upstream only uses the returned tensors.

`inv_freq` is a non-persistent buffer built exactly as flash builds it, so under Nanotron's
`init_on_device_and_dtype` it is moved and cast the same way; the module has no parameters, so block
split, build, freezing, DDP/optimizer construction and the engine schedule are unaffected.
"""

import torch
from torch import nn


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None, max_seqlen=None):
    """x: (batch, seqlen, heads, dim), or (total, heads, dim) with cu_seqlens; cos/sin: (seqlen_ro, rotary_dim / 2).
    seqlen_offsets: int or (batch,) tensor added to the positions."""
    rd = 2 * cos.shape[-1]
    if cu_seqlens is not None:  # position restarts at 0 for each packed sequence
        lens = cu_seqlens[1:] - cu_seqlens[:-1]
        pos = torch.arange(x.shape[0], device=x.device) - torch.repeat_interleave(cu_seqlens[:-1], lens)
        pos = pos + (
            seqlen_offsets if isinstance(seqlen_offsets, int) else torch.repeat_interleave(seqlen_offsets, lens)
        )
    else:
        pos = torch.arange(x.shape[1], device=x.device)[None, :]
        pos = pos + (seqlen_offsets if isinstance(seqlen_offsets, int) else seqlen_offsets[:, None])
    c, s = cos.float()[pos].unsqueeze(-2), sin.float()[pos].unsqueeze(-2)  # (..., seqlen, 1, rd/2)
    xr = x[..., :rd].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr.chunk(2, dim=-1)
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., rd:]), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim: int, base=10000.0, interleaved=False, scale_base=None, pos_idx_in_fp32=True, device=None):
        super().__init__()
        self.dim = dim
        self.base = float(base)
        self.pos_idx_in_fp32 = pos_idx_in_fp32
        self.register_buffer("inv_freq", self._compute_inv_freq(device), persistent=False)
        self.interleaved = interleaved
        self.scale_base = scale_base
        scale = (
            (torch.arange(0, dim, 2, device=device, dtype=torch.float32) + 0.4 * dim) / (1.4 * dim)
            if scale_base is not None
            else None
        )
        self.register_buffer("scale", scale, persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = self._sin_cached = self._cos_k_cached = self._sin_k_cached = None

    def _compute_inv_freq(self, device=None):
        return 1.0 / (self.base ** (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim))

    def _update_cos_sin_cache(self, seqlen, device=None, dtype=None):
        if (
            seqlen > self._seq_len_cached
            or self._cos_cached is None
            or self._cos_cached.device != device
            or self._cos_cached.dtype != dtype
            or (self.training and self._cos_cached.is_inference())
        ):
            self._seq_len_cached = seqlen
            if self.pos_idx_in_fp32:
                t = torch.arange(seqlen, device=device, dtype=torch.float32)
                inv_freq = self._compute_inv_freq(device) if self.inv_freq.dtype != torch.float32 else self.inv_freq
            else:
                t = torch.arange(seqlen, device=device, dtype=self.inv_freq.dtype)
                inv_freq = self.inv_freq
            freqs = torch.outer(t, inv_freq)
            if self.scale is not None:
                raise NotImplementedError("flash_attn stand-in: xPos (scale_base) is not supported")
            self._cos_cached, self._sin_cached = torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)

    def forward(
        self,
        qkv: torch.Tensor,
        kv: torch.Tensor | None = None,
        seqlen_offset: int | torch.Tensor = 0,
        max_seqlen: int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """qkv: (batch, seqlen, 3, heads, dim) if kv is None, else q: (batch, seqlen, heads, dim) and
        kv: (batch, seqlen, 2, heads_kv, dim). Rotates q and k, returns qkv or (q, kv)."""
        seqlen = qkv.shape[1]
        if max_seqlen is not None:
            self._update_cos_sin_cache(max_seqlen, device=qkv.device, dtype=qkv.dtype)
        elif isinstance(seqlen_offset, int):
            self._update_cos_sin_cache(seqlen + seqlen_offset, device=qkv.device, dtype=qkv.dtype)
        if self.scale is not None:
            raise NotImplementedError("flash_attn stand-in: xPos (scale_base) is not supported")

        def rot(x):
            return apply_rotary_emb(x, self._cos_cached, self._sin_cached, self.interleaved, True, seqlen_offset)

        if kv is None:
            return torch.stack((rot(qkv[:, :, 0]), rot(qkv[:, :, 1]), qkv[:, :, 2]), dim=2)
        return rot(qkv), torch.stack((rot(kv[:, :, 0]), kv[:, :, 1]), dim=2)
