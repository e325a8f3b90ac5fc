"""What a timeline shows, as data: a box per op (drawn at least :data:`MIN_WIDTH` of the step wide), the transfers
a rank waits on, which of a V's two chunks an op runs, and which ops carry their micro-batch number.

No matplotlib here: :mod:`nanotron_ext.simulate.timeline` draws these records as they are, so a test reads what
is drawn without looking at pixels.

**Transfers.** In Nanotron's engines (AFAB, 1F1B, zb1p, zb2p) every receive comes right before the op that takes it
(sends aside, which do not move a rank's clock), and a transfer is a rendezvous that ends when that receive does
(:mod:`nanotron_ext.schedule.simulator`): so the transfer into an op ends where the op starts and lasts its cut's
p2p time. In a V replayed with its sends posted as made (what ``simulate`` draws), a transfer leaves when the op
that makes it ends, and arrives its cut's p2p time later (:mod:`nanotron_ext.schedule.v_replay`). Either way it is
drawn on the receiving rank's row, under the ops: what shows is where the rank waits on it.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from nanotron_ext.report import format_seconds
from nanotron_ext.schedule import V_ENGINE
from nanotron_ext.schedule.simulator import SimResult
from nanotron_ext.schedule.zbv import VOp, _ready_after, v_rank

__all__ = [
    "MIN_WIDTH",
    "Box",
    "Hop",
    "boxes",
    "hops",
    "numbered_kinds",
    "ops_per_row",
    "row_note",
    "transfer_wait",
    "v_chunks",
]

#: The narrowest an op is drawn, as a share of the step (4-5 pixels on the default picture): a stage whose work is
#: a sliver of the step still shows, and :func:`row_note` prints the times drawn wider than they are.
MIN_WIDTH = 0.004


@dataclass(frozen=True)
class Box:
    """One op as drawn: ``kind`` (``F``, ``B``, ``W``, or the update ``U``) of ``micro_batch`` on ``row`` from
    ``start`` to ``end`` (s), drawn ``width`` seconds wide (at least the floor); in a V, ``chunk`` is its virtual
    stage and ``second`` whether that is the rank's chunk on the way up (drawn in a lighter shade)."""

    row: int
    kind: Literal["F", "B", "W", "U"]
    micro_batch: int
    start: float
    end: float
    width: float
    chunk: int | None = None
    second: bool = False

    @property
    def floored(self) -> bool:
        """Drawn wider than it lasts."""
        return self.width > self.end - self.start

    @property
    def gid(self) -> str:
        """``F3@5``: kind, micro-batch and chunk (a contiguous stage's own row), as its drawn patch is named."""
        return f"{self.kind}{self.micro_batch}@{self.row if self.chunk is None else self.chunk}"


@dataclass(frozen=True)
class Hop:
    """A transfer into ``row``: ``what`` of ``micro_batch`` across cut ``cut``, in flight from ``start`` to ``end``."""

    row: int
    what: Literal["activation", "gradient"]
    micro_batch: int
    cut: int
    start: float
    end: float


def v_chunks(result: SimResult, order: Sequence[Sequence[VOp]]) -> list[int | None]:
    """For each op of a V's one-row-per-rank ``result`` (:func:`~nanotron_ext.schedule.zbv.by_rank`), its virtual
    stage, from ``order`` (each rank's ops as it runs them); None for an update. A rank runs its ops in ``order``,
    one after the other, so the ``k``-th of its ops of one kind and micro-batch in time is the ``k``-th in order.

    Raises:
        ValueError: ``order`` is not ``result``'s (an op of a chunk on another rank, or one the step does not hold).
    """
    queue: dict[tuple[int, str, int], deque[int]] = defaultdict(deque)
    for rank, ops in enumerate(order):
        for op in ops:
            if v_rank(result.pp, op.stage) != rank:
                raise ValueError(f"rank {rank}'s order holds {op}, whose chunk is not on it; pass the V's own order")
            queue[(rank, op.kind, op.micro_batch)].append(op.stage)
    chunks: list[int | None] = []
    for op in result.ops:
        if op.kind == "U":
            chunks.append(None)
            continue
        held = queue.get((op.stage, op.kind, op.micro_batch))
        if not held:
            raise ValueError(f"{op.kind}{op.micro_batch} on rank {op.stage} is not in the V's order; pass its own")
        chunks.append(held.popleft())
    return chunks


