"""What ``predict_vs_measure.py`` predicts for each split, on rank 0 after training: its step under the planning and
the median profile, the step as priced before issue 29, and item 3's per-stage parts (and the step with eager
sends) of the splits whose step is taken apart."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from nanotron_ext.costs.analytic import trainable_before
from nanotron_ext.machine import EngineOverhead, block_signature, load_machine, price_blocks
from nanotron_ext.schedule.simulator import Action, _replay, engine_program, simulate
from nanotron_ext.simulate import plan_stage_times, simulate_plan
from pvm.splits import PlannedSplit, split_key


def describe_splits(
    plans: dict[str, PlannedSplit],
    planning_path: str,
    median_path: str,
    decompose: Sequence[str],
    busy: dict[str, list[float]],
) -> dict[str, Any]:
    """Per split: its stages, validity, model key, and its predicted step under both profiles; item 3's parts
    for the splits in ``decompose`` (``busy``: :func:`pvm.calibration.busy_block_times`)."""
    median = load_machine(median_path)
    out = {}
    for name, (cfg, blocks, plan) in plans.items():
        under = cfg.with_overrides(machine=median_path)
        out[name] = {
            "key": split_key(cfg, plan),
            "ranks": list(plan.block_ranks),
            "ok": plan.ok,
            "vocab_shards": cfg.vocab_shards,
            "stages": [s.label for s in plan.stages],
            "layout": cfg.ext.layout,
            "trainable": [s.trainable for s in plan.stages],
            "predicted": simulate_plan(plan, blocks, under).step_time,
            "predicted_planning": simulate_plan(plan, blocks, cfg.with_overrides(machine=planning_path)).step_time,
            "predicted_one_p2p": one_p2p_for_every_cut(plan, blocks, under),
            "parts": predicted_parts(plan, blocks, under, median, busy) if name in decompose else None,
        }
    return out


def one_p2p_for_every_cut(plan: Any, blocks: Sequence[Any], cfg: Any) -> float:
    """The step as the simulator priced it before issue 29: every cut charged the largest transfer of any cut."""
    t = plan_stage_times(plan, blocks, cfg)
    return simulate(
        t.stages, cfg.run.n_micro_batches, cfg.run.engine, max(t.p2p, default=0.0), grad_cuts=t.grad_cuts
    ).step_time


def predicted_parts(
    plan: Any, blocks: Sequence[Any], cfg: Any, machine: Any, busy: dict[str, list[float]]
) -> dict[str, Any]:
    """The simulated step of ``plan`` taken apart per stage as item 3 takes the measured one apart; and each
    stage's blocks timed with every rank busy (``busy``)."""
    sim = simulate_plan(plan, blocks, cfg)
    raw = price_blocks(dataclasses.replace(machine, overhead=EngineOverhead()), blocks, cfg)
    together = [busy[block_signature(b, input_grad=g)] for b, g in zip(blocks, trainable_before(blocks))]
    m = cfg.run.n_micro_batches
    stages = []
    for k in range(plan.pp):
        mine = [i for i, r in enumerate(plan.block_ranks) if r == k]
        compute = m * math.fsum(raw.forward[i] + raw.backward[i] for i in mine)
        ops = [op for op in sim.ops if op.stage == k and op.kind != "U"]
        computing = math.fsum(op.duration for op in ops)
        end = max((op.end for op in ops), default=0.0)
        stages.append(
            {
                "profiled": compute,
                "profiled_busy": m * math.fsum(sum(together[i][:2]) for i in mine),
                "update_busy": math.fsum(together[i][2] for i in mine),
                "overhead": computing - compute,
                "pipeline_wait": end - computing,
                "after_wait": sim.pipeline_time - end,
                "update": sim.stages[k].update,
            }
        )
    return {
        "step": sim.step_time,
        "pipeline": sim.pipeline_time,
        "p2p": sim.p2p_times,
        "stages": stages,
        "eager_step": eager_step(plan, blocks, cfg),
    }


def eager_step(plan: Any, blocks: Sequence[Any], cfg: Any) -> float:
    """The simulated step if the engine posted every send as soon as its tensor exists (right after its forward
    or backward). Nanotron's 1F1B defers steady-phase sends to the rank's next communication point, so the last
    stage sends micro-batch j's gradient only after micro-batch j + 1's activation has arrived. A what-if on the
    simulator's own replay (a private helper of ``nanotron_ext.schedule.simulator``), not a change to the engine."""
    times = plan_stage_times(plan, blocks, cfg)
    pp, cuts, programs = plan.pp, times.grad_cuts, []
    for s in range(pp):
        program = engine_program(
            cfg.run.engine,
            pp,
            s,
            cfg.run.n_micro_batches,
            grad_in=s == 0 or cuts[s - 1],
            grad_out=s == pp - 1 or cuts[s],
        )
        sends = [step for step in program if step.action.is_send]
        eager = []
        for step in program:
            if step.action.is_send:
                continue
            eager.append(step)
            if step.action.is_compute:
                kind = Action.SEND_ACT if step.action is Action.FORWARD else Action.SEND_GRAD
                eager += [x for x in sends if x.action is kind and x.micro_batch == step.micro_batch]
        programs.append(eager)
    _, clock = _replay(programs, times.stages, times.p2p)
    return max(clock) + max(st.update for st in times.stages)
