"""Planning speed: ``make_plan`` on 160 blocks at PP 64, for every optimal strategy. Goal: under 1 s; then the
default on 1000 blocks at PP 128 (goal 2 s) and 2000 blocks at PP 512 (goal 10 s). Exit 1 on a missed goal.

The model is Llama-3-8B's shape with 155 decoder layers (embedding + 155 layers + final norm + lm_head +
cast + loss = 160 PipelineBlocks), built with ``config_from_dict``. Each strategy is timed end to end
(pricing, the partitioner or the step-time search, validation), median of ``--repeat`` runs after one
warm-up.

Usage: ``python benchmarks/plan_speed.py [--layers 155] [--pp 64] [--repeat 7] [--scaling-repeat 3]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import yaml
from _common import CONFIGS, print_command, progress

from nanotron_ext.config import config_from_dict
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.plan import make_plan
from nanotron_ext.report import table

GOAL_S = 1.0
OPTIMAL = ("flops", "memory", "constrained", "uniform")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=155, help="decoder layers (blocks = layers + 5)")
    parser.add_argument("--pp", type=int, default=64, help="pipeline stages (default 64)")
    parser.add_argument("--repeat", type=int, default=7, help="timed runs per strategy (default 7)")
    parser.add_argument("--no-scaling", dest="scaling", action="store_false",
                        help="skip the 1000- and 2000-block cases")
    parser.add_argument("--scaling-repeat", type=int, default=3,
                        help="cold runs of each larger case (default 3; the median is compared with the goal)")
    args = parser.parse_args(argv)
    print_command()

    raw = yaml.safe_load((CONFIGS / "llama_3_8b.yaml").read_text())
    raw["model"]["model_config"]["num_hidden_layers"] = args.layers
    raw["parallelism"]["pp"] = args.pp
    raw["tokens"]["batch_accumulation_per_replica"] = 2 * args.pp  # 1F1B needs at least pp - 1 micro-batches
    cfg = config_from_dict(raw, source=f"Llama-3-8B shape, {args.layers} layers")
    start = time.perf_counter()
    blocks = inventory_from_config(cfg)
    inventory_s = time.perf_counter() - start
    print(
        f"{cfg.source}: {len(blocks)} blocks, pp={args.pp}, {cfg.run.engine}, "
        f"{cfg.run.n_micro_batches} micro-batches; median of {args.repeat} runs "
        f"after one warm-up (inventory_from_config: {inventory_s * 1e3:.1f} ms)\n"
    )

    rows = []
    worst = 0.0
    for name in progress(OPTIMAL, desc="strategies"):
        plan = make_plan(blocks, cfg, name)  # warm-up (imports, numpy caches)
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            plan = make_plan(blocks, cfg, name)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        worst = max(worst, med)
        rows.append(
            [
                name,
                f"{med * 1e3:.1f}",
                f"{min(times) * 1e3:.1f}",
                f"{max(times) * 1e3:.1f}",
                f"{med / GOAL_S:.3f}",
                "OK" if plan.ok else "INVALID",
            ]
        )
    print(
        table(["strategy", "median ms", "min ms", "max ms", "median ÷ 1 s goal", "plan"], rows, markdown=True)
    )
    verdict = "meets" if worst < GOAL_S else "MISSES"
    print(
        f"\nSlowest strategy: {worst * 1e3:.1f} ms = {worst / GOAL_S:.3f} × the 1 s goal — "
        f"{verdict} the goal."
    )
    scaling_ok = scaling(args.scaling_repeat) if args.scaling else True
    return 0 if worst < GOAL_S and scaling_ok else 1


#: (decoder layers, pp, goal in s) of the larger cases: 1000 and 2000 blocks.
SCALING = ((995, 128, 2.0), (1995, 512, 10.0))


def scaling(repeat: int = 3) -> bool:
    """Time the default (``constrained``, step-time objective) and Nanotron's rule on 1000 and 2000 blocks, each
    run cold (the compiled schedule graphs dropped first, as in a fresh ``nanotron-ext plan``), ``repeat``
    times; print the median and the range of wall times, the process's CPU time (what machine load does not
    stretch), the load average, and the search's proven bound (step ≤ (1 + gap) · optimum)."""
    import os

    from nanotron_ext.partition.schedule_aware import step_time_partition
    from nanotron_ext.partition.step_time_eval import schedule_graph
    from nanotron_ext.strategies.builtin import _constraints
    from nanotron_ext.strategies.step_time import schedule_problem

    rows, ok = [], True
    load_before = os.getloadavg()[0]
    for layers, pp, goal in progress(SCALING, desc="larger models"):
        raw = yaml.safe_load((CONFIGS / "llama_3_8b.yaml").read_text())
        raw["model"]["model_config"]["num_hidden_layers"] = layers
        raw["parallelism"]["pp"] = pp
        raw["tokens"]["batch_accumulation_per_replica"] = 2 * pp
        cfg = config_from_dict(raw, source=f"Llama-3-8B shape, {layers} layers")
        blocks = inventory_from_config(cfg)
        t0 = time.perf_counter()
        make_plan(blocks, cfg, "nanotron")
        rule_s = time.perf_counter() - t0
        walls, cpus = [], []
        for _ in range(repeat):
            schedule_graph.cache_clear()
            t0, c0 = time.perf_counter(), time.process_time()
            plan = make_plan(blocks, cfg, "constrained")
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        default_s = statistics.median(walls)
        reqs, memory = _constraints(blocks, cfg, True)
        found = step_time_partition(schedule_problem(blocks, cfg), requirements=reqs, memory=memory)
        ok &= default_s < goal
        if found.exact:
            quality = "exact"
        elif found.step_time != found.step_time:
            quality = "not simulated (pp·m too large): the lower bound's split"
        elif found.evaluated == 1:
            quality = f"≤ {1 + found.gap:.4f} × optimum (pp·m too large to search: the bound's split, simulated once)"
        else:
            quality = f"≤ {1 + found.gap:.4f} × optimum (search stopped by its work budget)"
        rows.append([f"{len(blocks)}", str(pp), str(2 * pp), f"{rule_s * 1e3:.1f}", f"{default_s:.2f}",
                     f"{min(walls):.2f}–{max(walls):.2f}", f"{statistics.median(cpus):.2f}", f"{goal:g}", quality,
                     "OK" if plan.ok else "INVALID"])
    print(f"\nLarger models, default = constrained with the step-time objective; each run cold, median of {repeat} "
          f"(load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after, {os.cpu_count()} CPUs):\n")
    print(table(["blocks", "pp", "m", "nanotron rule ms", "default s", "range s", "CPU s", "goal s",
                 "default's step time", "plan"], rows, markdown=True))
    return ok


if __name__ == "__main__":
    sys.exit(main())
