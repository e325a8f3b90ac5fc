"""Peak memory of a rank of a V (ZB-V, issue 43): two chunks on one rank, their terms added at the moments they
coincide.

A rank of a V holds chunk ``r`` (the way down) and chunk ``2 pp - 1 - r`` (the way up). What it holds throughout is
both chunks' weights, gradients, optimizer state and buffers, as one stage of their blocks would
(:func:`~nanotron_ext.costs.memory_estimate.stage_memory`: rank 0 holds the embedding and the lm_head, so a tied
weight is counted once). What it holds in the pipeline changes with the schedule: at each moment one of its ops
starts (:func:`~nanotron_ext.schedule.zbv.v_moments`), each chunk's activations times the micro-batches that hold
them, each chunk's deferred weight-gradient state times the micro-batches that keep it, and the running chunk's
temporaries. The peak is the worst of those moments, not the sum of each chunk's own worst.

Bounds, all upward: the micro-batch whose op starts counts its activations in full (they fill up during its
``F``), a ``B`` counts its activations and its W state at once (the second grows as the first is freed), and every
gradient is counted alive (after the first backward, as in 1F1B's steady state). The CPU runtime's retained sends
are not counted: no engine runs a V yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.config import PlannerConfig
from nanotron_ext.costs.memory_estimate import PeakOfTwoMoments, StageMemory, config_stage_memory
from nanotron_ext.errors import PlanningError
from nanotron_ext.schedule.v_moments import VMoment

__all__ = [
    "FIRST_BACKWARD",
    "VRankMemory",
    "v_least_largest_rank",
    "v_rank_at",
    "v_rank_floor",
    "v_rank_memory",
    "v_rank_terms",
]


@dataclass(frozen=True)
class VRankMemory(PeakOfTwoMoments):
    """Estimated peak memory of one rank of a V, by term (bytes); per-chunk pairs are (way down, way up).

    Attributes:
        rank: the rank.
        weights, gradients, optimizer, buffers, optimizer_temporaries, overhead: as
            :class:`~nanotron_ext.costs.memory_estimate.StageMemory`'s, of both chunks' blocks together.
        activations: one micro-batch's activations of each chunk.
        weight_pending: what one deferred ``W`` of a micro-batch keeps, per chunk.
        temporaries: each chunk's temporaries while one of its ops runs.
        worst: the moment of the pipeline's peak.
    """

    rank: int
    weights: float
    gradients: float
    optimizer: float
    buffers: float
    optimizer_temporaries: float
    overhead: float
    activations: tuple[float, float]
    weight_pending: tuple[float, float]
    temporaries: tuple[float, float]
    worst: VMoment

    @property
    def throughout(self) -> float:
        """Bytes held at every moment: weights, gradients, optimizer state, buffers, the overhead allowance."""
        return self.weights + self.gradients + self.optimizer + self.buffers + self.overhead

    def pipeline_at(self, moment: VMoment) -> float:
        """Bytes held at ``moment``: what the rank holds throughout, plus the moment's activations, W state and
        the running chunk's temporaries."""
        return (
            self.throughout
            + sum(n * a for n, a in zip(moment.held, self.activations))
            + sum(n * w for n, w in zip(moment.pending, self.weight_pending))
            + self.temporaries[moment.running]
        )

    @property
    def pipeline_peak(self) -> float:
        return self.pipeline_at(self.worst)

    @property
    def optimizer_peak(self) -> float:
        return self.throughout + self.optimizer_temporaries

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "worst": self.worst._asdict(),
            "peak": self.peak,
            "peak_at": self.peak_at,
            "pipeline_peak": self.pipeline_peak,
            "optimizer_peak": self.optimizer_peak,
        }


#: A moment every rank of a V reaches, whatever the schedule: micro-batch 0's B starting on the way up, with its F
#: of the way down still held (that chunk's B comes later) and the way up's W state counted from the B's start.
FIRST_BACKWARD = VMoment((1, 1), (0, 1), 1, "B")


