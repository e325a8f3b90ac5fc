"""Issues 42 and 53: a run that re-plans itself after K steps and keeps only a plan it measured faster, on Nanotron's
engine (``nanotron-ext train``: the CPU runtime, gloo processes, each rank on a core of its own).

Three cases (``replan_trial/cases.py``) on the SmolLM-135M shape at pp = 2, each run beside its *twin* (the same run
with ``min_gain: 0.99``: it re-plans at the same step and stays), in ``--rounds`` rounds, each round every case once:

* **transient load**: started on the split measured fastest, a CPU hog on rank 0's core during the profiled steps only,
  timed between two twins (twin, run, twin); the run must end no slower than the twins (the median of the steps after
  its trial against the mean of theirs, within the machine's noise: half the gap between the two twins, or a twin's
  median's 95 % half-interval where larger), so its report never calls a slower plan faster;
* **bad start**: most layers on the last stage, a quiet machine; the run must move and end faster than its twin;
* **close call**: one of the two splits that measured fastest in turn (``E,t*7|t,L``; ``E,t*8,N|H,C,X`` is the
  other), at ``min_gain: 0``; the run must try the plans within the profile's error and keep the one measured
  fastest, or one inside the fastest one's interval, when the plans it tried (its own among them) are measured apart
  afterwards (``--apart-rounds`` interleaved rounds of each).

Per case and round it prints what was tried (each candidate's predicted speed), the trial's verdict, the plan kept,
its speed in the trial, the run's and the twin's median step after the trial, and the trial's cost (moves, their
seconds, the steps run on plans not kept, the re-plan's own seconds). Exit 1 unless every case holds in every round.

Usage::

    python benchmarks/replan_cpu.py [--rounds 3] [--steps 32] [--after 6] [--cases A,B] [--out PATH]

About 2.5 minutes a case and round on the 2-core VM (the close call 4).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS, finish, print_command  # noqa: E402
from replan_trial import ranks, report  # noqa: E402
from replan_trial.cases import CASES, Case, Check  # noqa: E402

from nanotron_ext.allocator import MALLOC_ENV  # noqa: E402
from nanotron_ext.procs import local_env, run_local_ranks  # noqa: E402

PP = 2
WORLD_TIMEOUT_S = 1800.0


def _launch(kind: str, spec: dict[str, Any], folder: Path, name: str) -> dict[str, Any]:
    """``ranks.<kind>`` in PP fresh processes; what rank 0 wrote.

    Raises:
        SystemExit: a rank failed or the run passed :data:`WORLD_TIMEOUT_S`.
    """
    spec_path, out_path = folder / f"{name}.spec.json", folder / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    run = run_local_ranks(
        [sys.executable, str(Path(__file__).resolve()), "--worker", kind, str(spec_path), str(out_path)],
        PP,
        timeout=WORLD_TIMEOUT_S,
        grace=0,
        env={**MALLOC_ENV, **local_env(ROOT)},  # the malloc settings every CPU benchmark trains with
        cwd=ROOT,
    )
    if not run.ok or not out_path.exists():
        raise SystemExit(f"{name} {'timed out' if run.deadline_hit else 'failed'}:\n" + run.describe())
    return json.loads(out_path.read_text())


def _case_round(case: Case, k: int, args: argparse.Namespace, folder: Path) -> tuple[report.Row, dict[str, Any]]:
    """The case's run and its twins (see ``order``), and for a close call its plans measured apart."""
    label = case.label.split()[0]
    specs = {
        twin: {"config": str(case.config(folder, twin=twin, after=args.after)), "steps": args.steps, "hog": case.hog}
        for twin in (False, True)
    }
    # A run that must end no slower is timed between two twins (twin, run, twin): the machine's drift between runs,
    # which no run's own steps show, is then the twins' gap and the reference is their mean.
    # A close call is judged by its plans measured apart, not by a twin: it runs none.
    order = {Check.NO_SLOWER: [True, False, True], Check.KEEPS_FASTEST: [False]}.get(
        case.check, [k % 2 == 1, k % 2 == 0]
    )
    runs: list[tuple[bool, dict[str, Any]]] = []
    for i, twin in enumerate(order):
        print(f"  {case.label}, round {k + 1}: {'twin' if twin else 'run'}", flush=True)
        runs.append((twin, _launch("train", specs[twin], folder, f"{label}_{k}_{i}_{'twin' if twin else 'run'}")))
    out = {False: next(o for t, o in runs if not t)}
    twins = [o for t, o in runs if t]
    apart = None
    r = out[False]["replan"]
    if case.check is Check.KEEPS_FASTEST and r["candidates"]:
        layouts = [r["old"]["split"], *(c["split"] for c in r["candidates"])]
        spec = {"config": specs[True]["config"], "layouts": layouts, "rounds": args.apart_rounds, "steps": 2}
        print(f"  {case.label}, round {k + 1}: the {len(layouts)} plans it tried, measured apart", flush=True)
        apart = _launch("measure", spec, folder, f"{label}_{k}_apart")
    return report.row(case, k + 1, out[False], twins, apart), {
        "run": out[False]["replan"],
        "run_steps_s": out[False]["step_times_s"],
        "twin_steps_s": [t["step_times_s"] for t in twins],
        "apart": apart,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--after", type=int, default=6)
    parser.add_argument("--apart-rounds", dest="apart_rounds", type=int, default=6)
    parser.add_argument(
        "--cases",
        type=lambda text: text.split(","),
        default=[c.label.split()[0] for c in CASES],
        help="comma-separated first words of the cases: transient, bad, close",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "replan_cpu.json")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        getattr(ranks, args.worker[0])(*args.worker[1:])
        return 0
    print_command(argv)
    cases = [c for c in CASES if c.label.split()[0] in args.cases]
    rows: list[report.Row] = []
    raw: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="replan_cpu_") as tmp:
        for k in range(args.rounds):
            print(f"\nround {k + 1} of {args.rounds}", flush=True)
            done = [_case_round(case, k, args, Path(tmp)) for case in cases]
            report.print_round([row for row, _ in done])
            rows += [row for row, _ in done]
            raw += [{"case": row.case, "round": row.round, **data} for row, data in done]
    failures = [f"{r.case}, round {r.round}: {r.why}" for r in rows if not r.ok]
    for case in cases:
        held = sum(r.ok for r in rows if r.case == case.label)
        print(f"{case.label}: {case.check.value}: {held} of {args.rounds} rounds")
    return finish(args.out, {"rows": [dataclasses.asdict(r) for r in rows], "runs": raw}, failures)


if __name__ == "__main__":
    raise SystemExit(main())
