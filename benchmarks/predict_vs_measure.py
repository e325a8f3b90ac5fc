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

Usage: ``python benchmarks/predict_vs_measure.py [--quick] [--scenario LABEL ...] [--rounds R]
[--system-malloc]``. Exit status 1 when a check fails: predicted ÷ measured outside [0.95, 1.05] on any split,
a significant misordered pair, or the default not measured fastest (within the fastest one's interval).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _repeatability as repeatability  # noqa: E402
from measured_cpu import MALLOC_ENV, SYSTEM_MALLOC_ENV  # noqa: E402
from pvm.scenarios import ENGINE, RESULTS, ROOT, RankSpec, Scenario, scenarios  # noqa: E402
from pvm.splits import layout_of  # noqa: E402

from nanotron_ext.machine import load_machine  # noqa: E402
from nanotron_ext.procs import local_env, run_local_ranks  # noqa: E402
from nanotron_ext.stats import kendall_tau, median_interval  # noqa: E402

WORLD_TIMEOUT_S = 600.0
RATIO_RANGE = (0.95, 1.05)
CONFIDENCE = 0.95


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
            run = run_local_ranks([sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path),
                                   str(out_path)], spec.pp, timeout=WORLD_TIMEOUT_S, grace=0, env=env, cwd=ROOT)
        finally:
            stop.set()
            follower.join()
            bar.close()
        if not run.ok or not out_path.exists():
            raise RuntimeError(f"scenario {spec.label!r} {'timed out' if run.deadline_hit else 'failed'}:\n"
                               + run.describe())
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


# --- analysis and report ---------------------------------------------------------------------------------


@dataclass
class Row:
    """One split of one scenario, measured and predicted (seconds)."""

    name: str
    same_as: str | None  # an earlier split with the same model: trained once
    stages: list[str]
    ok: bool
    vocab_shards: int
    steps: list[float]  # every timed step, slowest rank
    median: float
    low: float
    high: float
    coverage: float
    predicted: float
    predicted_planning: float
    predicted_one_p2p: float

    @property
    def ratio(self) -> float:
        return self.predicted / self.median


def step_times(run: dict[str, Any]) -> list[float]:
    """Every timed step of a model: the slowest rank's (its clock stops at the closing barrier)."""
    records = run["records"]
    return [max(rank[i]["step"] for rank in records) for i in range(len(records[0]))]


def analyse(result: dict[str, Any]) -> list[Row]:
    rows, first = [], {}
    for name, s in result["splits"].items():
        run = next(r for r in result["runs"].values() if name in r["names"])
        steps = step_times(run)
        low, high, coverage = median_interval(steps)
        same = first.setdefault(s["key"], name)
        rows.append(Row(name, None if same == name else same, s["stages"], s["ok"], s["vocab_shards"], steps,
                        statistics.median(steps), low, high, coverage, s["predicted"], s["predicted_planning"],
                        s.get("predicted_one_p2p", math.nan)))
    return rows


def print_splits(rows: Sequence[Row]) -> None:
    from nanotron_ext.report import table

    head = ["split", "K", "stages", "valid", "steps", "measured ms", "95% interval ms", "predicted ms",
            "pred ÷ meas", "pred, planning profile ms", "pred, one p2p for every cut ÷ meas"]
    cells = []
    for r in rows:
        interval = f"{r.low * 1e3:.1f}–{r.high * 1e3:.1f}" + ("" if r.coverage >= CONFIDENCE else
                                                                 f" ({r.coverage:.0%})")
        cells.append([r.name + (f" (= {r.same_as})" if r.same_as else ""), r.vocab_shards, " / ".join(r.stages),
                      "yes" if r.ok else "NO (no gradient on a stage; its optimizer skipped)", len(r.steps),
                      f"{r.median * 1e3:.1f}", interval, f"{r.predicted * 1e3:.1f}", f"{r.ratio:.3f}",
                      f"{r.predicted_planning * 1e3:.1f}", f"{r.predicted_one_p2p / r.median:.3f}"])
    print(table(head, cells, markdown=True))


