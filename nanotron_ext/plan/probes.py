"""Probe splits for ``calibrate --in-run --probes``: splits that put every block that can move on every stage
position it can take, beside other neighbours, so that an in-run profile sees each block where a plan may put it.

From the config's own split (``block_ranks``):

* ``plan``: the split itself;
* ``cuts +1`` and ``cuts -1``: every cut inside the decoder stack moved one layer later and one earlier (each stage
  keeps a block), so each layer next to a cut runs on both of its sides;
* ``head early`` (pp >= 2): the final norm and the lm_head (or the vocabulary shards but the last) moved onto the
  stage before the last one, which keeps only what follows them (the cast and the loss): the lm_head away from the
  last stage, and what it hands on (the logits) across a cut.

The embedding and the loss cannot move off the first and the last stage; a split equal to one already listed is
left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from nanotron_ext.blocks import BlockInfo

__all__ = ["Probe", "probe_splits"]


class Probe(NamedTuple):
    """One probe split: its name and the stage of every block."""

    name: str
    block_ranks: tuple[int, ...]


def _shift_cuts(block_ranks: Sequence[int], roles: Sequence[str], shift: int) -> tuple[int, ...] | None:
    """Every cut whose two sides are decoder layers moved by ``shift`` blocks; None where a stage would empty."""
    pp = max(block_ranks) + 1
    starts = [block_ranks.index(s) for s in range(pp)]
    moved = list(starts)
    for s in range(1, pp):
        cut = starts[s]
        if roles[cut - 1] == "decoder" and roles[cut] == "decoder":
            moved[s] = cut + shift
    if any(b <= a for a, b in zip(moved, moved[1:])) or moved[0] != 0 or moved[-1] >= len(block_ranks):
        return None
    ranks = [0] * len(block_ranks)
    for s, start in enumerate(moved):
        for i in range(start, len(block_ranks)):
            ranks[i] = s
    return tuple(ranks)


def _head_early(block_ranks: Sequence[int], roles: Sequence[str]) -> tuple[int, ...] | None:
    """The output layer's blocks before the cast and the loss moved to the stage before the last; None at pp=1 or
    where nothing of it is on the last stage."""
    pp = max(block_ranks) + 1
    head = [i for i, r in enumerate(roles) if r in ("lm_head", "vocab_shard")]
    if pp < 2 or not head:
        return None
    last_head = head[-1] if roles[head[-1]] == "lm_head" else head[-2] if len(head) > 1 else None
    if last_head is None or block_ranks[last_head] != pp - 1 or last_head == len(roles) - 1:
        return None
    return tuple(pp - 2 if (r == pp - 1 and i <= last_head) else r for i, r in enumerate(block_ranks))


def probe_splits(blocks: Sequence[BlockInfo], block_ranks: Sequence[int]) -> list[Probe]:
    """The probe splits of ``block_ranks`` (see the module docstring), the split itself first."""
    roles = [b.role for b in blocks]
    out = [Probe("plan", tuple(block_ranks))]
    candidates = (
        ("cuts +1", _shift_cuts(block_ranks, roles, 1)),
        ("cuts -1", _shift_cuts(block_ranks, roles, -1)),
        ("head early", _head_early(block_ranks, roles)),
    )
    for name, ranks in candidates:
        if ranks is not None and ranks not in {p.block_ranks for p in out}:
            out.append(Probe(name, ranks))
    return out
