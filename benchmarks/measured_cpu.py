"""Measured on CPU with Nanotron's engine: step time and bubble per strategy, and simulated ÷ measured.

For each scenario, two real processes (gloo, one thread each) run Nanotron 0.2's 1F1B engine at pp=2 on the
CPU runtime (``nanotron_ext.runtime``). Every strategy's plan (``make_plan``) is built as a model in the same
two processes; all models stay alive and take turns, round after round (each turn: untimed re-warm steps, then
timed steps), so load from other processes on a shared machine slows every split alike.
``nanotron_ext.runtime.timing.StepTimer`` records each rank's busy and idle time. Strategies whose plans are
identical are trained once.

* measured step: median over timed steps of the full ``train_step`` (engine, tied-gradient sync, optimizer; no
  clipping, see the note in :func:`mcpu.ranks.worker`), slowest rank;
* measured pipeline: the engine's part of the step (``train_batch_iter`` and its sends), slowest rank;
* measured bubble: ``Σ idle / (pp × step)``;
* simulated step: ``nanotron_ext.simulate.simulate`` (1F1B: Nanotron's send/receive program, rendezvous
  transfers), fed with

  - each stage's forward/backward per micro-batch, summed from its blocks' ``profiled`` timings, measured on
    rank 0 of the same processes before every round, median over rounds;
  - one transfer across the plan's cut, measured between the two ranks through Nanotron's P2P with the
    tensors that cross it (metadata, fresh receive buffer and data, as in training), median over rounds;
  - each stage's update: its blocks' profiled AdamW steps, plus, where embedding and lm_head sit on different
    ranks and are tied, the measured all-reduce of that gradient;

  ``sim ÷ step`` therefore tests the whole model with measured block times, not a FLOP rate;
* its sources of error, apart: the pipeline part alone (simulated ÷ measured pipeline); each stage's busy
  time inside the pipeline ÷ ``m`` × its blocks' profiled forward + backward (do blocks timed alone predict a
  stage?); and the simulator fed with those in-pipeline stage times ÷ the measured pipeline (the schedule
  model alone);
* speed vs Nanotron: Nanotron's measured step ÷ this strategy's.

Nanotron's own rule leaves PP1 without parameters on the large-vocabulary model: Nanotron stops there
("no gradient on PP1"). It is run anyway with the optimizer skipped on that rank, to compare its step time.

Scenarios (shortened to fit a few minutes on 2 cores; fp32 because the CPU runtime trains in fp32):

* ``tiny-large-vocab``: ``nanotron_ext/configs/tiny_llama_large_vocab.yaml`` as shipped (2 layers, vocabulary
  50277, hidden 16, sequence 32, micro-batch 2, 4 micro-batches); 5 rounds, each turn 1 untimed + 3 timed
  steps (its ms-scale, memory-bound blocks run on a working set near the 32 MiB L3: after another model's
  turn the caches are cold, which a real run, training one model, never sees);
* ``SmolLM-135M-shaped``: ``nanotron_ext/configs/smollm_135m.yaml``'s shape (all 30 layers, hidden 576,
  9/3 heads, vocabulary 49152, tied embeddings) with sequence 128 (not 2048), micro-batch 1 (not 4) and 4
  micro-batches (not 8), fp32 (not bf16); 5 rounds of one timed step each;
* ``SmolLM-135M-shaped-m2``, only with ``--scenario SmolLM-135M-shaped-m2``: the same shape with 16 layers and
  2 micro-batches, where the default's split (``constrained``, objective ``step_time``) differs from the
  FLOP-optimal one (``constrained@slowest_stage``, the same split as Nanotron's rule); the two splits take
  turns for 12 rounds of 1 timed step, blocks profiled once, and a section after the checks compares their
  predicted and measured step times round by round.

The ranks run with glibc malloc told to keep freed memory (``MALLOC_ENV``; ``--system-malloc`` to leave the
defaults): with the defaults, how often a large tensor is page-faulted in again depends on the allocation
pattern (one block in a loop versus a pipeline holding several micro-batches), which skews profiled versus
measured times on this VM by 10–20 %, whatever the split.

Usage: ``python benchmarks/measured_cpu.py [--rounds R] [--warmup 1] [--scenario LABEL] [--profile-cache DIR]
[--quick] [--system-malloc]`` (``--quick``: SmolLM-shaped with 8 layers and sequence 64, for a fast look). Exit status 1
when a check printed at the end fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mcpu.analysis import Row, analyse  # noqa: E402
from mcpu.ranks import worker  # noqa: E402
from mcpu.report import print_checks, print_objectives, print_table, timeline  # noqa: E402
from mcpu.scenarios import (  # noqa: E402  (importable from here: the sibling benchmarks read them)
    ENGINE,
    MALLOC_ENV,
    OBJECTIVE_PAIR,
    PP,
    RESULTS,
    ROOT,
    SYSTEM_MALLOC_ENV,
    WORLD_TIMEOUT_S,
    Scenario,
    scenarios,
)

from nanotron_ext.procs import local_env, run_local_ranks  # noqa: E402

__all__ = [
    "ENGINE",
    "MALLOC_ENV",
    "PP",
    "SYSTEM_MALLOC_ENV",
    "Row",
    "Scenario",
    "analyse",
    "launch",
    "main",
    "scenarios",
]


# --- launching -----------------------------------------------------------------------------------------


def launch(
    spec: dict[str, Any], timeout: float = WORLD_TIMEOUT_S, malloc_env: bool = True, script: Path | None = None
) -> dict[str, Any]:
    """Run :func:`mcpu.ranks.worker` in ``PP`` fresh processes with torchrun's environment; return rank 0's JSON.

    Args:
        spec: the scenario (see :func:`main`).
        timeout: seconds before every rank is killed.
        malloc_env: give the ranks :data:`MALLOC_ENV` (unless the caller's environment sets those already).
        script: the benchmark whose ``--worker SPEC OUT`` the ranks run (default: this one).

    Raises:
        RuntimeError: a rank failed or the run passed ``timeout`` seconds (every rank is killed then).
    """
    with tempfile.TemporaryDirectory(prefix="measured_cpu_") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        env = local_env(ROOT)
        env = {**MALLOC_ENV, **env} if malloc_env else {**env, **SYSTEM_MALLOC_ENV}
        # grace=0: once a rank fails the scenario is lost, and its peers would only wait in a collective.
        run = run_local_ranks(
            [sys.executable, str(script or Path(__file__).resolve()), "--worker", str(spec_path), str(out_path)],
            PP,
            timeout=timeout,
            grace=0,
            env=env,
            cwd=ROOT,
        )
        if not run.ok or not out_path.exists():
            reason = "timed out" if run.deadline_hit else "failed"
            raise RuntimeError(f"scenario {spec['label']!r} {reason}:\n" + run.describe())
        return json.loads(out_path.read_text())


# --- the command ---------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        worker(argv[1], argv[2])
        return 0
    parser = _parser()
    args = parser.parse_args(argv)
    chosen = _chosen(parser, args)
    print(f"Reproduce: `python {shlex.join(['benchmarks/measured_cpu.py', *argv])}` (from the repository root)\n")
    _print_setup(chosen, args)
    started = time.perf_counter()
    all_rows: dict[str, list[Row]] = {}
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="nanotron_ext_profile_") as fresh_cache:
        for sc in chosen:
            results[sc.label], all_rows[sc.label] = _run_scenario(sc, args, fresh_cache)
    print()
    print_table(all_rows, results)
    ok = print_checks(all_rows)
    for label, result in results.items():
        if all(name in result["plans"] for name in OBJECTIVE_PAIR):
            print_objectives(label, result, all_rows[label])
    print(f"\nTotal wall time: {time.perf_counter() - started:.0f} s")
    return 0 if ok else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds in which every plan takes a turn (default: 5 for both scenarios)",
    )
    parser.add_argument(
        "--scenario",
        action="append",
        default=None,
        metavar="LABEL",
        help="run only this scenario (repeatable): tiny-large-vocab, SmolLM-135M-shaped, "
        "SmolLM-135M-shaped-m2 (the objective comparison; not run by default)",
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument(
        "--profile-cache",
        default=None,
        help="reuse this timing cache (default: a fresh one, so timings are of this run)",
    )
    parser.add_argument("--quick", action="store_true", help="SmolLM-shaped with 8 layers and sequence 64")
    parser.add_argument(
        "--system-malloc",
        action="store_true",
        help="leave glibc malloc's defaults (default: keep freed memory, see MALLOC_ENV)",
    )
    return parser


def _chosen(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[Scenario]:
    """The scenarios the flags ask for, with ``--rounds`` applied (a parser error on a bad flag)."""
    if (args.rounds is not None and args.rounds < 1) or args.warmup < 0:
        parser.error("--rounds must be >= 1 and --warmup >= 0")
    chosen = [
        sc for sc in scenarios(args.quick) if (sc.default if args.scenario is None else sc.label in args.scenario)
    ]
    if args.scenario is not None and len(chosen) != len(set(args.scenario)):
        known = ", ".join(sc.label for sc in scenarios(args.quick))
        parser.error(f"--scenario {args.scenario}: unknown label; known: {known}")
    if args.rounds is not None:
        chosen = [dataclasses.replace(sc, rounds=args.rounds) for sc in chosen]
    return chosen


def _print_setup(chosen: Sequence[Scenario], args: argparse.Namespace) -> None:
    import torch

    turns = "; ".join(
        f"{sc.label}: {sc.rounds} round(s) × ({sc.rewarm} untimed + {sc.steps_per_turn} timed)" for sc in chosen
    )
    print(
        f"Nanotron 0.2 1F1B engine on CPU (gloo), pp={PP}, 2 processes × 1 thread, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs; per distinct plan {args.warmup} warm-up step(s), then rounds in which each plan "
        f"takes a turn ({turns}), medians of the timed steps; "
        f"glibc malloc: {'defaults' if args.system_malloc else 'freed memory kept (' + ', '.join(MALLOC_ENV) + ')'}.\n"
    )


def _run_scenario(sc: Scenario, args: argparse.Namespace, fresh_cache: str) -> tuple[dict[str, Any], list[Row]]:
    """Train one scenario, write its JSON, print its line and timeline; its result and rows."""
    t0, load_before = time.perf_counter(), os.getloadavg()[0]
    spec = {
        "label": sc.label,
        "raw": sc.raw_config(),
        "rounds": sc.rounds,
        "steps_per_turn": sc.steps_per_turn,
        "rewarm": sc.rewarm,
        "warmup": args.warmup,
        "strategies": list(sc.strategies),
        "profile_rounds": sc.profile_rounds,
        "cache": args.profile_cache or fresh_cache,
    }
    result = launch(spec, malloc_env=not args.system_malloc)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = sc.label.lower().replace("-", "_")
    (RESULTS / f"measured_cpu_{stem}.json").write_text(json.dumps(result, indent=1))
    rows, sims = analyse(result)
    cuts = {k: v for k, v in result["p2p"].items() if k != "tied"}
    links = ", ".join(
        f"before {result['blocks'][int(k.split(':')[0])]['short']} {v * 1e3:.2f} ms"
        for k, v in sorted(cuts.items(), key=lambda kv: int(kv[0].split(":")[0]))
    )
    if result["tied"]:
        links += f"; tied-gradient all-reduce {result['p2p']['tied'] * 1e3:.1f} ms"
    print(
        f"- {sc.label} ({sc.notes}): {len(result['blocks'])} blocks, {result['n_micro_batches']} "
        f"micro-batches; profiled timings in {result['profile_s']:.1f} s; one p2p transfer (median over "
        f"rounds): {links}; "
        f"scenario wall {time.perf_counter() - t0:.0f} s; load average before/after "
        f"{load_before:.2f}/{os.getloadavg()[0]:.2f}",
        flush=True,
    )
    timeline(sc, sims, rows, result["blocks"])
    return result, rows


if __name__ == "__main__":
    sys.exit(main())
