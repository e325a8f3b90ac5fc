"""The vocabulary-shard chain: lm_head + cast + loss as K ``PipelineBlock``s (``nanotron_ext.vocab_shards``).

Shard ``i`` holds rows ``[lo, hi)`` of the lm_head. It computes its fp32 logits slice and folds it into running
statistics it passes on with the hidden state, an online log-sum-exp:

* ``running_max`` ``m``: the largest logit seen so far (only for numerical range, so it is detached: the
  log-sum-exp ``m + log s`` does not depend on it, and autograd differentiates ``s`` exactly);
* ``running_sumexp`` ``s = Σ exp(logit − m)`` over the rows seen so far (rescaled by ``exp(m_old − m)``
  whenever the max grows);
* ``target_logit``: the label's logit, added by the shard whose rows hold the label (0 elsewhere).

The last shard returns Nanotron's loss: ``mean over label_mask of (m + log s − target_logit)``. Every step is a
differentiable torch op or, for a slice's sum-exp and target logit, a Function with its exact derivative, so the
loss and every gradient equal the unsplit model's.

Labels: every shard reads ``label_ids`` (the last also ``label_mask``). The data loader hands the labels to each
rank that holds a shard (:func:`label_pp_ranks`; :func:`nanotron_ext.runtime.engine.make_micro_batch` reads it), so
no label crosses a pipeline link: a label sent from the last stage back to an earlier one would travel
against the activations, in the direction of the gradients, and could be received in a gradient's place.
"""

from __future__ import annotations

from typing import Any

import torch
from nanotron import distributed as dist
from nanotron.parallel.pipeline_parallel.block import PipelineBlock, TensorPointer
from nanotron.parallel.pipeline_parallel.p2p import P2P
from torch import nn

from nanotron_ext.blocks import vocab_slices
from nanotron_ext.zero_bubble.store import linear

__all__ = [
    "ChainLoss",
    "VocabShard",
    "label_pp_ranks",
    "replace_lm_head_with_vocab_chain",
    "route_labels",
    "vocab_shard_blocks",
]

TensorOrPointer = torch.Tensor | TensorPointer
STATS = ("running_max", "running_sumexp", "target_logit")
TOKEN_LAYOUTS = ("seq_batch", "flat")


