"""Judging and printing one scenario of ``in_run_accuracy.py``: every run measured (the slowest rank's step, its
median over the timed steps with a distribution-free 95 % interval) against ``simulate_plan`` under the in-run
profile and, beside it, under the standalone one.

Checks (issue 41), each printed with its verdict:

* every held-out row (a split, engine or micro-batch count the profile's run did not train) within the scenario's
  tolerance of measured under the in-run profile;
* Kendall's τ = 1 over the runs whose intervals separate (of one engine and micro-batch count);
* the planner's pick (``constrained`` under the in-run profile) measured fastest, or inside the fastest one's interval;
* where engines are compared, ``auto``'s pick under the in-run profile measured fastest at each micro-batch count, or
  inside the fastest one's interval;
* the in-run clock's cost (at most 2 %): its own time in its hooks, self-timed, ÷ the step; and the config's split with
  the clock installed ÷ without it, in the same rounds, not significantly above (its interval starts at or below).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nanotron_ext.config import load_config
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.machine import load_machine
from nanotron_ext.partition.layout_string import layout_string
from nanotron_ext.plan import make_plan, plan_with_ranks
from nanotron_ext.report import table
from nanotron_ext.simulate import simulate_plan
from nanotron_ext.stats import kendall_tau, median_interval

#: The in-run clock may cost at most this share of a step (issue 41).
CLOCK_BUDGET = 0.02


@dataclass(frozen=True)
class Row:
    """One run: measured and predicted seconds per step."""

    name: str
    layout: str
    engine: str
    m: int
    held_out: bool
    median: float
    low: float
    high: float
    in_run: float
    standalone: float
    before: float

    @property
    def ratio(self) -> float:
        return self.in_run / self.median

    @property
    def standalone_ratio(self) -> float:
        return self.standalone / self.median

    @property
    def before_ratio(self) -> float:
        return self.before / self.median


def step_times(records: Sequence[Sequence[dict[str, float]]]) -> list[float]:
    """Each timed step's time: its slowest rank's."""
    return [max(r["step"] for r in step) for step in records]


def rows(result: dict[str, Any]) -> tuple[list[Row], dict[str, float]]:
    """Every unclocked run as a :class:`Row`, and the clock's cost (``clocked ÷ plain`` median and interval)."""
    spec = result["spec"]
    cfg = load_config(spec["config"])
    blocks = inventory_from_config(cfg)
    profiles = {name: load_machine(path) for name, path in result["profiles"].items()}
    own = (tuple(make_plan(blocks, cfg).block_ranks), cfg.run.engine, cfg.run.n_micro_batches)
    out, clock = [], {}
    plain_of_own: list[float] = []
    for run in result["runs"].values():
        times = step_times(run["records"])
        ranks = tuple(run["block_ranks"])
        if run["clocked"]:
            clock["clocked"] = times
            continue
        c = cfg.with_overrides(engine=run["engine"], n_micro_batches=run["m"])
        plan = plan_with_ranks(blocks, c, ranks, "measured", suggest_fixes=False)
        predicted = {
            name: simulate_plan(plan, blocks, c, machine=p, device=spec["device"], backend="gloo").step_time
            for name, p in profiles.items()
        }
        low, high, _ = median_interval(times)
        key = (ranks, run["engine"], run["m"])
        if key == own:
            plain_of_own = times
        out.append(
            Row(
                ", ".join(run["names"]),
                layout_string([b.role for b in blocks], ranks) or "?",
                run["engine"],
                run["m"],
                key != own,
                statistics.median(times),
                low,
                high,
                predicted["in-run"],
                predicted["standalone"],
                predicted["in-run before"],
            )
        )
    if clock.get("clocked") and plain_of_own:
        pairs = [a / b for a, b in zip(clock["clocked"], plain_of_own)]
        low, high, _ = median_interval(pairs)
        clocked = next(run for run in result["runs"].values() if run["clocked"])
        # the clock's own seconds in its hooks, on the rank that spent most, ÷ the step (self-timed)
        own = [max(r["clock"] for r in ranks) / t for ranks, t in zip(clocked.get("steps", []), clock["clocked"])]
        clock = {
            "ratio": statistics.median(pairs),
            "low": low,
            "high": high,
            "own": statistics.median(own) if own else None,
        }
    return out, clock


