"""The mutation tables of tools/mutate.py, one module per area; MUTATIONS is every one, in order."""

from __future__ import annotations

from mutations import checkpoints_cli, pictures, planning, replan, runtime, v_schedule, zbv
from mutations.base import Mutation

MUTATIONS: tuple[Mutation, ...] = (
    planning.MUTATIONS
    + v_schedule.MUTATIONS
    + runtime.MUTATIONS
    + checkpoints_cli.MUTATIONS
    + replan.MUTATIONS
    + zbv.MUTATIONS
    + pictures.MUTATIONS
)
