"""What ``zbv_measured_cpu.py`` makes of its run: each engine's step simulated from the run's own ops (zbv's order
replayed under its chunks' times), next to the measured step, gain and heap peak."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from _in_run_ops import in_run_stages, per_step_ratios, step_times
from zb_mcpu.common import PP, median_interval

from zbv_mcpu.ranks import ENGINES

SIM_WITHIN = 0.05


def v_chunks(run: dict[str, Any]) -> list[Any]:
    """The V's four chunks as the run timed them: mean F, B and W per virtual stage, and each rank's update (its
    busy time after the pipeline) on its down chunk. No tied all-reduce: both ends of the tie are on rank 0."""
    from nanotron_ext.schedule.simulator import StageTimes
    from nanotron_ext.schedule.zbv import v_rank

    out = []
    for s in range(2 * PP):
        rank = v_rank(PP, s)
        mean = {
            k: statistics.fmean([t for step in run["v_ops"][rank] for kind, st, t in step if (kind, st) == (k, s)])
            for k in "FBW"
        }
        after = statistics.fmean(r["busy"] - (r["pipeline"] - r["pipeline_idle"]) for r in run["records"][rank])
        out.append(
            StageTimes(
                forward=mean["F"], backward=mean["B"] + mean["W"], weight=mean["W"], update=after if s < PP else 0.0
            )
        )
    return out


def simulated(result: dict[str, Any], run: dict[str, Any]) -> float:
    """The step the simulator gives ``run``'s engine (its own program) under ``run``'s own ops."""
    from nanotron_ext.schedule.simulator import simulate
    from nanotron_ext.schedule.v_replay import replay_v_order
    from nanotron_ext.schedule.zbv import VOp

    m, engine = run["m"], run["engine"]
    if engine == "zbv":
        order = [[VOp(k, int(j), int(st)) for k, j, st in ops] for ops in result["orders"][str(m)]]
        return replay_v_order(order, v_chunks(run), m, result["v_p2p"][str(m)]).step_time
    return simulate(
        in_run_stages(run, result["tied_sync"]), m, engine, p2p_time=result["p2p"][f"{engine}@{m}"]
    ).step_time


def report(result: dict[str, Any], ms: Sequence[int]) -> tuple[list[list[Any]], bool]:
    """The table's rows, and whether every engine's step replayed under its own ops is within ``SIM_WITHIN`` of the
    measured one (the median over the timed steps of :func:`per_step_ratios`)."""
    rows, holds = [], True
    for m in ms:
        ref = result["runs"][f"1f1b@{m}"]
        ref_peak = statistics.median(max(p) for p in zip(*ref["peaks"]))
        for engine in ENGINES:
            run = result["runs"][f"{engine}@{m}"]
            measured = statistics.median(step_times(run))
            gain = "-"
            if engine != "1f1b":
                med, lo, hi, _ = median_interval([a / b for a, b in zip(step_times(ref), step_times(run))])
                gain = f"{med:.3f}× [{lo:.3f}, {hi:.3f}]"
            sim = simulated(result, run)
            each = per_step_ratios(run, lambda one: simulated(result, one))
            holds &= abs(statistics.median(each) - 1) <= SIM_WITHIN
            peak = statistics.median(max(p) for p in zip(*run["peaks"]))
            rows.append(
                [
                    m,
                    engine,
                    f"{measured * 1e3:.0f}",
                    gain,
                    f"{sim * 1e3:.0f}",
                    f"{sim / measured:.3f}",
                    f"{statistics.median(each):.3f} [{min(each):.3f}, {max(each):.3f}]",
                    f"{peak / 2**20:.0f}",
                    f"{peak / ref_peak:.2f}",
                ]
            )
    return rows, holds