def checks(result: dict[str, Any], found: list[Row], clock: dict[str, float]) -> dict[str, bool]:
    """Each of the module docstring's checks, by name: passed or not."""
    spec = result["spec"]
    tolerance = spec["tolerance"]
    out = {f"held-out rows within ±{tolerance:.0%}": all(abs(r.ratio - 1) <= tolerance for r in found if r.held_out)}
    for (engine, m), group in _groups(found).items():
        out[f"τ = 1 over separated intervals ({engine}, m={m})"] = separated_tau(group) in (1.0, None)
    for (engine, m), group in _groups(found).items():
        pick = [r for r in group if "pick" in r.name.split(", ")]
        if pick:
            out[f"the pick measured fastest or within its interval ({engine}, m={m})"] = within_fastest(pick[0], group)
    if len(spec["engines"]) > 1:
        for m, choice in auto_picks(result).items():
            group = [r for r in found if r.m == m]
            chosen = [r for r in group if r.engine == choice]
            out[f"auto's pick ({choice}) measured fastest or within its interval (m={m})"] = bool(
                chosen
            ) and within_fastest(chosen[0], group)
    if clock:
        # Its own work, self-timed, and the side-by-side steps: not significantly above the budget (the interval of
        # clocked ÷ plain starts at or below it; the machine's noise between two turns is several percent).
        out[f"the in-run clock costs at most {CLOCK_BUDGET:.0%} of a step"] = (
            clock.get("own") is not None and clock["own"] <= CLOCK_BUDGET and clock["low"] <= 1 + CLOCK_BUDGET
        )
    return out


def auto_picks(result: dict[str, Any]) -> dict[int, str]:
    """Per micro-batch count of the scenario, the engine ``pp_engine: auto`` takes under the in-run profile."""
    from nanotron_ext.plan import resolve_engine

    cfg = load_config(result["spec"]["config"]).with_overrides(machine=result["profiles"]["in-run"])
    return {
        m: resolve_engine(cfg.with_overrides(engine="auto", n_micro_batches=m))[0].run.engine
        for m in result["spec"]["micro_batches"]
    }


def _groups(found: list[Row]) -> dict[tuple[str, int], list[Row]]:
    groups: dict[tuple[str, int], list[Row]] = {}
    for r in found:
        groups.setdefault((r.engine, r.m), []).append(r)
    return groups


def separated_tau(group: Sequence[Row]) -> float | None:
    """Kendall's τ of measured against predicted over the pairs whose measured intervals do not overlap (None: no
    such pair)."""
    pairs = [(a, b) for i, a in enumerate(group) for b in group[i + 1 :] if a.high < b.low or b.high < a.low]
    if not pairs:
        return None
    agree = sum((a.median < b.median) == (a.in_run < b.in_run) for a, b in pairs)
    return (2 * agree - len(pairs)) / len(pairs)


def within_fastest(row: Row, group: Sequence[Row]) -> bool:
    """``row`` is measured fastest of ``group``, or its median lies inside the fastest one's interval."""
    fastest = min(group, key=lambda r: r.median)
    return row is fastest or fastest.low <= row.median <= fastest.high


def print_scenario(result: dict[str, Any], found: list[Row], clock: dict[str, float]) -> None:
    """The scenario's table and its checks."""
    spec = result["spec"]
    print(f"\n## {spec['label']}: {spec['notes']}\n")
    print(
        table(
            [
                "run",
                "layout",
                "engine",
                "m",
                "held out",
                "measured ms [95 % interval]",
                "in-run ms",
                "in-run ÷ meas",
                "in-run before ÷ meas",
                "standalone ms",
                "standalone ÷ meas",
            ],
            [
                [
                    r.name,
                    r.layout,
                    r.engine,
                    r.m,
                    "yes" if r.held_out else "profile's run",
                    f"{r.median * 1e3:.1f} [{r.low * 1e3:.1f}, {r.high * 1e3:.1f}]",
                    f"{r.in_run * 1e3:.1f}",
                    f"{r.ratio:.3f}",
                    f"{r.before_ratio:.3f}",
                    f"{r.standalone * 1e3:.1f}",
                    f"{r.standalone_ratio:.3f}",
                ]
                for r in found
            ],
        )
    )
    print(
        "in-run: the clocked turns of the profile's split, in the same rounds; in-run before: calibrate --in-run's "
        "steps before the rounds (the same split); standalone: calibrate, blocks alone"
    )
    positions = result.get("positions", {})
    if any(len(by) > 1 for by in positions.values()):
        print("\nthe profile's split, clocked: each block's forward + backward per micro-batch (ms) by stage position")
        order = ("first", "middle", "last")
        print(
            table(
                ["block signature", *order],
                [
                    [sig, *(f"{by[p] * 1e3:.2f}" if p in by else "-" for p in order)]
                    for sig, by in positions.items()
                    if len(by) > 1
                ],
            )
        )
    tau = kendall_tau([r.median for r in found], [r.in_run for r in found])
    print(
        f"\nKendall τ (every row, in-run) {tau:.2f}; standalone "
        f"{kendall_tau([r.median for r in found], [r.standalone for r in found]):.2f}"
    )
    if clock:
        own = "" if clock.get("own") is None else f"; its own time in its hooks ÷ the step: {clock['own']:.2%}"
        print(
            f"in-run clock: the config's split with it ÷ without it, per round: {clock['ratio']:.3f} "
            f"[{clock['low']:.3f}, {clock['high']:.3f}]{own}"
        )
    for name, ok in checks(result, found, clock).items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
