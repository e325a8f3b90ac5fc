"""PNG pictures of simulated pipeline schedules and of per-stage loads.

matplotlib is imported inside the functions, so importing this module stays cheap; figures are drawn on
an Agg canvas directly (no pyplot), which leaves the caller's backend and pyplot state alone.
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanotron_ext.outputs import atomic_write_bytes, picture_format
from nanotron_ext.schedule.simulator import SimResult, ideal_bubble_fraction

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["legend_entries", "plot_stage_loads", "plot_timeline", "timeline_figure", "wrap_label"]

DPI = 150
FORWARD_COLOR = "#4C72B0"
BACKWARD_COLOR = "#DD8452"
WEIGHT_COLOR = "#8172B3"  # zb1p's deferred weight-gradient pass
UPDATE_COLOR = "#55A868"
IDLE_FACE = "#F2F2F2"
IDLE_HATCH = "#C8C8C8"
INVALID_COLOR = "#C44E52"
_LABEL_PT = 8
#: Characters per line of a stage label; a longer one is wrapped at its commas, never cut.
LABEL_WIDTH = 34


def plot_timeline(
    result: SimResult,
    path: str | os.PathLike[str],
    title: str | None = None,
    stage_labels: list[str] | None = None,
    verdict: str | None = None,
) -> Path:
    """Draw one row per stage (stage 0 on top): forward, backward, weight-gradient (zb1p's ``W``) and update
    boxes over a hatched idle background; see :func:`timeline_figure` for the arguments.

    Returns:
        The path written (parent folders are created).

    Raises:
        ValueError: if ``stage_labels`` does not have one entry per stage.
    """
    return _save(timeline_figure(result, title, stage_labels, verdict), path)


def timeline_figure(
    result: SimResult,
    title: str | None = None,
    stage_labels: list[str] | None = None,
    verdict: str | None = None,
) -> Figure:
    """The timeline of :func:`plot_timeline` as a figure.

    Args:
        result: output of :func:`nanotron_ext.schedule.simulator.simulate`.
        title: first title line; the bubble fraction and step time are always added below it.
        stage_labels: one label per stage, wrapped at commas when long (:func:`wrap_label`), never cut; default
            ``"stage s (PP rank s)"``.
        verdict: for a plan that cannot train, what is wrong (``INVALID, cannot train: no-params@1``): a red
            title line of its own, so the picture is never taken for a plan that runs.

    Raises:
        ValueError: if ``stage_labels`` does not have one entry per stage.
    """
    pp = result.pp
    labels = list(stage_labels) if stage_labels is not None else [f"stage {s} (PP rank {s})" for s in range(pp)]
    if len(labels) != pp:
        raise ValueError(f"stage_labels has {len(labels)} entries for {pp} stages; pass one label per stage")
    labels = [wrap_label(label) for label in labels]
    lines = max(label.count("\n") + 1 for label in labels)
    fig = _new_figure(width=11.0, height=1.6 + (0.5 + 0.15 * (lines - 1)) * pp + (0.3 if verdict else 0.0))
    ax = fig.add_subplot()
    span = result.step_time * 1e3 or 1.0  # ms; a zero-length step still gets a visible axis
    _draw_ops(ax, result, span)
    _stage_axes(ax, labels, span)
    _idle_shares(ax, result, span)
    _legend_and_title(fig, ax, result, title)
    if verdict:
        fig.suptitle(verdict, color=INVALID_COLOR, fontweight="bold")
    # Numbers go in only once the layout is final, so box widths in pixels are known.
    fig.canvas.draw()
    _number_the_boxes(ax, result, span)
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


_OP_COLORS = {"F": FORWARD_COLOR, "B": BACKWARD_COLOR, "W": WEIGHT_COLOR}


def _draw_ops(ax: Any, result: SimResult, span: float) -> None:
    """One box per forward, backward, weight-gradient pass (zb1p) and update, over a hatched row: idle is what
    the boxes leave uncovered."""
    ax.barh(range(result.pp), span, height=0.8, color=IDLE_FACE, hatch="///", edgecolor=IDLE_HATCH, linewidth=0)
    for op in result.ops:
        ax.barh(
            op.stage,
            op.duration * 1e3,
            left=op.start * 1e3,
            height=0.8,
            color=_OP_COLORS.get(op.kind, UPDATE_COLOR),
            edgecolor="white",
            linewidth=0.6,
        )


def _stage_axes(ax: Any, labels: list[str], span: float) -> None:
    pp = len(labels)
    ax.set_ylim(pp - 0.5, -0.5)  # stage 0 on top, like the usual pipeline diagrams
    ax.set_yticks(range(pp), labels)
    ax.set_xlim(0, span)
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", color="#DDDDDD", linewidth=0.5)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _idle_shares(ax: Any, result: SimResult, span: float) -> None:
    """Each stage's idle share on a right-hand axis, next to the row it describes."""
    right = ax.twinx()
    right.set_ylim(ax.get_ylim())
    right.set_yticks(range(result.pp), [f"idle {result.idle[s] / span * 1e3:.0%}" for s in range(result.pp)])
    right.tick_params(length=0, labelsize=8, labelcolor="#555555")
    for side in ("top", "right", "left", "bottom"):
        right.spines[side].set_visible(False)


def legend_entries(result: SimResult) -> list[tuple[str, str]]:
    """``(colour, label)`` of each legend entry of ``result``'s timeline: forward, backward (zb1p: its
    input-gradient part, then the deferred weight-gradient ``W``), update if any, idle."""
    zero_bubble = any(op.kind == "W" for op in result.ops)
    entries = [(FORWARD_COLOR, "forward"), (BACKWARD_COLOR, "backward (input gradient)" if zero_bubble else "backward")]
    if zero_bubble:
        entries.append((WEIGHT_COLOR, "weight gradient (deferred W)"))
    if any(op.kind == "U" for op in result.ops):
        entries.append((UPDATE_COLOR, "update (gradient sync + optimizer)"))
    return [*entries, (IDLE_FACE, "idle (bubble)")]


def _legend_and_title(fig: Figure, ax: Any, result: SimResult, title: str | None) -> None:
    from matplotlib.patches import Patch

    handles = [
        Patch(facecolor=IDLE_FACE, edgecolor=IDLE_HATCH, hatch="///", label=label)
        if colour == IDLE_FACE
        else Patch(color=colour, label=label)
        for colour, label in legend_entries(result)
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), frameon=False)
    pp = result.pp
    head = title or (f"{result.engine.upper()} schedule: {pp} stages, {result.n_micro_batches} micro-batches")
    ideal = ideal_bubble_fraction(pp, result.n_micro_batches)
    ax.set_title(
        f"{head}\nbubble {result.bubble_fraction:.1%} ("
        + (f"pipeline part {result.pipeline_bubble_fraction:.1%}, " if result.step_time > result.pipeline_time else "")
        + f"equal-stage ideal {ideal:.1%}), "
        f"step {_ms(result.step_time)} ms"
    )


