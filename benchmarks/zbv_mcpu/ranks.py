"""What runs inside the two ranks of ``zbv_measured_cpu.py`` (gloo, one thread each): calibrate, plan each engine's
split and the V, build one model per (m, engine), train them in turns with every op timed and the heap sampled after
each, and on rank 0 write a JSON of it all."""

from __future__ import annotations

import ctypes
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _in_run_ops import clear_ops, step_ops, tied_sync, time_ops
from zb_mcpu.common import PP

ENGINES = ("1f1b", "zb1p", "zb2p", "zbv")


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
    from nanotron_ext.runtime import GlooParallelContext

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    HEAP = _Heap()
    _instrument()
    ms = spec["ms"]
    with GlooParallelContext(1, PP, 1, timeout_s=900) as ctx:
        cfg = config_from_dict(spec["raw"], source="zbv_measured_cpu")
        blocks = inventory_from_config(cfg)
        machine = calibrate(cfg, progress=False)
        plans, v_plans = _plans(blocks, cfg, machine, ms, Path(spec_path).with_name(f"machine-{dist.get_rank()}.json"))
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
            out = _result(blocks, cfg, machine, plans, v_plans)
            Path(out_path).write_text(
                json.dumps({**out, "train_s": train_s, "runs": gathered, "load_average": os.getloadavg()[0]})
            )


def _plans(blocks: Any, cfg: Any, machine: Any, ms: Sequence[int], profile: Path) -> tuple[dict[str, Any], dict]:
    """Each contiguous engine's plan per m (``engine@m``) and the V's per m, under ``machine`` (saved at
    ``profile``)."""
    from nanotron_ext.plan import make_plan
    from nanotron_ext.plan.v_plan import make_v_plan

    # Each contiguous engine on the split the planner gives it under this profile (its default strategy), as
    # `plan --engine E --machine` would: every engine on its own best split, the V on its own.
    profile.write_text(machine.to_json())
    plans = {
        f"{e}@{m}": make_plan(blocks, cfg.with_overrides(engine=e, n_micro_batches=m, machine=str(profile)))
        for m in ms
        for e in ENGINES
        if e != "zbv"
    }
    v_plans = {m: make_v_plan(blocks, cfg.with_overrides(n_micro_batches=m, machine=str(profile))) for m in ms}
    return plans, v_plans


def _result(blocks: Any, cfg: Any, machine: Any, plans: dict[str, Any], v_plans: dict) -> dict[str, Any]:
    """Rank 0's JSON but the runs: the splits, the V's stages and orders, and each plan's transfers as priced."""
    from nanotron_ext.simulate import simulate_plan

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
    return {
        "ranks": {k: list(p.block_ranks) for k, p in plans.items()},
        "machine": machine.name,
        "stages": {m: p.stages for m, p in v_plans.items()},
        "orders": {m: [[list(op) for op in ops] for ops in p.order] for m, p in v_plans.items()},
        "v_planned": {m: p.step_time for m, p in v_plans.items()},
        "v_p2p": {m: p.p2p for m, p in v_plans.items()},
        "tied_sync": tied_sync(cfg, machine),
        "p2p": p2p,
    }


def plan_m(key: str) -> int:
    """The micro-batch count of a run's key (``engine@m``)."""
    return int(key.split("@")[1])
