"""Measured on CPU: zb1p and zb2p (``nanotron_ext.zero_bubble``) against Nanotron's 1F1B on the same split, next to
the step the simulator predicts for each.

Two real processes (gloo, one thread each) at pp=2 run the CPU runtime (``nanotron_ext.runtime``) on a
SmolLM-135M-shaped model (hidden 576, 9/3 heads, vocabulary 49152, tied embeddings; fewer layers and a shorter
sequence so that a run takes minutes), fp32. One split for every run (the ``flops`` strategy's, which does not
depend on the engine or the machine); for each micro-batch count ``m`` one model per engine, all alive in the same
processes and trained in interleaved turns (the engines' order alternates every round), so load from other
processes slows both engines alike, as in ``measured_cpu.py``. Each round pairs one timed step of each engine:

* measured gain: 1F1B's step ÷ a zero-bubble engine's step within a round (slowest rank, ``StepTimer``), the median
  over rounds with a distribution-free 95 % interval for the median (order statistics of the binomial);
* simulated gain: ``simulate_plan(plan, blocks, cfg, engine=...)`` under the profile ``calibrate(cfg)`` measured
  in the same two processes (blocks, links, engine overhead; W priced as the profile's split of each backward);
* simulated ÷ measured step of each engine (issue 31 asks within 5 %), under the profile ``calibrate`` takes first,
  before any model exists (as a user's ``calibrate`` runs before training), and, for comparison, under a second one
  taken once every model is built and has run its warm-up step (the state the timed steps run in);
* where the time goes, per engine and PP rank (medians per step): busy, waits in receives, sends and collectives,
  the closing wait for the slower rank, and (zb1p, zb2p) the time in W steps;
* one op of each kind (F, B, W) per engine and rank, its own work in the run (the waits on a peer inside it left
  out; ``_in_run_ops.py``) against the calibrated profile's price of it: where a calibrated step comes out short;
* the profile the run's own ops make: each rank's mean F, B, W and update replayed by the simulator (links and
  the tied all-reduce as calibrated) against the engine's pipeline and step. It checks the schedule the simulator
  runs apart from the calibration's prices.

Exit status 1 unless issue 31's checks hold (zb2p's gain, every simulated step within 5 %) and every step under
the run's own ops is within 5 % too.

Usage: ``python benchmarks/zb_measured_cpu.py [--rounds R] [--layers L] [--seq S] [--m 4 --m 8] [--quick]``
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zb_mcpu.common import (  # noqa: E402  (importable from here, as zbv_measured_cpu.py once took them)
    PP,
    launch,
    median_interval,
    raw_config,
    run_args,
)
from zb_mcpu.ranks import STRATEGY, worker  # noqa: E402
from zb_mcpu.report import GAIN_FLOOR, SIM_WITHIN, op_table, report, schedule_check  # noqa: E402

__all__ = ["launch", "main", "median_interval", "raw_config", "run_args"]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        worker(argv[1], argv[2])
        return 0
    args = run_args(__doc__.split("\n\n")[0], argv)
    rounds, layers, seq, ms = args.rounds, args.layers, args.seq, args.ms
    import torch

    print(f"Reproduce: `python {shlex.join(['benchmarks/zb_measured_cpu.py', *argv])}`\n")
    print(
        f"SmolLM-135M-shaped, {layers} layers, seq {seq}, micro-batch 1, fp32, pp={PP}, split by {STRATEGY!r}; "
        f"2 processes × 1 thread (gloo), torch {torch.__version__}, {os.cpu_count()} CPUs; {args.warmup} warm-up "
        f"+ {rounds} timed step(s) per model, engines alternating; load average {os.getloadavg()[0]:.1f}\n"
    )
    started = time.perf_counter()
    result = launch({"raw": raw_config(layers, seq, ms[0]), "ms": ms, "rounds": rounds, "warmup": args.warmup})
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(result["split"], "\n")
    print(f"machine profile: {result['machine']} (calibrated in the run, {result['calibrate_s']:.0f} s)\n")
    lines, holds = report(result, ms)
    print("\n".join(lines))
    print(
        f"\nOne op of each kind at m={min(ms)}, its own work in the run (waits on a peer left out) against what "
        f"the calibrated profile prices:\n"
    )
    print("\n".join(op_table(result, min(ms))))
    schedule_lines, schedule_holds = schedule_check(result, ms)
    print(
        "\nThe profile the run's own ops make: the simulator given each rank's mean F, B, W and update in the run "
        "(links and the tied all-reduce as calibrated), against the engine's median pipeline and step:\n"
    )
    print("\n".join(schedule_lines))
    print(
        f"\nCHECKS (issue 31: zb2p >= {GAIN_FLOOR}x 1F1B at m={min(ms)}, every simulated step within "
        f"{SIM_WITHIN:.0%} of measured): {'HOLD' if holds else 'DO NOT HOLD'}"
    )
    print(
        f"IN-RUN PROFILE (every engine's step simulated from the run's own ops within {SIM_WITHIN:.0%} of "
        f"measured): {'HOLDS' if schedule_holds else 'DOES NOT HOLD'}"
    )
    holds &= schedule_holds
    print(
        f"\n{time.perf_counter() - started:.0f} s in all ({result['train_s']:.0f} s training); load average at the "
        f"end {result['load_average']:.1f}"
    )
    return 0 if holds else 1


if __name__ == "__main__":
    sys.exit(main())
