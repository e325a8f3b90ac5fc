"""Measured on CPU (issue 43, item 6): ZB-V (``pp_engine: zbv``, two chunks per rank) against Nanotron's 1F1B and our
zb1p and zb2p, on Nanotron's engine, next to the step the simulator predicts for each from the run's own ops.

Two real processes (gloo, one thread each) at pp=2 run the CPU runtime on the SmolLM-135M shape of
``zb_measured_cpu.py`` (fewer layers, a shorter sequence, fp32). Every engine trains its own split under the profile
``calibrate`` takes in the same processes: 1F1B, zb1p and zb2p the planner's default for that engine and ``m`` (as
``plan --engine E --machine`` gives it); zbv four chunks folded into a V (rank 0 holds chunks 0 and 3, the embedding and
the loss; rank 1 chunks 1 and 2): the plan ``make_v_plan`` makes under the same profile, whose order the engine runs.
For each micro-batch count ``m`` one model per engine, all alive in the same processes, trained in interleaved turns
(the engines' order alternates every round), so load from other processes slows every engine alike. Reported per engine:

* measured step (slowest rank, ``StepTimer``) and gain over 1F1B within a round: median over rounds with a
  distribution-free 95 % interval;
* measured peak: the most heap bytes in use (glibc's ``mallinfo2``, every thread's arena; the runtime keeps freed
  memory, so nothing is mmapped) at the end of any op of the step, above the step's start, the larger of the two
  ranks; and its ratio to 1F1B's (issue 43: zbv's against 1F1B's and zb2p's);
* simulated step from the run's own ops (each rank's mean F, B and W, per chunk under zbv, and its update; links and
  the tied all-reduce as ``calibrate`` priced them in the same processes): 1F1B, zb1p and zb2p through the
  simulator's program, zbv through :func:`~nanotron_ext.schedule.v_replay.replay_v_order` of the order the engine
  ran; each cut's transfer as the plans priced it from the calibration. Printed twice: the run's mean ops against
  its median step, and each timed step replayed under its own ops against itself (median [min, max] over the steps).
  Issue 43 asks within 5 %; the check takes the second, since this host's speed drifts between rounds and one slow
  round moves the mean ops but not the median step (``_in_run_ops.per_step_ratios``).

Exit status 1 unless every engine's step, replayed under its own ops, is within 5 % of the measured one at the median
over the steps.

Usage: ``python benchmarks/zbv_measured_cpu.py [--rounds R] [--layers L] [--seq S] [--m 4 --m 8] [--quick]``
(``--quick``: 4 layers, sequence 64, 3 rounds).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zb_mcpu.common import PP, launch, raw_config, run_args  # noqa: E402
from zbv_mcpu.ranks import worker  # noqa: E402
from zbv_mcpu.report import SIM_WITHIN, report  # noqa: E402

from nanotron_ext.report import table  # noqa: E402

WORLD_TIMEOUT_S = 1800.0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        worker(argv[1], argv[2])
        return 0
    args = run_args(__doc__.split("\n\n")[0], argv)
    rounds, layers, seq, ms = args.rounds, args.layers, args.seq, args.ms
    import torch

    print(f"Reproduce: `python {shlex.join(['benchmarks/zbv_measured_cpu.py', *argv])}`\n")
    print(
        f"SmolLM-135M-shaped, {layers} layers, seq {seq}, micro-batch 1, fp32, pp={PP}; 2 processes × 1 thread "
        f"(gloo), torch {torch.__version__}, {os.cpu_count()} CPUs; {args.warmup} warm-up + {rounds} timed step(s) "
        f"per model, engines alternating; load average {os.getloadavg()[0]:.1f}\n"
    )
    started = time.perf_counter()
    result = launch(
        {"raw": raw_config(layers, seq, ms[0]), "ms": ms, "rounds": rounds, "warmup": args.warmup},
        script=__file__,
        timeout=WORLD_TIMEOUT_S,
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    _print_splits(result)
    rows, holds = report(result, ms)
    _print_table(rows)
    print(
        f"\nCHECK (every engine's step, replayed under its own ops, within {SIM_WITHIN:.0%} of measured at the median "
        f"over steps): {'HOLDS' if holds else 'DOES NOT HOLD'}"
    )
    print(
        f"\n{time.perf_counter() - started:.0f} s in all ({result['train_s']:.0f} s training); load average at the "
        f"end {result['load_average']:.1f}"
    )
    return 0 if holds else 1


def _print_splits(result: dict[str, Any]) -> None:
    print(
        "Each engine on its own split under the profile calibrated in the run: 1F1B, zb1p and zb2p the planner's "
        "default (block ranks), zbv the V make_v_plan cuts (virtual stages; rank 0 holds chunks 0 and 3):\n"
    )
    for key, ranks in result["ranks"].items():
        print(f"- {key}: {ranks}")
    for m, stages in result["stages"].items():
        print(f"- zbv@{m}: {stages}")
    print()


def _print_table(rows: list[list[Any]]) -> None:
    print(
        table(
            [
                "m",
                "engine",
                "measured step ms",
                "gain over 1F1B (median, 95 % CI)",
                "simulated ms (run's mean ops)",
                "÷ measured",
                "each step under its own ops: sim ÷ meas (median [min, max])",
                "peak MiB",
                "peak ÷ 1F1B's",
            ],
            rows,
            markdown=True,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
