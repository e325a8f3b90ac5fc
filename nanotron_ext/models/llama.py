"""A CPU Llama for Nanotron 0.2 with the exact block layout and parameter names of ``LlamaForTraining``.

``nanotron.models.llama`` imports ``flash_attn`` (CUDA-only) and its rotary buffers are allocated with
``device="cuda"``, so it cannot run here. This module re-creates the same graph with torch SDPA attention and
a plain RMSNorm, while everything parallel is Nanotron's own: ``PipelineBlock``, ``P2P`` (on the CPU device),
``TensorParallelColumnLinear`` / ``TensorParallelRowLinear`` / ``TensorParallelEmbedding`` and
``sharded_cross_entropy``. Module and parameter names match Nanotron's, e.g.
``model.decoder.0.pp_block.attn.qkv_proj.weight`` and ``model.lm_head.pp_block.weight``, so a plan computed
from this model applies unchanged to Nanotron's ``LlamaForTraining`` on GPUs.

Training only: the inference path (KV cache, ``AttachableStore``) of Nanotron's model is not reproduced.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from nanotron import distributed as dist
from nanotron.config import LlamaConfig, ParallelismArgs
from nanotron.models import NanotronModel
from nanotron.nn.activations import ACT2FN
from nanotron.parallel import ParallelContext
from nanotron.parallel.parameters import NanotronParameter
from nanotron.parallel.pipeline_parallel.block import PipelineBlock, TensorPointer
from nanotron.parallel.pipeline_parallel.p2p import P2P
from nanotron.parallel.tensor_parallel.functional import sharded_cross_entropy
from nanotron.parallel.tensor_parallel.nn import (
    TensorParallelColumnLinear,
    TensorParallelEmbedding,
    TensorParallelLinearMode,
    TensorParallelRowLinear,
)
from nanotron.random import RandomStates
from torch import nn

from nanotron_ext.blocks import vocab_slices
from nanotron_ext.inventory.family_blocks import llama_class_costs
from nanotron_ext.models.vocab_chain import ChainLoss, VocabShard, vocab_shard_blocks

__all__ = [
    "CPULlamaForTraining",
    "CPULlamaModel",
    "CausalSelfAttention",
    "CoreAttention",
    "Embedding",
    "GLUActivation",
    "LlamaDecoderLayer",
    "Loss",
    "MLP",
    "Projector",
    "RMSNorm",
    "RotaryEmbedding",
]

TensorOrPointer = torch.Tensor | TensorPointer


def _tp_mode(parallel_config: ParallelismArgs | None) -> TensorParallelLinearMode:
    # Same default as Nanotron's models (ALL_REDUCE when no parallel config is given).
    return parallel_config.tp_mode if parallel_config is not None else TensorParallelLinearMode.ALL_REDUCE


def _tp_async(parallel_config: ParallelismArgs | None) -> bool:
    return parallel_config.tp_linear_async_communication if parallel_config is not None else False


def _check_attention_shapes(config: LlamaConfig, tp_size: int) -> None:
    """Raise a clear ValueError where Nanotron would fail an assert on the head layout."""
    n_heads = config.num_attention_heads
    n_kv = config.num_key_value_heads if config.num_key_value_heads is not None else n_heads
    if config.hidden_size % n_heads != 0:
        raise ValueError(
            f"hidden_size={config.hidden_size} must be divisible by num_attention_heads={n_heads}."
        )
    if (config.hidden_size // n_heads) % 2 != 0:
        raise ValueError(
            f"head dim hidden_size/num_attention_heads={config.hidden_size // n_heads} must be even for "
            "rotary embeddings."
        )
    if n_heads % n_kv != 0:
        raise ValueError(
            f"num_attention_heads={n_heads} must be divisible by num_key_value_heads={n_kv} (GQA groups)."
        )
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
            exponent = (
                torch.arange(0, self.dim, 2, dtype=torch.float32, device=device)[: self.dim // 2] / self.dim
            )
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


class GLUActivation(nn.Module):
    """``act(gate) * up`` on a merged ``[gate | up]`` tensor, as in Nanotron."""

    def __init__(self, act_fn_name: str) -> None:
        super().__init__()
        self.act = ACT2FN[act_fn_name]

    def forward(self, merged_states: torch.Tensor) -> torch.Tensor:
        gate_states, up_states = torch.split(merged_states, merged_states.shape[-1] // 2, dim=-1)
        return self.act(gate_states) * up_states


class MLP(nn.Module):
    """Nanotron's Llama MLP: ``gate_up_proj`` (column-parallel) then ``down_proj`` (row-parallel)."""

    def __init__(
        self, config: LlamaConfig, parallel_config: ParallelismArgs | None, tp_pg: dist.ProcessGroup
    ) -> None:
        super().__init__()
        tp_mode = _tp_mode(parallel_config)
        tp_async = _tp_async(parallel_config)
        self.gate_up_proj = TensorParallelColumnLinear(
            config.hidden_size,
            2 * config.intermediate_size,
            pg=tp_pg,
            mode=tp_mode,
            bias=False,
            async_communication=tp_async,
            contiguous_chunks=(config.intermediate_size, config.intermediate_size),
        )
        self.down_proj = TensorParallelRowLinear(
            config.intermediate_size,
            config.hidden_size,
            pg=tp_pg,
            mode=tp_mode,
            bias=False,
            async_communication=tp_async and tp_mode is TensorParallelLinearMode.REDUCE_SCATTER,
        )
        self.split_silu_mul = GLUActivation(config.hidden_act)

    def forward(self, hidden_states: torch.Tensor) -> dict[str, torch.Tensor]:
        merged_states = self.gate_up_proj(hidden_states)
        return {"hidden_states": self.down_proj(self.split_silu_mul(merged_states))}


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
        _check_attention_shapes(config, tp_size)
        n_kv = (
            config.num_key_value_heads
            if config.num_key_value_heads is not None
            else config.num_attention_heads
        )
        self.n_local_q_heads = config.num_attention_heads // tp_size
        self.n_local_kv_heads = n_kv // tp_size
        self.n_repeats = config.num_attention_heads // n_kv
        self.is_gqa = config.num_attention_heads != n_kv
        self.d_qk = config.hidden_size // config.num_attention_heads
        self.d_v = config.hidden_size // config.num_attention_heads
        self.d_model = config.hidden_size
        tp_mode = _tp_mode(parallel_config)
        tp_async = _tp_async(parallel_config)

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
        self.rotary_embedding = RotaryEmbedding(
            dim=self.d_qk, end=config.max_position_embeddings, theta=theta
        )
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
        query_states = query_states.transpose(0, 1).reshape(
            batch_size, q_length, self.n_local_q_heads, self.d_qk
        )
        key_states = key_states.transpose(0, 1).reshape(
            batch_size, q_length, self.n_local_kv_heads, self.d_qk
        )
        value_states = value_states.transpose(0, 1).reshape(
            batch_size, q_length, self.n_local_kv_heads, self.d_v
        )

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
            attention_output.contiguous()
            .view(batch_size, q_length, self.n_local_q_heads * self.d_v)
            .transpose(0, 1)
        )
        return {"hidden_states": self.o_proj(attention_output), "sequence_mask": sequence_mask}


