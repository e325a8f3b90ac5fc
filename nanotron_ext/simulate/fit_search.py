"""``plan --fit``: the cheapest ways to make a config fit its memory, when one change is not enough.

Each candidate changes the config in its own terms (tensor parallelism up to 8× the config's, pp halved, kept,
doubled or quadrupled, ZeRO-1 where dp > 1, ``recompute_layer``, the 1F1B engine), is planned by the config's
strategy under the same memory (:func:`nanotron_ext.machine.memory_limit`; ``constrained`` picks the fastest split
that fits) and simulated; a candidate no split can make fit is priced by the least memory any split's largest stage
needs instead, as ``plan``'s fixes are (:func:`~nanotron_ext.plan.make.least_any_split_needs`). Rows that fit come
first, the fewest GPUs per replica (tp × pp) first, then the fastest step; then those that do not, the nearest to
fitting first.

Not tried: a larger dp without ZeRO (it leaves each rank's memory as it is), a smaller micro-batch (it changes
the training, not only its layout).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.config import PlannerConfig, RunShape
from nanotron_ext.errors import ConfigError, PlanningError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.machine.memory_limit import MemoryLimit, memory_limit
from nanotron_ext.plan.fit import heads_split
from nanotron_ext.plan.make import least_any_split_needs, make_plan
from nanotron_ext.plan.types import Plan
from nanotron_ext.schedule import V_ENGINE, too_few_micro_batches
from nanotron_ext.simulate.stage_times import simulate_plan
from nanotron_ext.strategies.memory_fit import only_whether_it_fits

__all__ = ["AS_CONFIGURED", "FitRow", "fit_search"]

#: Tensor parallelism is tried up to this many times the config's (one node's NVLink domain, 8 GPUs, from tp=1).
TP_FACTORS = (1, 2, 4, 8)
#: pp is tried halved, kept, doubled and quadrupled.
PP_FACTORS = (0.5, 1, 2, 4)
#: The change of the config's own row.
AS_CONFIGURED = "as configured"


@dataclass(frozen=True)
class FitRow:
    """One candidate: what changed, its parallelism, its largest stage peak, its simulated step, whether it fits.
    ``least``: no split of it fits, and ``peak`` is the least memory any split's largest stage needs (not planned:
    no step)."""

    change: str
    tp: int
    pp: int
    zero_stage: int
    engine: str
    recompute_layer: bool
    peak: float
    step_time: float | None
    fits: bool
    least: bool = False

    @property
    def gpus(self) -> int:
        """GPUs per data-parallel replica: tp × pp."""
        return self.tp * self.pp


def fit_search(
    cfg: PlannerConfig, strategy: str | None = None, *, progress: Callable[[int, int], None] | None = None
) -> tuple[MemoryLimit | None, list[FitRow]]:
    """Every candidate of the module docstring that can be planned, ordered (fits, GPUs, step); the config as
    it is among them (``change`` :data:`AS_CONFIGURED`). ``progress(done, total)`` after each candidate.

    Raises:
        ConfigError: the config's machine profile cannot be read; ``pp_engine: zbv``.
    """
    if cfg.run.engine == V_ENGINE:
        raise ConfigError(
            "plan --fit plans the changes' contiguous splits; pp_engine zbv searches a V under the "
            "memory itself (`nanotron-ext plan CONFIG` says whether one fits): drop --fit, or pass "
            "--engine zb1p to see the contiguous fixes"
        )
    limit = memory_limit(cfg)
    run, name = cfg.run, strategy or cfg.ext.cost_strategy
    zeros = sorted({run.zero_stage, 1}) if run.dp > 1 else [run.zero_stage]
    engines = sorted({run.engine, "1f1b"})
    rows = []
    candidates = list(itertools.product(TP_FACTORS, PP_FACTORS, zeros, engines, sorted({run.recompute_layer, True})))
    for done, (tf, pf, zero, engine, again) in enumerate(candidates, 1):
        if progress is not None:
            progress(done, len(candidates))
        tp, pp = run.tp * tf, int(run.pp * pf)
        if pp < 1 or pp != run.pp * pf or not heads_split(cfg, tp):  # an odd pp has no half
            continue
        if too_few_micro_batches(engine, pp, run.n_micro_batches) is not None:
            continue
        changed = dataclasses.replace(
            cfg.with_overrides(pp=pp, engine=engine),
            run=dataclasses.replace(run, tp=tp, pp=pp, zero_stage=zero, engine=engine, recompute_layer=again),
        )
        how = "constrained" if name == "layout" and pp != run.pp else name
        change = _change(run, changed.run)
        try:
            blocks = inventory_from_config(changed)
            if len(blocks) < pp:
                continue
            # A change no split can make fit is priced by the least memory any split needs (not planned), as
            # plan's fixes are; the config as it is is planned as plan plans it.
            least = None if limit is None or change == AS_CONFIGURED else least_any_split_needs(blocks, changed, limit)
            if least is not None:
                rows.append(FitRow(change, tp, pp, zero, engine, again, least, None, False, least=True))
                continue
            plan = _planned(blocks, changed, how)
        except (ConfigError, PlanningError):
            continue
        try:
            step: float | None = simulate_plan(plan, blocks, changed).step_time
        except ConfigError:
            step = None
        peak = max(s.memory_bytes for s in plan.stages)
        rows.append(FitRow(change, tp, pp, zero, engine, again, peak, step, limit is None or peak <= limit.bytes))
    # Those that fit: the fewest GPUs, then the fastest. Those that do not: the nearest to fitting.
    rows.sort(
        key=lambda r: (
            (0, r.gpus, float("inf") if r.step_time is None else r.step_time, 0.0) if r.fits else (1, 0, 0.0, r.peak)
        )
    )
    return limit, rows


def _planned(blocks: list[BlockInfo], cfg: PlannerConfig, how: str) -> Plan:
    """``cfg``'s plan by ``how`` under its memory; where ``memory_cap_gib`` leaves no split (the full estimate over
    it wherever the additive part fits), the plan without it, over the cap (as the device's memory is treated when
    no split fits it): a row to show, not one dropped.

    Raises:
        ConfigError, PlanningError: the change cannot be planned.
    """
    with only_whether_it_fits():
        try:
            return make_plan(blocks, cfg, how, suggest_fixes=False)
        except PlanningError:
            if cfg.ext.memory_cap_gib is None:
                raise
        uncapped = dataclasses.replace(cfg, ext=dataclasses.replace(cfg.ext, memory_cap_gib=None))
        return make_plan(blocks, uncapped, how, suggest_fixes=False)


def _change(was: RunShape, now: RunShape) -> str:
    """``tp: 4, pp: 8`` in the config's own keys; ``as configured`` for none."""
    parts = [
        f"{key}: {str(getattr(now, attr)).lower() if isinstance(getattr(now, attr), bool) else getattr(now, attr)}"
        for key, attr in (
            ("tp", "tp"),
            ("pp", "pp"),
            ("zero_stage", "zero_stage"),
            ("pp_engine", "engine"),
            ("recompute_layer", "recompute_layer"),
        )
        if getattr(now, attr) != getattr(was, attr)
    ]
    return ", ".join(parts) or AS_CONFIGURED
