"""Which part of a whole tensor a saved or a live tensor holds: boxes of index ranges, and the copies between them.

Nanotron saves a tensor-parallel shard with the slices it covers (``TensorMetadata.local_global_slices_pairs``): a
tuple of pairs, each mapping a slice of the local tensor onto a slice of the unsharded one, written as
``"0,10,None|None,None,None#0,10,None|None,None,None;..."`` (``nanotron/parallel/parameters.py``, ``SlicesPair``).
Here a slice becomes a half-open ``(start, stop)`` range per dimension, resolved against the shape, so that two
layouts of one tensor (another tp, another vocabulary split, one pp rank or two) compare and copy exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "Box",
    "Piece",
    "copy_pieces",
    "full_box",
    "intersect",
    "parse_slices_pairs",
    "pieces_of",
    "slices_pairs_str",
    "tiling_gaps",
    "volume",
]

#: One ``(start, stop)`` range per dimension.
Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Piece:
    """A local tensor's ``local`` box holds the whole tensor's ``whole`` box (same extents)."""

    local: Box
    whole: Box

    def __post_init__(self) -> None:
        if [b - a for a, b in self.local] != [b - a for a, b in self.whole]:
            raise ValueError(f"a piece's local box {self.local} and whole box {self.whole} differ in extent")


def full_box(shape: Sequence[int]) -> Box:
    """The box of a whole tensor of ``shape``."""
    return tuple((0, int(n)) for n in shape)


def volume(box: Box) -> int:
    return math.prod(max(0, b - a) for a, b in box)


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, None when they do not overlap."""
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def _index(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def _shift(box: Box, from_origin: Box, to_origin: Box) -> Box:
    return tuple((a - f + t, b - f + t) for (a, b), (f, _), (t, _) in zip(box, from_origin, to_origin))


def _range(text: str, size: int) -> tuple[int, int]:
    parts = [None if x == "None" else int(x) for x in text.split(",")]
    if len(parts) != 3:
        raise ValueError(f"a slice is written 'start,stop,step', got {text!r}")
    return _slice_range(slice(*parts), size)


def _slice_range(s: slice, size: int) -> tuple[int, int]:
    if s.step not in (None, 1):
        raise ValueError(f"slice {s} has step {s.step}; only contiguous slices are supported")
    lo, hi, _ = slice(s.start, s.stop).indices(size)
    return lo, hi


def pieces_of(
    pairs: Sequence[tuple[Sequence[slice], Sequence[slice]]], local_shape: Sequence[int], whole_shape: Sequence[int]
) -> tuple[Piece, ...]:
    """Pieces from ``(local slices, whole slices)`` pairs, as a live sharded parameter describes itself."""
    return tuple(
        Piece(
            tuple(_slice_range(s, n) for s, n in zip(local, local_shape)),
            tuple(_slice_range(s, n) for s, n in zip(whole, whole_shape)),
        )
        for local, whole in pairs
    )


def parse_slices_pairs(text: str, local_shape: Sequence[int], whole_shape: Sequence[int]) -> tuple[Piece, ...]:
    """Nanotron's ``local_global_slices_pairs`` string as pieces, resolved against both shapes.

    Example:
        >>> parse_slices_pairs("None,None,None|None,None,None#4,8,None|None,None,None", (4, 2), (8, 2))
        (Piece(local=((0, 4), (0, 2)), whole=((4, 8), (0, 2))),)
    """
    pieces = []
    for pair in text.split(";"):
        local_text, _, whole_text = pair.partition("#")
        local = local_text.split("|")
        whole = whole_text.split("|")
        if len(local) != len(local_shape) or len(whole) != len(whole_shape):
            raise ValueError(f"slices {pair!r} do not match the shapes {tuple(local_shape)} and {tuple(whole_shape)}")
        pieces.append(
            Piece(
                tuple(_range(t, n) for t, n in zip(local, local_shape)),
                tuple(_range(t, n) for t, n in zip(whole, whole_shape)),
            )
        )
    return tuple(pieces)


def slices_pairs_str(pieces: Sequence[Piece]) -> str:
    """The inverse of :func:`parse_slices_pairs`, in Nanotron's spelling (explicit bounds, no step)."""

    def one(box: Box) -> str:
        return "|".join(f"{a},{b},None" for a, b in box)

    return ";".join(f"{one(p.local)}#{one(p.whole)}" for p in pieces)


def tiling_gaps(boxes: Sequence[Box], shape: Sequence[int]) -> tuple[int, int]:
    """``(elements covered twice, elements not covered)`` when ``boxes`` should tile ``shape`` exactly once.

    Pairwise overlaps are summed, so three boxes over one element count it more than once; (0, 0) means an exact
    tiling either way.
    """
    inside = [b for b in boxes if intersect(b, full_box(shape)) == b]
    if len(inside) != len(boxes):
        return 0, -1  # a box outside the tensor: no tiling (the caller names the box)
    overlap = sum(volume(c) for i, a in enumerate(boxes) for b in boxes[i + 1 :] if (c := intersect(a, b)))
    missing = math.prod(shape) - sum(volume(b) for b in boxes) + overlap
    return overlap, missing


def copy_pieces(out: torch.Tensor, out_pieces: Sequence[Piece], src: torch.Tensor, src_pieces: Sequence[Piece]) -> int:
    """Copy into ``out`` every element of the whole tensor that both ``out`` and ``src`` hold; returns how many.

    Both sides are local tensors described by their pieces of one whole tensor.
    """
    copied = 0
    for o in out_pieces:
        for s in src_pieces:
            common = intersect(o.whole, s.whole)
            if common is None:
                continue
            dst = _shift(common, o.whole, o.local)
            from_ = _shift(common, s.whole, s.local)
            out[_index(dst)] = src[_index(from_)].to(out.dtype)
            copied += volume(common)
    return copied