class RMSNorm(nn.Module):
    """RMSNorm with a ``weight`` parameter (replaces Nanotron's Triton ``TritonRMSNorm``).

    Args:
        hidden_size: normalised dimension.
        eps: added to the mean square.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # The argument is called `input` because that is the final_layer_norm block's input key in Nanotron.
        # Normalise in fp32 for stability, as the Triton kernel does.
        x = input.float()
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return x.to(input.dtype) * self.weight


class LlamaDecoderLayer(nn.Module):
    """Pre-norm Llama decoder layer; submodule names equal Nanotron's (``input_layernorm``, ``attn``, ...)."""

    def __init__(
        self,
        config: LlamaConfig,
        parallel_config: ParallelismArgs | None,
        tp_pg: dist.ProcessGroup,
        layer_idx: int,
        recompute_layer: bool = False,
    ) -> None:
        super().__init__()
        self.recompute_layer = recompute_layer
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attn = CausalSelfAttention(
            config=config, parallel_config=parallel_config, tp_pg=tp_pg, layer_idx=layer_idx
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = MLP(config=config, parallel_config=parallel_config, tp_pg=tp_pg)

    def forward(self, hidden_states: torch.Tensor, sequence_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.recompute_layer and torch.is_grad_enabled():
            # Upstream's parallelism.recompute_layer (models/llama.py, LlamaDecoderLayer.forward): a reentrant
            # checkpoint of the whole layer keeps only its inputs; the backward runs the forward again.
            hidden_states, sequence_mask = torch.utils.checkpoint.checkpoint(
                self._core_forward, hidden_states, sequence_mask, use_reentrant=True)
        else:
            hidden_states, sequence_mask = self._core_forward(hidden_states, sequence_mask)
        return {"hidden_states": hidden_states, "sequence_mask": sequence_mask}

    def _core_forward(self, hidden_states: torch.Tensor, sequence_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        output = self.attn(hidden_states=hidden_states, sequence_mask=sequence_mask)
        hidden_states = output["hidden_states"] + residual

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states=hidden_states)["hidden_states"] + residual
        return hidden_states, output["sequence_mask"]


class Embedding(nn.Module):
    """Token embedding (vocab-parallel); outputs ``[seq, batch, hidden]`` as Nanotron's does."""

    def __init__(
        self, tp_pg: dist.ProcessGroup, config: LlamaConfig, parallel_config: ParallelismArgs | None
    ) -> None:
        super().__init__()
        if config.vocab_size % tp_pg.size() != 0:
            raise ValueError(
                f"vocab_size={config.vocab_size} is not divisible by the TP size {tp_pg.size()}; "
                "pad the vocabulary (Nanotron's trainer pads it to make_vocab_size_divisible_by * tp)."
            )
        self.token_embedding = TensorParallelEmbedding(
            num_embeddings=config.vocab_size,
            embedding_dim=config.hidden_size,
            padding_idx=config.pad_token_id,
            pg=tp_pg,
            mode=_tp_mode(parallel_config),
        )
        self.pg = tp_pg

    def forward(self, input_ids: torch.Tensor, input_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        # [batch, seq] -> [seq, batch] so that high TP works with small batches (Nanotron's layout).
        input_ids = input_ids.transpose(0, 1)
        return {"input_embeds": self.token_embedding(input_ids)}


class Projector(nn.Module):
    """A VLM-style trainable projector: ``x + proj(x)`` on the embeddings (off by default).

    Args:
        hidden_size: width of the embeddings.
    """

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, input_embeds: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"input_embeds": input_embeds + self.proj(input_embeds)}


class Loss(nn.Module):
    """Masked mean of Nanotron's vocab-parallel cross-entropy, in fp32."""

    def __init__(self, tp_pg: dist.ProcessGroup) -> None:
        super().__init__()
        self.tp_pg = tp_pg

    def forward(
        self, sharded_logits: torch.Tensor, label_ids: torch.Tensor, label_mask: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Args: sharded_logits ``[seq, batch, vocab/tp]``, label_ids and label_mask ``[batch, seq]``.

        Returns:
            ``{"loss": scalar}``.
        """
        loss = sharded_cross_entropy(
            sharded_logits, label_ids.transpose(0, 1).contiguous(), group=self.tp_pg, dtype=torch.float
        ).transpose(0, 1)
        mask = label_mask.to(torch.float)
        return {"loss": (loss * mask).sum(dtype=torch.float) / mask.sum()}


class CPULlamaModel(nn.Module):
    """The pipeline graph of Nanotron's ``LlamaModel`` (same attribute names and block order)."""

    def __init__(
        self,
        config: LlamaConfig,
        parallel_context: ParallelContext,
        parallel_config: ParallelismArgs | None,
        projector: bool = False,
        vocab_shards: int = 1,
        *,
        p2p: P2P,
        recompute_layer: bool = False,
    ) -> None:
        super().__init__()
        self.recompute_layer = recompute_layer
        # The runtime passes its CPUP2P: Nanotron's P2P with non-blocking sends (gloo's blocking send deadlocks
        # the engines; see nanotron_ext.runtime.p2p).
        self.p2p = p2p
        self.config = config
        self.parallel_config = parallel_config
        self.parallel_context = parallel_context
        self.tp_mode = _tp_mode(parallel_config)
        self.has_projector = projector
        self.n_vocab_shards = vocab_shards
        # Attribute order == named_modules() order == forward order; build_model relies on it.
        self._input_blocks()
        self._decoder_blocks()
        self._head_blocks()

    def _input_blocks(self) -> None:
        """The embedding, and the projector when asked for."""
        config, parallel_config, parallel_context = self.config, self.parallel_config, self.parallel_context
        self.token_position_embeddings = PipelineBlock(
            p2p=self.p2p,
            module_builder=Embedding,
            module_kwargs={
                "tp_pg": parallel_context.tp_pg,
                "config": config,
                "parallel_config": parallel_config,
            },
            module_input_keys={"input_ids", "input_mask"},
            module_output_keys={"input_embeds"},
        )
        if self.has_projector:
            self.projector = PipelineBlock(
                p2p=self.p2p,
                module_builder=Projector,
                module_kwargs={"hidden_size": config.hidden_size},
                module_input_keys={"input_embeds"},
                module_output_keys={"input_embeds"},
            )

    def _decoder_blocks(self) -> None:
        config, parallel_config, parallel_context = self.config, self.parallel_config, self.parallel_context
        self.decoder = nn.ModuleList(
            [
                PipelineBlock(
                    p2p=self.p2p,
                    module_builder=LlamaDecoderLayer,
                    module_kwargs={
                        "config": config,
                        "parallel_config": parallel_config,
                        "tp_pg": parallel_context.tp_pg,
                        "layer_idx": layer_idx,
                        "recompute_layer": self.recompute_layer,
                    },
                    module_input_keys={"hidden_states", "sequence_mask"},
                    module_output_keys={"hidden_states", "sequence_mask"},
                )
                for layer_idx in range(config.num_hidden_layers)
            ]
        )

    def _head_blocks(self) -> None:
        """The final norm, then the vocabulary chain or Nanotron's lm_head and cast (the loss is the model's)."""
        config, parallel_context = self.config, self.parallel_context
        self.final_layer_norm = PipelineBlock(
            p2p=self.p2p,
            module_builder=RMSNorm,
            module_kwargs={"hidden_size": config.hidden_size, "eps": config.rms_norm_eps},
            module_input_keys={"input"},
            module_output_keys={"hidden_states"},
        )
        if self.n_vocab_shards > 1:
            # The chain replaces lm_head, cast_to_fp32 and the loss (nanotron_ext.models.vocab_chain).
            self.vocab_shards = vocab_shard_blocks(self.p2p, config.hidden_size, config.vocab_size,
                                                   self.n_vocab_shards)
            return
        self.lm_head = PipelineBlock(
            p2p=self.p2p,
            module_builder=TensorParallelColumnLinear,
            module_kwargs={
                "in_features": config.hidden_size,
                "out_features": config.vocab_size,
                "pg": parallel_context.tp_pg,
                "bias": False,
                "mode": self.tp_mode,
                "async_communication": _tp_async(self.parallel_config),
            },
            module_input_keys={"x"},
            module_output_keys={"logits"},
        )
        self.cast_to_fp32 = PipelineBlock(
            p2p=self.p2p,
            # Exactly Nanotron's builder: a parameter-free lambda.
            module_builder=lambda: lambda x: x.float(),
            module_kwargs={},
            module_input_keys={"x"},
            module_output_keys={"output"},
        )

    def forward(self, input_ids: TensorOrPointer, input_mask: TensorOrPointer) -> TensorOrPointer:
        return self.forward_with_hidden_states(input_ids=input_ids, input_mask=input_mask)[0]

    def forward_with_hidden_states(
        self, input_ids: TensorOrPointer, input_mask: TensorOrPointer
    ) -> tuple[TensorOrPointer, TensorOrPointer]:
        """Run every block; on ranks that do not own a block its outputs are ``TensorPointer``s.

        Returns:
            ``(fp32 sharded logits, final hidden states)``.
        """
        output = self.token_position_embeddings(input_ids=input_ids, input_mask=input_mask)
        if self.has_projector:
            output = self.projector(input_embeds=output["input_embeds"])
        hidden_encoder_states = {"hidden_states": output["input_embeds"], "sequence_mask": input_mask}
        for encoder_block in self.decoder:
            hidden_encoder_states = encoder_block(**hidden_encoder_states)
        hidden_states = self.final_layer_norm(input=hidden_encoder_states["hidden_states"])["hidden_states"]
        if self.n_vocab_shards > 1:
            return TensorPointer(group_rank=self.vocab_shards[0].rank), hidden_states
        sharded_logits = self.lm_head(x=hidden_states)["logits"]
        fp32_sharded_logits = self.cast_to_fp32(x=sharded_logits)["output"]
        return fp32_sharded_logits, hidden_states

    def get_block_compute_costs(self) -> dict[type, int]:
        """Nanotron's exact per-class costs (so ``build_model``'s greedy split behaves as on GPU)."""
        c = self.config
        by_name = llama_class_costs(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                                    intermediate_size=c.intermediate_size, vocab_size=c.vocab_size)
        classes = {cls.__name__: cls for cls in (LlamaDecoderLayer, TensorParallelColumnLinear)}
        costs = {classes[name]: cost for name, cost in by_name.items()}
        # Nanotron's rule prices by class: each shard gets an equal part of the lm_head's cost.
        costs[VocabShard] = c.vocab_size * c.hidden_size // max(1, self.n_vocab_shards)
        return costs


def _name_seed(base_seed: int, name: str) -> int:
    # crc32 is stable across processes and Python runs (unlike hash()), so every rank and every PP layout
    # derives the same stream for the same parameter name.
    return (base_seed * 1_000_003 + zlib.crc32(name.encode("utf-8"))) % (2**63 - 1)


class CPULlamaForTraining(NanotronModel):
    """Nanotron's ``LlamaForTraining`` block layout, runnable on CPU.

    Blocks in order: ``model.token_position_embeddings``, [``model.projector``], ``model.decoder.{i}``,
    ``model.final_layer_norm``, ``model.lm_head``, ``model.cast_to_fp32``, ``loss``.

    Args:
        config: Nanotron ``LlamaConfig``.
        parallel_context: a (Gloo)ParallelContext.
        parallel_config: Nanotron ``ParallelismArgs`` (tp_mode, async comm) or None for defaults.
        random_states: accepted for signature compatibility with Nanotron; unused.
        projector: add a trainable ``model.projector`` block right after the embedding.
        p2p: the pipeline's point-to-point channel (the runtime's ``CPUP2P`` over ``parallel_context.pp_pg``).
        vocab_shards: K > 1 replaces ``model.lm_head``, ``model.cast_to_fp32`` and ``loss`` with
            ``model.vocab_shards.{0..K-1}`` (:mod:`nanotron_ext.models.vocab_chain`); the loss and gradients are the same.
        recompute_layer: recompute every decoder layer in its backward (upstream's ``parallelism.recompute_layer``).

    Raises:
        ValueError: head counts / vocabulary incompatible with the TP size; vocab_shards > 1 with tied
            embeddings or TP > 1.
    """

    def __init__(
        self,
        config: LlamaConfig,
        parallel_context: ParallelContext,
        parallel_config: ParallelismArgs | None,
        random_states: RandomStates | None = None,
        projector: bool = False,
        vocab_shards: int = 1,
        *,
        p2p: P2P,
        recompute_layer: bool = False,
    ) -> None:
        super().__init__()
        _check_attention_shapes(config, parallel_context.tp_pg.size())
        if vocab_shards > 1 and config.tie_word_embeddings:
            raise ValueError(
                f"vocab_shards={vocab_shards} with tie_word_embeddings=True is not supported: Nanotron ties whole "
                f"parameters, not row slices; set tie_word_embeddings: false to untie, or vocab_shards: 1"
            )
        if vocab_shards > 1 and parallel_context.tp_pg.size() > 1:
            raise ValueError(
                f"vocab_shards={vocab_shards} with tp={parallel_context.tp_pg.size()}: the CPU runtime's shards are "
                f"not split across TP ranks; use tp: 1 or vocab_shards: 1"
            )
        self.model = CPULlamaModel(
            config=config,
            parallel_context=parallel_context,
            parallel_config=parallel_config,
            projector=projector,
            vocab_shards=vocab_shards,
            p2p=p2p,
            recompute_layer=recompute_layer,
        )
        if vocab_shards > 1:
            self.chain_loss = ChainLoss(self.model.vocab_shards, parallel_context.pp_pg)
        else:
            self.loss = PipelineBlock(
                p2p=self.model.p2p,
                module_builder=Loss,
                module_kwargs={"tp_pg": parallel_context.tp_pg},
                module_input_keys={"sharded_logits", "label_ids", "label_mask"},
                module_output_keys={"loss"},
            )
        self.parallel_context = parallel_context
        self.config = config
        self.parallel_config = parallel_config
        # NanotronModel.__init__ ran before the submodules existed; refresh the name map it keeps.
        self.module_id_to_prefix = {id(module): f"{name}." for name, module in self.named_modules()}
        self.module_id_to_prefix[id(self)] = ""

    def forward(
        self,
        input_ids: TensorOrPointer,
        input_mask: TensorOrPointer,
        label_ids: TensorOrPointer,
        label_mask: TensorOrPointer,
    ) -> dict[str, TensorOrPointer]:
        if self.model.n_vocab_shards > 1:
            return self._forward_chain(input_ids, input_mask, label_ids, label_mask)
        sharded_logits = self.model(input_ids=input_ids, input_mask=input_mask)
        loss = self.loss(sharded_logits=sharded_logits, label_ids=label_ids, label_mask=label_mask)["loss"]
        return {"loss": loss}

    def _forward_chain(
        self, input_ids: TensorOrPointer, input_mask: TensorOrPointer, label_ids: TensorOrPointer,
        label_mask: TensorOrPointer,
    ) -> dict[str, TensorOrPointer]:
        _, hidden_states = self.model.forward_with_hidden_states(input_ids=input_ids, input_mask=input_mask)
        return self.chain_loss(sharded_logits=hidden_states, label_ids=label_ids, label_mask=label_mask)

    @torch.no_grad()
    def init_model_randomly(
        self,
        init_method: Callable[[torch.Tensor], Any],
        scaled_init_method: Callable[[torch.Tensor], Any],
    ) -> None:
        """Initialise every local parameter, reproducibly across PP/TP layouts.

        Each parameter draws from its own RNG stream, seeded from ``torch.initial_seed()`` and the parameter's
        full (tied-aware) name, so the same weights come out whatever the pipeline split. Sharded (TP)
        parameters are drawn at their full unsharded shape and then sliced, so TP=1 and TP=2 agree too.
        Column-parallel weights and embeddings use ``init_method``, row-parallel weights
        ``scaled_init_method`` (Nanotron's rule), norms are ones, biases zeros, the projector uses
        ``init_method``.

        Args:
            init_method: in-place initialiser, e.g. ``nanotron.utils.init_method_normal(std)``.
            scaled_init_method: in-place initialiser for output projections,
                e.g. ``scaled_init_method_normal(std, num_layers)``.
        """
        base_seed = torch.initial_seed()
        module_id_to_prefix = {id(module): f"{name}." for name, module in self.named_modules()}
        module_id_to_prefix[id(self)] = ""
        initialized: set[str] = set()
        for module_name, module in self.named_modules():
            for param_name, param in module.named_parameters(recurse=False):
                if isinstance(param, NanotronParameter) and param.is_tied:
                    full_name = param.get_tied_info().get_full_name_from_module_id_to_prefix(
                        module_id_to_prefix
                    )
                else:
                    full_name = f"{module_name}.{param_name}"
                if full_name in initialized:
                    continue
                if param_name == "bias":
                    param.zero_()
                elif isinstance(module, VocabShard):
                    self._init_vocab_shard(param, module, init_method, base_seed)
                elif isinstance(module, RMSNorm):
                    param.fill_(1.0)
                elif isinstance(module, TensorParallelRowLinear):
                    self._seeded_init(param, full_name, scaled_init_method, base_seed)
                elif isinstance(module, (TensorParallelColumnLinear, TensorParallelEmbedding, nn.Linear)):
                    self._seeded_init(param, full_name, init_method, base_seed)
                else:
                    raise ValueError(
                        f"init_model_randomly does not know how to initialise {full_name} "
                        f"(module {type(module).__name__})."
                    )
                initialized.add(full_name)

    def _init_vocab_shard(
        self, param: torch.Tensor, shard: VocabShard, init: Callable[[torch.Tensor], Any], base_seed: int
    ) -> None:
        # The rows the unsplit lm_head would get: same stream, same full draw, so K shards start from exactly
        # the weights of vocab_shards: 1 and the two models can be compared step for step.
        vocab = self.config.vocab_size
        assert (shard.lo, shard.hi) in vocab_slices(vocab, self.model.n_vocab_shards)
        full = torch.empty(vocab, self.config.hidden_size)
        self._seeded_init(full, "model.lm_head.pp_block.weight", init, base_seed)
        param.copy_(full[shard.lo:shard.hi].to(dtype=param.dtype))

    @staticmethod
    def _seeded_init(
        param: torch.Tensor, name: str, init: Callable[[torch.Tensor], Any], base_seed: int
    ) -> None:
        sharded = isinstance(param, NanotronParameter) and param.is_sharded
        shape = tuple(param.get_sharded_info().unsharded_shape) if sharded else tuple(param.shape)
        # fork_rng keeps the caller's global RNG untouched (init methods draw from the global generator).
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_name_seed(base_seed, name))
            full = torch.empty(shape, dtype=torch.float32, device="cpu")
            init(full)
        full = full.to(device=param.device, dtype=param.dtype)
        if not sharded:
            param.copy_(full)
            return
        for pair in param.get_sharded_info().local_global_slices_pairs:
            param[pair.local_slices].copy_(full[pair.global_slices])

    def get_embeddings_lm_head_tied_names(self) -> list[str]:
        """Names tied when ``config.tie_word_embeddings`` is True (same as Nanotron)."""
        if self.config.tie_word_embeddings is True:
            return [
                "model.token_position_embeddings.pp_block.token_embedding.weight",
                "model.lm_head.pp_block.weight",
            ]
        return []

    def get_block_compute_costs(self) -> dict[type, int]:
        """Nanotron's formula, keyed by block builder class."""
        return self.model.get_block_compute_costs()
