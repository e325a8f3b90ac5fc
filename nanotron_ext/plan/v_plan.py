"""A V plan (issue 43): the blocks cut into ``2 pp`` chunks, two per rank, for the simulated ZB-V step under each
rank's memory, with the order the engine runs. Plain data that prints (two chunks per rank), compares and serialises.

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
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from nanotron_ext.blocks import BlockInfo, short_name
from nanotron_ext.config import DEFAULT_STRATEGY, PlannerConfig
from nanotron_ext.costs.v_memory import v_least_largest_rank
from nanotron_ext.errors import ConfigError, PlanningError
from nanotron_ext.machine import machine_for
from nanotron_ext.machine.memory_limit import memory_limit
from nanotron_ext.partition.layout_string import layout_ranks
from nanotron_ext.partition.schedule_problem import ScheduleProblem
from nanotron_ext.partition.split import bounds_from_ranks
from nanotron_ext.partition.v_search import search_v_split
from nanotron_ext.partition.v_split import simulate_within, v_budget, v_floors, v_peaks, v_simulate
from nanotron_ext.plan.make import make_plan
from nanotron_ext.plan.types import Plan
from nanotron_ext.report import compact_names, format_seconds, table
from nanotron_ext.schedule import V_ENGINE
from nanotron_ext.schedule.simulator import SimResult
from nanotron_ext.schedule.v_replay import Transfer, replay_v_order, transfer_order
from nanotron_ext.schedule.zbv import VOp, by_rank, v_rank
from nanotron_ext.strategies.builtin import layout_of, layout_source
from nanotron_ext.strategies.step_time import schedule_problem

__all__ = ["V_SEARCH_EVALS", "V_STRATEGY", "VPlan", "make_v_plan", "plan_for", "strategy_note", "v_plan_timeline"]

GIB = 2**30
#: The most splits :func:`make_v_plan` simulates per search (two searches: the loss chunk's ``W`` deferred, and at
#: once). Each costs a simulated V step (0.1-0.2 s at pp 4, m 16): 40 keeps a plan of Llama-3-8B at pp 4 near 7 s,
#: where 300 (walk unbounded) took 109 s for a step 3.5 % shorter. A plan is a function of its config: the same
#: budget everywhere.
V_SEARCH_EVALS = 40
#: What chose a V's split (a V plan's ``strategy``): the config's ``cost_strategy`` prices contiguous stages only.
V_STRATEGY = "v-search"


@dataclass(frozen=True)
class VPlan:
    """A V over ``pp`` ranks: ``bounds`` cut the blocks into ``2 pp`` chunks; chunk ``s`` runs on rank
    ``v_rank(pp, s)``.

    Attributes:
        pp, n_micro_batches: the pipeline.
        blocks: the blocks' names, in order.
        bounds: ``2 pp + 1`` positions, 0 to the number of blocks.
        step_time, bubble: the simulated ZB-V step (s) and its pipeline bubble.
        peaks: each rank's estimated peak (bytes), both chunks at the moments they coincide.
        limit: the bytes each rank was held to (None: no limit known).
        p2p: each of the ``2 pp - 1`` cuts' transfer (s), as priced (the cut at the V's bottom stays on its rank).
        eager: the chunks whose ``W`` runs right after its ``B``.
        proven: whether the search proved the split the best under its rules (else its budget ran out); True for a
            layout's split, which is not searched.
        order: each rank's ops, in the order the engine runs them.
        strategy: what chose the split: :data:`V_STRATEGY`, or ``layout`` (the config's ``layout`` string).
        transfers: each rank's transfers in the order its sends are held to where they wait for their receive,
            keyed by the plan's own times (:func:`~nanotron_ext.schedule.v_replay.transfer_order`).
    """

    pp: int
    n_micro_batches: int
    blocks: tuple[str, ...]
    bounds: tuple[int, ...]
    step_time: float
    bubble: float
    peaks: tuple[float, ...]
    limit: float | None
    p2p: tuple[float, ...]
    eager: tuple[int, ...]
    proven: bool
    order: tuple[tuple[VOp, ...], ...]
    strategy: str = V_STRATEGY
    transfers: tuple[tuple[Transfer, ...], ...] = ()

    engine = V_ENGINE
    #: A V plan that exists trains: :func:`make_v_plan` raises where no split puts a trainable block on every
    #: chunk within the memory, so it carries no findings.
    findings: ClassVar[tuple[()]] = ()
    ok = True

    @property
    def stages(self) -> list[int]:
        """Each block's virtual stage (what ``build_cpu_llama(v_stages=...)`` and ``mark_v_stages`` take)."""
        return [s for s in range(2 * self.pp) for _ in range(self.bounds[s + 1] - self.bounds[s])]

    @property
    def block_ranks(self) -> list[int]:
        """Each block's PP rank: down the ranks and back up."""
        return [v_rank(self.pp, s) for s in self.stages]

    @property
    def verdict(self) -> str:
        """``OK``: a V plan that exists trains (as :attr:`Plan.verdict <nanotron_ext.plan.types.Plan.verdict>`)."""
        return "OK"

    def stage_map(self) -> str:
        """``0-5+32-34|6-10+27-31``: per rank, the block index ranges of its chunk down and its chunk up."""

        def span(stage: int) -> str:
            a, b = self.bounds[stage], self.bounds[stage + 1] - 1
            return f"{a}" if a == b else f"{a}-{b}"

        return "|".join(f"{span(r)}+{span(2 * self.pp - 1 - r)}" for r in range(self.pp))

    def order_for(self, pp: int, n_micro_batches: int) -> list[list[VOp]]:
        """Each rank's ops, for ``ZeroBubbleVPipelineEngine(order=plan.order_for)``.

        Raises:
            ValueError: a step of another pp or micro-batch count than the plan's.
        """
        if (pp, n_micro_batches) != (self.pp, self.n_micro_batches):
            raise ValueError(
                f"this V plan's order is for pp={self.pp}, m={self.n_micro_batches}; the step has "
                f"pp={pp}, m={n_micro_batches}: plan the V for the step's own pipeline"
            )
        return [list(ops) for ops in self.order]

    def transfers_for(self, pp: int, n_micro_batches: int) -> list[list[Transfer]]:
        """Each rank's transfers in their held order, for ``ZeroBubbleVPipelineEngine(transfers=plan.transfers_for)``.

        Raises:
            ValueError: as :meth:`order_for`.
        """
        order = self.order_for(pp, n_micro_batches)
        return [list(t) for t in self.transfers] if self.transfers else transfer_order(order)

    def chunk(self, stage: int) -> tuple[str, ...]:
        """The blocks of virtual stage ``stage``."""
        return self.blocks[self.bounds[stage] : self.bounds[stage + 1]]

    def table(self) -> str:
        """Two chunks per rank: the way down, the way up, the rank's peak."""
        rows = []
        for r in range(self.pp):
            up = 2 * self.pp - 1 - r
            rows.append(
                [
                    r,
                    f"{r}: {compact_names([short_name(b) for b in self.chunk(r)])}",
                    f"{up}: {compact_names([short_name(b) for b in self.chunk(up)])}",
                    f"{self.peaks[r] / GIB:.2f}",
                ]
            )
        limit = f"{self.limit / GIB:.2f} GiB" if self.limit is not None else "no limit known"
        return (
            table(["rank", "chunk down", "chunk up", "peak GiB"], rows)
            + f"\nzbv: pp={self.pp}, m={self.n_micro_batches}, simulated step {format_seconds(self.step_time)}, "
            f"pipeline bubble {self.bubble:.1%}; each rank under {limit}"
            + ("" if self.proven else " (the search's budget ran out: the best found, not proven best)")
        )

    def to_dict(self) -> dict[str, Any]:
        out = {"engine": self.engine, **asdict(self)}
        out["order"] = [[str(op) for op in ops] for ops in self.order]
        out["transfers"] = [[str(t) for t in ts] for ts in self.transfers]
        return out


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
    pp = cfg.run.pp
    if len(blocks) < 2 * pp:
        raise PlanningError(
            f"a V over pp={pp} ranks cuts the model into {2 * pp} chunks, but it has {len(blocks)} "
            f"pipeline blocks; lower pp to {len(blocks) // 2} or less, or use pp_engine zb1p"
        )
    chunked, problem = _chunk_problem(blocks, cfg)
    limit = memory_limit(cfg)
    cap = None if limit is None else limit.bytes
    trains = [b.trainable > 0 for b in blocks]
    if sum(trains) < 2 * pp:
        names = compact_names([short_name(b.name) for b in blocks if b.trainable > 0])
        raise PlanningError(
            f"a V over pp={pp} ranks needs a trainable block in each of its {2 * pp} chunks; "
            f"{sum(trains)} blocks train ({names}): unfreeze one, lower pp or use pp_engine zb1p"
        )

    least = v_least_largest_rank(blocks, chunked, pp)
    if cap is not None and least > cap:
        raise PlanningError(
            f"no V split of {len(blocks)} blocks over pp={pp} ranks fits under {limit}: the "
            f"weights, gradients and optimizer state alone put at least {least / GIB:.2f} GiB on "
            f"one rank; use pp_engine zb1p, or raise pp, tp or the memory"
        )

    def fits(bounds: Sequence[int], result: Any) -> bool:
        return cap is None or max(x.peak for x in v_peaks(blocks, chunked, bounds, result)) <= cap

    budgets = None if cap is None else (lambda bounds: v_budget(blocks, chunked, bounds, cap))
    if cfg.ext.cost_strategy == "layout" or v_stages is not None:
        what = f"layout {cfg.ext.layout!r}" if v_stages is None else "the recorded V"
        bounds = _chunk_bounds(blocks, cfg, trains, v_stages, what)
        ways = [
            (e, r)
            for e in ((), (2 * pp - 1,))
            for r in [simulate_within(problem, bounds, e, budgets)]
            if r is not None and fits(bounds, r)
        ]
        if not ways:
            floor = max(v_floors(blocks, chunked, bounds))
            raise PlanningError(
                f"the V of {what} does not fit {limit}: one of its ranks needs at least "
                f"{floor / GIB:.2f} GiB whatever the order; move blocks off rank 0's chunks (the "
                f"first and the last), or drop the layout to let zbv search a split"
            )
        eager, _ = min(ways, key=lambda way: way[1].step_time)
        return _v_plan(
            blocks, chunked, problem, bounds, eager, budgets, cap, proven=True, strategy=strategy or "layout"
        )
    # The seed need not fit (the search keeps only splits that do): planned under a cap every split meets.
    unbounded = chunked.with_overrides(memory_cap_gib=1e6)
    seed = tuple(bounds_from_ranks(make_plan(blocks, unbounded, "flops", suggest_fixes=False).block_ranks, 2 * pp))

    def valid(bounds: Sequence[int]) -> bool:
        every_chunk = all(any(trains[a:b]) for a, b in zip(bounds, bounds[1:]))
        return every_chunk and (cap is None or max(v_floors(blocks, chunked, bounds)) <= cap)

    # The walk is bounded with the simulations: where no split fits, every leaf is checked before it is simulated.
    tries = {
        eager: search_v_split(
            problem,
            seed,
            valid=valid,
            fits=fits,
            max_evals=max_evals,
            eager=eager,
            max_leaves=50 * max_evals,
            max_nodes=500 * max_evals,
            budgets=budgets,
        )
        for eager in ((), (2 * pp - 1,))
    }
    eager, found = min(tries.items(), key=lambda kv: kv[1].step)
    if found.bounds is None:
        floor = max(v_floors(blocks, chunked, seed))
        where = f"under {limit}" if limit is not None else "with a trainable block in every chunk"
        raise PlanningError(
            f"no V split of {len(blocks)} blocks over pp={pp} ranks fits {where}: the FLOP-balanced "
            f"chunks need at least {floor / GIB:.2f} GiB on one rank; use pp_engine zb1p, or raise "
            f"pp, tp or the memory"
        )
    return _v_plan(blocks, chunked, problem, found.bounds, eager, budgets, cap, proven=found.proven)


def _v_plan(
    blocks: Sequence[BlockInfo],
    chunked: PlannerConfig,
    problem: ScheduleProblem,
    bounds: Sequence[int],
    eager: Sequence[int],
    budgets: Any,
    cap: float | None,
    *,
    proven: bool,
    strategy: str = V_STRATEGY,
) -> VPlan:
    """The :class:`VPlan` of one split: simulated under its budget, with each rank's peak and each cut's p2p."""
    result = v_simulate(problem, bounds, eager, None if budgets is None else budgets(bounds))
    chunks, p2p, _ = problem.simulator_inputs(bounds)
    peaks = tuple(x.peak for x in v_peaks(blocks, chunked, bounds, result))
    return VPlan(
        pp=chunked.run.pp // 2,
        n_micro_batches=chunked.run.n_micro_batches,
        blocks=tuple(b.name for b in blocks),
        bounds=tuple(bounds),
        step_time=result.step_time,
        bubble=result.pipeline_bubble_fraction,
        peaks=peaks,
        limit=cap,
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
