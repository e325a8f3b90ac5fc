"""Planning speed: ``make_plan`` on 160 blocks at PP 64, for every optimal strategy. Goal: under 1 s.

The model is Llama-3-8B's shape with 155 decoder layers (embedding + 155 layers + final norm + lm_head +
cast + loss = 160 PipelineBlocks), built with ``config_from_dict``. Each strategy is timed end to end
(pricing, the two dynamic programmes, the optimum for ``vs_optimum``, validation), median of ``--repeat``
runs after one warm-up.

Usage: ``python benchmarks/plan_speed.py [--layers 155] [--pp 64] [--repeat 7]``
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
    return 0 if worst < GOAL_S else 1


if __name__ == "__main__":
    sys.exit(main())
