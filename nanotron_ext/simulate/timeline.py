"""The timeline picture of a simulated step: one row per stage (or per rank of a V), each op a box over a hatched
idle background, the transfers a rank waits on under them.

What is drawn comes from :mod:`nanotron_ext.simulate.timeline_marks` (boxes, transfers, numbers, floors); this
module only draws it. matplotlib is imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanotron_ext.report import format_seconds, percent, time_unit
from nanotron_ext.schedule import V_ENGINE
from nanotron_ext.schedule.simulator import SimResult, ideal_bubble_fraction
from nanotron_ext.simulate.figure import INVALID_COLOR, keep_title_inside, new_figure, save
from nanotron_ext.simulate.timeline_marks import (
    Box,
    Hop,
    boxes,
    hops,
    numbered_kinds,
    ops_per_row,
    row_note,
    transfer_wait,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["legend_entries", "plot_timeline", "shade", "timeline_figure", "wrap_label"]

FORWARD_COLOR = "#4C72B0"
BACKWARD_COLOR = "#DD8452"
WEIGHT_COLOR = "#8172B3"  # zb1p's deferred weight-gradient pass
UPDATE_COLOR = "#55A868"
TRANSFER_COLOR = "#F6E3A1"  # a transfer in flight into a rank that waits on it
IDLE_FACE = "#F2F2F2"
IDLE_HATCH = "#C8C8C8"
_OP_COLORS = {"F": FORWARD_COLOR, "B": BACKWARD_COLOR, "W": WEIGHT_COLOR, "U": UPDATE_COLOR}
#: How much white a V's second chunk (the way up) mixes into its kind's colour.
SECOND_CHUNK_WHITE = 0.5
_LABEL_PT = 7
#: Characters per line of a stage label; a longer one is wrapped at its commas, never cut.
LABEL_WIDTH = 34
#: Inches: the default width, and the most a picture with many ops per row widens to (0.3 in an op).
WIDTH, MAX_WIDTH = 11.0, 16.0


def plot_timeline(
    result: SimResult,
    path: str | os.PathLike[str],
    title: str | None = None,
    stage_labels: list[str] | None = None,
    verdict: str | None = None,
    *,
    chunks: Sequence[int | None] | None = None,
    grad_cuts: Sequence[bool] | None = None,
) -> Path:
    """Draw :func:`timeline_figure` to ``path`` (parent folders are created); returns the path written.

    Raises:
        ValueError: as :func:`timeline_figure`.
    """
    return save(timeline_figure(result, title, stage_labels, verdict, chunks=chunks, grad_cuts=grad_cuts), path)


def timeline_figure(
    result: SimResult,
    title: str | None = None,
    stage_labels: list[str] | None = None,
    verdict: str | None = None,
    *,
    chunks: Sequence[int | None] | None = None,
    grad_cuts: Sequence[bool] | None = None,
) -> Figure:
    """One row per stage (stage 0 on top): forward, backward, weight-gradient (zb1p's ``W``) and update boxes,
    each at least :data:`~nanotron_ext.simulate.timeline_marks.MIN_WIDTH` of the step wide (the times of those
    drawn wider printed on the right), the transfers a rank waits on, and the idle time hatched.

    Args:
        result: output of :func:`nanotron_ext.schedule.simulator.simulate` (or a V's, one row per rank).
        title: first title line; the bubble and step time are always added below it.
        stage_labels: one label per stage, wrapped at commas when long (:func:`wrap_label`), never cut; default
            ``"stage s (PP rank s)"``.
        verdict: for a plan that cannot train, what is wrong (``INVALID, cannot train: no-params@1``): a red
            title line of its own, so the picture is never taken for a plan that runs.
        chunks: a V's virtual stage of each op (:func:`~nanotron_ext.simulate.timeline_marks.v_chunks`): its
            second chunk is drawn lighter, and its transfers are the V's.
        grad_cuts: per cut, whether a gradient crosses it back (default every cut).

    Raises:
        ValueError: if ``stage_labels`` does not have one entry per stage, or ``chunks`` one per op.
    """
    pp = result.pp
    labels = list(stage_labels) if stage_labels is not None else [f"stage {s} (PP rank {s})" for s in range(pp)]
    if len(labels) != pp:
        raise ValueError(f"stage_labels has {len(labels)} entries for {pp} stages; pass one label per stage")
    labels = [wrap_label(label) for label in labels]
    drawn = boxes(result, chunks)
    transfers = hops(result, drawn, grad_cuts)
    right = _right_labels(result, drawn, transfers)
    lines = max(text.count("\n") + 1 for text in labels + right)
    fig = new_figure(
        width=min(MAX_WIDTH, max(WIDTH, 0.3 * ops_per_row(drawn))),
        height=1.6 + (0.5 + 0.15 * (lines - 1)) * pp + (0.3 if verdict else 0.0),
    )
    ax = fig.add_subplot()
    unit, scale = time_unit(result.step_time)
    _draw(ax, pp, drawn, transfers, scale, span=result.step_time / scale or 1.0)
    _stage_axes(ax, labels, result.step_time / scale or 1.0, unit)
    _right_axis(ax, right)
    _legend(fig, result, drawn, bool(transfers))
    if verdict:
        fig.suptitle(verdict, color=INVALID_COLOR, fontweight="bold")
    keep_title_inside(fig, ax, _title(result, title))  # lays the figure out: box widths in pixels are known now
    _number_the_boxes(fig, ax, drawn, scale)
    return fig


def wrap_label(label: str, width: int = LABEL_WIDTH) -> str:
    """``label`` on lines of at most ``width`` characters, broken after its commas (a single item longer than
    ``width`` keeps its own line whole).

    Example:
        >>> print(wrap_label("stage 7: decoder.28-29, final_norm, lm_head, cast, loss"))
        stage 7: decoder.28-29, final_norm,
        lm_head, cast, loss
    """
    lines: list[str] = []
    for part in label.split(", "):
        if lines and len(lines[-1]) + 2 + len(part) <= width:
            lines[-1] += f", {part}"
        else:
            if lines:
                lines[-1] += ","
            lines.append(part)
    return "\n".join(lines)


def shade(colour: str, second: bool) -> str:
    """The face of a box of ``colour``: as it is, or for a V's second chunk (``second``) lighter, mixed with
    :data:`SECOND_CHUNK_WHITE` of white."""
    if not second:
        return colour
    from matplotlib.colors import to_hex, to_rgb

    return to_hex(tuple(c + (1 - c) * SECOND_CHUNK_WHITE for c in to_rgb(colour)))


def _draw(ax: Any, pp: int, drawn: Sequence[Box], transfers: Sequence[Hop], scale: float, span: float) -> None:
    """The hatched idle rows, the transfers over them, and the boxes over both; each box's patch is named by
    :attr:`Box.gid`."""
    ax.barh(range(pp), span, height=0.8, color=IDLE_FACE, hatch="///", edgecolor=IDLE_HATCH, linewidth=0, zorder=1)
    if transfers:
        ax.barh(
            [h.row for h in transfers],
            [(h.end - h.start) / scale for h in transfers],
            left=[h.start / scale for h in transfers],
            height=0.8,
            color=TRANSFER_COLOR,
            linewidth=0,
            zorder=1.5,
        )
    if not drawn:
        return
    bars = ax.barh(
        [b.row for b in drawn],
        [b.width / scale for b in drawn],
        left=[b.start / scale for b in drawn],
        height=0.8,
        color=[shade(_OP_COLORS[b.kind], b.second) for b in drawn],
        edgecolor=["none" if b.floored else "white" for b in drawn],
        linewidth=0.6,
        zorder=2,
    )
    for patch, box in zip(bars.patches, drawn):
        patch.set_gid(box.gid)


def _stage_axes(ax: Any, labels: list[str], span: float, unit: str) -> None:
    pp = len(labels)
    ax.set_ylim(pp - 0.5, -0.5)  # stage 0 on top, like the usual pipeline diagrams
    ax.set_yticks(range(pp), labels)
    ax.set_xlim(0, span)
    ax.set_xlabel(f"time ({unit})")
    ax.grid(axis="x", color="#DDDDDD", linewidth=0.5)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _right_labels(result: SimResult, drawn: Sequence[Box], transfers: Sequence[Hop]) -> list[str]:
    """Each row's idle share of the step, the share it waits on transfers, and the times of its ops drawn wider
    than they are."""
    out = []
    for row in range(result.pp):
        step = result.step_time or 1.0
        wait = transfer_wait(row, drawn, transfers) / step
        lines = [f"idle {percent(result.idle[row] / step)}" + (f", {percent(wait)} on p2p" if wait >= 0.005 else "")]
        note = row_note(row, drawn)
        if note:
            lines.append(wrap_label(f"drawn wider: {note}", 28))
        out.append("\n".join(lines))
    return out


def _right_axis(ax: Any, labels: list[str]) -> None:
    right = ax.twinx()
    right.set_ylim(ax.get_ylim())
    right.set_yticks(range(len(labels)), labels)
    right.tick_params(length=0, labelsize=8, labelcolor="#555555")
    for side in ("top", "right", "left", "bottom"):
        right.spines[side].set_visible(False)


def legend_entries(result: SimResult, *, transfers: bool = False) -> list[tuple[str, str]]:
    """``(colour, label)`` of each legend entry of ``result``'s timeline: forward, backward (zb1p: its
    input-gradient part, then the deferred weight-gradient ``W``), update if any, a V's second chunk, transfers
    (``transfers``: any is drawn), idle."""
    zero_bubble = any(op.kind == "W" for op in result.ops)
    entries = [(FORWARD_COLOR, "forward"), (BACKWARD_COLOR, "backward (input gradient)" if zero_bubble else "backward")]
    if zero_bubble:
        entries.append((WEIGHT_COLOR, "weight gradient (deferred W)"))
    if any(op.kind == "U" for op in result.ops):
        entries.append((UPDATE_COLOR, "update (gradient sync + optimizer)"))
    if result.engine == V_ENGINE:
        entries.append((shade(FORWARD_COLOR, True), "lighter: the rank's 2nd chunk (way up)"))
    if transfers:
        entries.append((TRANSFER_COLOR, "waiting on a transfer (bubble)"))
    return [*entries, (IDLE_FACE, "idle (bubble)")]


def _legend(fig: Figure, result: SimResult, drawn: Sequence[Box], transfers: bool) -> None:
    from matplotlib.patches import Patch

    handles = [
        Patch(facecolor=IDLE_FACE, edgecolor=IDLE_HATCH, hatch="///", label=label)
        if colour == IDLE_FACE
        else Patch(color=colour, label=label)
        for colour, label in legend_entries(result, transfers=transfers)
    ]
    # One row where it fits, else two: the legend never runs off the figure.
    columns = len(handles) if len(handles) <= 5 else (len(handles) + 1) // 2
    fig.legend(handles=handles, loc="outside lower center", ncols=columns, frameon=False, fontsize=9)


def _title(result: SimResult, title: str | None) -> str:
    """The title's lines: ``title`` (or the engine and shape), then the bubble and the step."""
    pp = result.pp
    head = title or (f"{result.engine.upper()} schedule: {pp} stages, {result.n_micro_batches} micro-batches")
    ideal = ideal_bubble_fraction(pp, result.n_micro_batches)
    pipeline = (
        f"pipeline bubble {result.pipeline_bubble_fraction:.1%}, " if result.step_time > result.pipeline_time else ""
    )
    return (
        f"{head}\nbubble {result.bubble_fraction:.1%} ({pipeline}equal-stage ideal {ideal:.1%}), "
        f"step {format_seconds(result.step_time)}"
    )


def _number_the_boxes(fig: Figure, ax: Any, drawn: Sequence[Box], scale: float) -> None:
    """The micro-batch number inside every box of the kinds :func:`numbered_kinds` says hold theirs (the widest
    number, bold, with a margin), on every row alike."""
    if not drawn:
        return
    widest = ax.text(0, 0, str(max(b.micro_batch for b in drawn)), fontsize=_LABEL_PT, fontweight="bold")
    label_px = widest.get_window_extent(fig.canvas.get_renderer()).width + 3
    widest.remove()
    span = ax.get_xlim()[1] * scale  # seconds across the axes
    kinds = numbered_kinds(drawn, ax.get_window_extent().width / span, label_px)
    for box in (b for b in drawn if b.kind in kinds):
        ax.text(
            (box.start + box.width / 2) / scale,
            box.row,
            str(box.micro_batch),
            ha="center",
            va="center",
            fontsize=_LABEL_PT,
            color="#222222" if box.second else "white",
            fontweight="bold",
            zorder=3,
            gid=f"n{box.gid}",
        )
