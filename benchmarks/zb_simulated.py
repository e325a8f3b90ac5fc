"""Zero-bubble ZB-H1 (``pp_engine: zb1p``) against 1F1B, simulated on the public model shapes.

For each public shape (``nanotron_ext/configs/*.yaml``) at PP 4 and 8, with the config's micro-batch count and
with ``m = 2·pp``: the default plan (the config's strategy, whose step-time objective plans for the engine it is
given) is made once under 1F1B and once under zb1p, each simulated under its own engine on the same machine (the
analytic H100 model unless ``--machine``). Printed: each engine's simulated step and bubble fraction, 1F1B's step
÷ zb1p's, whether the two engines' best splits differ, and the largest per-stage memory peak of each plan
(zb1p keeps deferred weight-gradient state on the later stages).

The B/W split of each block is the planner's: a measured ``backward_weight`` if the profile has one, else the
backward split by input-gradient : weight-gradient FLOPs (``nanotron_ext.machine.pricing.weight_part``).

Usage: ``python benchmarks/zb_simulated.py [--machine FILE] [--tflops X] [--p2p-gbps Y]``
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from _common import CONFIGS, SHAPES, add_machine_args, machine_overrides, print_command, progress

from nanotron_ext.config import PlannerConfig, load_config
from nanotron_ext.errors import NanotronExtError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.machine import machine_for
from nanotron_ext.plan import make_plan
from nanotron_ext.report import human_bytes, table
from nanotron_ext.simulate import simulate_plan

PPS = (4, 8)
ENGINES = ("1f1b", "zb1p")


@dataclass(frozen=True)
class Outcome:
    """One engine's default plan of one case, simulated under that engine (None: it cannot run)."""

    ranks: tuple[int, ...] | None
    step: float = 0.0
    bubble: float = 0.0
    peak: float = 0.0
    error: str = ""


def outcome(cfg: PlannerConfig, engine: str) -> Outcome:
    cfg = cfg.with_overrides(engine=engine)
    blocks = inventory_from_config(cfg)
    try:
        plan = make_plan(blocks, cfg)
        result = simulate_plan(plan, blocks, cfg)
    except NanotronExtError as exc:
        return Outcome(None, error=str(exc).split(":")[0])
    return Outcome(tuple(plan.block_ranks), result.step_time, result.bubble_fraction,
                   max(s.memory_bytes for s in plan.stages))


def row(label: str, pp: int, m: int, m_source: str, one: Outcome, zb: Outcome) -> list[str]:
    head = [label, str(pp), f"{m} ({m_source})"]
    if one.ranks is None or zb.ranks is None:
        return head + ["-"] * 7 + [f"cannot run: {one.error or zb.error}"]
    return head + [
        f"{one.step * 1e3:.1f}", f"{one.bubble:.1%}", f"{zb.step * 1e3:.1f}", f"{zb.bubble:.1%}",
        f"{one.step / zb.step:.3f}x", "yes" if one.ranks != zb.ranks else "no",
        f"{human_bytes(one.peak)} / {human_bytes(zb.peak)}", "",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_machine_args(parser)
    args = parser.parse_args(argv)
    print_command()
    machine = machine_overrides(args)
    first = load_config(CONFIGS / SHAPES[0][1]).with_overrides(**machine)
    print(f"{machine_for(first).describe()}; default strategy ({first.ext.cost_strategy}) planned under each engine. "
          "step in ms; speedup = 1F1B step ÷ zb1p step; split differs: the two engines' best splits; max peak: "
          "the largest per-stage memory estimate, 1F1B / zb1p.\n")
    rows, speedups = [], []
    cases = [(s, pp, which) for s in SHAPES for pp in PPS for which in ("config", "2·pp")]
    for (label, yaml_name), pp, which in progress(cases, desc="shape × pp × m"):
        cfg = load_config(CONFIGS / yaml_name, pp=pp).with_overrides(**machine)
        if which == "2·pp":
            cfg = cfg.with_overrides(n_micro_batches=2 * pp)
        one, zb = (outcome(cfg, e) for e in ENGINES)
        rows.append(row(label, pp, cfg.run.n_micro_batches, which, one, zb))
        if one.ranks is not None and zb.ranks is not None:
            speedups.append(one.step / zb.step)
    print(table(["model", "pp", "m", "1f1b step", "1f1b bubble", "zb1p step", "zb1p bubble", "speedup",
                 "split differs", "max peak 1f1b / zb1p", "note"], rows))
    if speedups:
        print(f"\nzb1p speedup over 1F1B: min {min(speedups):.3f}x, max {max(speedups):.3f}x over {len(speedups)} "
              f"cases")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
