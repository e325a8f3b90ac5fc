"""The one pricing of a model's blocks under the config's schedule: per-block forward, backward, update and send
times (:class:`~nanotron_ext.partition.step_time_eval.ScheduleProblem`) on the config's machine.

The step-time objective, ``vocab_shards: auto`` and ``simulate`` (:func:`nanotron_ext.simulate.plan_stage_times`)
all read time through :func:`schedule_problem`, which reads it from one :class:`~nanotron_ext.machine.MachineProfile`
(:func:`nanotron_ext.machine.machine_for`: the config's profile or the analytic H100 model, with its overrides).
So the split ``constrained`` picks is the one ``simulate`` reports fastest (``tests/test_machine_pricing.py``
checks that both price through the one object).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.config import PlannerConfig
from nanotron_ext.costs.analytic import trainable_before
from nanotron_ext.machine import MachineProfile, machine_for, price_blocks
from nanotron_ext.partition.schedule_aware import ScheduleProblem

__all__ = ["schedule_problem"]


def schedule_problem(
    blocks: Sequence[BlockInfo], cfg: PlannerConfig, machine: MachineProfile | None = None, *, v_chunks: bool = False
) -> ScheduleProblem:
    """Per-block forward, backward, update and send times of ``blocks`` under ``cfg``'s engine and micro-batches,
    with the weight-gradient part of each backward (zb1p's ``W``).

    Args:
        blocks, cfg: the inventory and the config.
        machine: the machine; default :func:`~nanotron_ext.machine.machine_for` of ``cfg`` (pass it to price many
            candidates without reading the profile again).
        v_chunks: ``cfg``'s stages are a V's chunks (``ScheduleProblem.v_chunks``).
    """
    machine = machine or machine_for(cfg, blocks)
    try:
        return _remembered(tuple(blocks), cfg, machine, v_chunks)
    except TypeError:  # a config holding a dict of Nanotron's own keys (freezing patterns): priced every time
        return _priced(blocks, cfg, machine, v_chunks)


def _priced(
    blocks: Sequence[BlockInfo], cfg: PlannerConfig, machine: MachineProfile, v_chunks: bool
) -> ScheduleProblem:
    prices = price_blocks(machine, blocks, cfg)
    return ScheduleProblem(
        forward=tuple(map(float, prices.forward)),
        backward=tuple(map(float, prices.backward)),
        update=tuple(map(float, prices.update)),
        send=tuple(tuple(map(float, row)) for row in prices.send),
        grad_after=tuple(trainable_before(blocks)),
        pp=cfg.run.pp,
        n_micro_batches=cfg.run.n_micro_batches,
        engine=cfg.run.engine,
        weight=tuple(map(float, prices.weight)),
        tied_pair=prices.tied_pair,
        tied_saving=tuple(map(float, prices.tied_saving)),
        positions=tuple(
            (position, tuple(map(float, p.forward)), tuple(map(float, p.backward)), tuple(map(float, p.weight)))
            for position, p in prices.positions
        ),
        v_chunks=v_chunks,
    )


#: The last few problems priced: a plan searches its split, simulates it and prices Nanotron's rule's from one
#: model, config and machine (each pricing of a 1000-block model about 35 ms). A problem is immutable.
_remembered = lru_cache(maxsize=4)(_priced)
