"""A V plan (issue 43): the blocks cut into ``2 pp`` chunks, two per rank, for the simulated ZB-V step under each
rank's memory, with the order the engine runs. Plain data that prints (two chunks per rank), compares and serialises.

:func:`make_v_plan` searches the split (:func:`~nanotron_ext.partition.v_search.search_v_split`, from the
FLOP-balanced ``2 pp`` stages), every chunk priced as the config prices a stage (its machine profile, or the analytic
model), each rank's peak in bytes (both chunks at the moments they coincide) held to the config's memory limit.
Every chunk must train something: as a contiguous stage must (DDP refuses a rank without a gradient), and a chunk
of frozen or weightless blocks alone (the cast, the loss) only adds a crossing, one of the logits at that. The loss chunk's ``W``
is tried deferred and at once, and the faster kept. The plan keeps the order the simulator chose: the program
``ZeroBubbleVPipelineEngine`` runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from nanotron_ext.blocks import BlockInfo, short_name
from nanotron_ext.config import PlannerConfig
from nanotron_ext.errors import PlanningError
from nanotron_ext.machine import machine_for
from nanotron_ext.machine.memory_limit import memory_limit
from nanotron_ext.partition.split import bounds_from_ranks
from nanotron_ext.partition.v_search import search_v_split
from nanotron_ext.partition.v_split import v_budget, v_floors, v_peaks, v_simulate
from nanotron_ext.plan.make import make_plan
from nanotron_ext.report import compact_names, table
from nanotron_ext.schedule.zbv import VOp, v_rank
from nanotron_ext.strategies.step_time import schedule_problem

__all__ = ["VPlan", "make_v_plan"]

GIB = 2**30


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
        proven: whether the search proved the split the best under its rules (else its budget ran out).
        order: each rank's ops, in the order the engine runs them.
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

    @property
    def stages(self) -> list[int]:
        """Each block's virtual stage (what ``build_cpu_llama(v_stages=...)`` and ``mark_v_stages`` take)."""
        return [s for s in range(2 * self.pp) for _ in range(self.bounds[s + 1] - self.bounds[s])]

    @property
    def block_ranks(self) -> list[int]:
        """Each block's PP rank: down the ranks and back up."""
        return [v_rank(self.pp, s) for s in self.stages]

    def chunk(self, stage: int) -> tuple[str, ...]:
        """The blocks of virtual stage ``stage``."""
        return self.blocks[self.bounds[stage]:self.bounds[stage + 1]]

    def table(self) -> str:
        """Two chunks per rank: the way down, the way up, the rank's peak."""
        rows = []
        for r in range(self.pp):
            up = 2 * self.pp - 1 - r
            rows.append([r, f"{r}: {compact_names([short_name(b) for b in self.chunk(r)])}",
                         f"{up}: {compact_names([short_name(b) for b in self.chunk(up)])}",
                         f"{self.peaks[r] / GIB:.2f}"])
        limit = f"{self.limit / GIB:.2f} GiB" if self.limit is not None else "no limit known"
        return (table(["rank", "chunk down", "chunk up", "peak GiB"], rows)
                + f"\nzbv: pp={self.pp}, m={self.n_micro_batches}, simulated step {self.step_time * 1e3:.1f} ms, "
                  f"bubble {self.bubble:.1%}; each rank under {limit}"
                  + ("" if self.proven else " (the search's budget ran out: the best found, not proven best)"))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["order"] = [[str(op) for op in ops] for ops in self.order]
        return out


def make_v_plan(blocks: Sequence[BlockInfo], cfg: PlannerConfig, *, max_evals: int = 300) -> VPlan:
    """The V split of ``blocks`` over ``cfg.run.pp`` ranks with the least simulated step that fits each rank.

    Raises:
        PlanningError: fewer blocks than ``2 pp`` chunks, or no split trains in every chunk within the memory limit
            (naming the limit and the least peak a rank can have).
    """
    pp, m = cfg.run.pp, cfg.run.n_micro_batches
    if len(blocks) < 2 * pp:
        raise PlanningError(f"a V over pp={pp} ranks cuts the model into {2 * pp} chunks, but it has {len(blocks)} "
                            f"pipeline blocks; lower pp to {len(blocks) // 2} or less, or use pp_engine zb1p")
    # Chunks are priced as the stages of a 2 pp pipeline, with the config's own machine (whose key is this pp's).
    machine = machine_for(cfg, blocks)
    chunked = dataclasses.replace(cfg, ext=dataclasses.replace(cfg.ext, machine=None)).with_overrides(
        pp=2 * pp, engine="zb1p")
    # The seed need not fit (the search keeps only splits that do): planned under a cap every split meets.
    unbounded = chunked.with_overrides(memory_cap_gib=1e6)
    seed = tuple(bounds_from_ranks(make_plan(blocks, unbounded, "flops", suggest_fixes=False).block_ranks, 2 * pp))
    problem = schedule_problem(blocks, chunked, machine)
    limit = memory_limit(cfg)
    cap = None if limit is None else limit.bytes
    trains = [b.trainable > 0 for b in blocks]
    if sum(trains) < 2 * pp:
        names = compact_names([short_name(b.name) for b in blocks if b.trainable > 0])
        raise PlanningError(f"a V over pp={pp} ranks needs a trainable block in each of its {2 * pp} chunks; "
                            f"{sum(trains)} blocks train ({names}): unfreeze one, lower pp or use pp_engine zb1p")

    def valid(bounds: Sequence[int]) -> bool:
        every_chunk = all(any(trains[a:b]) for a, b in zip(bounds, bounds[1:]))
        return every_chunk and (cap is None or max(v_floors(blocks, chunked, bounds)) <= cap)

    def fits(bounds: Sequence[int], result: Any) -> bool:
        return cap is None or max(x.peak for x in v_peaks(blocks, chunked, bounds, result)) <= cap

    budgets = None if cap is None else (lambda bounds: v_budget(blocks, chunked, bounds, cap))
    tries = {eager: search_v_split(problem, seed, valid=valid, fits=fits, max_evals=max_evals, eager=eager,
                                   budgets=budgets) for eager in ((), (2 * pp - 1,))}
    eager, found = min(tries.items(), key=lambda kv: kv[1].step)
    if found.bounds is None:
        floor = max(v_floors(blocks, chunked, seed))
        where = f"under {limit}" if limit is not None else "with a trainable block in every chunk"
        raise PlanningError(f"no V split of {len(blocks)} blocks over pp={pp} ranks fits {where}: the FLOP-balanced "
                            f"chunks need at least {floor / GIB:.2f} GiB on one rank; use pp_engine zb1p, or raise "
                            f"pp, tp or the memory")
    result = v_simulate(problem, found.bounds, eager, None if budgets is None else budgets(found.bounds))
    _, p2p, _ = problem.simulator_inputs(found.bounds)
    peaks = tuple(x.peak for x in v_peaks(blocks, chunked, found.bounds, result))
    return VPlan(pp=pp, n_micro_batches=m, blocks=tuple(b.name for b in blocks), bounds=tuple(found.bounds),
                 step_time=result.step_time, bubble=result.pipeline_bubble_fraction, peaks=peaks, limit=cap,
                 p2p=tuple(float(t) for t in p2p),
                 eager=tuple(eager), proven=found.proven, order=result.order)
