"""Making a V plan (issue 43): the blocks cut into ``2 pp`` chunks, two per rank, for the simulated ZB-V step under
each rank's memory, with the order the engine runs (the record, :class:`~nanotron_ext.plan.v_types.VPlan`, is
re-exported here).

:func:`make_v_plan` searches the split (:func:`~nanotron_ext.partition.v_search.search_v_split`, from the
FLOP-balanced ``2 pp`` stages), every chunk priced as the config prices a stage (its machine profile, or the analytic
model), each rank's peak in bytes (both chunks at the moments they coincide) held to the config's memory limit.
Every chunk must train something: as a contiguous stage must (DDP refuses a rank without a gradient), and a chunk
of frozen or weightless blocks alone (the cast, the loss) only adds a crossing, one of the logits at that. The loss
chunk's ``W`` is tried deferred and at once, and the faster kept. The plan keeps the order the simulator chose: the
program ``ZeroBubbleVPipelineEngine`` runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from nanotron_ext.blocks import BlockInfo, short_name
from nanotron_ext.config import DEFAULT_STRATEGY, PlannerConfig
from nanotron_ext.costs.v_memory import v_least_largest_rank
from nanotron_ext.errors import ConfigError, PlanningError
from nanotron_ext.machine import machine_for
from nanotron_ext.machine.memory_limit import MemoryLimit, memory_limit
from nanotron_ext.partition.layout_string import layout_ranks
from nanotron_ext.partition.schedule_problem import ScheduleProblem
from nanotron_ext.partition.split import bounds_from_ranks
from nanotron_ext.partition.v_search import search_v_split
from nanotron_ext.partition.v_split import Budgets, VMemory, simulate_within, v_simulate
from nanotron_ext.plan.make import make_plan
from nanotron_ext.plan.types import Plan
from nanotron_ext.plan.v_types import GIB, V_STRATEGY, VPlan
from nanotron_ext.report import compact_names
from nanotron_ext.schedule import V_ENGINE
from nanotron_ext.schedule.simulator import SimResult
from nanotron_ext.schedule.v_replay import replay_v_order, transfer_order
from nanotron_ext.schedule.zbv import VResult, by_rank
from nanotron_ext.strategies.builtin import layout_of, layout_source
from nanotron_ext.strategies.step_time import schedule_problem

__all__ = ["V_SEARCH_EVALS", "V_STRATEGY", "VPlan", "make_v_plan", "plan_for", "strategy_note", "v_plan_timeline"]

#: The most splits :func:`make_v_plan` simulates per search (two searches: the loss chunk's ``W`` deferred, and at
#: once). Each costs a simulated V step (milliseconds at pp 4, m 16, less where it is stopped past the best): 40
#: keep a plan of Llama-3-8B at pp 4 near 0.6 s of CPU (7 s before issue 55), where 300 (walk unbounded) took 109 s
#: then for a step 3.5 % shorter. A plan is a function of its config: the same budget everywhere.
V_SEARCH_EVALS = 40


def make_v_plan(
    blocks: Sequence[BlockInfo],
    cfg: PlannerConfig,
    *,
    max_evals: int = V_SEARCH_EVALS,
    v_stages: Sequence[int] | None = None,
    strategy: str | None = None,
) -> VPlan:
    """The V split of ``blocks`` over ``cfg.run.pp`` ranks with the least simulated step that fits each rank.

    Under ``cost_strategy: layout`` the split is the config's ``layout`` string of ``2 pp`` chunks, not searched;
    given ``v_stages`` (each block's chunk: a resumed V's), those chunks, recorded as ``strategy``.

    Raises:
        ConfigError: a layout that does not write ``2 pp`` chunks.
        PlanningError: fewer blocks than ``2 pp`` chunks, or no split trains in every chunk within the memory limit
            (naming the limit and the least peak a rank can have), or a layout's V that does not.
    """
    space = _VSpace.of(blocks, cfg)
    if cfg.ext.cost_strategy == "layout" or v_stages is not None:
        what = f"layout {cfg.ext.layout!r}" if v_stages is None else "the recorded V"
        bounds = _chunk_bounds(blocks, cfg, space.trains, v_stages, what)
        ways = [
            (e, r)
            for e in ((), (2 * cfg.run.pp - 1,))
            for r in [simulate_within(space.problem, bounds, e, space.budgets)]
            if r is not None and space.fits(bounds, r)
        ]
        if not ways:
            floor = max(space.memory.floors(bounds))
            raise PlanningError(
                f"the V of {what} does not fit {space.limit}: one of its ranks needs at least "
                f"{floor / GIB:.2f} GiB whatever the order; move blocks off rank 0's chunks (the "
                f"first and the last), or drop the layout to let zbv search a split"
            )
        eager, _ = min(ways, key=lambda way: way[1].step_time)
        return _v_plan(space, bounds, eager, proven=True, strategy=strategy or "layout")
    return _searched_v_plan(space, max_evals)


@dataclass
class _VSpace:
    """What a V's split is searched under: the blocks, the config as ``2 pp`` chunks and their prices, the memory
    limit, which chunks train, each rank's memory (estimated once per pair of chunks), and the split's budget for the
    scheduler under the limit."""

    blocks: Sequence[BlockInfo]
    chunked: PlannerConfig
    problem: ScheduleProblem
    limit: MemoryLimit | None
    trains: list[bool]
    memory: VMemory

    @classmethod
    def of(cls, blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> _VSpace:
        """The search space of ``blocks`` under ``cfg``.

        Raises:
            PlanningError: fewer blocks than ``2 pp`` chunks or than trainable ones, or weights, gradients and
                optimizer state that put more than the limit on some rank whatever the split.
        """
        pp = cfg.run.pp
        if len(blocks) < 2 * pp:
            raise PlanningError(
                f"a V over pp={pp} ranks cuts the model into {2 * pp} chunks, but it has {len(blocks)} "
                f"pipeline blocks; lower pp to {len(blocks) // 2} or less, or use pp_engine zb1p"
            )
        chunked, problem = _chunk_problem(blocks, cfg)
        limit = memory_limit(cfg)
        trains = [b.trainable > 0 for b in blocks]
        if sum(trains) < 2 * pp:
            names = compact_names([short_name(b.name) for b in blocks if b.trainable > 0])
            raise PlanningError(
                f"a V over pp={pp} ranks needs a trainable block in each of its {2 * pp} chunks; "
                f"{sum(trains)} blocks train ({names}): unfreeze one, lower pp or use pp_engine zb1p"
            )
        least = v_least_largest_rank(blocks, chunked, pp)
        if limit is not None and least > limit.bytes:
            raise PlanningError(
                f"no V split of {len(blocks)} blocks over pp={pp} ranks fits under {limit}: the "
                f"weights, gradients and optimizer state alone put at least {least / GIB:.2f} GiB on "
                f"one rank; use pp_engine zb1p, or raise pp, tp or the memory"
            )
        return cls(blocks, chunked, problem, limit, trains, VMemory(blocks, chunked))

    @property
    def cap(self) -> float | None:
        """The bytes each rank is held to (None: no limit known)."""
        return None if self.limit is None else self.limit.bytes

    @property
    def budgets(self) -> Budgets | None:
        """Each split's byte budget for the scheduler under the limit (None without one)."""
        cap = self.cap
        return None if cap is None else (lambda bounds: self.memory.budget(bounds, cap))

    def fits(self, bounds: Sequence[int], result: VResult) -> bool:
        """Whether every rank's peak of ``bounds`` scheduled as ``result`` is within the limit."""
        return self.cap is None or max(x.peak for x in self.memory.peaks(bounds, result)) <= self.cap

    def valid(self, bounds: Sequence[int]) -> bool:
        """Whether every chunk of ``bounds`` trains and every rank's least peak is within the limit."""
        every_chunk = all(any(self.trains[a:b]) for a, b in zip(bounds, bounds[1:]))
        return every_chunk and (self.cap is None or max(self.memory.floors(bounds)) <= self.cap)


