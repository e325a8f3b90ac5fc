"""The stage-loads picture: each strategy's load per stage as grouped bars, a dashed line at the slowest stage of
each plan that can train, and a plan that cannot train hatched red and called INVALID, never drawn as the best.

matplotlib is imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from nanotron_ext.simulate.figure import INVALID_COLOR, keep_title_inside, new_figure, save

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["INVALID_HATCH", "loads_figure", "plot_stage_loads"]

#: The hatch of a plan that cannot train.
INVALID_HATCH = "xx"


def plot_stage_loads(
    labels: list[str],
    loads_by_strategy: dict[str, list[float]],
    path: str | os.PathLike[str],
    title: str | None = None,
    ylabel: str = "load per stage",
    *,
    invalid: Mapping[str, str] | None = None,
    unit: str = "",
) -> Path:
    """Draw :func:`loads_figure` to ``path`` (parent folders are created); returns the path written.

    Raises:
        ValueError: as :func:`loads_figure`.
    """
    return save(loads_figure(labels, loads_by_strategy, title, ylabel, invalid=invalid, unit=unit), path)


def loads_figure(
    labels: list[str],
    loads_by_strategy: dict[str, list[float]],
    title: str | None = None,
    ylabel: str = "load per stage",
    *,
    invalid: Mapping[str, str] | None = None,
    unit: str = "",
) -> Figure:
    """Grouped bar chart of per-stage load for each strategy. A plan that can train gets a dashed line at its
    slowest stage; one that cannot (``invalid``:
    strategy → why, e.g. its verdict's codes) is hatched and edged red, its legend entry and every bar of it say
    ``INVALID``, and it gets no line: its low bars are no yardstick.

    Args:
        labels: one x-axis label per stage.
        loads_by_strategy: strategy name -> one load per stage (same order as ``labels``).
        title: figure title, kept inside the frame (wrapped when long); a generic one by default.
        ylabel: y-axis label, e.g. with the unit of the loads.
        invalid: the strategies whose plan cannot train, each with why.
        unit: written after the loads in the legend (``µs``).

    Raises:
        ValueError: on no labels, no strategy, a load list of the wrong length, a non-finite load, or an
            ``invalid`` strategy that is not drawn.
    """
    invalid = dict(invalid or {})
    _check_loads(labels, loads_by_strategy, invalid)
    from matplotlib import colormaps

    n_stages, n_strats = len(labels), len(loads_by_strategy)
    fig = new_figure(width=max(8.0, 0.35 * n_stages * n_strats + 2.5), height=4.8)
    ax = fig.add_subplot()
    colors = colormaps["tab10"].colors
    width = 0.8 / n_strats
    suffix = f" {unit}" if unit else ""
    for i, (name, loads) in enumerate(loads_by_strategy.items()):
        color = colors[i % len(colors)]
        xs = [s - 0.4 + width * (i + 0.5) for s in range(n_stages)]
        peak = max(loads)
        if name in invalid:
            bars = ax.bar(
                xs,
                loads,
                width=width,
                color=(*color[:3], 0.35),
                hatch=INVALID_HATCH,
                edgecolor=INVALID_COLOR,
                linewidth=1.0,
                label=f"{name}: INVALID ({invalid[name]}), max {peak:.3g}{suffix}",
            )
            for bar in bars:
                ax.annotate(
                    "INVALID",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    xytext=(0, 2),
                    textcoords="offset points",
                    ha="center",
                    va="bottom",
                    rotation=90,
                    fontsize=7,
                    color=INVALID_COLOR,
                    fontweight="bold",
                )
            continue
        ax.bar(xs, loads, width=width, color=color, label=f"{name} (max {peak:.3g}{suffix})")
        ax.axhline(peak, color=color, linestyle="--", linewidth=1.2)
    _axes(ax, labels, ylabel)
    keep_title_inside(fig, ax, title or "Per-stage load by strategy")
    return fig


def _axes(ax: Axes, labels: list[str], ylabel: str) -> None:
    n_stages = len(labels)
    crowded = n_stages > 8  # long rows of labels overlap unless slanted
    ax.set_xticks(range(n_stages), labels, rotation=30 if crowded else 0, ha="right" if crowded else "center")
    ax.set_xlim(-0.6, n_stages - 0.4)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.12)  # room for the INVALID marks
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", color="#DDDDDD", linewidth=0.5)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.legend(
        title="strategy\n(dashed: its slowest stage;\nhatched red: cannot train)",
        fontsize=8,
        title_fontsize=8,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        frameon=False,
    )


def _check_loads(labels: list[str], loads_by_strategy: dict[str, list[float]], invalid: Mapping[str, str]) -> None:
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
    unknown = sorted(set(invalid) - set(loads_by_strategy))
    if unknown:
        raise ValueError(f"invalid names {unknown}, which have no loads; name strategies of loads_by_strategy")
