"""A CPU Llama for Nanotron 0.2 with the exact block layout and parameter names of ``LlamaForTraining``.

``nanotron.models.llama`` imports ``flash_attn`` (CUDA-only) and its rotary buffers are allocated with
``device="cuda"``, so it cannot run here. This module re-creates the same graph with torch SDPA attention and
a plain RMSNorm, while everything parallel is Nanotron's own: ``PipelineBlock``, ``P2P`` (on the CPU device),
``TensorParallelColumnLinear`` / ``TensorParallelRowLinear`` / ``TensorParallelEmbedding`` and
``sharded_cross_entropy``. Module and parameter names match Nanotron's, e.g.
``model.decoder.0.pp_block.attn.qkv_proj.weight`` and ``model.lm_head.pp_block.weight``, so a plan computed
from this model applies unchanged to Nanotron's ``LlamaForTraining`` on GPUs. Its layers live in
``llama_attention`` and ``llama_layers``, its initialisation in ``llama_init``. Training only: no KV cache, no
``AttachableStore``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from nanotron.config import LlamaConfig, ParallelismArgs
from nanotron.models import NanotronModel
from nanotron.parallel import ParallelContext
from nanotron.parallel.pipeline_parallel.block import PipelineBlock, TensorPointer
from nanotron.parallel.pipeline_parallel.p2p import P2P
from nanotron.parallel.tensor_parallel.nn import (
    TensorParallelColumnLinear,
)
from nanotron.random import RandomStates
from torch import nn

from nanotron_ext.inventory.family_blocks import llama_class_costs
from nanotron_ext.models.llama_attention import (
    CausalSelfAttention,
    CoreAttention,
    RotaryEmbedding,
    check_attention_shapes,
    linear_async,
    linear_mode,
)
from nanotron_ext.models.llama_init import init_randomly
from nanotron_ext.models.llama_layers import (
    MLP,
    Embedding,
    GLUActivation,
    LlamaDecoderLayer,
    Loss,
    Projector,
    RMSNorm,
)
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
        self.tp_mode = linear_mode(parallel_config)
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
            self.vocab_shards = vocab_shard_blocks(self.p2p, config.hidden_size, config.vocab_size, self.n_vocab_shards)
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
                "async_communication": linear_async(self.parallel_config),
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
        by_name = llama_class_costs(
            hidden_size=c.hidden_size,
            num_attention_heads=c.num_attention_heads,
            intermediate_size=c.intermediate_size,
            vocab_size=c.vocab_size,
        )
        classes = {cls.__name__: cls for cls in (LlamaDecoderLayer, TensorParallelColumnLinear)}
        costs = {classes[name]: cost for name, cost in by_name.items()}
        # Nanotron's rule prices by class: each shard gets an equal part of the lm_head's cost.
        costs[VocabShard] = c.vocab_size * c.hidden_size // max(1, self.n_vocab_shards)
        return costs


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
            ``model.vocab_shards.{0..K-1}`` (:mod:`nanotron_ext.models.vocab_chain`); the loss and gradients are the
            same.
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
        check_attention_shapes(config, parallel_context.tp_pg.size())
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
        self,
        input_ids: TensorOrPointer,
        input_mask: TensorOrPointer,
        label_ids: TensorOrPointer,
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

        See :func:`nanotron_ext.models.llama_init.init_randomly`.
        """
        init_randomly(self, init_method, scaled_init_method)

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
