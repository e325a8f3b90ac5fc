"""What ``measured_cpu.py`` prints after the runs: the table of every scenario's plans, the checks, the default's
split against the FLOP-optimal one, and each scenario's simulated timeline as a picture."""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from mcpu.analysis import Row
from mcpu.scenarios import NOISE, OBJECTIVE_PAIR, OURS, PP, RESULTS, ROOT, SIM_RANGE, Scenario
from mcpu.splits import split_label


def _valid_label(row: Row, trainable: list[int]) -> str:
    if row.ok:
        return "yes"
    empty = [k for k, t in enumerate(trainable) if t == 0]
    where = ", ".join(f"PP{k}" for k in empty) or "a stage"
    return f"NO: crashes (no gradient on {where}); run with {where}'s optimizer skipped"


def timeline(sc: Scenario, sims: dict[str, Any], rows: list[Row], blocks: Sequence[dict]) -> None:
    """The simulated schedule of the profiled plan (else the default's) measured run, as a PNG in
    ``benchmarks/results``."""
    from nanotron_ext.simulate.timeline import plot_timeline

    shown = "profiled" if "profiled" in sims else "constrained"
    sim, plan = sims[shown]
    row = next(r for r in rows if r.strategy == shown)
    labels = []
    for k, part in enumerate(split_label(plan["ranks"], blocks).split(" / ")):
        text = f"PP{k}: {part}"
        labels.append(text if len(text) <= 34 else text[:33] + "…")
    stem = sc.label.lower().replace("-", "_").replace(" ", "_")
    path = RESULTS / f"measured_cpu_{stem}_{shown}_timeline.png"
    plot_timeline(
        sim,
        path,
        stage_labels=labels,
        title=f"{sc.label}: {shown} split, 1F1B, pp={PP}, simulated from CPU block timings\n"
        f"measured step {row.step * 1e3:.0f} ms",
    )
    print(f"  timeline: {path.relative_to(ROOT)}")


def print_table(all_rows: dict[str, list[Row]], results: dict[str, dict[str, Any]]) -> None:
    from nanotron_ext.report import table

    head = [
        "scenario",
        "strategy",
        "split (PP0 / PP1)",
        "plan valid?",
        "step ms",
        "sim step ms",
        "sim ÷ step",
        "pipeline ms",
        "sim pipeline ms",
        "sim ÷ pipeline",
        "bubble",
        "sim bubble",
        "sim p2p ms",
        "sim update ms (PP0, PP1)",
        "in-pipeline busy ÷ profiled (PP0, PP1)",
        "sim from in-pipeline stage times ÷ pipeline",
        "speed vs Nanotron",
    ]
    cells = []
    for label, rows in all_rows.items():
        nanotron = next(r for r in rows if r.strategy == "nanotron")
        for r in rows:
            trainable = results[label]["plans"][r.strategy]["trainable"]
            name = r.strategy + (f" (= {r.same_as})" if r.same_as else "")
            cells.append(
                [
                    label,
                    name,
                    r.split,
                    _valid_label(r, trainable),
                    f"{r.step * 1e3:.1f}",
                    f"{r.sim_step * 1e3:.1f}",
                    f"{r.sim_step / r.step:.2f}",
                    f"{r.pipeline * 1e3:.1f}",
                    f"{r.sim_pipeline * 1e3:.1f}",
                    f"{r.sim_pipeline / r.pipeline:.2f}",
                    f"{r.bubble:.1%}",
                    f"{r.sim_bubble:.1%}",
                    f"{r.p2p * 1e3:.2f}",
                    ", ".join(f"{x * 1e3:.1f}" for x in r.update),
                    ", ".join(f"{x:.2f}" for x in r.busy_ratio),
                    f"{r.sim_in_situ / r.pipeline:.2f}",
                    f"{nanotron.step / r.step:.2f}x",
                ]
            )
    print(table(head, cells, markdown=True))
    print(
        "\n(= X): same split as X, trained once. step: the full train_step (engine, tied-gradient sync, optimizer;"
        " no clipping); sim step: the simulated pipeline plus each stage's update (its blocks' profiled optimizer"
        " steps, plus the measured tied-gradient all-reduce where embedding and lm_head sit on different ranks)."
        " pipeline: the engine's part alone. bubble: Σ idle ÷ (pp × step).\nin-pipeline busy ÷ profiled: each"
        " stage's compute inside the pipeline ÷ m × its blocks' profiled forward + backward (1.00: the blocks timed"
        " alone predict the stage). sim from in-pipeline stage times: the simulator fed with those measured stage"
        " times instead (tests the schedule model alone)."
    )


def _out_of_range(all_rows: dict[str, list[Row]], ratio: Callable[[Row], float]) -> list[str]:
    lo, hi = SIM_RANGE
    return [
        f"{label}/{r.strategy} {ratio(r):.2f}"
        for label, rows in all_rows.items()
        for r in rows
        if not lo <= ratio(r) <= hi
    ]


