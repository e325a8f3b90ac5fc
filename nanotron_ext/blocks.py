"""The planner's record of one Nanotron ``PipelineBlock``, shared by every stage of the flow.

Built by :mod:`nanotron_ext.inventory`, priced by :mod:`nanotron_ext.costs`, split by the strategies. Block
names follow Nanotron's Llama layout (``model.decoder.3``, ``model.lm_head``, ``loss``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from nanotron_ext.report import compact_names

__all__ = [
    "DEFERS_WEIGHT_GRADIENT",
    "VOCAB_SHARDS_PATH",
    "BlockInfo",
    "ParamInfo",
    "Role",
    "compact_roles",
    "held_parameters",
    "role_of",
    "short_name",
    "tied_copy",
    "tied_pair",
    "vocab_slices",
]

Role = Literal["embedding", "projector", "decoder", "final_norm", "lm_head", "cast", "loss", "vocab_shard", "other"]
#: Roles whose weight gradient zb1p defers to its W pass: the blocks made of linears (the weight-gradient store
#: of :mod:`nanotron_ext.zero_bubble` covers Nanotron's linears, the lm_head, the projector and the vocabulary
#: shards). An embedding's or a norm's weight gradient is made in B.
DEFERS_WEIGHT_GRADIENT: frozenset[str] = frozenset({"decoder", "lm_head", "vocab_shard", "projector"})

#: Module path of the vocabulary-shard chain (``nanotron_ext.vocab_shards``): ``model.vocab_shards.{i}``.
VOCAB_SHARDS_PATH = "model.vocab_shards"


@dataclass(frozen=True)
class ParamInfo:
    """One parameter tensor of a block (name relative to the model, Nanotron's spelling)."""

    name: str
    numel: int
    trainable: bool = True


@dataclass(frozen=True)
class BlockInfo:
    """One pipeline block, as the planner sees it.

    Attributes:
        index: position in forward order.
        name: module path, e.g. ``model.decoder.3``.
        role: embedding, projector, decoder, final_norm, lm_head, cast, loss or other.
        builder: class name of the block's ``module_builder``.
        params: parameter count (this TP shard).
        trainable: parameters that receive gradients.
        param_bytes: bytes of the weights in the model dtype.
        flops_fwd / flops_bwd_input / flops_bwd_weight: FLOPs per micro-batch.
        nanotron_cost: the value Nanotron's ``get_block_compute_costs()`` gives this block (0 if absent).
        parameters: the block's parameter tensors, for freezing by name.
    """

    index: int
    name: str
    role: Role
    builder: str
    params: int
    trainable: int
    param_bytes: int
    flops_fwd: float
    flops_bwd_input: float
    flops_bwd_weight: float
    nanotron_cost: float = 0.0
    parameters: tuple[ParamInfo, ...] = ()

    @property
    def short(self) -> str:
        """``decoder.7`` for decoder layers, the role for everything else."""
        return short_name(self.name, self.role)

    def with_trainable(self, trainable_names: Callable[[str], bool]) -> BlockInfo:
        """A copy whose parameters are trainable where ``trainable_names(full_name)`` is true."""
        params = tuple(dataclasses.replace(p, trainable=bool(trainable_names(p.name))) for p in self.parameters)
        return dataclasses.replace(self, parameters=params, trainable=sum(p.numel for p in params if p.trainable))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["parameters"] = [dataclasses.asdict(p) for p in self.parameters]
        return d


def role_of(name: str) -> Role:
    """Role of a block from its module path (Nanotron's Llama naming)."""
    last = name.rsplit(".", 1)[-1]
    if last in ("token_position_embeddings", "embed_tokens") or last.endswith("embeddings"):
        return "embedding"
    if re.search(r"(^|\.)decoder\.\d+$", name):
        return "decoder"
    if last in ("final_layer_norm", "final_norm", "norm"):
        return "final_norm"
    if last == "lm_head":
        return "lm_head"
    if last == "cast_to_fp32":
        return "cast"
    if last == "loss":
        return "loss"
    if last == "projector":
        return "projector"
    if re.search(r"(^|\.)vocab_shards\.\d+$", name):
        return "vocab_shard"
    return "other"


def short_name(name: str, role: Role | None = None) -> str:
    """The name tables print: ``decoder.7`` for a decoder layer, ``vocab.2`` for a vocabulary shard, the role
    otherwise, the path for ``other``.

    Example:
        >>> short_name("model.decoder.7"), short_name("model.lm_head"), short_name("model.vocab_shards.2")
        ('decoder.7', 'lm_head', 'vocab.2')
    """
    role = role or role_of(name)
    if role == "decoder":
        return f"decoder.{int(name.rsplit('.', 1)[-1])}"
    if role == "vocab_shard":
        return f"vocab.{int(name.rsplit('.', 1)[-1])}"
    return role if role != "other" else name


def tied_pair(blocks: Sequence[BlockInfo], tied: bool) -> tuple[int, int] | None:
    """Indices in ``blocks`` of the embedding and the lm_head whose weight is the embedding's, both present:
    Nanotron ties the two names to one tensor. None when untied or when either is absent."""
    roles = {b.role: i for i, b in enumerate(blocks)}
    return (roles["embedding"], roles["lm_head"]) if tied and "embedding" in roles and "lm_head" in roles else None


def tied_copy(blocks: Sequence[BlockInfo], tied: bool) -> int | None:
    """Index in ``blocks`` of an lm_head whose weight is the embedding's, both held here: one set of parameters,
    counted once (with the embedding). None otherwise (:func:`tied_pair`).

    With ``tie_word_embeddings`` and the two on different stages each stage holds its own copy (an all-reduce
    keeps them equal), so each counts it.
    """
    pair = tied_pair(blocks, tied)
    return None if pair is None else pair[1]


def held_parameters(blocks: Sequence[BlockInfo], tied: bool) -> tuple[int, int]:
    """``(parameters, trainable parameters)`` that ``blocks`` hold together, a tied weight counted once
    (:func:`tied_copy`)."""
    copy = tied_copy(blocks, tied)
    kept = [b for i, b in enumerate(blocks) if i != copy]
    return sum(b.params for b in kept), sum(b.trainable for b in kept)


def compact_roles(roles: Sequence[str]) -> str:
    """A model's blocks given by role in forward order, listed as every table lists blocks (numbered, then
    compressed to ranges by :func:`nanotron_ext.report.compact_names`).

    Example:
        >>> compact_roles(["embedding", "decoder", "decoder", "decoder", "final_norm", "lm_head", "cast", "loss"])
        'embedding, decoder.0-2, final_norm, lm_head, cast, loss'
    """
    seen = {"decoder": 0, "vocab_shard": 0}
    shorts = []
    for role in roles:
        if role in seen:
            path = f"model.decoder.{seen[role]}" if role == "decoder" else f"{VOCAB_SHARDS_PATH}.{seen[role]}"
            shorts.append(short_name(path, role))  # type: ignore[arg-type]
            seen[role] += 1
        else:
            shorts.append(role)
    return compact_names(shorts)


def vocab_slices(vocab_size: int, shards: int) -> list[tuple[int, int]]:
    """Row ranges ``[lo, hi)`` of the lm_head each vocabulary shard holds: contiguous, in order, sizes differing
    by at most one (the first ``vocab_size % shards`` shards get the extra row), so any ``vocab_size`` splits.

    Example:
        >>> vocab_slices(11, 3)
        [(0, 4), (4, 8), (8, 11)]

    Raises:
        ValueError: ``shards`` is not between 1 and ``vocab_size``.
    """
    if not 1 <= shards <= vocab_size:
        raise ValueError(f"vocab_shards={shards} must be between 1 and the vocabulary size {vocab_size}")
    base, extra = divmod(vocab_size, shards)
    out, lo = [], 0
    for i in range(shards):
        hi = lo + base + (1 if i < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out
