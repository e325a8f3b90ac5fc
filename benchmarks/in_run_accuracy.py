"""Issue 41, measured: the in-run profile (``calibrate --in-run``) against Nanotron's engine, on splits, engines and
micro-batch counts its run never trained, next to the standalone profile (``calibrate``) of the same processes.

Per scenario (``in_run/scenarios.py``), ``pp`` real processes (gloo, one thread each) run the CPU runtime: the
standalone calibration, then the in-run steps of the config's own split, then every split, engine and micro-batch
count of the scenario in interleaved rounds (``in_run/ranks.py``). Every run is predicted with ``simulate_plan``
under both profiles and judged (``in_run/report.py``): every held-out row within the scenario's tolerance (5 %; 10 %
on the seed model's millisecond blocks), τ = 1 over the runs whose intervals separate, the planner's pick and
``auto``'s measured fastest or inside the fastest one's interval, the in-run clock at most 2 % of a step.

Usage: ``python benchmarks/in_run_accuracy.py [--scenario LABEL ...] [--quick] [--repeats N] [--out FILE]``; exit
status 1 when a check fails (with ``--quick``, a rehearsal: fewer rounds, its verdicts printed but not counted).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from in_run import ranks, report  # noqa: E402
from in_run.scenarios import SCENARIOS, Scenario  # noqa: E402
from measured_cpu import MALLOC_ENV  # noqa: E402  (the malloc settings every CPU benchmark trains with)

from nanotron_ext.devices import DEVICE_TYPES, device_type  # noqa: E402
from nanotron_ext.procs import local_env, run_local_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
WORLD_TIMEOUT_S = 3600.0


def spec_of(sc: Scenario, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """What the ranks read: the scenario, its config written to ``folder``, the counts."""
    config = folder / f"{sc.label}.yaml"
    config.write_text(yaml.safe_dump(sc.raw_config()))
    return {
        "label": sc.label,
        "notes": sc.notes,
        "config": str(config),
        "folder": str(folder),
        "splits": [{"name": s.name, "layout": s.layout} for s in sc.splits],
        "engines": list(sc.engines),
        "micro_batches": [sc.micro_batches, *sc.micro_batches_also],
        "tolerance": sc.tolerance,
        "rounds": sc.rounds,
        "steps_per_turn": sc.steps_per_turn,
        "rewarm": sc.rewarm,
        "warmup": 2,
        "repeats": args.repeats,
        "in_run_steps": args.in_run_steps,
        "pp": sc.pp,
        "device": args.device,
    }


def launch(spec: dict[str, Any]) -> dict[str, Any]:
    """:func:`in_run.ranks.worker` in ``pp`` fresh processes, a progress bar following rank 0's turns.

    Raises:
        RuntimeError: a rank failed, or the scenario passed :data:`WORLD_TIMEOUT_S`.
    """
    from tqdm import tqdm

    folder = Path(spec["folder"])
    spec = {**spec, "progress": str(folder / "progress.json")}
    spec_path, out_path = folder / f"{spec['label']}.spec.json", folder / f"{spec['label']}.out.json"
    spec_path.write_text(json.dumps(spec))
    stop = threading.Event()
    bar = tqdm(desc=spec["label"], unit="turn", file=sys.stderr, dynamic_ncols=True)

    def follow() -> None:
        while not stop.wait(0.5):
            try:
                state = json.loads(Path(spec["progress"]).read_text())
            except (OSError, ValueError):
                continue
            bar.total, bar.n = state["total"], state["done"]
            bar.refresh()

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    try:
        run = run_local_ranks(
            [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path), str(out_path)],
            spec["pp"],
            timeout=WORLD_TIMEOUT_S,
            grace=0,
            env={**MALLOC_ENV, **local_env(ROOT, NANOTRON_EXT_DEVICE=spec["device"])},
            cwd=ROOT,
        )
    finally:
        stop.set()
        follower.join()
        bar.close()
    if not run.ok or not out_path.exists():
        raise RuntimeError(
            f"scenario {spec['label']!r} {'timed out' if run.deadline_hit else 'failed'}:\n" + run.describe()
        )
    return json.loads(out_path.read_text())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--scenario", action="append", choices=[s.label for s in SCENARIOS], help="run only these (default: all)"
    )
    parser.add_argument("--quick", action="store_true", help="fewer rounds: a rehearsal, its verdicts not counted")
    parser.add_argument("--repeats", type=int, default=11, help="calibrate's --repeats for the standalone profile")
    parser.add_argument("--in-run-steps", type=int, default=5, help="timed steps of the profile's run")
    parser.add_argument(
        "--device",
        choices=DEVICE_TYPES,
        default=None,
        help="where the ranks train and calibrate (default: the one device rule: $NANOTRON_EXT_DEVICE, "
        "else cuda when torch sees a GPU, else cpu); on one GPU the ranks share it, host-staged",
    )
    parser.add_argument("--out", default=None, help="results JSON (default: benchmarks/results/in_run_accuracy.json)")
    parser.add_argument(
        "--raw",
        default=None,
        help="also write every scenario's raw results (every clocked step, every run's steps) to this JSON, for "
        "benchmarks/in_run/estimators.py",
    )
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        ranks.worker(*args.worker)
        return 0
    args.device = device_type(args.device)
    print("$ " + shlex.join(["python", *sys.argv]) + f"  (device: {args.device})")
    chosen = [s for s in SCENARIOS if not args.scenario or s.label in args.scenario]
    folder = Path(tempfile.mkdtemp(prefix="in_run_accuracy_"))
    results, failed, raw = {}, [], {}
    for sc in chosen:
        sc = sc.quick() if args.quick else sc
        start = time.perf_counter()
        result = launch(spec_of(sc, args, folder))
        found, clock = report.rows(result)
        report.print_scenario(result, found, clock)
        verdicts = report.checks(result, found, clock)
        failed += [f"{sc.label}: {name}" for name, ok in verdicts.items() if not ok]
        profiles = {name: json.loads(Path(path).read_text()) for name, path in result["profiles"].items()}
        raw[sc.label] = {**result, "profiles_json": profiles, "config_yaml": Path(result["spec"]["config"]).read_text()}
        results[sc.label] = {
            "rows": [r.__dict__ for r in found],
            "clock": clock,
            "checks": verdicts,
            "profiles": profiles,
            "seconds": time.perf_counter() - start,
        }
        print(f"({time.perf_counter() - start:.0f} s)")
    stem = "in_run_accuracy" + ("_cuda" if args.device == "cuda" else "") + ("_quick" if args.quick else "")
    out = Path(args.out) if args.out else RESULTS / f"{stem}.json"
    out.write_text(json.dumps({"command": sys.argv, "scenarios": results}, indent=1))
    print(f"\nwrote {out}")
    if args.raw:
        Path(args.raw).write_text(json.dumps(raw))
        print(f"wrote {args.raw}")
    if failed:
        print("\nFAILED:\n" + "\n".join(f"  {f}" for f in failed))
    return 0 if args.quick or not failed else 1


if __name__ == "__main__":
    sys.exit(main())
