"""Simulated step time of the default (``constrained``, objective ``step_time``) against every peer split.

Part 1: the 21 public cases (7 shapes in ``nanotron_ext/configs`` × PP 2/4/8), at the configs' micro-batch
count and at m = 4·pp, under each config's engine (1F1B) on the analytic H100 machine model. Peers:
Nanotron's rule (where its plan can train), ``uniform``, ``flops``, DeepSpeed's ``partition_balanced`` and
torchgpipe's block partition on the same per-block training FLOPs (libraries when installed, else the
transcriptions in ``_common.py``). Every split is timed by the same simulator. A cell is peer step ÷ default
step (≥ 1: the default is at least as fast).

Part 2: random instances small enough to simulate every split; the default's search against brute force.

Exit 1 if the default is ever slower than a peer or than the brute-force best.

Usage: ``python benchmarks/step_time_quality.py [--instances 600]``
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time
from collections.abc import Sequence

from _common import CONFIGS, PPS, SHAPES, external_partitioners, print_command, progress

from nanotron_ext.config import load_config
from nanotron_ext.costs.analytic import training_flops
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.machine import machine_for
from nanotron_ext.partition import bounds_from_ranks
from nanotron_ext.partition.schedule_aware import ScheduleProblem, StepTimeEvaluator, step_time_partition
from nanotron_ext.plan import make_plan
from nanotron_ext.report import table
from nanotron_ext.schedule import min_micro_batches
from nanotron_ext.strategies.step_time import schedule_problem

TOL = 1e-9
PEERS = ("nanotron", "uniform", "flops", "deepspeed", "torchgpipe")


def _bounds(ranks: Sequence[int], pp: int) -> tuple[int, ...]:
    return tuple(bounds_from_ranks(ranks, pp))


def public_cases() -> tuple[list[list[str]], int, float]:
    external = {p.name: p for p in external_partitioners()}
    rows, violations, worst_gain = [], 0, 0.0
    cases = [(label, y, pp, mode) for mode in ("config m", "m = 4·pp") for label, y in SHAPES for pp in PPS]
    for label, yaml_name, pp, mode in progress(cases, desc="public cases"):
        cfg = load_config(CONFIGS / yaml_name, pp=pp)
        if mode != "config m":
            cfg = cfg.with_overrides(n_micro_batches=4 * pp)
        blocks = inventory_from_config(cfg)
        evaluate = StepTimeEvaluator(schedule_problem(blocks, cfg))
        t0 = time.perf_counter()
        default = make_plan(blocks, cfg, "constrained")
        plan_ms = 1e3 * (time.perf_counter() - t0)
        splits = {"default": _bounds(default.block_ranks, pp)}
        valid = {}
        for name in ("nanotron", "uniform", "flops"):
            plan = make_plan(blocks, cfg, name)
            splits[name], valid[name] = _bounds(plan.block_ranks, pp), plan.ok
        flops = training_flops(blocks)
        for name in ("deepspeed", "torchgpipe"):
            try:
                b = tuple(external[name].split(flops, pp))
            except Exception:  # torchgpipe can fail to answer: no split to compare with
                continue
            splits[name] = b
            valid[name] = len(b) == pp + 1 and all(e > s for s, e in zip(b[:-1], b[1:]))
        names = list(splits)
        times = dict(zip(names, evaluate([splits[n] for n in names])))
        step = times["default"]
        cells = []
        best_peer = min(times[n] for n in PEERS if n in times and valid.get(n))
        for name in PEERS:
            if name not in times:
                cells.append("no answer")
                continue
            ratio = times[name] / step
            cells.append(f"{ratio:.4f}x" + ("" if valid[name] else " ✗"))
            if valid[name] and times[name] < step * (1 - TOL):
                violations += 1
        gain = best_peer / step
        worst_gain = max(worst_gain, gain)
        cells.append(f"{gain:.4f}x")
        rows.append([label, str(pp), f"{cfg.run.n_micro_batches}", mode, *cells, f"{plan_ms:.0f}"])
    return rows, violations, worst_gain


def _random_problem(rng: random.Random) -> ScheduleProblem:
    n = rng.randint(3, 11)
    pp = rng.randint(2, min(n, 6))
    engine = rng.choice(["1f1b", "1f1b", "afab"])
    m = rng.randint(min_micro_batches(engine, pp), 3 * pp)
    family = rng.choice(["uniform", "lognormal", "llm", "spiky"])
    if family == "uniform":
        f = [rng.random() for _ in range(n)]
    elif family == "lognormal":
        f = [rng.lognormvariate(0, 1) for _ in range(n)]
    elif family == "llm":
        f = [0.05] + [1.0] * (n - 3) + [rng.uniform(0.2, 8), 0.1]
    else:
        f = [rng.random() for _ in range(n)]
        for i in rng.sample(range(n), min(2, n)):
            f[i] *= 20
    b = [x * rng.uniform(1.5, 2.5) for x in f]
    u = [0.3 * rng.random() if rng.random() < 0.3 else 0.0 for _ in range(n)]
    send = [0.05 * rng.random() if rng.random() < 0.5 else 0.0 for _ in range(n)]
    return ScheduleProblem(tuple(f), tuple(b), tuple(u), tuple(send), (False,) + (True,) * n, pp, m, engine)


def random_instances(count: int) -> tuple[str, int]:
    rng = random.Random(0)
    worse = exact = 0
    gaps, splits_total = [], 0
    for _ in progress(range(count), desc="random instances"):
        problem = _random_problem(rng)
        splits = [(0, *c, problem.n) for c in itertools.combinations(range(1, problem.n), problem.pp - 1)]
        splits_total += len(splits)
        brute = float(min(StepTimeEvaluator(problem)(splits)))
        found = step_time_partition(problem)
        worse += found.step_time > brute * (1 + TOL)
        exact += found.exact
        gaps.append(brute / found.lower_bound - 1)
        assert found.lower_bound <= brute * (1 + TOL), "lower bound above the brute-force optimum"
    line = (
        f"{count} instances (n 3–11, pp 2–6, 1F1B and AFAB, m from the minimum to 3·pp, updates and p2p "
        f"included; {splits_total} splits simulated by brute force): default worse than the brute-force best in "
        f"{worse}; search proved optimal (exact) in {exact}/{count}; lower bound ≤ optimum in all, mean "
        f"optimum ÷ bound − 1 = {sum(gaps) / len(gaps):.2%}, max {max(gaps):.2%}"
    )
    return line, worse


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--instances", type=int, default=600)
    args = parser.parse_args(argv)
    print_command()
    sources = ", ".join(f"{p.name}: {p.source}" for p in external_partitioners())
    machine = machine_for(load_config(CONFIGS / SHAPES[0][1])).describe()
    print(f"{machine}, the configs' engine (1F1B). External splits: {sources}.\n")
    rows, violations, _ = public_cases()
    print("## Peer step ÷ default step (≥ 1.0000x: the default is at least as fast; ✗: plan cannot train)\n")
    print(
        table(["model", "pp", "m", "case", *PEERS, "best valid peer ÷ default", "default plan ms"], rows, markdown=True)
    )
    print(f"\nDefault slower than a valid peer: {violations} of {len(rows)} cases × {len(PEERS)} peers")
    line, worse = random_instances(args.instances)
    print(f"\n## Random instances against brute force (seed 0)\n\n{line}")
    ok = violations == 0 and worse == 0
    print("\nPASS" if ok else "\nFAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