def order_checks(label: str, rows: Sequence[Row]) -> dict[str, Any]:
    """Kendall's τ, significant misordered pairs and the default's rank, over the distinct splits."""
    distinct = [r for r in rows if r.same_as is None]
    tau = kendall_tau([r.median for r in distinct], [r.predicted for r in distinct])
    misordered = [(a, b) for a in distinct for b in distinct if a.high < b.low and a.predicted > b.predicted]
    print(f"\n{label}: Kendall τ (measured vs predicted order, {len(distinct)} distinct splits) = {tau:.2f}")
    for a, b in misordered:
        print(f"  MISORDERED: {a.name} measured faster ({a.median * 1e3:.1f} ms, interval up to {a.high * 1e3:.1f}) "
              f"than {b.name} ({b.median * 1e3:.1f} ms, from {b.low * 1e3:.1f}), predicted slower "
              f"({a.predicted * 1e3:.1f} vs {b.predicted * 1e3:.1f} ms)")
    if not misordered:
        print("  no pair with disjoint intervals is predicted in the opposite order")
    valid = [r for r in distinct if r.ok]
    fastest = min(valid, key=lambda r: r.median)
    default = next((r for r in rows if r.name == "default"), None)
    bad_ratio = [r for r in distinct if not RATIO_RANGE[0] <= r.ratio <= RATIO_RANGE[1]]
    checks = {"tau": tau, "misordered": [[a.name, b.name] for a, b in misordered], "default_ok": True,
              "fastest": fastest.name, "bad_ratio": [[r.name, r.ratio] for r in bad_ratio]}
    if default is None:  # hand layouts only (issue 32's scenario)
        return checks
    checks["default_ok"] = default_ok = default.median <= fastest.high
    where = "the fastest" if default is fastest or default.same_as == fastest.name else (
        f"within the fastest one's interval ({fastest.name}, {fastest.median * 1e3:.1f} ms, "
        f"{fastest.low * 1e3:.1f}–{fastest.high * 1e3:.1f})" if default_ok else
        f"NOT within the fastest one's interval ({fastest.name}, {fastest.median * 1e3:.1f} ms, "
        f"{fastest.low * 1e3:.1f}–{fastest.high * 1e3:.1f})")
    print(f"  default under the profile ({default.median * 1e3:.1f} ms) among the {len(valid)} valid splits: {where}")
    return checks


def print_chain(result: dict[str, Any], rows: Sequence[Row]) -> dict[str, Any]:
    """The measured gain of each chain over K=1 (the default), and what ``auto`` picks under the profile."""
    by_name = {r.name: r for r in rows}
    default = by_name["default"]
    for r in rows:
        if r.name.startswith("chain"):
            print(f"  {r.name}: measured {default.median / r.median:.3f}x as fast as K=1 (default), "
                  f"predicted {default.predicted / r.predicted:.3f}x")
    auto = result["auto"]
    if auto is None:
        return {}
    picked = by_name.get(auto["same_as"]) if auto["same_as"] else None
    times = ", ".join(f"K={k}: {t * 1e3:.1f} ms" for k, t in auto["step_times"].items())
    gain = default.median / picked.median if picked else math.nan
    what = f"= the '{picked.name}' split, measured gain vs K=1 {gain:.3f}x" if picked else "(a split not trained)"
    print(f"  vocab_shards: auto under the planning profile picks K={auto['shards']} {what}; "
          f"its simulated steps: {times}")
    later = result["auto_median"]
    print(f"  (under the median of the run's profiles auto would pick K={later['shards']}: "
          + ", ".join(f"K={k}: {t * 1e3:.1f} ms" for k, t in later["step_times"].items()) + ")")
    return {"auto_shards": auto["shards"], "auto_gain": gain, "auto_shards_median": later["shards"]}


def measured_parts(records: Sequence[dict[str, float]]) -> dict[str, float]:
    """One rank's step taken apart (medians over timed steps): compute inside the pipeline, receive and send
    waits, the wait in collectives after it, the busy time after it (update), and the closing wait."""
    def med(f: Callable[[dict[str, float]], float]) -> float:
        return statistics.median(f(r) for r in records)

    return {"step": med(lambda r: r["step"]), "compute": med(lambda r: r["pipeline"] - r["pipeline_idle"]),
            "recv": med(lambda r: r["recv_wait"]), "send": med(lambda r: r["send_wait"]),
            "after_wait": med(lambda r: r["collective_wait"]),
            "update": med(lambda r: r["busy"] - (r["pipeline"] - r["pipeline_idle"])),
            "end": med(lambda r: r["end_wait"]), "cpu": med(lambda r: r["cpu"]), "idle": med(lambda r: r["idle"])}