def _number_the_boxes(ax: Any, result: SimResult, span: float) -> None:
    """The micro-batch number inside every forward, backward and weight-gradient box wide enough to hold it."""
    px_per_ms = ax.get_window_extent().width / span
    digit_px = 0.62 * _LABEL_PT * DPI / 72
    for op in result.ops:
        if op.kind == "U":
            continue
        text = str(op.micro_batch)
        if op.duration * 1e3 * px_per_ms >= digit_px * len(text) + 4:
            ax.text(
                (op.start + op.end) / 2 * 1e3,
                op.stage,
                text,
                ha="center",
                va="center",
                fontsize=_LABEL_PT,
                color="white",
                fontweight="bold",
            )


def plot_stage_loads(
    labels: list[str],
    loads_by_strategy: dict[str, list[float]],
    path: str | os.PathLike[str],
    title: str | None = None,
    ylabel: str = "load per stage",
) -> Path:
    """Grouped bar chart of per-stage load for each strategy, with a dashed line at each strategy's max.

    Args:
        labels: one x-axis label per stage.
        loads_by_strategy: strategy name -> one load per stage (same order as ``labels``).
        path: where to write the PNG (parent folders are created).
        title: figure title; a generic one by default.
        ylabel: y-axis label, e.g. with the unit of the loads.

    Returns:
        The path written.

    Raises:
        ValueError: on no labels, no strategy, a load list of the wrong length, or a non-finite load.
    """
    _check_loads(labels, loads_by_strategy)
    from matplotlib import colormaps

    n_stages, n_strats = len(labels), len(loads_by_strategy)
    fig = _new_figure(width=max(8.0, 0.35 * n_stages * n_strats + 2.5), height=4.8)
    ax = fig.add_subplot()
    colors = colormaps["tab10"].colors
    width = 0.8 / n_strats
    for i, (name, loads) in enumerate(loads_by_strategy.items()):
        color = colors[i % len(colors)]
        xs = [s - 0.4 + width * (i + 0.5) for s in range(n_stages)]
        peak = max(loads)
        ax.bar(xs, loads, width=width, color=color, label=f"{name} (max {peak:.4g})")
        ax.axhline(peak, color=color, linestyle="--", linewidth=1.2)

    crowded = n_stages > 8  # long rows of labels overlap unless slanted
    ax.set_xticks(range(n_stages), labels, rotation=30 if crowded else 0, ha="right" if crowded else "center")
    ax.set_xlim(-0.6, n_stages - 0.4)
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", color="#DDDDDD", linewidth=0.5)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.legend(
        title="strategy\n(dashed: its slowest stage)",
        fontsize=8,
        title_fontsize=8,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        frameon=False,
    )
    ax.set_title(title or "Per-stage load by strategy")
    return _save(fig, path)


def _check_loads(labels: list[str], loads_by_strategy: dict[str, list[float]]) -> None:
    if not labels:
        raise ValueError("labels is empty; pass one label per stage")
    if not loads_by_strategy:
        raise ValueError("loads_by_strategy is empty; pass {strategy name: [load per stage]}")
    for name, loads in loads_by_strategy.items():
        if len(loads) != len(labels):
            raise ValueError(
                f"strategy {name!r} has {len(loads)} loads for {len(labels)} labels; pass one load per stage"
            )
        if not all(math.isfinite(x) for x in loads):
            raise ValueError(f"strategy {name!r} has a non-finite load in {list(loads)}; pass finite numbers")


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.4g}" if ms < 1e3 else f"{ms:.0f}"  # 4 significant digits, never scientific notation


def _new_figure(width: float, height: float) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: str | os.PathLike[str]) -> Path:
    # The format follows the suffix (.png, .pdf, .svg); written whole to a temporary file, then renamed.
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=DPI, format=picture_format(path))
    return atomic_write_bytes(path, buffer.getvalue())