class VocabShard(nn.Module):
    """Rows ``[lo, hi)`` of the lm_head, the cast to fp32 and this slice's share of the cross-entropy.

    Args:
        hidden_size: model width.
        lo, hi: the vocabulary rows this shard holds.
        first: no statistics come in (the first shard starts them).
        last: return the loss instead of the statistics.
        token_layout: how the hidden state lays out tokens: ``seq_batch`` (Llama, ``[seq, batch, hidden]``) or
            ``flat`` (upstream's Qwen2, ``[batch·seq, hidden]``); labels are ``[batch, seq]`` either way.
    """

    #: Under ``pp_engine: zb1p`` the shard's weight gradient is deferred to W (``nanotron_ext.zero_bubble``).
    defers_weight_gradients = True

    def __init__(
        self, hidden_size: int, lo: int, hi: int, first: bool, last: bool, token_layout: str = "seq_batch"
    ) -> None:
        super().__init__()
        if token_layout not in TOKEN_LAYOUTS:
            raise ValueError(f"token_layout={token_layout!r} is not one of {', '.join(TOKEN_LAYOUTS)}")
        self.lo, self.hi, self.first, self.last, self.token_layout = lo, hi, first, last, token_layout
        self.weight = nn.Parameter(torch.empty(hi - lo, hidden_size))

    def _as_tokens(self, per_token: torch.Tensor) -> torch.Tensor:
        """``[batch, seq]`` labels or mask in the hidden state's token order."""
        return per_token.transpose(0, 1) if self.token_layout == "seq_batch" else per_token.reshape(-1)

    def forward(
        self,
        hidden_states: torch.Tensor,
        label_ids: torch.Tensor,
        label_mask: torch.Tensor | None = None,
        running_max: torch.Tensor | None = None,
        running_sumexp: torch.Tensor | None = None,
        target_logit: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Args: hidden_states ``[seq, batch, hidden]``; label_ids, label_mask ``[batch, seq]``; the statistics
        ``[seq, batch]`` fp32 (absent on the first shard).

        Returns:
            ``{"loss": scalar}`` on the last shard, else the hidden state and the updated statistics.
        """
        # Nanotron's lm_head runs in the model dtype, then cast_to_fp32.
        logits = linear(self, hidden_states, self.weight).float()  # [seq, batch, rows]
        local_max = logits.detach().amax(dim=-1)
        new_max = local_max if running_max is None else torch.maximum(running_max, local_max)
        labels = self._as_tokens(label_ids)
        here = (labels >= self.lo) & (labels < self.hi)
        index = (labels - self.lo).clamp(0, self.hi - self.lo - 1).unsqueeze(-1)
        sumexp, target = _SliceStats.apply(logits, new_max, index, here)
        if running_sumexp is not None:
            sumexp = sumexp + running_sumexp * torch.exp(running_max - new_max)
        if target_logit is not None:
            target = target + target_logit
        if self.last:
            assert label_mask is not None  # the last block's input keys include it
            loss = new_max + torch.log(sumexp) - target
            mask = self._as_tokens(label_mask).to(torch.float)
            return {"loss": (loss * mask).sum(dtype=torch.float) / mask.sum()}
        return {
            "hidden_states": hidden_states,
            "running_max": new_max,
            "running_sumexp": sumexp,
            "target_logit": target,
        }


class _SliceStats(torch.autograd.Function):
    """``Σ exp(logit − m)`` and the label's logit (0 where the label is not in the slice) over one shard's logits,
    with the gradient written in one pass: ``exp(logit − m) · ∂sumexp + onehot(label) · ∂target``.

    Autograd through ``exp``, ``sum``, ``gather`` and ``where`` would allocate and add several logits-sized
    tensors in backward; this keeps one, the ``exp`` it needs anyway, and turns it into the gradient in place.
    """

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, new_max: torch.Tensor, index: torch.Tensor, here: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        exp = torch.exp(logits - new_max.unsqueeze(-1))
        target = torch.where(here, logits.gather(-1, index).squeeze(-1), torch.zeros_like(new_max))
        ctx.save_for_backward(exp, index, here)
        return exp.sum(dim=-1), target

    @staticmethod
    def backward(ctx: Any, grad_sumexp: torch.Tensor, grad_target: torch.Tensor) -> tuple[Any, ...]:
        exp, index, here = ctx.saved_tensors
        grad = exp.mul_(grad_sumexp.unsqueeze(-1))  # exp is not needed after this
        grad.scatter_add_(-1, index, (grad_target * here).unsqueeze(-1).to(grad.dtype))
        return grad, None, None, None


def vocab_shard_blocks(
    p2p: P2P, hidden_size: int, vocab_size: int, shards: int, token_layout: str = "seq_batch"
) -> nn.ModuleList:
    """The chain's ``PipelineBlock``s, in order (``model.vocab_shards.{i}``)."""
    slices = vocab_slices(vocab_size, shards)
    blocks = []
    for i, (lo, hi) in enumerate(slices):
        first, last = i == 0, i == len(slices) - 1
        inputs = {"hidden_states", "label_ids"} | (set() if first else set(STATS)) | ({"label_mask"} if last else set())
        outputs = {"loss"} if last else {"hidden_states", *STATS}
        blocks.append(
            PipelineBlock(
                p2p=p2p,
                module_builder=VocabShard,
                module_kwargs={
                    "hidden_size": hidden_size,
                    "lo": lo,
                    "hi": hi,
                    "first": first,
                    "last": last,
                    "token_layout": token_layout,
                },
                module_input_keys=inputs,
                module_output_keys=outputs,
            )
        )
    return nn.ModuleList(blocks)


def route_labels(block: PipelineBlock, labels: TensorOrPointer, pp_pg: dist.ProcessGroup) -> TensorOrPointer:
    """What one shard block receives as ``label_ids``/``label_mask`` on this rank: the local labels where the
    block runs, a pointer to its rank elsewhere (a tensor given to a block on another rank would be *sent*).

    Raises:
        RuntimeError: this rank runs the block but was given no labels (the data loader must hand them to every
            rank in ``label_pp_ranks``).
    """
    here = dist.get_rank(pp_pg) == block.rank
    if here and not isinstance(labels, torch.Tensor):
        raise RuntimeError(
            f"pipeline rank {block.rank} runs a vocabulary shard but its micro-batch has no labels; hand labels to "
            "every rank in nanotron_ext.models.vocab_chain.label_pp_ranks(model) "
            "(nanotron_ext.runtime.make_micro_batch does)"
        )
    return labels if here else TensorPointer(group_rank=block.rank)


class _PassThrough(nn.Module):
    """Stands where upstream's ``lm_head`` / ``cast_to_fp32`` block was: hands the hidden state on unchanged
    under the output key its caller reads. Not a ``PipelineBlock``, so it is no block and holds no weight."""

    def __init__(self, output_key: str) -> None:
        super().__init__()
        self.output_key = output_key

    def forward(self, x: TensorOrPointer) -> dict[str, TensorOrPointer]:
        return {self.output_key: x}


class ChainLoss(nn.Module):
    """Stands where upstream's ``loss`` block was: runs the chain on the hidden state it is handed as
    ``sharded_logits`` and returns ``{"loss": ...}`` (a ``TensorPointer`` on every rank but the last shard's).

    The blocks are the model's ``model.vocab_shards`` (kept out of this module's children, so every weight has
    one name).
    """

    def __init__(self, blocks: nn.ModuleList, pp_pg: dist.ProcessGroup) -> None:
        super().__init__()
        self.__dict__["_blocks"] = blocks
        self.__dict__["_pp_pg"] = pp_pg

    def forward(
        self, sharded_logits: TensorOrPointer, label_ids: TensorOrPointer, label_mask: TensorOrPointer
    ) -> dict[str, TensorOrPointer]:
        state: dict[str, TensorOrPointer] = {"hidden_states": sharded_logits}
        for block in self._blocks:
            kwargs = {**state, "label_ids": route_labels(block, label_ids, self._pp_pg)}
            if "label_mask" in block.module_input_keys:
                kwargs["label_mask"] = route_labels(block, label_mask, self._pp_pg)
            state = block(**kwargs)
        return {"loss": state["loss"]}


#: Upstream model class name -> (its hidden state's token layout, whether it has a cast_to_fp32 block).
UPSTREAM_MODELS = {"LlamaForTraining": ("seq_batch", True), "Qwen2ForTraining": ("flat", False)}


def replace_lm_head_with_vocab_chain(model: nn.Module, shards: int) -> nn.Module:
    """Put the vocabulary-shard chain into an upstream ``LlamaForTraining`` / ``Qwen2ForTraining``, in place,
    before ``build_model`` assigns its blocks.

    ``model.model.lm_head`` (and Llama's ``cast_to_fp32``) become pass-throughs of the hidden state,
    ``model.loss`` runs the chain, and the K blocks are ``model.model.vocab_shards.{i}``, after the final norm in
    forward order, so ``build_model`` and our planner see them as the model's last blocks. The model's own
    ``forward`` is untouched. What the caller still owes: hand labels to every rank in :func:`label_pp_ranks`
    (after the blocks are placed), and initialise the shards' weights (upstream's ``init_model_randomly`` does
    not know them).

    Args:
        model: an upstream ``LlamaForTraining`` or ``Qwen2ForTraining``, not yet built (no ranks assigned).
        shards: K >= 2.

    Returns:
        The same model.

    Raises:
        ValueError: another model class, K < 2 or more than the vocabulary, tied embeddings, z-loss, TP > 1.
    """
    name = type(model).__name__
    if name not in UPSTREAM_MODELS:
        raise ValueError(f"replace_lm_head_with_vocab_chain knows {', '.join(UPSTREAM_MODELS)}, not {name}")
    config = model.config
    if not 2 <= shards <= config.vocab_size:
        raise ValueError(f"vocab_shards={shards} must be between 2 and the vocabulary size {config.vocab_size}")
    if config.tie_word_embeddings:
        raise ValueError(
            f"vocab_shards={shards} with tie_word_embeddings=True is not supported; set "
            f"tie_word_embeddings: false to untie, or vocab_shards: 1"
        )
    if getattr(config, "z_loss_enabled", False):
        raise ValueError(
            f"vocab_shards={shards} with z_loss_enabled is not supported; disable z-loss or use vocab_shards: 1"
        )
    tp = model.parallel_context.tp_pg.size()
    if tp > 1:
        raise ValueError(f"vocab_shards={shards} with tp={tp}: shards are not split across TP ranks; use tp: 1")
    layout, has_cast = UPSTREAM_MODELS[name]
    inner = model.model
    inner.lm_head = _PassThrough("logits")
    if has_cast:
        inner.cast_to_fp32 = _PassThrough("output")
    inner.vocab_shards = vocab_shard_blocks(inner.p2p, config.hidden_size, config.vocab_size, shards, layout)
    model.loss = ChainLoss(inner.vocab_shards, model.parallel_context.pp_pg)
    # Nanotron's build_model prices blocks by builder class: each shard an equal part of the lm_head's cost.
    costs = model.get_block_compute_costs()
    costs[VocabShard] = config.vocab_size * config.hidden_size // shards
    model.get_block_compute_costs = lambda: costs
    # NanotronModel keeps a module -> name map for tied parameters; refresh it for the new modules.
    if hasattr(model, "module_id_to_prefix"):
        model.module_id_to_prefix = {id(m): f"{n}." for n, m in model.named_modules()}
        model.module_id_to_prefix[id(model)] = ""
    return model


def label_pp_ranks(model: nn.Module) -> list[int]:
    """Pipeline ranks whose micro-batches must carry the labels: every rank holding a vocabulary shard, or, in a
    model without the chain, its ``output_pp_rank`` (the loss block's), as Nanotron's data loader does.

    Args:
        model: a built model (ranks assigned), not DDP-wrapped.
    """
    ranks = {m.rank for m in model.modules() if isinstance(m, PipelineBlock) and m.module_builder is VocabShard}
    return sorted(ranks) if ranks else [model.output_pp_rank]