PIPELINE_HEAD = ["split", "stage", "step meas", "step pred", "compute meas", "compute pred", "blocks alone",
                 "blocks, all ranks busy", "engine overhead meas", "engine overhead pred", "recv wait meas",
                 "recv wait + transfer pred", "send wait meas"]
AFTER_HEAD = ["split", "stage", "after-pipeline wait meas", "after-pipeline wait pred", "update meas",
              "update pred", "optimizer, all ranks busy", "closing wait meas", "CPU meas", "busy meas"]


def print_parts(result: dict[str, Any], sc: Scenario) -> dict[str, Any]:
    """Item 3: per stage, the measured step's parts next to the profile's prediction of each (ms)."""
    from nanotron_ext.report import table

    inside, after, out, notes = [], [], {}, []
    for name in sc.decompose:
        split = result["splits"][name]
        run = next(r for r in result["runs"].values() if name in r["names"])
        pred = split["parts"]
        out[name] = {"measured": [measured_parts(recs) for recs in run["records"]], "predicted": pred}
        for k, (meas, p) in enumerate(zip(out[name]["measured"], pred["stages"])):
            where = [name, f"PP{k}: {split['stages'][k]}"]
            inside.append(where + _ms(meas["step"], pred["step"], meas["compute"], p["profiled"] + p["overhead"],
                                      p["profiled"], p["profiled_busy"], meas["compute"] - p["profiled"],
                                      p["overhead"], meas["recv"], p["pipeline_wait"], meas["send"]))
            after.append(where + _ms(meas["after_wait"], p["after_wait"], meas["update"], p["update"],
                                     p["update_busy"], meas["end"], meas["cpu"], meas["step"] - meas["idle"]))
        counts = "; ".join(f"PP{k} sends {sent} and receives {got}" for k, (sent, got) in enumerate(run["tensors"]))
        notes.append(f"{name}: tensors through P2P per step: {counts} (Nanotron sends each tensor of a cut "
                     f"separately, one per communication call; the profile prices one transfer per micro-batch "
                     f"and direction: {sc.n_micro_batches} each way per cut)")
        if run["exchange"]:
            x = run["exchange"]
            notes.append(f"{name}: one micro-batch's exchange across the cut (activations one way, gradients the "
                         f"other), timed between the ranks: {x['one per call'] * 1e3:.2f} ms one tensor per call "
                         f"as Nanotron's pipeline state does it, {x['all sends first'] * 1e3:.2f} ms with every send "
                         f"posted first; the profile prices two transfers, {2 * pred['p2p'][0] * 1e3:.2f} ms")  # pp=2: one cut
        lost = pred["step"] - pred["eager_step"]
        notes.append(f"{name}: simulated step {pred['step'] * 1e3:.1f} ms with Nanotron's send order, "
                     f"{pred['eager_step'] * 1e3:.1f} ms with every send posted as soon as its tensor exists "
                     f"({lost * 1e3:.1f} ms, {lost / pred['step']:.1%} of the step, lost to deferred sends)")
    if not inside:
        return out
    print(f"\nWhere the time goes (item 3), medians over timed steps, ms; m = {sc.n_micro_batches}. Inside the "
          f"pipeline:")
    print(table(PIPELINE_HEAD, inside, markdown=True))
    print("\nAfter the pipeline:")
    print(table(AFTER_HEAD, after, markdown=True))
    print("\n" + "\n".join(notes))
    print("compute: busy inside the pipeline (until this rank's engine is done and its sends taken); blocks alone: "
          "m × the stage's blocks' profiled forward + backward (rank 0 timing them while the others wait), all "
          "ranks busy: the same timed on every rank at once; engine overhead: compute − blocks alone (pred: the "
          "profile's per-call overhead); recv wait + transfer pred: the simulated stage's idle time inside the "
          "pipeline; after-pipeline wait: in collectives after the pipeline (loss broadcast, tied all-reduce; pred: "
          "until the slowest stage's pipeline ends); update: busy after the pipeline (optimizer, gradient syncs); "
          "closing wait: the barrier that ends the timed step; CPU: the main thread's CPU time over the step.")
    return out


