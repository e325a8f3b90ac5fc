"""Attention of the CPU runtime's Llama: rotary embeddings, torch SDPA with GQA, Nanotron's tensor-parallel
qkv and output projections (names as in Nanotron's ``CausalSelfAttention``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from nanotron import distributed as dist
from nanotron.config import LlamaConfig, ParallelismArgs
from nanotron.parallel.tensor_parallel.nn import (
    TensorParallelColumnLinear,
    TensorParallelLinearMode,
    TensorParallelRowLinear,
)
from torch import nn

__all__ = [
    "CausalSelfAttention",
    "CoreAttention",
    "RotaryEmbedding",
    "check_attention_shapes",
    "linear_async",
    "linear_mode",
]


def linear_mode(parallel_config: ParallelismArgs | None) -> TensorParallelLinearMode:
    # Same default as Nanotron's models (ALL_REDUCE when no parallel config is given).
    return parallel_config.tp_mode if parallel_config is not None else TensorParallelLinearMode.ALL_REDUCE


def linear_async(parallel_config: ParallelismArgs | None) -> bool:
    return parallel_config.tp_linear_async_communication if parallel_config is not None else False


def check_attention_shapes(config: LlamaConfig, tp_size: int) -> None:
    """Raise a clear ValueError where Nanotron would fail an assert on the head layout."""
    n_heads = config.num_attention_heads
    n_kv = config.num_key_value_heads if config.num_key_value_heads is not None else n_heads
    if config.hidden_size % n_heads != 0:
        raise ValueError(f"hidden_size={config.hidden_size} must be divisible by num_attention_heads={n_heads}.")
    if (config.hidden_size // n_heads) % 2 != 0:
        raise ValueError(
            f"head dim hidden_size/num_attention_heads={config.hidden_size // n_heads} must be even for "
            "rotary embeddings."
        )
    if n_heads % n_kv != 0:
        raise ValueError(f"num_attention_heads={n_heads} must be divisible by num_key_value_heads={n_kv} (GQA groups).")
    if n_heads % tp_size != 0 or n_kv % tp_size != 0:
        raise ValueError(
            f"num_attention_heads={n_heads} and num_key_value_heads={n_kv} must both be divisible by the "
            f"tensor-parallel size {tp_size}; lower TP or change the head counts."
        )


class RotaryEmbedding(nn.Module):
    """Interleaved rotary position embedding (same rotation as Nanotron's ``RotaryEmbedding``), on any device.

    The cos/sin tables are plain cached attributes, not buffers, so DDP never tries to broadcast them and
    ``init_on_device_and_dtype`` never casts them.

    Args:
        dim: head dimension (even).
        end: initial table length; grows (doubling) when longer sequences arrive, as Nanotron's does.
        theta: RoPE base.
    """

    def __init__(self, dim: int, end: int, theta: float = 10000.0) -> None:
        super().__init__()
        if dim % 2 != 0:
            raise ValueError(f"Rotary dim must be even, got {dim}.")
        self.dim = dim
        self.end = end
        self.theta = theta
        self._cache: tuple[torch.device, int, torch.Tensor, torch.Tensor] | None = None

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cache is None or self._cache[0] != device or self._cache[1] != self.end:
            exponent = torch.arange(0, self.dim, 2, dtype=torch.float32, device=device)[: self.dim // 2] / self.dim
            inv_freq = 1.0 / (self.theta**exponent)
            positions = torch.arange(self.end, dtype=torch.float32, device=device)
            angles = torch.outer(positions, inv_freq)  # [end, dim/2]
            self._cache = (device, self.end, torch.cos(angles), torch.sin(angles))
        return self._cache[2], self._cache[3]

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate ``x``.

        Args:
            x: ``[batch, seq, heads, dim]``.
            position_ids: optional ``[batch, seq]`` positions; ``arange(seq)`` when None.

        Returns:
            The rotated tensor, same shape and dtype as ``x``.
        """
        batch_size, seq_length, num_heads, inner_dim = x.shape
        max_pos = seq_length if position_ids is None else int(position_ids.max().item()) + 1
        while max_pos > self.end:
            self.end *= 2
        cos, sin = self._tables(x.device)
        if position_ids is None:
            cos, sin = cos[None, :seq_length, None, :], sin[None, :seq_length, None, :]
        else:
            if int(position_ids.min().item()) < 0:
                raise ValueError("position_ids must be non-negative.")
            cos, sin = cos[position_ids][:, :, None, :], sin[position_ids][:, :, None, :]
        dtype = x.dtype
        pairs = x.float().view(batch_size, seq_length, num_heads, inner_dim // 2, 2)
        x0, x1 = pairs[..., 0], pairs[..., 1]
        # Complex multiplication (x0 + i x1) * (cos + i sin), written in reals.
        out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
        return out.view(batch_size, seq_length, num_heads, inner_dim).to(dtype)


class CoreAttention(nn.Module):
    """Causal attention with ``torch.nn.functional.scaled_dot_product_attention`` (replaces flash-attn)."""

    def __init__(self, config: LlamaConfig, parallel_config: ParallelismArgs | None, layer_idx: int) -> None:
        super().__init__()
        self.d_qk = config.hidden_size // config.num_attention_heads
        self.d_v = config.hidden_size // config.num_attention_heads

    def forward(
        self,
        query_states: torch.Tensor,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        q_sequence_mask: torch.Tensor,
        kv_sequence_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Attend.

        Args:
            query_states: ``[batch, q_len, n_q_heads, d]``.
            key_states: ``[batch, kv_len, n_kv_heads, d]``; ``n_q_heads`` must be a multiple of
            ``n_kv_heads``.
            value_states: ``[batch, kv_len, n_kv_heads, d]``.
            q_sequence_mask: bool ``[batch, q_len]``; False marks padding.
            kv_sequence_mask: bool ``[batch, kv_len]``; False marks padding.

        Returns:
            ``[batch, q_len, n_q_heads, d]``; padded query positions are zero.
        """
        n_q_heads, n_kv_heads = query_states.shape[2], key_states.shape[2]
        if n_q_heads != n_kv_heads:
            # GQA: query head i reads kv head i // group, flash-attn's convention.
            group = n_q_heads // n_kv_heads
            key_states = key_states.repeat_interleave(group, dim=2)
            value_states = value_states.repeat_interleave(group, dim=2)
        q = query_states.transpose(1, 2)  # [batch, heads, q_len, d]
        k = key_states.transpose(1, 2)
        v = value_states.transpose(1, 2)
        q_len, kv_len = q.shape[2], k.shape[2]
        q_mask = q_sequence_mask.bool()
        kv_mask = kv_sequence_mask.bool()
        if bool(q_mask.all()) and bool(kv_mask.all()):
            # Training on packed sequences (Nanotron's data loader): the plain causal kernel.
            out = F.scaled_dot_product_attention(q, k, v, is_causal=q_len > 1)
            return out.transpose(1, 2)
        # Padding present: causal (aligned to the end, as flash-attn does when q_len < kv_len) AND key mask.
        causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril(diagonal=kv_len - q_len)
        allowed = causal[None, None] & kv_mask[:, None, None, :]
        # A query that can see no key would produce NaN; let it see everything and zero it below.
        fully_masked = ~allowed.any(dim=-1, keepdim=True)
        allowed = allowed | fully_masked
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        out = out * q_mask[:, None, :, None].to(out.dtype)
        return out.transpose(1, 2)


class CausalSelfAttention(nn.Module):
    """Nanotron's Llama attention block (``qkv_proj``, rotary, ``o_proj``) with SDPA; GQA supported."""

    def __init__(
        self,
        config: LlamaConfig,
        parallel_config: ParallelismArgs | None,
        tp_pg: dist.ProcessGroup,
        layer_idx: int,
    ) -> None:
        super().__init__()
        tp_size = tp_pg.size()
        check_attention_shapes(config, tp_size)
        n_kv = config.num_key_value_heads if config.num_key_value_heads is not None else config.num_attention_heads
        self.n_local_q_heads = config.num_attention_heads // tp_size
        self.n_local_kv_heads = n_kv // tp_size
        self.n_repeats = config.num_attention_heads // n_kv
        self.is_gqa = config.num_attention_heads != n_kv
        self.d_qk = config.hidden_size // config.num_attention_heads
        self.d_v = config.hidden_size // config.num_attention_heads
        self.d_model = config.hidden_size
        tp_mode = linear_mode(parallel_config)
        tp_async = linear_async(parallel_config)

        self.qkv_proj = TensorParallelColumnLinear(
            self.d_model,
            config.num_attention_heads * self.d_qk + 2 * n_kv * self.d_qk,
            pg=tp_pg,
            mode=tp_mode,
            bias=False,
            async_communication=tp_async,
            contiguous_chunks=(
                config.num_attention_heads * self.d_qk,
                n_kv * self.d_qk,
                n_kv * self.d_qk,
            ),
        )
        theta = float(getattr(config, "rope_theta", None) or 10000.0)
        self.rotary_embedding = RotaryEmbedding(dim=self.d_qk, end=config.max_position_embeddings, theta=theta)
        self.o_proj = TensorParallelRowLinear(
            config.num_attention_heads * self.d_qk,
            self.d_model,
            pg=tp_pg,
            mode=tp_mode,
            bias=False,
            async_communication=tp_async,
        )
        self.attention = CoreAttention(config, parallel_config=parallel_config, layer_idx=layer_idx)

    def forward(self, hidden_states: torch.Tensor, sequence_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """Args: hidden_states ``[seq, batch, hidden]``, sequence_mask ``[batch, seq]``.

        Returns:
            ``{"hidden_states": [seq, batch, hidden], "sequence_mask": sequence_mask}``.
        """
        qkv_states = self.qkv_proj(hidden_states)  # [seq, batch, (n_q + 2 n_kv) * d_qk] (local heads)
        q_length, batch_size, _ = qkv_states.shape
        # The qkv weight is laid out [q | k | v] (contiguous chunks), both with and without GQA.
        query_states, key_states, value_states = torch.split(
            qkv_states,
            [
                self.n_local_q_heads * self.d_qk,
                self.n_local_kv_heads * self.d_qk,
                self.n_local_kv_heads * self.d_qk,
            ],
            dim=-1,
        )
        query_states = query_states.transpose(0, 1).reshape(batch_size, q_length, self.n_local_q_heads, self.d_qk)
        key_states = key_states.transpose(0, 1).reshape(batch_size, q_length, self.n_local_kv_heads, self.d_qk)
        value_states = value_states.transpose(0, 1).reshape(batch_size, q_length, self.n_local_kv_heads, self.d_v)

        query_states = self.rotary_embedding(query_states)
        key_states = self.rotary_embedding(key_states)

        attention_output = self.attention(
            query_states=query_states,
            key_states=key_states,
            value_states=value_states,
            q_sequence_mask=sequence_mask,
            kv_sequence_mask=sequence_mask,
        )
        attention_output = (
            attention_output.contiguous().view(batch_size, q_length, self.n_local_q_heads * self.d_v).transpose(0, 1)
        )
        return {"hidden_states": self.o_proj(attention_output), "sequence_mask": sequence_mask}