def _searched_v_plan(space: _VSpace, max_evals: int) -> VPlan:
    """The searched V: the split of the least simulated step that fits, the loss chunk's ``W`` deferred or at once.

    Raises:
        PlanningError: no split trains in every chunk within the memory limit.
    """
    blocks, pp = space.blocks, space.chunked.run.pp // 2
    # The seed need not fit (the search keeps only splits that do): planned under a cap every split meets.
    unbounded = space.chunked.with_overrides(memory_cap_gib=1e6)
    seed = tuple(bounds_from_ranks(make_plan(blocks, unbounded, "flops", suggest_fixes=False).block_ranks, 2 * pp))
    # The walk is bounded with the simulations: where no split fits, every leaf is checked before it is simulated.
    tries = {
        eager: search_v_split(
            space.problem,
            seed,
            valid=space.valid,
            fits=space.fits,
            max_evals=max_evals,
            eager=eager,
            max_leaves=50 * max_evals,
            max_nodes=500 * max_evals,
            budgets=space.budgets,
        )
        for eager in ((), (2 * pp - 1,))
    }
    eager, found = min(tries.items(), key=lambda kv: kv[1].step)
    if found.bounds is None:
        floor = max(space.memory.floors(seed))
        where = f"under {space.limit}" if space.limit is not None else "with a trainable block in every chunk"
        raise PlanningError(
            f"no V split of {len(blocks)} blocks over pp={pp} ranks fits {where}: the FLOP-balanced "
            f"chunks need at least {floor / GIB:.2f} GiB on one rank; use pp_engine zb1p, or raise "
            f"pp, tp or the memory"
        )
    return _v_plan(space, found.bounds, eager, proven=found.proven)


