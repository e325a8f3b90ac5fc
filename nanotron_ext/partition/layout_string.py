"""Explicit per-stage layouts, Megatron style: ``"E,t*5|t*6,L"``.

Syntax:

* ``|`` separates stages, ``,`` separates items within a stage; spaces are ignored;
* ``E`` embedding, ``P`` projector, ``t`` one decoder layer, ``t*K`` K decoder layers;
* ``L`` the output group: final norm, lm_head, cast and loss; or, one by one,
  ``N`` final norm, ``H`` lm_head, ``C`` cast to fp32, ``X`` loss;
* ``V`` one vocabulary shard, ``V*K`` K of them (``nanotron_ext.vocab_shards``), e.g. ``"E,t*8,N,V|V*3"``.

Every block of the model must appear exactly once, in forward order. Every error names the layout's source where
the caller gives it (``c.yaml: nanotron_ext.layout``: the file and the key it came from).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from nanotron_ext.blocks import compact_roles, role_of, short_name
from nanotron_ext.errors import LayoutError
from nanotron_ext.report import compact_names

__all__ = ["SYMBOLS", "layout_ranks", "layout_string", "parse_layout"]

SYMBOLS: dict[str, tuple[str, ...]] = {
    "E": ("embedding",),
    "P": ("projector",),
    "t": ("decoder",),
    "N": ("final_norm",),
    "H": ("lm_head",),
    "C": ("cast",),
    "X": ("loss",),
    "L": ("final_norm", "lm_head", "cast", "loss"),
    "V": ("vocab_shard",),
}
_ITEM = re.compile(r"\s*([A-Za-z])\s*(?:\*\s*(\d*))?\s*")


def parse_layout(layout: str, *, source: str | None = None) -> list[list[str]]:
    """Parse a layout string into the roles of each stage.

    Args:
        layout: e.g. ``"E,t*5|t*6,L"``.
        source: where it came from, named first in every error (``c.yaml: nanotron_ext.layout``).

    Returns:
        One list of roles per stage, e.g. ``[["embedding", "decoder", ...], [..., "loss"]]``.

    Raises:
        LayoutError: unknown symbol, bad repeat count or empty stage; the message points at the character.
    """
    if not isinstance(layout, str) or not layout.strip():
        raise LayoutError(f"{_at(source)}layout={layout!r} is empty; write one stage per '|', e.g. 'E,t*5|t*6,L'")
    stages: list[list[str]] = []
    pos = 0
    for stage_text in layout.split("|"):
        roles: list[str] = []
        item_pos = pos
        for item in stage_text.split(","):
            if not item.strip():
                raise _error(layout, item_pos + len(item) - len(item.lstrip()), "empty item or stage", source)
            match = _ITEM.fullmatch(item)
            if match is None:
                bad = item_pos + _first_bad(item)
                raise _error(
                    layout, bad, "expected a symbol (E, P, t, N, H, C, X, L, V) optionally followed by *K", source
                )
            symbol, count = match.group(1), match.group(2)
            at = item_pos + match.start(1)
            if symbol not in SYMBOLS:
                raise _error(layout, at, f"unknown symbol {symbol!r}; known: {', '.join(SYMBOLS)}", source)
            if count is not None and (count == "" or int(count) < 1):
                raise _error(layout, item_pos + item.index("*") + 1, "a repeat count after '*' must be >= 1", source)
            roles += list(SYMBOLS[symbol]) * (int(count) if count else 1)
            item_pos += len(item) + 1
        stages.append(roles)
        pos += len(stage_text) + 1
    return stages


def layout_ranks(layout: str, roles: Sequence[str], *, source: str | None = None) -> list[int]:
    """Stage of each block for a layout.

    Args:
        layout: the layout string.
        roles: the model's block roles in forward order.
        source: where it came from, named first in every error (``c.yaml: nanotron_ext.layout``).

    Returns:
        The stage of each block.

    Raises:
        LayoutError: the layout does not name the model's blocks in order (says which block differs).
    """
    stages = parse_layout(layout, source=source)
    named = f"{_at(source)}layout {layout!r}"
    flat = [(stage, role) for stage, rs in enumerate(stages) for role in rs]
    want_dec, got_dec = sum(r == "decoder" for r in roles), sum(r == "decoder" for _, r in flat)
    if want_dec != got_dec:
        raise LayoutError(
            f"{named} has {got_dec} decoder layers but the model has {want_dec}; make its t and t*K "
            f"items add up to {want_dec}"
        )
    for i, role in enumerate(roles):
        if i >= len(flat):
            raise LayoutError(f"{named} stops before block {i} ({role}); add the remaining blocks")
        if flat[i][1] != role:
            raise LayoutError(
                f"{named}: block {i} of the model is {role!r} but the layout says {flat[i][1]!r}; "
                f"the model's blocks in order are {compact_roles(roles)}"
            )
    if len(flat) > len(roles):
        raise LayoutError(
            f"{named} names {len(flat)} blocks but the model has {len(roles)}; drop the items past "
            f"block {len(roles) - 1} ({roles[-1]})"
        )
    return [stage for stage, _ in flat]


def layout_string(roles: Sequence[str], ranks: Sequence[int]) -> str | None:
    """The layout string of a split, the inverse of :func:`layout_ranks`: runs of decoder layers and vocabulary
    shards as ``t*K`` / ``V*K``, the final norm, lm_head, cast and loss as ``L`` when one stage holds all four.

    Returns:
        The string, or None when a block's role has no symbol (``other``) or a stage is empty.

    Example:
        >>> layout_string(["embedding", "decoder", "decoder", "final_norm", "lm_head", "cast", "loss"],
        ...               [0, 0, 1, 1, 1, 1, 1])
        'E,t|t,L'
    """
    letter = {symbols[0]: s for s, symbols in SYMBOLS.items() if len(symbols) == 1}
    if any(r not in letter for r in roles) or sorted(set(ranks)) != list(range(max(ranks, default=-1) + 1)):
        return None
    stages = []
    for k in range(max(ranks) + 1):
        items = [letter[r] for r, rank in zip(roles, ranks) if rank == k]
        text = ",".join(items)
        while "N,H,C,X" in text:
            text = text.replace("N,H,C,X", "L", 1)
        parts: list[str] = []
        for item in text.split(","):
            if parts and parts[-1].split("*")[0] == item and item in ("t", "V"):
                head, _, count = parts[-1].partition("*")
                parts[-1] = f"{head}*{int(count or 1) + 1}"
            else:
                parts.append(item)
        stages.append(",".join(parts))
    return "|".join(stages)


def split_text(names: Sequence[str], ranks: Sequence[int], pp: int) -> str:
    """A split as a person reads it: its layout string (``E,t|t,L``), or each stage's block labels where a block
    has no layout symbol (``embed,d0 | d1,head``)."""
    text = layout_string([role_of(n) for n in names], ranks)
    if text is not None:
        return text
    return " | ".join(compact_names([short_name(n) for n, s in zip(names, ranks) if s == k]) for k in range(pp))


def _first_bad(item: str) -> int:
    stripped = item.lstrip()
    offset = len(item) - len(stripped)
    if stripped and stripped[0].isalpha():
        rest = stripped[1:].lstrip()
        return offset + (len(stripped) - len(rest)) if rest else offset
    return offset


def _at(source: str | None) -> str:
    """``c.yaml: nanotron_ext.layout: ``, what every message starts with where the layout's source is known."""
    return f"{source}: " if source else ""


def _error(layout: str, at: int, why: str, source: str | None) -> LayoutError:
    return LayoutError(
        f"{_at(source)}malformed layout at character {at + 1}: {why}; separate items with ',' and stages with '|', "
        f"e.g. 'E,t*5|t*6,L'\n  {layout}\n  {' ' * at}^"
    )
