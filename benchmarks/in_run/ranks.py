"""What runs inside the ranks of one scenario of ``in_run_accuracy.py`` (one process per pipeline stage, gloo, one
thread each):

1. ``calibrate``: the standalone profile (every block alone, the links, the all-reduces);
2. the in-run profile on top of it, as ``calibrate --in-run`` takes it: the config's own split trained for a few
   steps under :class:`~nanotron_ext.runtime.op_clock.OpClock` (``profile_in_context``): ``in-run before``;
3. every split of the scenario (the planner's pick under that profile among them) built once per engine and
   micro-batch count, all alive at once, trained in interleaved rounds (the order rotates every round) with a
   :class:`~nanotron_ext.runtime.timing.StepTimer`; the config's split also runs turns under an ``OpClock``, so its
   cost is measured side by side (issue 41: at most 2 % of a step), and its clocked steps make a second in-run profile,
   ``in-run``, taken in the same rounds as every split it prices: the machine's drift between a calibration and the
   training after it (this VM's speed moves by 10-25 % over minutes to hours) is then out of the comparison, as in a
   run that profiles its own first steps (issue 42). No held-out split is ever clocked.

Rank 0 writes a JSON of everything measured; the launcher's progress bar follows a small file rank 0 rewrites.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

#: The run that times the config's split with the in-run clock installed, beside the same split without it.
CLOCKED = " [clocked]"


def _plan_split(cfg: Any, layout: str, machine: str) -> tuple[int, ...]:
    """The stage of every block: the config's own plan (``plan``), the pick under the in-run profile (``pick``), or
    a layout string."""
    from nanotron_ext.inventory import inventory_from_config
    from nanotron_ext.plan import make_plan

    blocks = inventory_from_config(cfg)
    if layout == "plan":
        return tuple(make_plan(blocks, cfg).block_ranks)
    if layout == "pick":
        return tuple(make_plan(blocks, cfg.with_overrides(machine=machine), "constrained").block_ranks)
    return tuple(make_plan(blocks, cfg.with_overrides(layout=layout), "layout").block_ranks)


class _Progress:
    def __init__(self, path: str, total: int, active: bool) -> None:
        self.path, self.total, self.active, self.done = Path(path), total, active, 0

    def advance(self) -> None:
        self.done += 1
        if self.active:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"done": self.done, "total": self.total}))
            os.replace(tmp, self.path)


def worker(spec_path: str, out_path: str) -> None:
    """One scenario inside this rank (collective); rank 0 writes ``out_path``."""
    import torch.distributed

    from nanotron_ext.config import load_config
    from nanotron_ext.inventory import inventory_from_config
    from nanotron_ext.machine.calibrate import calibrate
    from nanotron_ext.machine.in_run import InRunSplit, in_run_profile, samples_of
    from nanotron_ext.plan.probes import Probe
    from nanotron_ext.runtime import GlooParallelContext
    from nanotron_ext.runtime.in_run_calibrate import build_split, profile_in_context

    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ["RANK"])
    folder = Path(spec["folder"])
    cfg = load_config(spec["config"])
    with GlooParallelContext(
        tensor_parallel_size=1, pipeline_parallel_size=cfg.run.pp, data_parallel_size=1, timeout_s=1800
    ) as ctx:
        standalone = calibrate(cfg, repeats=spec["repeats"], progress=False)
        plan = _plan_split(cfg, "plan", "")
        in_run = profile_in_context(cfg, ctx, standalone, [Probe("plan", plan)], steps=spec["in_run_steps"])
        paths = {
            "standalone": folder / "standalone.json",
            "in-run before": folder / "in_run_before.json",
            "in-run": folder / "in_run.json",
        }
        if rank == 0:
            standalone.save(paths["standalone"])
            in_run.save(paths["in-run before"])
        torch.distributed.barrier(group=ctx.world_pg)  # rank 0's files exist before anyone reads them
        runs = _build(spec, cfg, ctx, str(paths["in-run before"]), build_split)
        progress = _Progress(spec["progress"], spec["rounds"] * len(runs), rank == 0)
        _rounds(spec, cfg, ctx, runs, progress)
        out = {name: _gathered(run) for name, run in runs.items()}
        if rank == 0:
            clocked = next(run for run in runs.values() if run["clocked"])
            split = InRunSplit(tuple(clocked["block_ranks"]), tuple(clocked["steps"]))
            in_run_profile(
                clocked["cfg"],
                inventory_from_config(cfg),
                [split],
                standalone,
                source=f"in_run_accuracy.py {spec['label']}: the clocked turns",
            ).save(paths["in-run"])
            positions = {
                sig: {
                    pos: statistics.fmean(ops.forward) + statistics.fmean(ops.backward)
                    for pos, ops in sample.positions.items()
                    if ops.forward
                }
                for sig, sample in samples_of(inventory_from_config(cfg), cfg, [split]).items()
            }
    if rank == 0:
        Path(out_path).write_text(
            json.dumps(
                {
                    "spec": spec,
                    "runs": out,
                    "profiles": {k: str(p) for k, p in paths.items()},
                    "positions": positions,
                    "splits": {name: list(r["block_ranks"]) for name, r in runs.items()},
                }
            )
        )


def _build(spec: dict[str, Any], cfg: Any, ctx: Any, in_run_path: str, build_split: Any) -> dict[str, dict[str, Any]]:
    """One run per distinct (split, engine, micro-batches), plus the config's split under the clock."""
    from nanotron_ext.runtime.timing import StepTimer

    runs: dict[str, dict[str, Any]] = {}
    models: dict[tuple, Any] = {}
    for split in spec["splits"]:
        ranks = _plan_split(cfg, split["layout"], in_run_path)
        for engine in spec["engines"]:
            for m in spec["micro_batches"]:
                key = (ranks, engine, m)
                name = _run_name(split["name"], engine, m, spec)
                if key in models:
                    models[key]["names"].append(name)
                    continue
                c = cfg.with_overrides(engine=engine, n_micro_batches=m)
                run = build_split(c, ranks, ctx)
                models[key] = {
                    "names": [name],
                    "cfg": c,
                    "run": run,
                    "block_ranks": ranks,
                    "engine": engine,
                    "m": m,
                    "timer": StepTimer(run.model, ctx),
                    "clocked": False,
                    "records": [],
                }
                runs[name] = models[key]
    own = (_plan_split(cfg, "plan", ""), cfg.run.engine, cfg.run.n_micro_batches)
    plan = models[own]
    runs[plan["names"][0] + CLOCKED] = {
        **plan,
        "names": [plan["names"][0] + CLOCKED],
        "clocked": True,
        "records": [],
        "steps": [],
    }
    return runs