def _v_plan(
    space: _VSpace, bounds: Sequence[int], eager: Sequence[int], *, proven: bool, strategy: str = V_STRATEGY
) -> VPlan:
    """The :class:`VPlan` of one split: simulated under its budget, with each rank's peak and each cut's p2p."""
    budgets = space.budgets
    result = v_simulate(space.problem, bounds, eager, None if budgets is None else budgets(bounds))
    chunks, p2p, _ = space.problem.simulator_inputs(bounds)
    peaks = tuple(x.peak for x in space.memory.peaks(bounds, result))
    return VPlan(
        pp=space.chunked.run.pp // 2,
        n_micro_batches=space.chunked.run.n_micro_batches,
        blocks=tuple(b.name for b in space.blocks),
        bounds=tuple(bounds),
        step_time=result.step_time,
        bubble=result.pipeline_bubble_fraction,
        peaks=peaks,
        limit=space.cap,
        p2p=tuple(float(t) for t in p2p),
        eager=tuple(eager),
        proven=proven,
        order=result.order,
        strategy=strategy,
        transfers=tuple(tuple(t) for t in transfer_order(result.order, chunks, p2p)),
    )


def _chunk_bounds(
    blocks: Sequence[BlockInfo], cfg: PlannerConfig, trains: Sequence[bool], v_stages: Sequence[int] | None, what: str
) -> tuple[int, ...]:
    """The chunks ``v_stages`` (else the config's ``layout`` string) write for a V: ``2 pp`` stages, the way down
    then the way up, each training; ``what`` names them in an error.

    Raises:
        ConfigError: no layout, or one of another number of stages (an odd number cannot fold).
        PlanningError: a chunk that trains nothing.
    """
    pp = cfg.run.pp
    roles = [b.role for b in blocks]
    stages = list(v_stages) if v_stages is not None else layout_ranks(layout_of(cfg), roles, source=layout_source(cfg))
    n = max(stages) + 1
    if n != 2 * pp:
        fold = "an odd number cannot fold into two per rank" if n % 2 else f"or set pp to {n // 2}"
        raise ConfigError(
            f"{layout_source(cfg)}: layout {cfg.ext.layout!r} writes {n} stages; a V over pp={pp} ranks takes {2 * pp} "
            f"chunks, rank r holding chunk r and chunk {2 * pp - 1} - r: write {2 * pp} '|'-separated "
            f"chunks, {fold}"
        )
    bounds = tuple(bounds_from_ranks(stages, n))
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if not any(trains[a:b]):
            names = compact_names([short_name(x.name) for x in blocks[a:b]])
            raise PlanningError(
                f"{what}: chunk {k} ({names}) trains nothing, and every chunk of "
                f"a V must (its rank's DDP and optimizer need a gradient of each); give it a block "
                f"that trains"
            )
    return bounds


def _chunk_problem(blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> tuple[PlannerConfig, ScheduleProblem]:
    """The config as ``2 pp`` zb1p stages, and its pricing: a V's chunks are priced as those stages are, on the
    config's own machine (whose key is this pp's)."""
    machine = machine_for(cfg, blocks)
    chunked = dataclasses.replace(cfg, ext=dataclasses.replace(cfg.ext, machine=None)).with_overrides(
        pp=2 * cfg.run.pp, engine="zb1p"
    )
    return chunked, schedule_problem(blocks, chunked, machine, v_chunks=True)


def v_plan_timeline(
    plan: VPlan, blocks: Sequence[BlockInfo], cfg: PlannerConfig, *, sends_wait: bool = False
) -> SimResult:
    """The plan's order replayed under its chunks' prices, one row per rank (what ``simulate`` prints and draws);
    with ``sends_wait``, its sends held to their one order of transfers keyed by those prices, as Nanotron's trainer
    runs the V (a GPU's send waits for its receive).

    Raises:
        ValueError: ``blocks`` are not the plan's.
    """
    if tuple(b.name for b in blocks) != plan.blocks:
        raise ValueError("these blocks are not the ones the V plan was made for; plan them again")
    _, problem = _chunk_problem(blocks, cfg)
    chunks, p2p, _ = problem.simulator_inputs(plan.bounds)
    return by_rank(
        replay_v_order(plan.order, chunks, plan.n_micro_batches, p2p, sends_wait=sends_wait, keys_from=chunks),
        chunks,
        p2p,
    )


def plan_for(blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> Plan | VPlan:
    """The plan ``cfg`` trains: a :class:`VPlan` under ``pp_engine: zbv``, else the strategy's contiguous one.

    Raises:
        ConfigError / PlanningError: as :func:`make_v_plan` and :func:`~nanotron_ext.plan.make.make_plan`.
    """
    return make_v_plan(blocks, cfg) if cfg.run.engine == V_ENGINE else make_plan(blocks, cfg)


def strategy_note(cfg: PlannerConfig) -> str | None:
    """What a V does with a ``cost_strategy`` the config names: it is not used (None where it is the default)."""
    if cfg.run.engine != V_ENGINE or cfg.ext.cost_strategy in (DEFAULT_STRATEGY, "layout"):
        return None
    return (
        f"cost_strategy {cfg.ext.cost_strategy!r} is not used: pp_engine zbv searches its own split, the fastest "
        f"simulated V whose every chunk trains and every rank fits (or takes a layout's 2 pp chunks)"
    )