def v_rank_memory(
    chunks: tuple[Sequence[BlockInfo], Sequence[BlockInfo]], moments: Sequence[VMoment], cfg: PlannerConfig, rank: int
) -> VRankMemory:
    """The peak memory of rank ``rank`` of a V holding ``chunks`` (way down, way up), over ``moments``.

    Args:
        chunks: the blocks of the rank's two chunks, each contiguous in forward order.
        moments: what the rank holds at each of its ops' starts (:func:`~nanotron_ext.schedule.zbv.v_moments`).
        cfg: the config (model, run, memory runtime, overhead); its engine is not read: a V defers every
            backward's weight gradient, as zb1p.
        rank: the rank.

    Raises:
        PlanningError: no moments, or a chunk without blocks.
    """
    if not moments:
        raise PlanningError(f"rank {rank} of the V has no ops: pass the moments of a simulated step (v_moments)")
    return v_rank_at(v_rank_terms(chunks, cfg, rank), moments)


def v_rank_terms(chunks: tuple[Sequence[BlockInfo], Sequence[BlockInfo]], cfg: PlannerConfig, rank: int) -> VRankMemory:
    """Rank ``rank``'s terms, whatever the schedule (its ``worst`` is :data:`FIRST_BACKWARD` until
    :func:`v_rank_at` puts the schedule's there): what a split search keeps for each pair of chunks.

    Raises:
        PlanningError: a chunk without blocks.
    """
    if not (chunks[0] and chunks[1]):
        raise PlanningError(f"rank {rank} of the V has an empty chunk; every chunk needs a block")
    if cfg.run.engine != "zb1p":
        cfg = cfg.with_overrides(engine="zb1p")
    whole = _estimate([*chunks[0], *chunks[1]], cfg)
    parts = (_estimate(chunks[0], cfg), _estimate(chunks[1], cfg))
    return VRankMemory(
        rank=rank,
        weights=whole.weights,
        gradients=whole.gradients,
        optimizer=whole.optimizer,
        buffers=whole.buffers,
        optimizer_temporaries=whole.optimizer_temporaries,
        overhead=whole.overhead,
        activations=(parts[0].activations, parts[1].activations),
        weight_pending=(parts[0].weight_pending, parts[1].weight_pending),
        temporaries=(parts[0].pipeline_temporaries, parts[1].pipeline_temporaries),
        worst=FIRST_BACKWARD,
    )


def v_rank_at(base: VRankMemory, moments: Sequence[VMoment]) -> VRankMemory:
    """``base``'s terms with the worst of ``moments`` (what the rank holds at each of its ops' starts)."""
    return replace(base, worst=max(moments, key=base.pipeline_at))


def v_rank_floor(chunks: tuple[Sequence[BlockInfo], Sequence[BlockInfo]], cfg: PlannerConfig, rank: int) -> float:
    """A lower bound of :func:`v_rank_memory`'s peak under any schedule (its terms at :data:`FIRST_BACKWARD`, or
    the optimizer step): what a split search checks before simulating a split."""
    return v_rank_terms(chunks, cfg, rank).peak


def v_least_largest_rank(blocks: Sequence[BlockInfo], cfg: PlannerConfig, pp: int) -> float:
    """A lower bound of the largest rank's peak in any V of ``blocks`` over ``pp`` ranks, with no split: every
    block's weights, gradients, optimizer state and buffers sit on some rank, so the largest holds at least their
    ``pp``-th part (a search that cannot succeed stops on it at once)."""
    whole = _estimate(blocks, cfg)
    return (whole.weights + whole.gradients + whole.optimizer + whole.buffers) / pp


def _estimate(blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> StageMemory:
    """The 1F1B-family estimate of ``blocks`` as the pipeline's last stage (one micro-batch in flight), without
    retained sends."""
    return config_stage_memory(blocks, cfg, cfg.run.pp - 1, retain_sends=False)
