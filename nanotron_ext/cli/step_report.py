"""How ``simulate`` prints a simulated step: each stage's op times, the step's summary line and each stage's busy
and idle time. Every time in them is :func:`~nanotron_ext.report.format_seconds`' (µs, ms or s by size), as in
``plan``.

Words (docs/simulator.md): the **bubble** is the step's idle share, Σ idle ÷ (pp × step), the updates included;
the **pipeline bubble** the same over the pipeline part alone (before the updates), the figure the equal-stage
ideal ``(p−1)/(m+p−1)`` is for.
"""

from __future__ import annotations

from nanotron_ext.plan import Plan
from nanotron_ext.report import format_seconds, table
from nanotron_ext.schedule import V_ENGINE, ZERO_BUBBLE
from nanotron_ext.schedule.simulator import SimResult, ideal_bubble_fraction

__all__ = ["p2p_text", "stage_table", "step_lines"]


def stage_table(plan: Plan, result: SimResult) -> str:
    """Each stage's blocks, forward and backward of one micro-batch (zb1p, zb2p: the backward's ``W`` part too)
    and update."""
    rows = [
        [s.stage, s.label, format_seconds(t.forward), format_seconds(t.backward), format_seconds(t.update)]
        for s, t in zip(plan.stages, result.stages)
    ]
    head = ["stage", "blocks", "forward/mb", "backward/mb", "update/step"]
    if result.engine in ZERO_BUBBLE:  # the backward's weight-gradient part, run later as W
        head.insert(4, "of which W/mb")
        for row, t in zip(rows, result.stages):
            row.insert(4, format_seconds(t.weight))
    return table(head, rows)


def p2p_text(result: SimResult) -> str:
    """``p2p 10.1 µs`` when every cut takes the same, else ``p2p per cut 0->1 20.1 µs, 1->2 10.1 µs`` (a V's
    bottom, whose two chunks share a rank, left out)."""
    pp, times = result.pp, result.p2p_times
    cuts = [(c, t) for c, t in enumerate(times) if not (result.engine == V_ENGINE and c == pp - 1)]
    if not cuts:
        return "p2p -"
    if len({t for _, t in cuts}) == 1:
        return f"p2p {format_seconds(cuts[0][1])}"
    return "p2p per cut " + ", ".join(f"{c}->{c + 1} {format_seconds(t)}" for c, t in cuts)


def step_lines(result: SimResult) -> str:
    """``1f1b: pp=2, micro-batches=4, p2p 10.1 µs, step 89.1 µs (pipeline 81.6 µs + update), bubble 89.6%
    (pipeline bubble 97.9%, ideal 20.0%)``, then each stage's busy and idle time, idle share and peak in flight."""
    pp, m = result.pp, result.n_micro_batches
    updated = result.step_time > result.pipeline_time
    head = (
        f"{result.engine}: pp={pp}, micro-batches={m}, {p2p_text(result)}, step {format_seconds(result.step_time)}"
        + (f" (pipeline {format_seconds(result.pipeline_time)} + update)" if updated else "")
        + f", bubble {result.bubble_fraction:.1%} ("
        + (f"pipeline bubble {result.pipeline_bubble_fraction:.1%}, " if updated else "")
        + f"ideal {ideal_bubble_fraction(pp, m):.1%})"
    )
    step = result.step_time
    rows = [
        [
            s,
            format_seconds(result.busy[s]),
            format_seconds(result.idle[s]),
            f"{result.idle[s] / step if step > 0 else 0.0:.1%}",
            result.peak_in_flight[s],
        ]
        for s in range(pp)
    ]
    return head + "\n" + table(["stage", "busy", "idle", "idle %", "peak in flight"], rows)