def _run_name(split: str, engine: str, m: int, spec: dict[str, Any]) -> str:
    """``plan``, or ``plan zb1p m=8`` where the scenario trains several engines or micro-batch counts."""
    parts = [split]
    if len(spec["engines"]) > 1:
        parts.append(engine)
    if len(spec["micro_batches"]) > 1:
        parts.append(f"m={m}")
    return " ".join(parts)


def _rounds(spec: dict[str, Any], cfg: Any, ctx: Any, runs: dict[str, dict[str, Any]], progress: _Progress) -> None:
    """Every run takes a turn in every round, the order rotating; the first round warms each run up first."""
    from nanotron_ext.runtime.op_clock import OpClock

    names = list(runs)
    for r in range(spec["rounds"]):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            run = runs[name]
            untimed = (spec["warmup"] if r == 0 else 0) + spec["rewarm"]
            timer = OpClock(run["run"].model, ctx) if run["clocked"] else run["timer"]
            with timer as t:
                for i in range(untimed + spec["steps_per_turn"]):
                    with t.step(record=i >= untimed):
                        run["run"].step(run["cfg"], ctx)
                records = (t.timer if run["clocked"] else t).gather()
                clocked = t.gather() if run["clocked"] else None
            if clocked is not None:
                run["steps"] += list(zip(*clocked))
            if records is not None:
                run["records"] += [[rec.to_dict() for rec in per_rank] for per_rank in zip(*records)]
            if not run["clocked"]:
                run["timer"].records.clear()  # the next turn gathers only its own steps
            progress.advance()


def _gathered(run: dict[str, Any]) -> dict[str, Any]:
    """A run's JSON: what it trained and every timed step; a clocked run also every rank's clocked step (kept, so
    that the in-run profile can be priced again from them)."""
    out = {
        "names": run["names"],
        "engine": run["engine"],
        "m": run["m"],
        "block_ranks": list(run["block_ranks"]),
        "clocked": run["clocked"],
        "records": run["records"],
    }
    if run["clocked"]:
        out["steps"] = [[dataclasses.asdict(rank) for rank in step] for step in run["steps"]]
    return out


def scratch_folder() -> Path:
    """A folder for the profiles a run writes (kept: the report prints from them)."""
    return Path(tempfile.mkdtemp(prefix="in_run_accuracy_"))
