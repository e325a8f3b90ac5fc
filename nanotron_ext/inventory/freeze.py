"""Freezing by config, known to the planner before it splits and applied on each rank to what it owns.

YAML, under ``nanotron_ext:``::

    freeze:
      modules: [decoder]              # what to freeze (see patterns below)
      unfreeze: [decoder.11]          # exceptions, applied after `modules`
      unfreeze_last_decoder_layers: 0 # train the last N decoder layers
    allow_frozen_stages: false        # stages with nothing trainable run without optimizer and DDP

A pattern matches a block by role (``embedding``, ``projector``, ``decoder``, ``final_norm``, ``lm_head``),
by short name glob (``decoder.3``, ``decoder.1*``, ``*``), by module path glob (``model.decoder.3``), or a
parameter by its full name glob (``model.decoder.*.pp_block.mlp.*``). With ``vocab_shards`` K > 1 (or ``auto``)
the lm_head is the chain's K shards (``vocab.0`` ... ``vocab.K-1``, role ``vocab_shard``): the role word
``lm_head`` then names all of them, so one freeze spec means the same whatever K is, by hand or chosen by
``auto``; ``vocab_shard`` or ``vocab.1`` name shards alone. Examples:

* freeze the decoder: ``modules: [decoder]``;
* freeze embedding and output: ``modules: [embedding, lm_head]``;
* train only the output layer and the last layer: ``modules: ["*"], unfreeze: [lm_head],
  unfreeze_last_decoder_layers: 1``;
* train only a projector (LLaVA-style): ``modules: ["*"], unfreeze: [projector]``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

from nanotron_ext.blocks import BlockInfo, ParamInfo
from nanotron_ext.errors import ConfigError, suggest
from nanotron_ext.report import compact_names

if TYPE_CHECKING:
    from nanotron_ext.config import PlannerConfig

__all__ = [
    "FreezeSpec",
    "apply_config_freeze",
    "apply_freeze",
    "freeze_module_parameters",
    "frozen_names",
    "matches",
    "tied_embedding_names",
]


@dataclass(frozen=True)
class FreezeSpec:
    """Which parameters to freeze.

    Attributes:
        modules: patterns of what to freeze.
        unfreeze: patterns of exceptions; each must name something ``modules`` froze.
        unfreeze_last_decoder_layers: keep the last N decoder layers trainable.
    """

    modules: tuple[str, ...] = ()
    unfreeze: tuple[str, ...] = ()
    unfreeze_last_decoder_layers: int = 0

    def __post_init__(self) -> None:
        for name in ("modules", "unfreeze"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = (value,)
            if not all(isinstance(p, str) and p for p in value):
                raise ConfigError(
                    f"freeze.{name}={value!r} must be a list of non-empty patterns; write it like "
                    f"`{name}: [decoder, lm_head]` (roles, short names or globs: docs/freezing.md)"
                )
            object.__setattr__(self, name, tuple(value))
        n = self.unfreeze_last_decoder_layers
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(
                f"freeze.unfreeze_last_decoder_layers={n!r} must be a non-negative integer; write it "
                f"like `unfreeze_last_decoder_layers: 1`"
            )

    @staticmethod
    def from_dict(raw: dict[str, Any] | None) -> FreezeSpec | None:
        """Parse the YAML mapping; unknown keys are an error naming them."""
        if not raw:
            return None
        known = {f.name for f in dataclasses.fields(FreezeSpec)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(
                f"unknown key(s) {', '.join(map(repr, unknown))} in 'freeze:'; known: {', '.join(sorted(known))}"
            )
        return FreezeSpec(**raw)


#: Role words that name more than their own role: the vocabulary chain's shards are the lm_head split by rows.
_ROLE_WORDS: dict[str, tuple[str, ...]] = {"lm_head": ("lm_head", "vocab_shard")}


def matches(pattern: str, block: BlockInfo, param: ParamInfo) -> bool:
    """Whether ``pattern`` selects ``param`` of ``block``."""
    return (
        block.role in _ROLE_WORDS.get(pattern, (pattern,))
        or fnmatchcase(block.short, pattern)
        or fnmatchcase(block.name, pattern)
        or fnmatchcase(param.name, pattern)
    )


def frozen_names(spec: FreezeSpec, blocks: Sequence[BlockInfo], *, tied: Iterable[tuple[str, str]] = ()) -> set[str]:
    """Full names of the parameters ``spec`` freezes.

    Args:
        spec: the freeze spec.
        blocks: the model's inventory (every block, not just this rank's: every rank computes the same set).
        tied: pairs of parameter names that share storage; they must be frozen together.

    Raises:
        ConfigError: a pattern that matches nothing (lists the module paths that exist), an ``unfreeze`` of
        something not frozen, a spec that freezes every parameter, or tied weights frozen apart.
    """
    params = [(b, p) for b in blocks for p in b.parameters]
    words = {w for b in blocks if b.parameters for w in (b.short, b.role)}  # what "did you mean" may offer

    def hint(pattern: str) -> str:
        # decoder.9 of a 2-layer model is an index out of range, not a slip: the list of modules says so
        return "" if re.fullmatch(r"(decoder|vocab)\.\d+", pattern) else suggest(pattern, words)

    frozen: set[str] = set()
    for pattern in spec.modules:
        hit = {p.name for b, p in params if matches(pattern, b, p)}
        if not hit:
            raise ConfigError(
                f"freeze pattern {pattern!r} matches no module; {hint(pattern)}modules are: "
                f"{compact_names([b.short for b in blocks if b.parameters])} "
                f"(paths like {blocks[0].name}, roles like decoder, globs like decoder.1*)"
            )
        frozen |= hit
    thaw: list[tuple[str, set[str]]] = [
        (pattern, {p.name for b, p in params if matches(pattern, b, p)}) for pattern in spec.unfreeze
    ]
    decoders = [b for b in blocks if b.role == "decoder"]
    if spec.unfreeze_last_decoder_layers > len(decoders):
        raise ConfigError(
            f"freeze.unfreeze_last_decoder_layers={spec.unfreeze_last_decoder_layers} but the model has "
            f"{len(decoders)} decoder layers"
        )
    if spec.unfreeze_last_decoder_layers:
        last = decoders[-spec.unfreeze_last_decoder_layers :]
        thaw.append((f"the last {len(last)} decoder layers", {p.name for b in last for p in b.parameters}))
    for what, names in thaw:
        if not names:
            raise ConfigError(
                f"unfreeze pattern {what!r} matches no module; {hint(what)}modules are: "
                f"{compact_names([b.short for b in blocks if b.parameters])}"
            )
        if not names & frozen:
            raise ConfigError(f"unfreeze {what!r}: it is not frozen by freeze.modules {list(spec.modules)}; drop it")
        frozen -= names
    if frozen and len(frozen) == len(params):
        raise ConfigError(
            f"freeze spec freezes every parameter ({list(spec.modules)}), so nothing would train; "
            f"unfreeze something, e.g. `unfreeze: [lm_head]`"
        )
    for a, b in tied:
        if (a in frozen) != (b in frozen):
            raise ConfigError(
                f"{a} and {b} are tied (tie_word_embeddings: true) but only one is frozen; freeze both or neither"
            )
    return frozen


def apply_freeze(blocks: Sequence[BlockInfo], spec: FreezeSpec | None, **kwargs: Any) -> list[BlockInfo]:
    """The inventory with trainable counts from ``spec`` (``None`` leaves it as is)."""
    if spec is None:
        return list(blocks)
    frozen = frozen_names(spec, blocks, **kwargs)
    return [b.with_trainable(lambda name: name not in frozen) for b in blocks]


def apply_config_freeze(blocks: list[BlockInfo], cfg: PlannerConfig) -> list[BlockInfo]:
    """Apply ``nanotron_ext.freeze`` from the config, so the planner knows what trains before it splits."""
    spec = FreezeSpec.from_dict(cfg.ext.freeze)
    if spec is None:
        return blocks
    return apply_freeze(blocks, spec, tied=tied_embedding_names(blocks, cfg.model.tie_word_embeddings))


def tied_embedding_names(blocks: Sequence[BlockInfo], tie_word_embeddings: bool) -> list[tuple[str, str]]:
    """The (embedding, lm_head) weight pair when the config ties them."""
    if not tie_word_embeddings:
        return []
    emb = [p.name for b in blocks if b.role == "embedding" for p in b.parameters]
    head = [p.name for b in blocks if b.role == "lm_head" for p in b.parameters]
    return [(emb[0], head[0])] if emb and head else []


def freeze_module_parameters(named_parameters: Iterable[tuple[str, Any]], frozen: set[str]) -> int:
    """Set ``requires_grad=False`` on this rank's parameters whose names are frozen; returns how many."""
    count = 0
    for name, param in named_parameters:
        if name in frozen:
            param.requires_grad_(False)
            count += 1
    return count
