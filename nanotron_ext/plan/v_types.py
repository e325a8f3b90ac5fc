"""A V plan's record (issue 43): the blocks cut into ``2 pp`` chunks, two per rank, its simulated ZB-V step, each
rank's peak and the order the engine runs. Plain data that prints (two chunks per rank), compares and serialises;
:func:`~nanotron_ext.plan.v_plan.make_v_plan` makes one."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from nanotron_ext.blocks import short_name
from nanotron_ext.report import compact_names, format_seconds, table
from nanotron_ext.schedule import V_ENGINE
from nanotron_ext.schedule.v_replay import Transfer, transfer_order
from nanotron_ext.schedule.zbv import VOp, v_rank

__all__ = ["GIB", "V_STRATEGY", "VPlan"]

GIB = 2**30
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
