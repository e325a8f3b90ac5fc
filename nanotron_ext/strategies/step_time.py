"""The one pricing of a model's blocks under the config's schedule: per-block forward, backward, update and send
times (:class:`~nanotron_ext.partition.step_time_eval.ScheduleProblem`).

The step-time objective, ``vocab_shards: auto`` and ``simulate`` (:func:`nanotron_ext.simulate.plan_stage_times`)
all read time through :func:`schedule_problem`: FLOP-rate model (forward FLOPs ÷ throughput; backward = the rest
of the training FLOPs, freeze-aware) or measured timings, and p2p = what a block sends (the memory model's
``output``) ÷ bandwidth. So the split ``constrained`` picks is the one ``simulate`` reports fastest
(``tests/test_schedule_aware.py`` checks that both price every split alike).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.config import PlannerConfig
from nanotron_ext.costs.analytic import trainable_before, training_flops
from nanotron_ext.costs.memory_estimate import block_memory
from nanotron_ext.partition.schedule_aware import ScheduleProblem

if TYPE_CHECKING:
    from nanotron_ext.costs.profiled import BlockTiming

__all__ = ["DEFAULT_TFLOPS", "schedule_problem"]

#: Default throughput, TFLOP/s: roughly what a bf16 training run achieves on one H100 (about 40 % of its
#: 989 TFLOP/s dense peak). Only ratios between splits matter for comparisons; absolute times scale with it.
DEFAULT_TFLOPS = 400.0


def schedule_problem(
    blocks: Sequence[BlockInfo],
    cfg: PlannerConfig,
    *,
    timings: Sequence[BlockTiming] | None = None,
    flops_per_second: float | None = None,
    p2p_bytes_per_second: float | None = None,
) -> ScheduleProblem:
    """Per-block forward, backward, update and send times of ``blocks`` under ``cfg``'s engine and micro-batches.

    Args:
        blocks, cfg: the inventory and the config.
        timings: measured block times (forward, backward, optimizer step); default: the FLOP-rate model.
        flops_per_second: the FLOP-rate model's throughput (default ``DEFAULT_TFLOPS``).
        p2p_bytes_per_second: link bandwidth; None ignores p2p (as ``simulate`` does by default).
    """
    if timings is not None:
        fwd = [t.forward for t in timings]
        bwd = [t.backward for t in timings]
        upd = [t.optimizer for t in timings]
    else:
        rate = flops_per_second or DEFAULT_TFLOPS * 1e12
        train = training_flops(blocks)
        fwd = [b.flops_fwd / rate for b in blocks]
        bwd = [max(0.0, t - b.flops_fwd) / rate for b, t in zip(blocks, train)]
        upd = [0.0] * len(blocks)
    if p2p_bytes_per_second is None:
        send = [0.0] * len(blocks)
    else:  # what a block hands on, counted once: the memory model's output (the tensors the engine sends)
        send = [block_memory(b, cfg.model, cfg.run).output / p2p_bytes_per_second for b in blocks]
    return ScheduleProblem(
        forward=tuple(map(float, fwd)),
        backward=tuple(map(float, bwd)),
        update=tuple(map(float, upd)),
        send=tuple(map(float, send)),
        grad_after=tuple(trainable_before(blocks)),
        pp=cfg.run.pp,
        n_micro_batches=cfg.run.n_micro_batches,
        engine=cfg.run.engine,
    )
