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

import ctypes
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _in_run_ops import (  # noqa: E402
    clear_ops,
    in_run_stages,
    per_step_ratios,
    step_ops,
    step_times,
    tied_sync,
    time_ops,
)
from zb_measured_cpu import launch, median_interval, raw_config, run_args  # noqa: E402

from nanotron_ext.report import table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PP = 2
ENGINES = ("1f1b", "zb1p", "zb2p", "zbv")
SIM_WITHIN = 0.05
WORLD_TIMEOUT_S = 1800.0


# --- inside the two ranks ------------------------------------------------------------------------------


class _Heap:
    """Heap bytes in use in this process (glibc ``mallinfo2``: every arena, so every thread, fibers included)."""

    def __init__(self) -> None:
        class Info(ctypes.Structure):
            _fields_ = [
                (n, ctypes.c_size_t)
                for n in (
                    "arena",
                    "ordblks",
                    "smblks",
                    "hblks",
                    "hblkhd",
                    "usmblks",
                    "fsmblks",
                    "uordblks",
                    "fordblks",
                    "keepcost",
                )
            ]

        self._libc = ctypes.CDLL("libc.so.6")
        self._libc.mallinfo2.restype = Info
        self.peak = 0

    def used(self) -> int:
        info = self._libc.mallinfo2()
        return int(info.uordblks + info.hblkhd)

    def sample(self) -> None:
        self.peak = max(self.peak, self.used())


HEAP: _Heap | None = None
V_OPS: list[tuple[str, int, float]] = []  # (kind, virtual stage, own seconds) of the zbv ops of the current step


