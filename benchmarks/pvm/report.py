"""What ``predict_vs_measure.py`` prints for a scenario (its splits, the order checks, the chain and ``auto``'s pick,
item 3's parts, the eager send order) and the verdict over every scenario; each returns the figures the results
JSON keeps."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

import _repeatability as repeatability

from nanotron_ext.report import table
from nanotron_ext.stats import median_interval
from pvm.analysis import CONFIDENCE, RATIO_RANGE, OrderChecks, Row, measured_parts, run_of, step_times
from pvm.scenarios import Scenario

PIPELINE_HEAD = [
    "split",
    "stage",
    "step meas",
    "step pred",
    "compute meas",
    "compute pred",
    "blocks alone",
    "blocks, all ranks busy",
    "engine overhead meas",
    "engine overhead pred",
    "recv wait meas",
    "recv wait + transfer pred",
    "send wait meas",
]
AFTER_HEAD = [
    "split",
    "stage",
    "after-pipeline wait meas",
    "after-pipeline wait pred",
    "update meas",
    "update pred",
    "optimizer, all ranks busy",
    "closing wait meas",
    "CPU meas",
    "busy meas",
]


def print_splits(rows: Sequence[Row]) -> None:
    """Every split of a scenario: measured (with its interval), predicted, and their ratio."""
    head = [
        "split",
        "K",
        "stages",
        "valid",
        "steps",
        "measured ms",
        "95% interval ms",
        "predicted ms",
        "pred ÷ meas",
        "pred, planning profile ms",
        "pred, one p2p for every cut ÷ meas",
    ]
    cells = []
    for r in rows:
        interval = f"{r.low * 1e3:.1f}–{r.high * 1e3:.1f}" + (
            "" if r.coverage >= CONFIDENCE else f" ({r.coverage:.0%})"
        )
        cells.append(
            [
                r.name + (f" (= {r.same_as})" if r.same_as else ""),
                r.vocab_shards,
                " / ".join(r.stages),
                "yes" if r.ok else "NO (no gradient on a stage; its optimizer skipped)",
                len(r.steps),
                f"{r.median * 1e3:.1f}",
                interval,
                f"{r.predicted * 1e3:.1f}",
                f"{r.ratio:.3f}",
                f"{r.predicted_planning * 1e3:.1f}",
                f"{r.predicted_one_p2p / r.median:.3f}",
            ]
        )
    print(table(head, cells, markdown=True))


def print_order(label: str, checks: OrderChecks) -> None:
    """Kendall's τ, every significant misordered pair, and where the default lands among the valid splits."""
    print(
        f"\n{label}: Kendall τ (measured vs predicted order, {len(checks.distinct)} distinct splits) = {checks.tau:.2f}"
    )
    for a, b in checks.misordered:
        print(
            f"  MISORDERED: {a.name} measured faster ({a.median * 1e3:.1f} ms, interval up to {a.high * 1e3:.1f}) "
            f"than {b.name} ({b.median * 1e3:.1f} ms, from {b.low * 1e3:.1f}), predicted slower "
            f"({a.predicted * 1e3:.1f} vs {b.predicted * 1e3:.1f} ms)"
        )
    if not checks.misordered:
        print("  no pair with disjoint intervals is predicted in the opposite order")
    default, fastest = checks.default, checks.fastest
    if default is None:  # hand layouts only (issue 32's scenario)
        return
    interval = f"({fastest.name}, {fastest.median * 1e3:.1f} ms, {fastest.low * 1e3:.1f}–{fastest.high * 1e3:.1f})"
    where = (
        "the fastest"
        if default is fastest or default.same_as == fastest.name
        else (
            f"within the fastest one's interval {interval}"
            if checks.default_ok
            else f"NOT within the fastest one's interval {interval}"
        )
    )
    print(
        f"  default under the profile ({default.median * 1e3:.1f} ms) among the {len(checks.valid)} valid splits: "
        f"{where}"
    )