def print_send_order(result: dict[str, Any], rows: Sequence[Row]) -> dict[str, Any]:
    """Item 3's candidate engine fix: each split with every queued send posted at once (``sends="eager"``)
    against Nanotron's order (one tensor of a cut per communication call), same model, same rounds."""
    from nanotron_ext.report import table

    by_name, cells, out = {r.name: r for r in rows}, [], {}
    for run in result["runs"].values():
        if run["sends"] != "eager":
            continue
        base = by_name[run["of"]]
        steps = step_times(run)
        med, (low, high, _) = statistics.median(steps), median_interval(steps)
        out[run["of"]] = {"eager": med, "nanotron": base.median, "gain": base.median / med}
        cells.append([run["of"], f"{base.median * 1e3:.1f}", f"{base.low * 1e3:.1f}–{base.high * 1e3:.1f}",
                      f"{med * 1e3:.1f}", f"{low * 1e3:.1f}–{high * 1e3:.1f}", f"{base.median / med:.3f}",
                      f"{base.low / high:.3f}–{base.high / low:.3f}", f"{base.predicted * 1e3:.1f}",
                      f"{base.predicted / med:.3f}"])
    if cells:
        print("\nEvery queued send posted at once (nanotron_ext.runtime.send_order, sends=\"eager\") against "
              "Nanotron's order (one tensor of a cut per communication call, the rows above), same model, same "
              "rounds:")
        print(table(["split", "Nanotron's order ms", "95% interval", "eager ms", "95% interval", "gain of eager",
                     "gain, from the intervals", "predicted ms", "pred ÷ meas, eager"], cells, markdown=True))
    return out


def _ms(*seconds: float) -> list[str]:
    return [f"{x * 1e3:.1f}" for x in seconds]


def run_scenario(sc: Scenario, args: argparse.Namespace, stem: str) -> dict[str, Any]:
    """Launch one scenario, print its report, return its record for the JSON file (``checks_count``: whether
    its checks decide the exit status)."""
    paths = {kind: str(RESULTS / f"{stem}_{sc.label}_profile_{kind}.json") for kind in ("planning", "median")}
    spec = RankSpec.of(sc, paths["planning"], paths["median"])
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    result = launch(spec, malloc_env=not args.system_malloc)
    oversubscribed = sc.pp > (os.cpu_count() or 1)
    print(f"\n## {sc.label}: {sc.notes}; {sc.rounds} rounds × ({sc.rewarm} untimed + {sc.steps_per_turn} timed) "
          f"per split, calibrate {spec.n_calibrations}× (first: {result['calibrate_s']:.1f} s); wall "
          f"{time.perf_counter() - t0:.0f} s; load average {load0:.2f} before, {min(result['load_average']):.2f}–"
          f"{max(result['load_average']):.2f} during")
    if oversubscribed:
        print(f"OVERSUBSCRIBED: {sc.pp} processes on {os.cpu_count()} CPUs: ranks take turns on the cores, so "
              f"measured steps include time a rank was runnable but not running; the checks below are printed "
              f"but do not decide the exit status.")
    print(f"profile (median of the run's calibrations): {load_machine(paths['median']).describe()}; files: "
          f"{', '.join(str(Path(p).relative_to(ROOT)) for p in paths.values())}\n")
    rows = analyse(result)
    print_splits(rows)
    checks = order_checks(sc.label, rows)
    if any(r.name.startswith("chain") for r in rows):
        checks |= print_chain(result, rows)
    parts = print_parts(result, sc)
    checks["send_order"] = print_send_order(result, rows)
    if sc.calibrations_first > 1:
        checks["repeatability"] = repeatability.report(result, spec.raw, rows, dict(sc.layouts), layout_of,
                                                        sc.repeatable)
    return {"scenario": dataclasses.asdict(sc), "result": result, "rows": [dataclasses.asdict(r) for r in rows],
            "checks": checks, "parts": parts, "checks_count": not oversubscribed}


