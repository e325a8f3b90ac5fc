"""Simulated gain of the vocabulary-shard chain over the best split of whole blocks, on public shapes.

For each shape at PP 2/4/8: the default planner (``constrained``, step-time objective) splits the unsplit model
(``vocab_shards: 1``) and the chain (``vocab_shards: auto``, which tries K = 1, 2, 3, 4, 6, 8, 12, 16 up to
2·pp and keeps the fastest); both plans are simulated under 1F1B with max(the config's micro-batches, pp),
on one machine (the analytic H100 model unless ``--machine``). Printed: the chosen K, the ratio of the two
simulated step times (the gain), the ratio of their slowest stages (training FLOPs), and the FLOP bound on the
gain: the whole-block split's slowest stage ÷ the slowest stage of the FLOP-optimal split with the vocabulary
in 64 shards (the decoder layers cannot be divided, so no chain does much better than that).

The chain refuses tied embeddings (see README), and Llama-3.2-1B and Gemma-2B tie them: they are planned
untied here. Their FLOPs are the same either way; only memory and the tied gradient's all-reduce differ.

Usage: ``python benchmarks/vocab_shards_simulated.py [--machine FILE] [--tflops X] [--p2p-gbps Y]``
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

from _common import CONFIGS, PPS, add_machine_args, machine_overrides, print_command

from nanotron_ext.config import PlannerConfig, load_config
from nanotron_ext.costs import training_flops
from nanotron_ext.errors import PlanningError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.machine import machine_for
from nanotron_ext.plan import Plan, make_plan, resolve_vocab_shards
from nanotron_ext.report import table
from nanotron_ext.simulate.stage_times import simulate_plan

SHAPES: tuple[tuple[str, str], ...] = (
    ("Llama-3.2-1B", "llama_3_2_1b.yaml"),
    ("Gemma-2B", "gemma_2b.yaml"),
    ("seed tiny (vocab 50277)", "tiny_llama_large_vocab.yaml"),
)
#: Shards of the FLOP bound's split: the vocabulary almost as divisible as one likes.
FINE = 64


def _with(cfg: PlannerConfig, shards: Any) -> PlannerConfig:
    return dataclasses.replace(cfg, ext=dataclasses.replace(cfg.ext, vocab_shards=shards))


def _untied(cfg: PlannerConfig, pp: int) -> PlannerConfig:
    model = dataclasses.replace(cfg.model, tie_word_embeddings=False)
    run = dataclasses.replace(cfg.run, pp=pp, n_micro_batches=max(cfg.run.n_micro_batches, pp))
    return dataclasses.replace(cfg, model=model, run=run)


def _slowest(plan: Plan, blocks: Sequence[Any]) -> float:
    flops = training_flops(blocks)
    return max(sum(f for f, r in zip(flops, plan.block_ranks) if r == k) for k in range(plan.pp))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_machine_args(parser)
    args = parser.parse_args(argv)
    print_command()
    machine = machine_overrides(args)
    print(
        f"1F1B, micro-batches max(config's, pp), on "
        f"{machine_for(load_config(CONFIGS / SHAPES[0][1]).with_overrides(**machine)).describe()}; "
        f"both plans by the default planner under that machine.\n"
    )
    rows = []
    for label, yaml_name in SHAPES:
        base = load_config(CONFIGS / yaml_name)
        for pp in PPS:
            whole_cfg = _with(_untied(base, pp), 1).with_overrides(**machine)
            chain_cfg, _ = resolve_vocab_shards(_with(whole_cfg, "auto"))
            try:
                whole_blocks = inventory_from_config(whole_cfg)
                whole = make_plan(whole_blocks, whole_cfg)
            except PlanningError:
                rows.append(
                    [
                        label,
                        pp,
                        chain_cfg.vocab_shards,
                        "-",
                        "-",
                        "-",
                        "whole blocks cannot be planned: fewer blocks with parameters than stages",
                    ]
                )
                continue
            chain_blocks = inventory_from_config(chain_cfg)
            chain = make_plan(chain_blocks, chain_cfg)
            steps = [
                simulate_plan(p, b, c).step_time
                for p, b, c in ((whole, whole_blocks, whole_cfg), (chain, chain_blocks, chain_cfg))
            ]
            fine_cfg = _with(whole_cfg, FINE)
            fine_blocks = inventory_from_config(fine_cfg)
            floor = _slowest(make_plan(fine_blocks, fine_cfg, "flops"), fine_blocks)
            slow_w, slow_c = _slowest(whole, whole_blocks), _slowest(chain, chain_blocks)
            rows.append(
                [
                    label,
                    pp,
                    chain_cfg.vocab_shards,
                    f"{steps[0] / steps[1]:.3f}x",
                    f"{slow_w / slow_c:.3f}x",
                    f"{slow_w / floor:.3f}x",
                    "",
                ]
            )
    print(
        table(
            [
                "model",
                "pp",
                "K (auto)",
                "step gain (simulated)",
                "slowest-stage gain",
                "FLOP bound on the gain",
                "note",
            ],
            rows,
            markdown=True,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