def print_chain(result: dict[str, Any], rows: Sequence[Row]) -> dict[str, Any]:
    """The measured gain of each chain over K=1 (the default), and what ``auto`` picks under the profile."""
    by_name = {r.name: r for r in rows}
    default = by_name["default"]
    for r in rows:
        if r.name.startswith("chain"):
            print(
                f"  {r.name}: measured {default.median / r.median:.3f}x as fast as K=1 (default), "
                f"predicted {default.predicted / r.predicted:.3f}x"
            )
    auto = result["auto"]
    if auto is None:
        return {}
    picked = by_name.get(auto["same_as"]) if auto["same_as"] else None
    times = ", ".join(f"K={k}: {t * 1e3:.1f} ms" for k, t in auto["step_times"].items())
    gain = default.median / picked.median if picked else math.nan
    what = f"= the '{picked.name}' split, measured gain vs K=1 {gain:.3f}x" if picked else "(a split not trained)"
    print(
        f"  vocab_shards: auto under the planning profile picks K={auto['shards']} {what}; its simulated steps: {times}"
    )
    later = result["auto_median"]
    print(
        f"  (under the median of the run's profiles auto would pick K={later['shards']}: "
        + ", ".join(f"K={k}: {t * 1e3:.1f} ms" for k, t in later["step_times"].items())
        + ")"
    )
    return {"auto_shards": auto["shards"], "auto_gain": gain, "auto_shards_median": later["shards"]}


def print_parts(result: dict[str, Any], sc: Scenario) -> dict[str, Any]:
    """Item 3: per stage, the measured step's parts next to the profile's prediction of each (ms)."""
    inside, after, out, notes = [], [], {}, []
    for name in sc.decompose:
        split = result["splits"][name]
        run = run_of(result, name)
        pred = split["parts"]
        out[name] = {"measured": [measured_parts(recs) for recs in run["records"]], "predicted": pred}
        for k, (meas, p) in enumerate(zip(out[name]["measured"], pred["stages"])):
            where = [name, f"PP{k}: {split['stages'][k]}"]
            inside.append(
                where
                + _ms(
                    meas["step"],
                    pred["step"],
                    meas["compute"],
                    p["profiled"] + p["overhead"],
                    p["profiled"],
                    p["profiled_busy"],
                    meas["compute"] - p["profiled"],
                    p["overhead"],
                    meas["recv"],
                    p["pipeline_wait"],
                    meas["send"],
                )
            )
            after.append(
                where
                + _ms(
                    meas["after_wait"],
                    p["after_wait"],
                    meas["update"],
                    p["update"],
                    p["update_busy"],
                    meas["end"],
                    meas["cpu"],
                    meas["step"] - meas["idle"],
                )
            )
        counts = "; ".join(f"PP{k} sends {sent} and receives {got}" for k, (sent, got) in enumerate(run["tensors"]))
        notes.append(
            f"{name}: tensors through P2P per step: {counts} (Nanotron sends each tensor of a cut "
            f"separately, one per communication call; the profile prices one transfer per micro-batch "
            f"and direction: {sc.n_micro_batches} each way per cut)"
        )
        if run["exchange"]:
            x = run["exchange"]
            notes.append(
                f"{name}: one micro-batch's exchange across the cut (activations one way, gradients the "
                f"other), timed between the ranks: {x['one per call'] * 1e3:.2f} ms one tensor per call "
                f"as Nanotron's pipeline state does it, {x['all sends first'] * 1e3:.2f} ms with every send "
                f"posted first; the profile prices two transfers, {2 * pred['p2p'][0] * 1e3:.2f} ms"
            )  # pp=2: one cut
        lost = pred["step"] - pred["eager_step"]
        notes.append(
            f"{name}: simulated step {pred['step'] * 1e3:.1f} ms with Nanotron's send order, "
            f"{pred['eager_step'] * 1e3:.1f} ms with every send posted as soon as its tensor exists "
            f"({lost * 1e3:.1f} ms, {lost / pred['step']:.1%} of the step, lost to deferred sends)"
        )
    if not inside:
        return out
    print(
        f"\nWhere the time goes (item 3), medians over timed steps, ms; m = {sc.n_micro_batches}. Inside the pipeline:"
    )
    print(table(PIPELINE_HEAD, inside, markdown=True))
    print("\nAfter the pipeline:")
    print(table(AFTER_HEAD, after, markdown=True))
    print("\n" + "\n".join(notes))
    print(
        "compute: busy inside the pipeline (until this rank's engine is done and its sends taken); blocks alone: "
        "m × the stage's blocks' profiled forward + backward (rank 0 timing them while the others wait), all "
        "ranks busy: the same timed on every rank at once; engine overhead: compute − blocks alone (pred: the "
        "profile's per-call overhead); recv wait + transfer pred: the simulated stage's idle time inside the "
        "pipeline; after-pipeline wait: in collectives after the pipeline (loss broadcast, tied all-reduce; pred: "
        "until the slowest stage's pipeline ends); update: busy after the pipeline (optimizer, gradient syncs); "
        "closing wait: the barrier that ends the timed step; CPU: the main thread's CPU time over the step."
    )
    return out


