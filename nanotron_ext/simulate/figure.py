"""What the pictures share: a figure on its own Agg canvas, a title kept inside the frame, and the file written.

matplotlib is imported inside the functions, so importing this module stays cheap; figures are drawn on an Agg
canvas directly (no pyplot), which leaves the caller's backend and pyplot state alone.
"""

from __future__ import annotations

import io
import os
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

from nanotron_ext.outputs import atomic_write_bytes, picture_format

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["DPI", "INVALID_COLOR", "keep_title_inside", "new_figure", "save"]

DPI = 150
#: What marks a plan that cannot train, in every picture.
INVALID_COLOR = "#C44E52"
#: Pixels a title keeps from the figure's edges.
_MARGIN_PX = 6


def new_figure(width: float, height: float) -> Figure:
    """A ``width`` × ``height`` inch figure with constrained layout on an Agg canvas of its own."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save(fig: Figure, path: str | os.PathLike[str]) -> Path:
    """Write ``fig`` to ``path`` in the format its suffix names (.png, .pdf, .svg), whole or not at all."""
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=DPI, format=picture_format(path))
    return atomic_write_bytes(path, buffer.getvalue())


def keep_title_inside(fig: Figure, ax: Axes, text: str, **kwargs: object) -> None:
    """Set ``ax``'s title to ``text``, each line wrapped (at its spaces) until the title is no wider than the
    figure, then moved sideways into the frame: a title centred over axes that a legend or long tick labels push
    aside would otherwise run off the figure's edge (``...na_large_vocab, pp=2``). Lays the figure out."""
    width = max(len(line) for line in text.splitlines())
    title = ax.set_title(text, **kwargs)
    fig.canvas.draw()
    frame = fig.bbox.width - 2 * _MARGIN_PX
    while title.get_window_extent().width > frame and width > 20:
        width = int(width * 0.85)
        title.set_text("\n".join(textwrap.fill(line, width) for line in text.splitlines()))
        fig.canvas.draw()  # the layout makes room for the taller title
    box = title.get_window_extent()
    shift = max(0.0, _MARGIN_PX - box.x0) - max(0.0, box.x1 - (fig.bbox.width - _MARGIN_PX))
    if shift:
        x, y = title.get_position()
        title.set_position((x + shift / ax.bbox.width, y))
