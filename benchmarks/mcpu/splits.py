"""A plan's cut, as the ranks key the transfer they measure across it, and its split as the tables print it."""

from __future__ import annotations

from collections.abc import Sequence

from mcpu.scenarios import PP


def cut_key(ranks: Sequence[int], blocks: Sequence[dict]) -> str:
    """``"INDEX:ROLE"`` of the first block after the plan's cut (what crosses it depends on that block's role)."""
    cut = next(i for i in range(1, len(ranks)) if ranks[i] != ranks[i - 1])
    return f"{cut}:{blocks[cut]['role']}"


def split_label(ranks: Sequence[int], blocks: Sequence[dict]) -> str:
    """Each stage's blocks, compacted, stages joined by `` / ``."""
    from nanotron_ext.report import compact_names

    # " / " between stages: a "|" would split the markdown table cell.
    return " / ".join(compact_names([b["short"] for b, r in zip(blocks, ranks) if r == k]) for k in range(PP))