def boxes(result: SimResult, chunks: Sequence[int | None] | None = None) -> list[Box]:
    """Every op of ``result`` as drawn, in ``result.ops``' order; ``chunks``: a V's (:func:`v_chunks`).

    Raises:
        ValueError: ``chunks`` has another length than ``result.ops``.
    """
    if chunks is not None and len(chunks) != len(result.ops):
        raise ValueError(f"{len(chunks)} chunks for {len(result.ops)} ops; pass one per op (v_chunks)")
    floor = MIN_WIDTH * result.step_time
    out = []
    for k, op in enumerate(result.ops):
        chunk = None if chunks is None else chunks[k]
        out.append(
            Box(
                row=op.stage,
                kind=op.kind,
                micro_batch=op.micro_batch,
                start=op.start,
                end=op.end,
                width=max(op.end - op.start, floor),
                chunk=chunk,
                second=chunk is not None and chunk >= result.pp,
            )
        )
    return out


def hops(result: SimResult, drawn: Sequence[Box], grad_cuts: Sequence[bool] | None = None) -> list[Hop]:
    """The transfers each rank receives (see the module docstring), from ``drawn`` (:func:`boxes` of ``result``,
    a V's with its chunks); ``grad_cuts``: per cut, whether a gradient crosses it back (default: every cut; a cut
    behind a frozen prefix carries none). Transfers of no length are left out."""
    if result.engine == V_ENGINE:
        return _v_hops(result, drawn)
    pp, out = result.pp, []
    for box in drawn:
        if box.kind == "F" and box.row > 0:
            cut, what = box.row - 1, "activation"
        elif box.kind == "B" and box.row < pp - 1 and (grad_cuts is None or grad_cuts[box.row]):
            cut, what = box.row, "gradient"
        else:
            continue
        took = result.p2p_times[cut]
        if took > 0:
            out.append(Hop(box.row, what, box.micro_batch, cut, box.start - took, box.start))  # type: ignore[arg-type]
    return out


def _v_hops(result: SimResult, drawn: Sequence[Box]) -> list[Hop]:
    pp = result.pp
    end = {(b.kind, b.micro_batch, b.chunk): b.end for b in drawn if b.chunk is not None}
    out = []
    for box in drawn:
        if box.chunk is None or box.kind == "W":
            continue
        maker = _ready_after(VOp(box.kind, box.micro_batch, box.chunk), pp)  # type: ignore[arg-type]
        if maker is None or maker.kind != box.kind or v_rank(pp, maker.stage) == box.row:
            continue  # the first chunk's forward; the loss's backward (its own forward); the V's bottom
        cut = min(box.chunk, maker.stage)
        left, took = end[(maker.kind, maker.micro_batch, maker.stage)], result.p2p_times[cut]
        if took > 0:
            what = "activation" if box.kind == "F" else "gradient"
            out.append(Hop(box.row, what, box.micro_batch, cut, left, left + took))  # type: ignore[arg-type]
    return out


def transfer_wait(row: int, drawn: Sequence[Box], transfers: Sequence[Hop]) -> float:
    """Seconds ``row`` waits on a transfer: while one into it is in flight and it runs no op."""
    wait = _union((h.start, h.end) for h in transfers if h.row == row)
    busy = _union((b.start, b.end) for b in drawn if b.row == row)
    return sum(hi - lo for lo, hi in wait) - _overlap(wait, busy)


def _union(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for lo, hi in sorted(s for s in spans if s[1] > s[0]):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _overlap(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> float:
    total, j = 0.0, 0
    for lo, hi in a:
        while j < len(b) and b[j][1] <= lo:
            j += 1
        k = j
        while k < len(b) and b[k][0] < hi:
            total += min(hi, b[k][1]) - max(lo, b[k][0])
            k += 1
    return total


def numbered_kinds(drawn: Sequence[Box], px_per_second: float, label_px: float) -> frozenset[str]:
    """The kinds (``F``, ``B``, ``W``) whose every box, on every row, is at least ``label_px`` pixels wide at
    ``px_per_second``: each of their boxes carries its micro-batch number, and no box of the others does. One
    rule for every row, sized by the widest number, so no row stops numbering at 10."""
    kinds = set()
    for kind in "FBW":
        widths = [b.width * px_per_second for b in drawn if b.kind == kind]
        if widths and min(widths) >= label_px:
            kinds.add(kind)
    return frozenset(kinds)


def row_note(row: int, drawn: Sequence[Box]) -> str | None:
    """``F 3.33 ns, B ≤ 6.68 ns``: for each kind of op the row draws wider than it lasts, how long it lasts (the
    longest, ``≤``, where they differ); None where the row draws every op as it is."""
    parts = []
    for kind in "FBWU":
        floored = [b.end - b.start for b in drawn if b.row == row and b.kind == kind and b.floored]
        if floored:
            same = format_seconds(max(floored)) == format_seconds(min(floored))
            parts.append(f"{kind} {'' if same else '≤ '}{format_seconds(max(floored))}")
    return ", ".join(parts) if parts else None


def ops_per_row(drawn: Sequence[Box]) -> int:
    """The most ops any row draws."""
    count: dict[int, int] = defaultdict(int)
    for b in drawn:
        count[b.row] += 1
    return max(count.values(), default=0)
