"""What runs inside the two ranks of ``zb_measured_cpu.py`` (gloo, one thread each): calibrate, plan one split,
build one model per (m, engine) on it, train them in turns, each op timed, and on rank 0 write a JSON of it all."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _in_run_ops import clear_ops, step_ops, tied_sync, time_ops  # the ops as the run times them

from zb_mcpu.common import PP

ENGINES = ("1f1b", "zb1p", "zb2p")
ZERO_BUBBLE = ENGINES[1:]
STRATEGY = "flops"


def _build_runs(cfg: Any, ctx: Any, ranks: list[int], ms: Sequence[int]) -> dict[str, dict[str, Any]]:
    """One model per (m, engine), same init and split, each with its optimizer, data and timer."""
    import torch

    from nanotron_ext.models.profiled_blocks import llama_config_from_shape
    from nanotron_ext.runtime import build_cpu_llama, build_optimizer, random_micro_batches
    from nanotron_ext.runtime.timing import StepTimer

    lcfg = llama_config_from_shape(cfg)
    runs = {}
    for m in ms:
        for engine in ENGINES:
            torch.manual_seed(0)
            model = build_cpu_llama(lcfg, ctx, block_ranks=ranks)
            optimizer, grad_acc = build_optimizer(model, ctx, learning_rate=1e-4)
            runs[f"{engine}@{m}"] = {
                "engine": engine,
                "m": m,
                "model": model,
                "optimizer": optimizer,
                "grad_acc": grad_acc,
                "batches": random_micro_batches(model, ctx, lcfg.vocab_size, 1, cfg.run.sequence_length),
                "timer": StepTimer(model, ctx),
                "ops": [],
                "losses": [],
            }
    return runs


def _step(run: dict[str, Any], ctx: Any, record: bool) -> None:
    from nanotron_ext.runtime import train_step

    clear_ops()
    with run["timer"] as timer, timer.step(record=record):
        # No clipping: the runtime's clip cannot run on a rank whose only weights are tied copies (measured_cpu.py).
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


def _warm_up(runs: dict[str, dict[str, Any]], ctx: Any, warmup: int) -> None:
    for run in runs.values():
        for _ in range(warmup):
            _step(run, ctx, record=False)


def _train(runs: dict[str, dict[str, Any]], ctx: Any, ms: Sequence[int], rounds: int) -> None:
    """Rounds in which each model takes one timed step; the engines' order alternates."""
    for r in range(rounds):
        for m in ms:
            for engine in ENGINES if r % 2 == 0 else ENGINES[::-1]:
                _step(runs[f"{engine}@{m}"], ctx, record=True)


def _gathered(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every run's per-rank step records and op times, on rank 0 (collective)."""
    import torch.distributed as dist

    out = {}
    for key, run in runs.items():
        per_rank = run["timer"].gather()
        ops_all: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(run["ops"], ops_all, dst=0)
        if per_rank is not None:
            out[key] = {
                "engine": run["engine"],
                "m": run["m"],
                "losses": run["losses"],
                "ops": ops_all,
                "records": [[rec.to_dict() for rec in recs] for recs in per_rank],
            }
    return out


def worker(spec_path: str, out_path: str) -> None:
    """One rank: calibrate, plan once, train every (m, engine) model in turns; rank 0 writes the JSON."""
    import torch
    import torch.distributed as dist

    from nanotron_ext.config import config_from_dict
    from nanotron_ext.inventory import inventory_from_config
    from nanotron_ext.machine.calibrate import calibrate
    from nanotron_ext.plan import make_plan
    from nanotron_ext.runtime import GlooParallelContext
    from nanotron_ext.simulate import simulate_plan

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    time_ops()
    ms = spec["ms"]
    with GlooParallelContext(1, PP, 1, timeout_s=600) as ctx:
        cfg = config_from_dict(spec["raw"], source="zb_measured_cpu")
        blocks = inventory_from_config(cfg)
        t0 = time.perf_counter()
        machine = calibrate(cfg, progress=False)  # as a user's `calibrate` is taken: before anything trains
        calibrate_s = time.perf_counter() - t0
        plan = make_plan(blocks, cfg, STRATEGY)
        runs = _build_runs(cfg, ctx, list(plan.block_ranks), ms)
        _warm_up(runs, ctx, spec["warmup"])
        # Again in the state the steps run in (every model, optimizer state and data alive): issue 32's question
        # whether a calibration taken there predicts better.
        late = calibrate(cfg, progress=False)
        t0 = time.perf_counter()
        _train(runs, ctx, ms, spec["rounds"])
        train_s = time.perf_counter() - t0
        gathered = _gathered(runs)
        if dist.get_rank() == 0:
            sims = {
                f"{e}@{m}": simulate_plan(
                    plan, blocks, cfg.with_overrides(n_micro_batches=m), machine=machine, engine=e
                )
                for m in ms
                for e in ENGINES
            }
            late_sims = {
                f"{e}@{m}": simulate_plan(
                    plan, blocks, cfg.with_overrides(n_micro_batches=m), machine=late, engine=e
                ).step_time
                for m in ms
                for e in ENGINES
            }
            Path(out_path).write_text(
                json.dumps(
                    {
                        "split": plan.table(),
                        "ranks": list(plan.block_ranks),
                        "machine": machine.name,
                        "profile": json.loads(machine.to_json()),  # to re-simulate the run's plan by hand
                        "late_profile": json.loads(late.to_json()),
                        "late_sim": late_sims,
                        "calibrate_s": calibrate_s,
                        "train_s": train_s,
                        "runs": gathered,
                        "tied_sync": tied_sync(cfg, machine),
                        "sim": {
                            k: {
                                "step": s.step_time,
                                "busy": list(s.busy),
                                "bubble": s.bubble_fraction,
                                "pipeline": s.pipeline_time,
                                "p2p": list(s.p2p_times),
                                "stages": [dataclasses.asdict(st) for st in s.stages],
                            }
                            for k, s in sims.items()
                        },
                        "load_average": os.getloadavg()[0],
                    }
                )
            )