def print_verdict(records: dict[str, dict[str, Any]]) -> bool:
    """The checks over every scenario; True when all that count hold."""
    lo, hi = RATIO_RANGE
    ok = True
    print("\n" + "=" * 100)
    for label, rec in records.items():
        c = rec["checks"]
        bad = ", ".join(f"{n} {x:.3f}" for n, x in c["bad_ratio"])
        holds = (not c["bad_ratio"] and not c["misordered"] and c["default_ok"]
                 and c.get("repeatability", {}).get("holds", True))
        ok &= holds or not rec["checks_count"]
        note = "" if rec["checks_count"] else " (oversubscribed: not counted)"
        print(f"{'HOLDS' if holds else 'FAILS'}: {label}{note}: pred ÷ meas within [{lo}, {hi}]: "
              f"{'yes' if not bad else 'no — ' + bad}; significant misordered pairs: {len(c['misordered'])}; "
              f"default measured fastest or within the fastest's interval: {'yes' if c['default_ok'] else 'no'}; "
              f"Kendall τ {c['tau']:.2f}" + repeatability.verdict(c.get("repeatability")))
    print(f"CHECKS: {'ALL HOLD' if ok else 'SOME FAIL'}")
    print("=" * 100)
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        from pvm.ranks import worker  # torch and Nanotron's runtime: only the ranks load them

        worker(argv[1], argv[2])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller models, fewer rounds (a minute or two)")
    parser.add_argument("--scenario", action="append", default=None, metavar="LABEL",
                        help="run only this scenario (repeatable): seed-pp2, smollm-m2, smollm-m4, smollm-pp3, "
                        "smollm-layouts, seed-pp4")
    parser.add_argument("--rounds", type=int, default=None, help="rounds in which every split takes a turn")
    parser.add_argument("--calibrate-every", type=int, default=None, metavar="N",
                        help="calibrate again after every N rounds (pairs each calibration with the steps measured "
                        "beside it in time)")
    parser.add_argument("--system-malloc", action="store_true",
                        help="leave glibc malloc's defaults (default: keep freed memory, see measured_cpu.MALLOC_ENV)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the ranks compute (NANOTRON_EXT_DEVICE; cuda: one GPU, P2P host-staged over gloo)")
    args = parser.parse_args(argv)
    os.environ["NANOTRON_EXT_DEVICE"] = args.device  # every rank inherits it (nanotron_ext.runtime.device)
    known = {sc.label: sc for sc in scenarios(args.quick)}
    unknown = set(args.scenario or ()) - set(known)
    if unknown or (args.rounds is not None and args.rounds < 1):
        parser.error(f"unknown scenario {sorted(unknown)} (known: {', '.join(known)}) or --rounds < 1")
    if args.calibrate_every is not None and args.calibrate_every < 0:
        parser.error(f"--calibrate-every {args.calibrate_every}: a number of rounds, 0 (calibrate only before "
                     f"training) or more")
    chosen = [sc for label, sc in known.items() if args.scenario is None or label in args.scenario]
    if args.rounds is not None:
        chosen = [dataclasses.replace(sc, rounds=args.rounds) for sc in chosen]
    if args.calibrate_every is not None:
        chosen = [dataclasses.replace(sc, calibrate_every=args.calibrate_every) for sc in chosen]
    print(f"Reproduce: `python {shlex.join(['benchmarks/predict_vs_measure.py', *argv])}` (from the repository root)\n")
    import torch

    where = "CPU (gloo)" if args.device == "cpu" else "one CUDA GPU (P2P host-staged over gloo)"
    print(f"Nanotron 0.2 {ENGINE} engine on {where}, one thread per process, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs; glibc malloc: {'defaults' if args.system_malloc else 'freed memory kept'}; "
          f"per split 1 warm-up step first; steps: the slowest rank's full train_step (no clipping)")
    # A run of some scenarios only (--scenario) does not overwrite the full run's files.
    stem = ("predict_vs_measure" + ("_cuda" if args.device == "cuda" else "") + ("_quick" if args.quick else "")
            + ("_partial" if args.scenario else ""))
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
