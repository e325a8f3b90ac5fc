"""Predicted vs measured step time of many splits on Nanotron's engine, under a machine profile taken in the run.

Issue 22, items 3 and 4. For each scenario, ``pp`` real processes (gloo, one thread each) run Nanotron 0.2's
1F1B engine on the CPU runtime (``nanotron_ext.runtime``). At the start, inside those processes,
``calibrate(cfg)`` measures a :class:`~nanotron_ext.machine.MachineProfile` (blocks, links between pipeline
neighbours, engine overhead, all-reduces); it is saved as JSON and the profile-based splits are planned with
``cfg.with_overrides(machine=PATH)``. Every split is then built as a model in the same processes; all stay alive
and take turns, round after round, in a rotating order (each turn: untimed re-warm steps, then timed steps), as
``measured_cpu.py`` does, so machine load hits every split alike. ``calibrate`` runs again every few rounds (on
the SmolLM shape only once more, at the end); the prediction uses the median of those profiles (also saved),
and the table shows the planning profile's too.

For every split: the measured step (median over timed steps of the slowest rank's full ``train_step``, with an
order-statistic 95 % interval of the median), the predicted step (``simulate_plan(plan, blocks,
cfg.with_overrides(machine=median profile)).step_time``) and predicted ÷ measured. Per scenario: Kendall's τ
between the measured and the predicted order, every pair whose intervals do not overlap but whose predicted
order is the opposite, whether the default (``constrained``, objective step_time, under the profile) is
measured fastest among the valid splits or inside the fastest one's interval, and, on the seed model, what
``vocab_shards: auto`` picks under the profile and its measured gain over K=1.

Item 3, "find the missing time": for the default split and the K=2 chain on the seed model (and the default on
``smollm-m4``), each stage's measured step is taken apart (``nanotron_ext.runtime.timing.StepTimer``) into
compute inside the pipeline, the part of it the profiled blocks do not explain (engine overhead), receive and
send waits, the wait in the collectives after the pipeline, the update and the closing wait, next to what the
profile and the simulator predict for each part. Probes of where a gap comes from: the stage's blocks timed
again with every rank timing at once (ranks computing side by side share caches, memory bandwidth and, when
oversubscribed, cores; the profile times rank 0 alone); the tensors each rank sends and receives per step, and
one micro-batch's exchange across the cut timed between the ranks with those tensors, one per communication call
as Nanotron's pipeline state does it and with every send posted first (the profile prices a cut as one transfer
each way); and the simulated step if the engine posted every send as soon as its tensor exists (what Nanotron's
deferred 1F1B sends cost). The splits in a scenario's ``eager_sends`` are trained a second time in the same
rounds with the runtime's ``sends="eager"`` (every queued send posted at once, :mod:`nanotron_ext.runtime.send_order`),
and their measured gain over Nanotron's order is printed.

Scenarios (fp32, the CPU runtime's dtype):

* ``seed-pp2``: ``nanotron_ext/configs/tiny_llama_large_vocab.yaml`` as shipped at pp=2: Nanotron's rule (it
  leaves PP1 without parameters; run with PP1's optimizer skipped, as ``measured_cpu.py`` does), uniform,
  FLOP-optimal (``constrained``, objective ``slowest_stage``), the default under the profile, and the
  vocabulary-shard chain at K = 2, 3, 4 under the profile;
* ``smollm-m2`` / ``smollm-m4``: SmolLM-135M's shape (hidden 576, 9/3 heads, vocabulary 49152, tied) shrunk
  to fit the time (fewer layers, sequence 128, micro-batch 1) at 2 and 4 micro-batches: the default under the
  profile, FLOP-optimal, uniform, Nanotron's rule, and two decoder layers more and fewer on PP0 than the default
  has (``layout`` strategy);
* ``smollm-pp3``: the SmolLM shape at pp=3, m=4: the default, FLOP-optimal, and Nanotron's rule, which puts the
  lm_head and ``cast, loss`` on two stages and so ships the logits across one cut and hidden states across the
  other (3 processes: oversubscribed on 2 cores);
* ``smollm-layouts`` (issue 32): the SmolLM shape untied at m=4 and four hand layouts no other scenario trains
  (front-heavy, even, back-heavy, and one that ships the logits across the cut); three calibrations back to back,
  each predicting every layout: their spread (max ÷ min, at most 1.03) and each one's pred ÷ meas (within [0.90,
  1.10]), and every block figure in each (:mod:`_repeatability`);
* ``seed-pp4``: the seed model with 6 layers at pp=4, 4 micro-batches, 4 processes: on fewer than 4 cores they
  are oversubscribed (the output says so, and that scenario's checks are printed but do not fail the run).

The code, in ``benchmarks/pvm/``: the scenarios and what their ranks read (``scenarios``); inside the ranks,
the profiles (``calibration``), the splits (``splits``), the training in rounds (``ranks``) and the predictions
(``predictions``); back in this launcher, the rows and order checks (``analysis``) and the tables (``report``).

Usage: ``python benchmarks/predict_vs_measure.py [--quick] [--scenario LABEL ...] [--rounds R]
[--calibrate-every N] [--system-malloc] [--device cpu|cuda]``. Exit status 1 when a check fails: predicted ÷ measured
outside [0.95, 1.05] on any split, a significant misordered pair, or the default not measured fastest (within the
fastest one's interval).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _repeatability as repeatability  # noqa: E402
from measured_cpu import MALLOC_ENV, SYSTEM_MALLOC_ENV  # noqa: E402
from pvm.analysis import analyse, order_checks  # noqa: E402
from pvm.report import print_chain, print_order, print_parts, print_send_order, print_splits, print_verdict  # noqa: E402
from pvm.scenarios import ENGINE, RESULTS, ROOT, RankSpec, Scenario, scenarios  # noqa: E402
from pvm.splits import layout_of  # noqa: E402

from nanotron_ext.machine import load_machine  # noqa: E402
from nanotron_ext.procs import local_env, run_local_ranks  # noqa: E402

WORLD_TIMEOUT_S = 600.0


def launch(spec: RankSpec, *, malloc_env: bool) -> dict[str, Any]:
    """Run :func:`pvm.ranks.worker` in ``spec.pp`` fresh processes; a progress bar on stderr follows rank 0's turns.

    Raises:
        RuntimeError: a rank failed or the scenario passed :data:`WORLD_TIMEOUT_S` (every rank is killed then).
    """
    from tqdm import tqdm

    with tempfile.TemporaryDirectory(prefix="predict_vs_measure_") as tmp:
        spec = dataclasses.replace(spec, progress=str(Path(tmp) / "progress.json"))
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(spec.to_json())
        env = local_env(ROOT)
        env = {**MALLOC_ENV, **env} if malloc_env else {**env, **SYSTEM_MALLOC_ENV}
        stop = threading.Event()
        bar = tqdm(desc=spec.label, unit="turn", file=sys.stderr, dynamic_ncols=True)
        follower = threading.Thread(target=_follow, args=(Path(spec.progress), bar, stop), daemon=True)
        follower.start()
        try:
            # grace=0: once a rank fails the scenario is lost, and its peers would only wait in a collective.
            run = run_local_ranks(
                [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path), str(out_path)],
                spec.pp,
                timeout=WORLD_TIMEOUT_S,
                grace=0,
                env=env,
                cwd=ROOT,
            )
        finally:
            stop.set()
            follower.join()
            bar.close()
        if not run.ok or not out_path.exists():
            raise RuntimeError(
                f"scenario {spec.label!r} {'timed out' if run.deadline_hit else 'failed'}:\n" + run.describe()
            )
        return json.loads(out_path.read_text())


def _follow(path: Path, bar: Any, stop: threading.Event) -> None:
    while not stop.wait(0.5):
        _show(path, bar)
    _show(path, bar)


def _show(path: Path, bar: Any) -> None:
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    bar.total = state["total"]
    bar.n = state["done"]
    bar.refresh()


def run_scenario(sc: Scenario, args: argparse.Namespace, stem: str) -> dict[str, Any]:
    """Launch one scenario, print its report, return its record for the JSON file (``checks_count``: whether
    its checks decide the exit status)."""
    paths = {kind: str(RESULTS / f"{stem}_{sc.label}_profile_{kind}.json") for kind in ("planning", "median")}
    spec = RankSpec.of(sc, paths["planning"], paths["median"])
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    result = launch(spec, malloc_env=not args.system_malloc)
    oversubscribed = sc.pp > (os.cpu_count() or 1)
    print(
        f"\n## {sc.label}: {sc.notes}; {sc.rounds} rounds × ({sc.rewarm} untimed + {sc.steps_per_turn} timed) "
        f"per split, calibrate {spec.n_calibrations}× (first: {result['calibrate_s']:.1f} s); wall "
        f"{time.perf_counter() - t0:.0f} s; load average {load0:.2f} before, {min(result['load_average']):.2f}–"
        f"{max(result['load_average']):.2f} during"
    )
    if oversubscribed:
        print(
            f"OVERSUBSCRIBED: {sc.pp} processes on {os.cpu_count()} CPUs: ranks take turns on the cores, so "
            f"measured steps include time a rank was runnable but not running; the checks below are printed "
            f"but do not decide the exit status."
        )
    print(
        f"profile (median of the run's calibrations): {load_machine(paths['median']).describe()}; files: "
        f"{', '.join(str(Path(p).relative_to(ROOT)) for p in paths.values())}\n"
    )
    rows = analyse(result)
    print_splits(rows)
    order = order_checks(rows)
    print_order(sc.label, order)
    checks = order.record()
    if any(r.name.startswith("chain") for r in rows):
        checks |= print_chain(result, rows)
    parts = print_parts(result, sc)
    checks["send_order"] = print_send_order(result, rows)
    if sc.calibrations_first > 1:
        checks["repeatability"] = repeatability.report(
            result, spec.raw, rows, dict(sc.layouts), layout_of, sc.repeatable
        )
    return {
        "scenario": dataclasses.asdict(sc),
        "result": result,
        "rows": [dataclasses.asdict(r) for r in rows],
        "checks": checks,
        "parts": parts,
        "checks_count": not oversubscribed,
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        from pvm.ranks import worker  # torch and Nanotron's runtime: only the ranks load them

        worker(argv[1], argv[2])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller models, fewer rounds (a minute or two)")
    parser.add_argument(
        "--scenario",
        action="append",
        default=None,
        metavar="LABEL",
        help="run only this scenario (repeatable): seed-pp2, smollm-m2, smollm-m4, smollm-pp3, "
        "smollm-layouts, seed-pp4",
    )
    parser.add_argument("--rounds", type=int, default=None, help="rounds in which every split takes a turn")
    parser.add_argument(
        "--calibrate-every",
        type=int,
        default=None,
        metavar="N",
        help="calibrate again after every N rounds (pairs each calibration with the steps measured beside it in time)",
    )
    parser.add_argument(
        "--system-malloc",
        action="store_true",
        help="leave glibc malloc's defaults (default: keep freed memory, see measured_cpu.MALLOC_ENV)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the ranks compute (NANOTRON_EXT_DEVICE; cuda: one GPU, P2P host-staged over gloo)",
    )
    args = parser.parse_args(argv)
    os.environ["NANOTRON_EXT_DEVICE"] = args.device  # every rank inherits it (nanotron_ext.runtime.device)
    known = {sc.label: sc for sc in scenarios(args.quick)}
    unknown = set(args.scenario or ()) - set(known)
    if unknown or (args.rounds is not None and args.rounds < 1):
        parser.error(f"unknown scenario {sorted(unknown)} (known: {', '.join(known)}) or --rounds < 1")
    if args.calibrate_every is not None and args.calibrate_every < 0:
        parser.error(
            f"--calibrate-every {args.calibrate_every}: a number of rounds, 0 (calibrate only before training) or more"
        )
    chosen = [sc for label, sc in known.items() if args.scenario is None or label in args.scenario]
    if args.rounds is not None:
        chosen = [dataclasses.replace(sc, rounds=args.rounds) for sc in chosen]
    if args.calibrate_every is not None:
        chosen = [dataclasses.replace(sc, calibrate_every=args.calibrate_every) for sc in chosen]
    print(f"Reproduce: `python {shlex.join(['benchmarks/predict_vs_measure.py', *argv])}` (from the repository root)\n")
    import torch

    where = "CPU (gloo)" if args.device == "cpu" else "one CUDA GPU (P2P host-staged over gloo)"
    print(
        f"Nanotron 0.2 {ENGINE} engine on {where}, one thread per process, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs; glibc malloc: {'defaults' if args.system_malloc else 'freed memory kept'}; "
        f"per split 1 warm-up step first; steps: the slowest rank's full train_step (no clipping)"
    )
    # A run of some scenarios only (--scenario) does not overwrite the full run's files.
    stem = (
        "predict_vs_measure"
        + ("_cuda" if args.device == "cuda" else "")
        + ("_quick" if args.quick else "")
        + ("_partial" if args.scenario else "")
    )
    started = time.perf_counter()
    RESULTS.mkdir(parents=True, exist_ok=True)
    records = {sc.label: run_scenario(sc, args, stem) for sc in chosen}
    ok = print_verdict(records)
    out = RESULTS / f"{stem}.json"
    out.write_text(json.dumps({"argv": argv, "ok": ok, "scenarios": records}, indent=1))
    print(f"\nResults: {out.relative_to(ROOT)}; total wall time {time.perf_counter() - started:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
