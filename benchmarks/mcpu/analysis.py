"""The launcher's reading of one ``measured_cpu.py`` scenario: each plan simulated from the blocks and links the
ranks measured, next to what they measured, as the table's rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mcpu.scenarios import ENGINE, PP
from mcpu.splits import cut_key, split_label


@dataclass
class Row:
    strategy: str
    split: str
    ok: bool
    findings: list[str]
    same_as: str | None
    step: float
    pipeline: float
    bubble: float
    pipeline_bubble: float
    sim_step: float  # pipeline + update (gradient sync, optimizer)
    sim_pipeline: float
    sim_bubble: float
    p2p: float
    update: list[float]  # per stage: simulated update (optimizer step + tied-gradient all-reduce)
    busy_ratio: list[float]  # per stage: measured busy in the pipeline ÷ m × profiled forward + backward
    sim_in_situ: float  # the simulator's pipeline, fed with the stage times measured in the pipeline
    notes: list[str] = field(default_factory=list)


def analyse(result: dict[str, Any]) -> tuple[list[Row], dict[str, Any]]:
    """Rows of the table for one scenario, and the simulated schedules by strategy."""
    rows, sims = [], {}
    for name, plan in result["plans"].items():
        row, sim = _row(result, name, plan)
        rows.append(row)
        sims[name] = (sim, plan)
    return rows, sims


def _stage_times(result: dict[str, Any], ranks: list[int]) -> tuple[list[float], list[float], list[float]]:
    """Per stage: forward, backward and update, summed from its blocks' profiled times (the update with the
    measured tied-gradient all-reduce where the tied copies sit on different ranks)."""
    fwd, bwd, update = [0.0] * PP, [0.0] * PP, [0.0] * PP
    for (f, b, o), r in zip(result["timings"], ranks):
        fwd[r] += f
        bwd[r] += b
        update[r] += o
    if result["tied"]:
        roles = [b["role"] for b in result["blocks"]]
        tied_on = {ranks[roles.index("embedding")], ranks[roles.index("lm_head")]}
        if len(tied_on) > 1:  # both copies' ranks join the all-reduce
            for k in tied_on:
                update[k] += result["p2p"]["tied"]
    return fwd, bwd, update


def _row(result: dict[str, Any], name: str, plan: dict[str, Any]) -> tuple[Row, Any]:
    """One plan's row, and its simulated schedule."""
    from nanotron_ext.simulate import StageTimes, simulate

    blocks, m = result["blocks"], result["n_micro_batches"]
    run = result["runs"][",".join(map(str, plan["ranks"]))]
    fwd, bwd, update = _stage_times(result, plan["ranks"])
    transfer = result["p2p"][cut_key(plan["ranks"], blocks)]
    sim = simulate([StageTimes(fwd[k], bwd[k], update[k]) for k in range(PP)], m, ENGINE, transfer)
    s = run["summary"]
    # Separates the two sources of error: per-block timings measured alone (busy ratio ≠ 1) versus the
    # schedule model (the simulator fed with in-pipeline stage times, scaled from the profiled split of
    # forward and backward, still misses the measured pipeline).
    ratio = [s["pipeline_busy"][k] / (m * (fwd[k] + bwd[k])) if fwd[k] + bwd[k] else float("nan") for k in range(PP)]
    in_situ = simulate([StageTimes(fwd[k] * ratio[k], bwd[k] * ratio[k]) for k in range(PP)], m, ENGINE, transfer)
    row = Row(
        name,
        split_label(plan["ranks"], blocks),
        plan["ok"],
        plan["findings"],
        run["first"] if run["first"] != name else None,
        s["step"],
        s["pipeline"],
        s["bubble"],
        s["pipeline_bubble"],
        sim.step_time,
        sim.pipeline_time,
        sim.bubble_fraction,
        transfer,
        update,
        ratio,
        in_situ.pipeline_time,
    )
    return row, sim
