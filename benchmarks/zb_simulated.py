"""Zero-bubble ZB-H1 and ZB-H2 (``pp_engine: zb1p``, ``zb2p``) against 1F1B, and what ``auto`` picks, simulated
on the public model shapes.

For each public shape (``nanotron_ext/configs/*.yaml``) at PP 4 and 8, with the config's micro-batch count and
with ``m = 2·pp``: the default plan (the config's strategy, whose step-time objective plans for the engine it is
given) is made under each engine and simulated under it, on the same machine (the analytic H100 model unless
``--machine``). Printed per engine: the simulated step, the bubble fraction and the largest per-stage memory
peak; for zb2p also the *floor* of its split: the bubble of a synchronised step that lasts as long as the slowest
"first activation in, then all of the stage's work" path (every stage starts at t = 0 and the step ends with a
collective, so stage ``s`` cannot finish before micro-batch 0's forwards below it plus its own ``m`` forwards,
backwards and weight passes and its update; ``nanotron_ext.partition.step_time_bound``'s zb2p term). Then the
engine ``pp_engine: auto`` takes under the memory limit (the analytic H100's 79.18 GiB unless ``--machine``):
the fastest whose every stage fits (``nanotron_ext.plan.engine_choice``).

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
from nanotron_ext.partition import bounds_from_ranks
from nanotron_ext.partition.step_time_bound import lower_bound
from nanotron_ext.plan import AUTO_ENGINES, choose_engine, make_plan
from nanotron_ext.report import human_bytes, table
from nanotron_ext.simulate import simulate_plan
from nanotron_ext.strategies.step_time import schedule_problem

PPS = (4, 8)
ENGINES = AUTO_ENGINES  # 1f1b, zb1p, zb2p


@dataclass(frozen=True)
class Outcome:
    """One engine's default plan of one case, simulated under that engine (None: it cannot run)."""

    ranks: tuple[int, ...] | None
    step: float = 0.0
    bubble: float = 0.0
    peak: float = 0.0
    floor: float = 0.0  # the bubble of a step as long as the split's path lower bound (zb2p's rows)
    error: str = ""


def outcome(cfg: PlannerConfig, engine: str) -> Outcome:
    cfg = cfg.with_overrides(engine=engine)
    blocks = inventory_from_config(cfg)
    try:
        plan = make_plan(blocks, cfg)
        result = simulate_plan(plan, blocks, cfg)
    except NanotronExtError as exc:
        return Outcome(None, error=str(exc).split(":")[0])
    bound = lower_bound(schedule_problem(blocks, cfg), bounds_from_ranks(plan.block_ranks, plan.pp))
    floor = 1.0 - sum(result.busy) / (plan.pp * bound)
    return Outcome(
        tuple(plan.block_ranks),
        result.step_time,
        result.bubble_fraction,
        max(s.memory_bytes for s in plan.stages),
        floor,
    )


def auto_pick(cfg: PlannerConfig) -> str:
    try:
        choice = choose_engine(cfg)
    except NanotronExtError:
        return "none fits"
    over = [o.engine for o in choice.faster_not_taken]
    return choice.engine + (f" ({', '.join(over)}: faster, does not fit)" if over else "")


def row(label: str, pp: int, m: int, m_source: str, out: dict[str, Outcome], pick: str) -> list[str]:
    head = [label, str(pp), f"{m} ({m_source})"]
    if any(o.ranks is None for o in out.values()):
        return head + ["-"] * 9 + [f"cannot run: {next(o.error for o in out.values() if o.error)}"]
    one, zb1, zb2 = (out[e] for e in ENGINES)
    return head + [
        f"{one.step * 1e3:.1f}",
        f"{one.bubble:.1%}",
        f"{zb1.bubble:.1%}",
        f"{zb2.bubble:.1%}",
        f"{zb2.floor:.1%}",
        f"{one.step / zb1.step:.3f}x",
        f"{one.step / zb2.step:.3f}x",
        " / ".join(human_bytes(out[e].peak) for e in ENGINES),
        pick,
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_machine_args(parser)
    args = parser.parse_args(argv)
    print_command()
    machine = machine_overrides(args)
    first = load_config(CONFIGS / SHAPES[0][1]).with_overrides(**machine)
    print(
        f"{machine_for(first).describe()}; default strategy ({first.ext.cost_strategy}) planned under each engine. "
        "1f1b step in ms; bubble: simulated idle share of the step; zb2p floor: the bubble of a step as long as "
        "its split's slowest 'first activation in, then all of the stage's work' path; speedup: 1F1B step ÷ "
        "the engine's; max peak: the largest per-stage memory estimate of each engine's plan; auto: what "
        "pp_engine: auto takes under the memory limit.\n"
    )
    rows: list[list[str]] = []
    gains: dict[str, list[float]] = {"zb1p": [], "zb2p": []}
    gaps: list[float] = []
    cases = [(s, pp, which) for s in SHAPES for pp in PPS for which in ("config", "2·pp")]
    for (label, yaml_name), pp, which in progress(cases, desc="shape × pp × m"):
        cfg = load_config(CONFIGS / yaml_name, pp=pp).with_overrides(**machine)
        if which == "2·pp":
            cfg = cfg.with_overrides(n_micro_batches=2 * pp)
        out = {e: outcome(cfg, e) for e in ENGINES}
        rows.append(row(label, pp, cfg.run.n_micro_batches, which, out, auto_pick(cfg.with_overrides(engine="auto"))))
        if all(o.ranks is not None for o in out.values()):
            for e in gains:
                gains[e].append(out["1f1b"].step / out[e].step)
            gaps.append(out["zb2p"].bubble - out["zb2p"].floor)
    print(
        table(
            [
                "model",
                "pp",
                "m",
                "1f1b step",
                "1f1b bubble",
                "zb1p bubble",
                "zb2p bubble",
                "zb2p floor",
                "zb1p speedup",
                "zb2p speedup",
                "max peak 1f1b / zb1p / zb2p",
                "auto",
            ],
            rows,
        )
    )
    for engine, values in gains.items():
        if values:
            print(
                f"\n{engine} speedup over 1F1B: min {min(values):.3f}x, max {max(values):.3f}x over {len(values)} "
                f"cases",
                end="",
            )
    if gaps:
        within = sum(g <= 0.01 for g in gaps)
        print(
            f"\nzb2p bubble above its split's floor: {within} of {len(gaps)} cases within one point "
            f"(largest {max(gaps):.1%})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
