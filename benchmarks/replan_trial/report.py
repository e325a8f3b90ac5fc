"""What ``replan_cpu.py`` makes of a round: each case's run against its twin (and, for a close call, against the
plans it tried measured apart), the check, and the table printed."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nanotron_ext.report import table
from nanotron_ext.stats import median_interval, relative_spread
from replan_trial.cases import Case, Check


@dataclass(frozen=True)
class Row:
    """One case in one round."""

    case: str
    round: int
    start: str
    tried: tuple[str, ...]  # the candidates, fastest predicted first
    predicted_speed: tuple[float, ...]  # each candidate's predicted step speed over the start's
    verdict: str
    kept: str
    trial_speed: float  # the kept plan's measured speed over the start's in the trial (1 where it went back)
    window: tuple[int, int]  # the steps compared with the twin: after the trial
    run_ms: float  # the run's median step in the window
    twin_ms: float
    noise: float  # the machine's: half the twins' gap, or a twin's median's relative half-interval where larger
    apart: dict[str, tuple[float, float, float]]  # the tried plans measured apart: median, low, high (s)
    moves: int
    move_s: float
    other_steps: int  # steps the run spent on plans it did not keep
    replan_s: float
    ok: bool
    why: str

    @property
    def ratio(self) -> float:
        return self.run_ms / self.twin_ms


def row(case: Case, k: int, run: dict[str, Any], twins: Sequence[dict[str, Any]], apart: dict[str, Any] | None) -> Row:
    """The round's row of ``case``: its run's and its twins' metrics, the plans it tried measured apart.

    The twins' step is the mean of their medians; the noise the larger of half their gap (relative to that mean)
    and each one's median's 95 % half-interval."""
    r = run["replan"]
    start = r["old"]["split"]
    last = r["trial"]["turns"][-1]["timed_steps"][-1] if r["trial"] else r["after_step"]
    window = (last + 2, len(run["step_times_s"]))
    steps = slice(window[0] - 1, window[1])
    run_ms = statistics.median(run["step_times_s"][steps]) * 1e3
    medians = [statistics.median(t["step_times_s"][steps]) * 1e3 for t in twins]
    twin_ms = noise = math.nan  # a close call runs no twin
    if medians:
        twin_ms = statistics.fmean(medians)
        gap = (max(medians) - min(medians)) / 2 / twin_ms
        noise = max(gap, *(relative_spread(t["step_times_s"][steps]) for t in twins))
    outcome = r["outcome"]
    kept = r["kept"]["split"]
    speed = (
        1.0
        if outcome is None or outcome["kept"] == 0
        else outcome["estimates_s"][0] / outcome["estimates_s"][outcome["kept"]]
    )
    intervals = {}
    if apart is not None:
        for layout, times in apart["times"].items():
            low, high, _ = median_interval(times)
            intervals[layout] = (statistics.median(times), low, high)
    ok, why = _check(case, start, kept, run_ms / twin_ms, noise, r, intervals)
    return Row(
        case.label,
        k,
        start,
        tuple(c["split"] for c in r["candidates"]),
        tuple(r["old"]["predicted_step_s"] / c["predicted_step_s"] for c in r["candidates"]),
        r["verdict"] if outcome is None else outcome["verdict"],
        kept,
        speed,
        window,
        run_ms,
        twin_ms,
        noise,
        intervals,
        r["cost"]["moves"],
        r["cost"]["move_seconds"],
        r["cost"]["steps_on_other_plans"],
        r["seconds"].get("profile", 0.0) + r["seconds"].get("plan", 0.0),
        ok,
        why,
    )


def _check(
    case: Case,
    start: str,
    kept: str,
    ratio: float,
    noise: float,
    r: dict[str, Any],
    apart: dict[str, tuple[float, float, float]],
) -> tuple[bool, str]:
    """Whether the case's check holds this round, and why not."""
    if case.check is Check.NO_SLOWER:
        return ratio <= 1 + noise, f"ended {ratio:.3f}x the twins' step, noise {noise:.1%}"
    if case.check is Check.MOVES_FASTER:
        return kept != start and ratio < 1, f"kept {kept}, {ratio:.3f}x the twin's step"
    if not r["candidates"]:
        return False, "no close call: no plan within the profile's error was tried"
    fastest = min(apart, key=lambda layout: apart[layout][0])
    inside = apart[kept][1] <= apart[fastest][2]  # the kept plan's interval reaches the fastest one's
    return kept == fastest or inside, f"kept {kept}; measured apart the fastest is {fastest}"


def print_round(rows: Sequence[Row]) -> None:
    """The round's table, then each close call's plans measured apart."""
    print(
        table(
            [
                "case",
                "start",
                "tried (predicted speed)",
                "verdict",
                "kept",
                "trial speed",
                "steps",
                "run ms",
                "twin ms",
                "run/twin",
                "noise",
                "moves",
                "move s",
                "other steps",
                "re-plan s",
                "check",
            ],
            [
                [
                    r.case,
                    r.start,
                    ", ".join(f"{t} ({s:.3f}x)" for t, s in zip(r.tried, r.predicted_speed)) or "-",
                    r.verdict,
                    r.kept,
                    f"{r.trial_speed:.3f}x",
                    f"{r.window[0]}-{r.window[1]}",
                    f"{r.run_ms:.0f}",
                    *(
                        ("-", "-", "-")
                        if math.isnan(r.twin_ms)
                        else (f"{r.twin_ms:.0f}", f"{r.ratio:.3f}", f"{r.noise:.1%}")
                    ),
                    str(r.moves),
                    f"{r.move_s:.1f}",
                    str(r.other_steps),
                    f"{r.replan_s:.1f}",
                    "holds" if r.ok else f"FAILS ({r.why})",
                ]
                for r in rows
            ],
        ),
        flush=True,
    )
    for r in rows:
        if r.apart:
            cells = [
                [layout, f"{m * 1e3:.0f}", f"[{lo * 1e3:.0f}, {hi * 1e3:.0f}]", "kept" if layout == r.kept else ""]
                for layout, (m, lo, hi) in sorted(r.apart.items(), key=lambda kv: kv[1][0])
            ]
            print(f"\n{r.case}: the plans it tried, measured apart in interleaved turns")
            print(table(["plan", "median ms", "95% interval", ""], cells), flush=True)
