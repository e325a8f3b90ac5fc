"""Partition quality: slowest stage ÷ the optimum, for every strategy and for other partitioners.

Part 1 — public model shapes (``nanotron_ext/configs/*.yaml``) at PP 2/4/8: every strategy's plan, plus
torchgpipe's block partition and DeepSpeed's ``partition_balanced`` run on the same per-block training
FLOPs. Yardstick: training FLOPs per micro-batch of the slowest stage ÷ the best contiguous split's
(``Plan.vs_optimum``); ``✗`` marks a plan that cannot train (a stage without parameters or trainable ones).

Part 2 — seeded random cost vectors in five families: our ``nanotron_ext.partition.partition`` against
Nanotron's greedy rule, torchgpipe and DeepSpeed on the same costs. Ratio = their slowest stage ÷ ours.
Ours is an exact minimiser, so every ratio must be ≥ 1; the script counts violations and exits 1 if any.

Usage: ``python benchmarks/partition_quality.py [--seed 0] [--per-pp 40] [--limit-s 1]``
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from _common import (
    CONFIGS,
    PPS,
    SHAPES,
    STRATEGIES,
    Partitioner,
    Timeout,
    external_partitioners,
    fmt_ratio,
    print_command,
    progress,
    stage_loads,
    time_limit,
    transcriptions,
)

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.config import PlannerConfig, load_config
from nanotron_ext.costs import training_flops
from nanotron_ext.errors import NanotronExtError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.partition import bounds_from_ranks, nanotron_greedy_ranks, partition, ranks_from_bounds
from nanotron_ext.plan import make_plan
from nanotron_ext.report import table
from nanotron_ext.strategies import Assignment, register_strategy

RTOL = 1e-9


# --- part 1: model shapes --------------------------------------------------------------------------


def register_external(partitioners: Sequence[Partitioner]) -> list[str]:
    """Make each external partitioner a strategy over training FLOPs, so ``make_plan`` validates it."""
    names = []
    for p in partitioners:

        class External:
            name = p.name
            _split = staticmethod(p.split)

            def assign(self, blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> Assignment:
                costs = training_flops(blocks)
                return Assignment(ranks_from_bounds(self._split(costs, cfg.run.pp)), costs, "FLOPs")

        register_strategy(p.name)(External)
        names.append(p.name)
    return names


def model_shapes(extra: Sequence[str]) -> str:
    columns = [*STRATEGIES, *extra]
    rows: list[list[object]] = []
    worst = {c: 1.0 for c in columns}
    invalid = {c: 0 for c in columns}
    for (label, yaml_name), pp in progress([(s, pp) for s in SHAPES for pp in PPS], desc="model shapes"):
        cfg = load_config(CONFIGS / yaml_name, pp=pp)
        blocks = inventory_from_config(cfg)
        cells: list[object] = [label, pp]
        for name in columns:
            try:
                plan = make_plan(blocks, cfg, name)
            except (NanotronExtError, Timeout) as exc:
                cells.append(f"no plan ({type(exc).__name__})")
                invalid[name] += 1
                continue
            cells.append(fmt_ratio(plan.vs_optimum) + ("" if plan.ok else " ✗"))
            if plan.ok:
                worst[name] = max(worst[name], plan.vs_optimum)
            else:
                invalid[name] += 1
        rows.append(cells)
    n = len(SHAPES) * len(PPS)
    rows.append(["**worst valid**", "", *(fmt_ratio(worst[c]) for c in columns)])
    rows.append(["**plans that cannot train**", "", *(f"{invalid[c]}/{n}" for c in columns)])
    return table(["model", "pp", *columns], rows, markdown=True)


# --- part 2: random instances ----------------------------------------------------------------------


def llm_like(rng: np.random.Generator, n: int) -> np.ndarray:
    """Embedding, ``n − 5`` near-equal decoder layers, norm, an lm_head of 0.2–8 layers, cast, loss."""
    layers = rng.normal(1.0, 0.05, n - 5).clip(0.5)
    head = rng.uniform(0.2, 8.0)
    return np.concatenate([[0.01], layers, [0.01, head, 0.05, 0.05]])


def spiky(rng: np.random.Generator, n: int) -> np.ndarray:
    """Unit costs with three blocks twenty times heavier."""
    c = np.ones(n)
    c[rng.choice(n, size=3, replace=False)] = 20.0
    return c


FAMILIES: dict[str, Callable[[np.random.Generator, int], np.ndarray]] = {
    "uniform U(0,1)": lambda rng, n: rng.random(n),
    "log-normal (σ=1)": lambda rng, n: rng.lognormal(0.0, 1.0, n),
    "small integers 1–5": lambda rng, n: rng.integers(1, 6, n).astype(float),
    "spiky (3 blocks ×20)": spiky,
    "LLM-like (head 0.2–8 layers)": llm_like,
}


@dataclass
class Tally:
    """Ratios of one algorithm over one family."""

    ratios: list[float] = field(default_factory=list)
    worse: int = 0  # instances where it is strictly slower than ours
    empty: int = 0  # instances where it leaves a stage empty
    no_answer: int = 0  # instances where it did not return in time
    violations: int = 0  # instances where it beats ours (must never happen)


def run_random(seed: int, per_pp: int, partitioners: Sequence[Partitioner]) -> tuple[str, int, int, str]:
    algos: dict[str, Callable[[Sequence[float], int], list[int]]] = {
        "nanotron greedy": lambda c, pp: bounds_from_ranks(nanotron_greedy_ranks(c, pp), pp),
        **{p.name: p.split for p in partitioners},
    }
    check = transcriptions()
    agree = {name: 0 for name in check}
    rng = np.random.default_rng(seed)
    tallies = {(fam, a): Tally() for fam in FAMILIES for a in algos}
    jobs = [(fam, pp) for fam in FAMILIES for pp in PPS for _ in range(per_pp)]
    for fam, pp in progress(jobs, desc="random instances"):
        n = int(rng.integers(max(2 * pp, 8), 97))
        costs = [float(x) for x in FAMILIES[fam](rng, n)]
        ours = partition(costs, pp).max_cost
        for name, split in algos.items():
            t = tallies[(fam, name)]
            try:
                bounds = split(costs, pp)
            except Timeout:
                t.no_answer += 1
                bounds = None
            if name in check:
                try:
                    with time_limit(1.0):
                        mine = check[name](costs, pp)
                except Timeout:
                    mine = None
                agree[name] += mine == bounds
            if bounds is None:
                continue
            loads = stage_loads(costs, bounds)
            theirs = max(loads)
            ratio = theirs / ours if ours else 1.0
            t.ratios.append(ratio)
            t.worse += ratio > 1 + RTOL
            t.empty += any(b == a for a, b in zip(bounds, bounds[1:]))
            t.violations += theirs < ours * (1 - RTOL)
    rows = []
    for fam in FAMILIES:
        cells: list[object] = [fam, per_pp * len(PPS)]
        for name in algos:
            t = tallies[(fam, name)]
            mean = math.fsum(t.ratios) / len(t.ratios) if t.ratios else float("nan")
            cell = f"{fmt_ratio(mean)} / {fmt_ratio(max(t.ratios, default=float('nan')))}"
            notes = [f"{t.worse} worse"]
            if t.empty:
                notes.append(f"{t.empty} empty")
            if t.no_answer:
                notes.append(f"{t.no_answer} no answer")
            cells.append(f"{cell} ({', '.join(notes)})")
        rows.append(cells)
    heads = ["family", "instances", *(f"{a}: mean / worst" for a in algos)]
    violations = sum(t.violations for t in tallies.values())
    total = len(jobs)
    agreement = ", ".join(f"{name} transcription = library on {agree[name]}/{total}" for name in check)
    return table(heads, rows, markdown=True), violations, total, agreement


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="seed of the random instances (default 0)")
    parser.add_argument("--per-pp", type=int, default=40, help="random instances per family and pp (default 40)")
    parser.add_argument(
        "--limit-s",
        type=float,
        default=1.0,
        help="seconds torchgpipe's solver gets per instance before it counts as no answer",
    )
    args = parser.parse_args(argv)
    print_command()
    partitioners = external_partitioners(args.limit_s)
    for p in partitioners:
        print(f"- {p.name}: {p.source}")
    print()

    extra = register_external(partitioners)
    print("## Public model shapes: slowest stage ÷ optimum (training FLOPs per micro-batch)\n")
    print(
        "✗ = the plan cannot train (a stage without parameters); torchgpipe and deepspeed split the same "
        "per-block training FLOPs as `flops`.\n"
    )
    print(model_shapes(extra))

    print(f"\n## Random instances (seed {args.seed}): their slowest stage ÷ ours\n")
    print(
        "n uniform in [max(2·pp, 8), 96], pp ∈ {2, 4, 8}; cells: mean / worst ratio (instances strictly "
        "worse than ours, with an empty stage, with no answer within the time limit).\n"
    )
    text, violations, total, agreement = run_random(args.seed, args.per_pp, partitioners)
    print(text)
    if all(p.source.split()[0] in ("torchgpipe", "deepspeed") for p in partitioners):
        print(f"\nCross-check: {agreement}.")
    print()
    if violations:
        print(f"FAIL: another algorithm beat ours on {violations} of {total} instances — a partitioner bug")
        return 1
    print(f"PASS: ours ≤ every other algorithm on all {total} instances (0 violations)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
