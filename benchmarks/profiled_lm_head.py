"""Measured block times of the bundled tiny large-vocabulary model: does the lm_head dominate here?

The ``profiled`` strategy's premise on this model: the lm_head (50277 × 16) costs far more than a decoder
layer (4128 weights), so the measured split puts it, the cast and the loss on the last stage. Measured times
vary with the machine and its load, so this is a benchmark, not a test (the tests check the profiler with a
scripted clock). Each round measures every block from scratch (no cache), then prints per-block times and the
lm_head ÷ decoder.0 ratio of forward + backward; the summary gives the median ratio and the plan.

Usage: ``python benchmarks/profiled_lm_head.py [--rounds 3] [--warmup 2] [--repeats 5]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections.abc import Sequence

from _common import print_command

from nanotron_ext.config import bundled_config, load_config
from nanotron_ext.costs import profiled
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.plan import make_plan
from nanotron_ext.report import table


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=profiled.DEFAULT_WARMUP)
    parser.add_argument("--repeats", type=int, default=profiled.DEFAULT_REPEATS)
    args = parser.parse_args(argv)
    print_command()
    ratios = []
    for round_ in range(1, args.rounds + 1):
        with tempfile.TemporaryDirectory(prefix="nanotron_ext_bench_") as cache:
            cfg = load_config(bundled_config()).with_overrides(profile_cache=cache)
            blocks = inventory_from_config(cfg)
            timings = profiled.profile_blocks(blocks, cfg, warmup=args.warmup, repeats=args.repeats)
            if round_ == args.rounds:
                plan = make_plan(blocks, cfg, "profiled")  # reads this round's cache: no new measurement
        by_name = dict(zip((b.short for b in blocks), timings))
        ratio = by_name["lm_head"].total / by_name["decoder.0"].total
        ratios.append(ratio)
        print(f"\nround {round_}: lm_head ÷ decoder.0 (forward + backward) = {ratio:.2f}")
        print(
            table(
                ["block", "forward ms", "backward ms", "optimizer ms"],
                [
                    [name, f"{t.forward * 1e3:.3f}", f"{t.backward * 1e3:.3f}", f"{t.optimizer * 1e3:.3f}"]
                    for name, t in by_name.items()
                ],
            )
        )
    print(
        f"\nmedian lm_head ÷ decoder.0 over {len(ratios)} rounds: {statistics.median(ratios):.2f} "
        f"(min {min(ratios):.2f}, max {max(ratios):.2f}); lm_head dominates: {min(ratios) > 1}"
    )
    print(f"profiled plan (last round): {list(plan.block_ranks)}  {plan.verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