def print_checks(all_rows: dict[str, list[Row]]) -> bool:
    print()
    fast_ok = True
    for label, rows in all_rows.items():
        nanotron = next(r for r in rows if r.strategy == "nanotron")
        best = min((r for r in rows if r.strategy.split("@")[0] in OURS and r.ok), key=lambda r: r.step)
        holds = best.step <= nanotron.step * (1 + NOISE)
        fast_ok &= holds
        print(
            f"{'HOLDS' if holds else 'FAILS'}: {label}: best of ours ({best.strategy}, {best.step * 1e3:.1f} ms) vs "
            f"Nanotron's rule ({nanotron.step * 1e3:.1f} ms{'' if nanotron.ok else ', a plan Nanotron cannot train'}"
            f"): {nanotron.step / best.step:.3f}x"
        )
    lo, hi = SIM_RANGE
    step_ratios = [r.sim_step / r.step for rows in all_rows.values() for r in rows]
    bad_step = _out_of_range(all_rows, lambda r: r.sim_step / r.step)
    bad_pipe = _out_of_range(all_rows, lambda r: r.sim_pipeline / r.pipeline)
    bad_situ = _out_of_range(all_rows, lambda r: r.sim_in_situ / r.pipeline)
    banner = "=" * 100
    print(banner)
    print(
        f"CHECK 'best of ours is at least as fast as Nanotron's rule' (within {NOISE:.0%} noise) on every scenario: "
        f"{'YES' if fast_ok else 'NO'}"
    )
    print(
        f"CHECK 'simulated ÷ measured step time within {lo}–{hi}' on every row: {'YES' if not bad_step else 'NO'}"
        f" (range {min(step_ratios):.2f}–{max(step_ratios):.2f})"
        + ("" if not bad_step else " — out of range: " + ", ".join(bad_step))
    )
    print(
        f"      the engine's part alone, 'simulated ÷ measured pipeline within {lo}–{hi}': "
        f"{'YES' if not bad_pipe else 'NO'}" + ("" if not bad_pipe else " — out of range: " + ", ".join(bad_pipe))
    )
    print(
        f"      the schedule model alone, 'simulated from in-pipeline stage times ÷ measured pipeline within "
        f"{lo}–{hi}': {'YES' if not bad_situ else 'NO'}"
        + ("" if not bad_situ else " — out of range: " + ", ".join(bad_situ))
    )
    print(banner)
    return fast_ok and not bad_step


def print_objectives(label: str, result: dict[str, Any], rows: list[Row]) -> None:
    """The default's split against the FLOP-optimal one: predicted and measured step times, round by round."""
    default, flop = OBJECTIVE_PAIR
    by_name = {r.strategy: r for r in rows}
    a, b = by_name[default], by_name[flop]
    print(f"\nObjectives on {label}: {default} (objective step_time, the default) vs {flop} (FLOP-optimal)")
    if a.same_as == flop or b.same_as == default:
        print("  same split: nothing to compare")
        return
    runs = {name: result["runs"][",".join(map(str, result["plans"][name]["ranks"]))] for name in OBJECTIVE_PAIR}
    per = result["steps_per_turn"]
    rounds = [
        [statistics.median(runs[name]["steps"][i : i + per]) for i in range(0, len(runs[name]["steps"]), per)]
        for name in OBJECTIVE_PAIR
    ]
    paired = [f / d for d, f in zip(*rounds)]  # FLOP split's step ÷ the default's, per round
    faster = sum(x > 1 for x in paired)
    flop_rate = result["flop_rate_sim"]
    print(f"  splits: {default}: {a.split}; {flop}: {b.split}")
    print(
        f"  predicted, FLOP-rate model (what the planner optimises): {flop} ÷ {default} = "
        f"{flop_rate[flop] / flop_rate[default]:.4f}"
    )
    print(
        f"  predicted, simulator fed with this run's measured block and link times: {b.sim_step * 1e3:.1f} ÷ "
        f"{a.sim_step * 1e3:.1f} ms = {b.sim_step / a.sim_step:.4f}"
    )
    print(
        f"  measured step (median of {len(runs[default]['steps'])} timed steps each): {b.step * 1e3:.1f} ÷ "
        f"{a.step * 1e3:.1f} ms = {b.step / a.step:.4f} ({(b.step - a.step) * 1e3:+.1f} ms for the FLOP split)"
    )
    print(
        f"  per round (median of the round's steps), {flop} ÷ {default}: "
        + ", ".join(f"{x:.3f}" for x in paired)
        + f"; median {statistics.median(paired):.4f}, range {min(paired):.3f}–{max(paired):.3f}; "
        f"the default faster in {faster} of {len(paired)} rounds (two-sided sign test p = "
        f"{_sign_test(faster, len(paired)):.3f})"
    )
    loads = result["load_average"]
    print(f"  1-minute load average inside the run: {min(loads):.2f}–{max(loads):.2f} on {os.cpu_count()} CPUs")


def _sign_test(k: int, n: int) -> float:
    """Two-sided p-value of ``k`` successes in ``n`` fair coin flips."""
    from math import comb

    tail = sum(comb(n, i) for i in range(min(k, n - k) + 1)) / 2**n
    return min(1.0, 2 * tail)
