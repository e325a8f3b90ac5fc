"""Simulated step time and bubble of every strategy's plan, under Nanotron's 1F1B schedule.

For each public model shape (``nanotron_ext/configs/*.yaml``) at PP 2/4/8, each strategy's plan is turned
into per-stage forward/backward times by the planner's own pricing with the FLOP-rate model (``nanotron_ext.simulate.
plan_stage_times``) and simulated with the config's micro-batch count. Printed per strategy: step time
÷ the fastest valid plan's, and the bubble (idle) fraction; beside them the equal-stage ideal
``(p−1)/(m+p−1)``. The machine is the analytic H100 model unless ``--machine``.

Also writes, for Llama-3.2-1B at PP 8, the timelines of Nanotron's rule and of ``constrained`` and their
per-stage loads into ``benchmarks/results/``.

Usage: ``python benchmarks/simulated_bubble.py [--machine FILE] [--tflops X] [--p2p-gbps Y]``
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from _common import (
    CONFIGS,
    PPS,
    RESULTS,
    SHAPES,
    STRATEGIES,
    add_machine_args,
    machine_overrides,
    print_command,
    progress,
)

from nanotron_ext.config import load_config
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.machine import machine_for
from nanotron_ext.plan import make_plan
from nanotron_ext.report import table
from nanotron_ext.simulate import ideal_bubble_fraction
from nanotron_ext.simulate.loads_chart import plot_stage_loads
from nanotron_ext.simulate.stage_times import simulate_plan, stage_labels
from nanotron_ext.simulate.timeline import plot_timeline

ENGINE = "1f1b"
PICTURE = ("Llama-3.2-1B", 8, ("nanotron", "constrained"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_machine_args(parser)
    args = parser.parse_args(argv)
    print_command()
    machine = machine_overrides(args)
    described = machine_for(load_config(CONFIGS / SHAPES[0][1]).with_overrides(**machine)).describe()
    print(
        f"{described}, {ENGINE.upper()}, the config's "
        f"micro-batches. Cells: step ÷ fastest valid plan · bubble; ✗ = plan cannot train.\n"
    )

    rows = []
    bubbles: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    speedups = []
    for (label, yaml_name), pp in progress([(s, pp) for s in SHAPES for pp in PPS], desc="shapes × pp"):
        cfg = load_config(CONFIGS / yaml_name, pp=pp).with_overrides(**machine)
        blocks = inventory_from_config(cfg)
        m = cfg.run.n_micro_batches
        results = {}
        for name in STRATEGIES:
            plan = make_plan(blocks, cfg, name)
            result = simulate_plan(plan, blocks, cfg, engine=ENGINE)
            results[name] = (plan, result)
            if (label, pp) == PICTURE[:2] and name in PICTURE[2]:
                stem = f"{yaml_name.removesuffix('.yaml')}_pp{pp}_{name}_timeline.png"
                plot_timeline(
                    result,
                    RESULTS / stem,
                    stage_labels=stage_labels(plan),
                    title=f"{label}: {name} split, {ENGINE.upper()}, pp={pp}, {m} micro-batches",
                )
        best = min(r.step_time for p, r in results.values() if p.ok)
        cells = []
        for name in STRATEGIES:
            plan, result = results[name]
            bubbles[name].append(result.bubble_fraction)
            cells.append(f"{result.step_time / best:.3f}x · {result.bubble_fraction:.1%}" + ("" if plan.ok else " ✗"))
        speedup = results["nanotron"][1].step_time / results["constrained"][1].step_time
        speedups.append(speedup)
        rows.append([label, pp, m, f"{ideal_bubble_fraction(pp, m):.1%}", *cells, f"{speedup:.3f}x"])
        if (label, pp) == PICTURE[:2]:
            loads = {n: [1e3 * (s.forward + s.backward) for s in results[n][1].stages] for n in PICTURE[2]}
            plot_stage_loads(
                [f"stage {k}" for k in range(pp)],
                loads,
                RESULTS / f"{yaml_name.removesuffix('.yaml')}_pp{pp}_stage_loads.png",
                title=f"{label}, pp={pp}: forward + backward per micro-batch ({machine_for(cfg).name})",
                ylabel="ms per micro-batch (F + B)",
            )
    rows.append(
        [
            "**mean bubble**",
            "",
            "",
            "",
            *(f"{sum(b) / len(b):.1%}" for b in bubbles.values()),
            f"{sum(speedups) / len(speedups):.3f}x",
        ]
    )
    print(
        table(
            ["model", "pp", "m", "ideal bubble", *STRATEGIES, "nanotron ÷ constrained step"],
            rows,
            markdown=True,
        )
    )
    print(f"\nPictures ({PICTURE[0]}, pp={PICTURE[1]}):")
    for path in sorted(RESULTS.glob("*.png")):
        print(f"- {path.relative_to(RESULTS.parents[1])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