def _instrument() -> None:
    """Time every op (waits on peers left out) and sample the heap after each: Nanotron's F and B and the W of
    zb1p/zb2p (``_in_run_ops.time_ops``), and each op of the V engine (its forwards pause inside Nanotron's F, so
    they are timed here, one chunk each)."""
    from nanotron.parallel.pipeline_parallel.engine import PipelineEngine

    from nanotron_ext.runtime.timing import StepTimer
    from nanotron_ext.zero_bubble import engine, v_engine

    time_ops()

    def sampled(fn: Any) -> Any:
        def op(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            finally:
                HEAP.sample()

        return op

    PipelineEngine.forward = sampled(PipelineEngine.forward)
    PipelineEngine.backward = sampled(PipelineEngine.backward)
    engine.accumulate_weight_gradients = sampled(engine.accumulate_weight_gradients)
    do = v_engine._VRun.do

    def timed_do(self: Any, op: Any) -> None:
        timer = StepTimer.installed()
        t0, w0 = time.perf_counter(), timer.waited() if timer else 0.0
        try:
            do(self, op)
        finally:
            V_OPS.append((op.kind, op.stage, time.perf_counter() - t0 - ((timer.waited() if timer else 0.0) - w0)))
            HEAP.sample()

    v_engine._VRun.do = timed_do


def _build_runs(
    cfg: Any, ctx: Any, ranks: dict[str, list[int]], v_plans: dict[int, Any], ms: Sequence[int]
) -> dict[str, Any]:
    import torch

    from nanotron_ext.models.profiled_blocks import llama_config_from_shape
    from nanotron_ext.runtime import build_cpu_llama, build_optimizer, random_micro_batches
    from nanotron_ext.runtime.timing import StepTimer
    from nanotron_ext.zero_bubble.v_engine import ZeroBubbleVPipelineEngine

    lcfg = llama_config_from_shape(cfg)
    runs = {}
    for m in ms:
        for engine in ENGINES:
            torch.manual_seed(0)
            placed = {"v_stages": v_plans[m].stages} if engine == "zbv" else {"block_ranks": ranks[f"{engine}@{m}"]}
            pipeline = (
                ZeroBubbleVPipelineEngine(order=lambda pp, m, o=v_plans[m].order: o) if engine == "zbv" else engine
            )
            model = build_cpu_llama(lcfg, ctx, **placed)
            optimizer, grad_acc = build_optimizer(model, ctx, learning_rate=1e-4)
            runs[f"{engine}@{m}"] = {
                "engine": pipeline,
                "name": engine,
                "m": m,
                "model": model,
                "optimizer": optimizer,
                "grad_acc": grad_acc,
                "batches": random_micro_batches(model, ctx, lcfg.vocab_size, 1, cfg.run.sequence_length),
                "timer": StepTimer(model, ctx),
                "ops": [],
                "v_ops": [],
                "peaks": [],
                "losses": [],
            }
    return runs


def _step(run: dict[str, Any], ctx: Any, record: bool) -> None:
    from nanotron_ext.runtime import train_step

    clear_ops()
    V_OPS.clear()
    HEAP.peak = start = HEAP.used()
    with run["timer"] as timer, timer.step(record=record):
        run["losses"].append(
            train_step(
                run["model"],
                ctx,
                run["engine"],
                run["batches"],
                run["m"],
                run["optimizer"],
                grad_accumulator=run["grad_acc"],
                clip_grad=None,
            )
        )
    if record:
        run["ops"].append(step_ops())
        run["v_ops"].append(list(V_OPS))
        run["peaks"].append(HEAP.peak - start)


def _gathered(runs: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    out = {}
    for key, run in runs.items():
        per_rank = run["timer"].gather()
        mine = {"ops": run["ops"], "v_ops": run["v_ops"], "peaks": run["peaks"]}
        every: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, every, dst=0)
        if per_rank is not None:
            out[key] = {
                "engine": run["name"],
                "m": run["m"],
                "losses": run["losses"],
                "records": [[rec.to_dict() for rec in recs] for recs in per_rank],
                **{k: [r[k] for r in every] for k in mine},
            }
    return out


def worker(spec_path: str, out_path: str) -> None:
    """One rank: calibrate, plan both splits, train every (m, engine) model in turns; rank 0 writes the JSON."""
    global HEAP
    import torch
    import torch.distributed as dist

    from nanotron_ext.config import config_from_dict
    from nanotron_ext.inventory import inventory_from_config
    from nanotron_ext.machine.calibrate import calibrate
    from nanotron_ext.plan import make_plan
    from nanotron_ext.plan.v_plan import make_v_plan
    from nanotron_ext.runtime import GlooParallelContext
    from nanotron_ext.simulate import simulate_plan

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    HEAP = _Heap()
    _instrument()
    ms = spec["ms"]
    with GlooParallelContext(1, PP, 1, timeout_s=900) as ctx:
        cfg = config_from_dict(spec["raw"], source="zbv_measured_cpu")
        blocks = inventory_from_config(cfg)
        machine = calibrate(cfg, progress=False)
        # Each contiguous engine on the split the planner gives it under this profile (its default strategy), as
        # `plan --engine E --machine` would: every engine on its own best split, the V on its own.
        profile = Path(spec_path).with_name(f"machine-{dist.get_rank()}.json")
        profile.write_text(machine.to_json())
        plans = {
            f"{e}@{m}": make_plan(blocks, cfg.with_overrides(engine=e, n_micro_batches=m, machine=str(profile)))
            for m in ms
            for e in ENGINES
            if e != "zbv"
        }
        v_plans = {m: make_v_plan(blocks, cfg.with_overrides(n_micro_batches=m, machine=str(profile))) for m in ms}
        runs = _build_runs(cfg, ctx, {k: list(p.block_ranks) for k, p in plans.items()}, v_plans, ms)
        for run in runs.values():
            for _ in range(spec["warmup"]):
                _step(run, ctx, record=False)
        t0 = time.perf_counter()
        for r in range(spec["rounds"]):
            for m in ms:
                for engine in ENGINES if r % 2 == 0 else ENGINES[::-1]:
                    _step(runs[f"{engine}@{m}"], ctx, record=True)
        train_s = time.perf_counter() - t0
        gathered = _gathered(runs)
        if dist.get_rank() == 0:
            p2p = {
                k: list(
                    simulate_plan(
                        plan,
                        blocks,
                        cfg.with_overrides(n_micro_batches=plan_m(k)),
                        machine=machine,
                        engine=k.split("@")[0],
                    ).p2p_times
                )
                for k, plan in plans.items()
            }
            Path(out_path).write_text(
                json.dumps(
                    {
                        "ranks": {k: list(p.block_ranks) for k, p in plans.items()},
                        "machine": machine.name,
                        "stages": {m: p.stages for m, p in v_plans.items()},
                        "orders": {m: [[list(op) for op in ops] for ops in p.order] for m, p in v_plans.items()},
                        "v_planned": {m: p.step_time for m, p in v_plans.items()},
                        "v_p2p": {m: p.p2p for m, p in v_plans.items()},
                        "tied_sync": tied_sync(cfg, machine),
                        "p2p": p2p,
                        "train_s": train_s,
                        "runs": gathered,
                        "load_average": os.getloadavg()[0],
                    }
                )
            )


def plan_m(key: str) -> int:
    """The micro-batch count of a run's key (``engine@m``)."""
    return int(key.split("@")[1])


# --- the report ----------------------------------------------------------------------------------------


def v_chunks(run: dict[str, Any]) -> list[Any]:
    """The V's four chunks as the run timed them: mean F, B and W per virtual stage, and each rank's update (its
    busy time after the pipeline) on its down chunk. No tied all-reduce: both ends of the tie are on rank 0."""
    from nanotron_ext.schedule.simulator import StageTimes
    from nanotron_ext.schedule.zbv import v_rank

    out = []
    for s in range(2 * PP):
        rank = v_rank(PP, s)
        mean = {
            k: statistics.fmean([t for step in run["v_ops"][rank] for kind, st, t in step if (kind, st) == (k, s)])
            for k in "FBW"
        }
        after = statistics.fmean(r["busy"] - (r["pipeline"] - r["pipeline_idle"]) for r in run["records"][rank])
        out.append(
            StageTimes(
                forward=mean["F"], backward=mean["B"] + mean["W"], weight=mean["W"], update=after if s < PP else 0.0
            )
        )
    return out


def simulated(result: dict[str, Any], run: dict[str, Any]) -> float:
    """The step the simulator gives ``run``'s engine (its own program) under ``run``'s own ops."""
    from nanotron_ext.schedule.simulator import simulate
    from nanotron_ext.schedule.v_replay import replay_v_order
    from nanotron_ext.schedule.zbv import VOp

    m, engine = run["m"], run["engine"]
    if engine == "zbv":
        order = [[VOp(k, int(j), int(st)) for k, j, st in ops] for ops in result["orders"][str(m)]]
        return replay_v_order(order, v_chunks(run), m, result["v_p2p"][str(m)]).step_time
    return simulate(
        in_run_stages(run, result["tied_sync"]), m, engine, p2p_time=result["p2p"][f"{engine}@{m}"]
    ).step_time


def report(result: dict[str, Any], ms: Sequence[int]) -> tuple[list[list[Any]], bool]:
    """The table's rows, and whether every engine's step replayed under its own ops is within ``SIM_WITHIN`` of the
    measured one (the median over the timed steps of :func:`per_step_ratios`)."""
    rows, holds = [], True
    for m in ms:
        ref = result["runs"][f"1f1b@{m}"]
        ref_peak = statistics.median(max(p) for p in zip(*ref["peaks"]))
        for engine in ENGINES:
            run = result["runs"][f"{engine}@{m}"]
            measured = statistics.median(step_times(run))
            gain = "-"
            if engine != "1f1b":
                med, lo, hi, _ = median_interval([a / b for a, b in zip(step_times(ref), step_times(run))])
                gain = f"{med:.3f}× [{lo:.3f}, {hi:.3f}]"
            sim = simulated(result, run)
            each = per_step_ratios(run, lambda one: simulated(result, one))
            holds &= abs(statistics.median(each) - 1) <= SIM_WITHIN
            peak = statistics.median(max(p) for p in zip(*run["peaks"]))
            rows.append(
                [
                    m,
                    engine,
                    f"{measured * 1e3:.0f}",
                    gain,
                    f"{sim * 1e3:.0f}",
                    f"{sim / measured:.3f}",
                    f"{statistics.median(each):.3f} [{min(each):.3f}, {max(each):.3f}]",
                    f"{peak / 2**20:.0f}",
                    f"{peak / ref_peak:.2f}",
                ]
            )
    return rows, holds


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
    print(
        "Each engine on its own split under the profile calibrated in the run: 1F1B, zb1p and zb2p the planner's "
        "default (block ranks), zbv the V make_v_plan cuts (virtual stages; rank 0 holds chunks 0 and 3):\n"
    )
    for key, ranks in result["ranks"].items():
        print(f"- {key}: {ranks}")
    for m, stages in result["stages"].items():
        print(f"- zbv@{m}: {stages}")
    print()
    rows, holds = report(result, ms)
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
    print(
        f"\nCHECK (every engine's step, replayed under its own ops, within {SIM_WITHIN:.0%} of measured at the median "
        f"over steps): {'HOLDS' if holds else 'DOES NOT HOLD'}"
    )
    print(
        f"\n{time.perf_counter() - started:.0f} s in all ({result['train_s']:.0f} s training); load average at the "
        f"end {result['load_average']:.1f}"
    )
    return 0 if holds else 1


if __name__ == "__main__":
    sys.exit(main())
