"""The ops of a pipeline step as a run times them (``zb_measured_cpu.py``): each F, B and W's own work with its
waits on peers left out, and the profile those times make, which the simulator replays against the engine's
step. Issue 31: it tells the simulator's schedule apart from the calibration's prices."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from nanotron_ext.schedule import ZERO_BUBBLE
from nanotron_ext.schedule.simulator import StageTimes

#: The compute ops of a step: forward, backward (under zb1p and zb2p its input-gradient part) and W.
OP_KINDS = ("F", "B", "W")
#: This process's compute seconds of each op kind (F, B, W) in the current step, waits on peers left out.
_OPS: dict[str, list[float]] = {"F": [], "B": [], "W": []}


def time_ops() -> None:
    """Time every F, B and W step of every engine into :data:`_OPS` (this process only).

    F and B are Nanotron's ``PipelineEngine.forward`` and ``backward``, which its 1F1B and our zero-bubble
    engines both call; W is the zero-bubble engine's weight pass (``accumulate_weight_gradients``, the one function
    for W). Receives happen inside F and B (Nanotron's
    ``run_communication``): the time the installed ``StepTimer`` counts as waiting on a peer during the op is taken
    out, so what is left is the op's own work, which is what the simulator prices."""
    from nanotron.parallel.pipeline_parallel.engine import PipelineEngine

    from nanotron_ext.runtime.timing import StepTimer
    from nanotron_ext.zero_bubble import engine

    def waited() -> float:
        timer = StepTimer.installed()
        return timer.waited() if timer is not None else 0.0

    def timed(fn: Any, kind: str) -> Any:
        def op(*args: Any, **kwargs: Any) -> Any:
            t0, w0 = time.perf_counter(), waited()
            try:
                return fn(*args, **kwargs)
            finally:
                _OPS[kind].append(time.perf_counter() - t0 - (waited() - w0))

        return op

    PipelineEngine.forward = timed(PipelineEngine.forward, "F")
    PipelineEngine.backward = timed(PipelineEngine.backward, "B")
    engine.accumulate_weight_gradients = timed(engine.accumulate_weight_gradients, "W")


def clear_ops() -> None:
    """Forget the ops timed so far (at the start of a step)."""
    for times in _OPS.values():
        times.clear()


def step_ops() -> dict[str, list[float]]:
    """The ops timed since :func:`clear_ops`, by kind."""
    return {kind: list(times) for kind, times in _OPS.items()}


def _slowest_rank(run: dict[str, Any], field: str) -> list[float]:
    """Each timed step's ``StepTimer`` record ``field`` on the slowest rank."""
    return [max(per_rank) for per_rank in zip(*[[r[field] for r in rank] for rank in run["records"]])]


def step_times(run: dict[str, Any]) -> list[float]:
    """The step time of each timed step: the slowest rank's."""
    return _slowest_rank(run, "step")


def one_step(run: dict[str, Any], i: int) -> dict[str, Any]:
    """``run`` cut down to its ``i``-th timed step: the same fields, each per-step list holding only that step."""
    per_step = ("records", "ops", "v_ops", "peaks")
    return {**run, **{k: [rank[i : i + 1] for rank in run[k]] for k in per_step if k in run}}


def per_step_ratios(run: dict[str, Any], simulated: Callable[[dict[str, Any]], float]) -> list[float]:
    """Each timed step's simulated ÷ measured step, the step replayed under its own ops (``simulated`` of
    :func:`one_step`). The run's mean ops against its median step mix two statistics: on a host whose speed drifts
    between rounds, one slow round moves the mean ops but not the median step (a first round at 1.6× the median
    put a whole-run replay 6 % slow, 2026-11-28), which is the host and not the schedule."""
    steps = (one_step(run, i) for i in range(len(run["records"][0])))
    return [simulated(one) / step_times(one)[0] for one in steps]


def _per_kind(run: dict[str, Any], rank: int, statistic: Callable[[list[float]], float]) -> dict[str, float]:
    """``statistic`` of every F, every B and every W on ``rank`` over the run's timed steps (0 for a kind the engine
    never ran there)."""
    out = {}
    for kind in OP_KINDS:
        xs = [t for step in run["ops"][rank] for t in step[kind]]
        out[kind] = statistic(xs) if xs else 0.0
    return out


def op_means(run: dict[str, Any], rank: int) -> dict[str, float]:
    """Mean compute seconds of one F, one B and one W on ``rank``. The mean, not the median: a step adds its ops
    up, slow ones included, and an op's times lean right (a median of them priced the steps 2-5 % short,
    2026-11-26)."""
    return _per_kind(run, rank, statistics.fmean)


def op_fastest(run: dict[str, Any], rank: int) -> dict[str, float]:
    """The fastest F, B and W on ``rank`` in the run (what a calibration's fastest round compares with)."""
    return _per_kind(run, rank, min)


def in_run_stages(run: dict[str, Any], synced: float) -> list[StageTimes]:
    """Each rank's stage as timed in the run: one F, B and W (:func:`op_means`) and its update (the mean of its
    busy time after the pipeline: gradient finishing and the optimizer step), plus ``synced``, the tied
    all-reduce as calibrated (its time inside a collective is a wait to the step timer, transfer and all).
    At pp=2 the two ends of the tie sit on the two ranks, so both pay it."""
    stages = []
    for rank, recs in enumerate(run["records"]):
        mean = op_means(run, rank)
        after = statistics.fmean(r["busy"] - (r["pipeline"] - r["pipeline_idle"]) for r in recs)
        stages.append(
            StageTimes(forward=mean["F"], backward=mean["B"] + mean["W"], weight=mean["W"], update=after + synced)
        )
    return stages


def calibrated_ops(sim: dict[str, Any], engine: str) -> list[dict[str, float]]:
    """Per rank, one F, B and W as ``simulate_plan`` priced them from the calibrated profile (zero-bubble B is the
    backward less its W; 1F1B has no W)."""
    out = []
    for st in sim["stages"]:
        w = st["weight"] if engine in ZERO_BUBBLE else 0.0
        out.append({"F": st["forward"], "B": st["backward"] - w, "W": w})
    return out


def measured_pipeline(run: dict[str, Any]) -> float:
    """Median over the timed steps of the pipeline makespan (the slowest rank's ``StepTimer`` ``pipeline``)."""
    return statistics.median(_slowest_rank(run, "pipeline"))


def tied_sync(cfg: Any, machine: Any) -> float:
    """Seconds of the tied embedding's gradient all-reduce between the first and the last stage, as the calibrated
    profile prices it (0 without tied embeddings)."""
    from nanotron_ext.machine.pricing import tied_sync_seconds

    return tied_sync_seconds(machine, cfg) if cfg.model.tie_word_embeddings else 0.0