def print_send_order(result: dict[str, Any], rows: Sequence[Row]) -> dict[str, Any]:
    """Item 3's candidate engine fix: each split with every queued send posted at once (``sends="eager"``)
    against Nanotron's order (one tensor of a cut per communication call), same model, same rounds."""
    by_name, cells, out = {r.name: r for r in rows}, [], {}
    for run in result["runs"].values():
        if run["sends"] != "eager":
            continue
        base = by_name[run["of"]]
        steps = step_times(run)
        med, (low, high, _) = statistics.median(steps), median_interval(steps)
        out[run["of"]] = {"eager": med, "nanotron": base.median, "gain": base.median / med}
        cells.append(
            [
                run["of"],
                f"{base.median * 1e3:.1f}",
                f"{base.low * 1e3:.1f}–{base.high * 1e3:.1f}",
                f"{med * 1e3:.1f}",
                f"{low * 1e3:.1f}–{high * 1e3:.1f}",
                f"{base.median / med:.3f}",
                f"{base.low / high:.3f}–{base.high / low:.3f}",
                f"{base.predicted * 1e3:.1f}",
                f"{base.predicted / med:.3f}",
            ]
        )
    if cells:
        print(
            '\nEvery queued send posted at once (nanotron_ext.runtime.send_order, sends="eager") against '
            "Nanotron's order (one tensor of a cut per communication call, the rows above), same model, same "
            "rounds:"
        )
        print(
            table(
                [
                    "split",
                    "Nanotron's order ms",
                    "95% interval",
                    "eager ms",
                    "95% interval",
                    "gain of eager",
                    "gain, from the intervals",
                    "predicted ms",
                    "pred ÷ meas, eager",
                ],
                cells,
                markdown=True,
            )
        )
    return out


def _ms(*seconds: float) -> list[str]:
    return [f"{x * 1e3:.1f}" for x in seconds]


def print_verdict(records: dict[str, dict[str, Any]]) -> bool:
    """The checks over every scenario; True when all that count hold."""
    lo, hi = RATIO_RANGE
    ok = True
    print("\n" + "=" * 100)
    for label, rec in records.items():
        c = rec["checks"]
        bad = ", ".join(f"{n} {x:.3f}" for n, x in c["bad_ratio"])
        holds = (
            not c["bad_ratio"]
            and not c["misordered"]
            and c["default_ok"]
            and c.get("repeatability", {}).get("holds", True)
        )
        ok &= holds or not rec["checks_count"]
        note = "" if rec["checks_count"] else " (oversubscribed: not counted)"
        print(
            f"{'HOLDS' if holds else 'FAILS'}: {label}{note}: pred ÷ meas within [{lo}, {hi}]: "
            f"{'yes' if not bad else 'no — ' + bad}; significant misordered pairs: {len(c['misordered'])}; "
            f"default measured fastest or within the fastest's interval: {'yes' if c['default_ok'] else 'no'}; "
            f"Kendall τ {c['tau']:.2f}" + repeatability.verdict(c.get("repeatability"))
        )
    print(f"CHECKS: {'ALL HOLD' if ok else 'SOME FAIL'}")
    print("=" * 100)
    return ok
