"""The other layers of the CPU runtime's Llama (``nanotron_ext.models.llama``): MLP, RMSNorm, the decoder layer,
embedding, projector and loss, with Nanotron's tensor-parallel linears and submodule names."""

from __future__ import annotations

import torch
from nanotron import distributed as dist
from nanotron.config import LlamaConfig, ParallelismArgs
from nanotron.nn.activations import ACT2FN
from nanotron.parallel.tensor_parallel.functional import sharded_cross_entropy
from nanotron.parallel.tensor_parallel.nn import (
    TensorParallelColumnLinear,
    TensorParallelEmbedding,
    TensorParallelLinearMode,
    TensorParallelRowLinear,
)
from torch import nn

from nanotron_ext.models.llama_attention import CausalSelfAttention, linear_async, linear_mode

__all__ = ["Embedding", "GLUActivation", "LlamaDecoderLayer", "Loss", "MLP", "Projector", "RMSNorm"]


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

    def __init__(self, config: LlamaConfig, parallel_config: ParallelismArgs | None, tp_pg: dist.ProcessGroup) -> None:
        super().__init__()
        tp_mode = linear_mode(parallel_config)
        tp_async = linear_async(parallel_config)
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
                self._core_forward, hidden_states, sequence_mask, use_reentrant=True
            )
        else:
            hidden_states, sequence_mask = self._core_forward(hidden_states, sequence_mask)
        return {"hidden_states": hidden_states, "sequence_mask": sequence_mask}

    def _core_forward(
        self, hidden_states: torch.Tensor, sequence_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
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

    def __init__(self, tp_pg: dist.ProcessGroup, config: LlamaConfig, parallel_config: ParallelismArgs | None) -> None:
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
            mode=linear_mode(parallel_config),
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
