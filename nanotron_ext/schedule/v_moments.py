"""What a rank of a V holds when each of its ops starts (its memory's moments): per chunk, the micro-batches whose
activations and whose deferred weight-gradient state it keeps (:func:`v_moments`, read by
:mod:`nanotron_ext.costs.v_memory`)."""

from __future__ import annotations

from typing import NamedTuple

from nanotron_ext.schedule.zbv import Kind, VResult, v_rank

__all__ = ["VMoment", "v_moments"]


class VMoment(NamedTuple):
    """What a rank of a V holds when one of its ops starts, per chunk (0: the way down, 1: the way up).

    Attributes:
        held: micro-batches holding the chunk's activations: from the start of their ``F`` to the end of their
            ``B`` (the one starting counted in full).
        pending: micro-batches holding the chunk's deferred weight-gradient state: from the start of their ``B``
            (its products accumulate during it) to the end of their ``W``.
        running: the chunk of the op that starts.
        kind: that op's kind.
    """

    held: tuple[int, int]
    pending: tuple[int, int]
    running: int
    kind: Kind


def v_moments(result: VResult, rank: int) -> list[VMoment]:
    """Each moment one of ``rank``'s ops starts in ``result``, in time order: what the rank holds then.

    Raises:
        ValueError: a rank outside ``0..pp - 1``.
    """
    if not 0 <= rank < result.pp:
        raise ValueError(f"rank {rank} is outside 0..{result.pp - 1}")
    pp = result.pp
    ops = [o for o in result.ops if v_rank(pp, o.stage) == rank]
    # At one instant ends come before starts: what ends as another op starts is no longer held.
    events = sorted([(o.start, 1, o) for o in ops] + [(o.end, 0, o) for o in ops], key=lambda e: (e[0], e[1]))
    held, pending = [0, 0], [0, 0]
    out = []
    for _, starts, o in events:
        chunk = 0 if o.stage < pp else 1
        if starts:
            if o.kind == "F":
                held[chunk] += 1
            elif o.kind == "B":
                pending[chunk] += 1
            out.append(VMoment((held[0], held[1]), (pending[0], pending[1]), chunk, o.kind))
        elif o.kind == "B":
            held[chunk] -= 1
        elif o.kind == "W":
            pending[chunk] -= 1
    return out
