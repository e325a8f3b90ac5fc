"""Peak memory of a pipeline stage: what each block saves for backward, what is alive at once, and why.

Per micro-batch of ``t = b·s`` tokens, a stage's peak is the larger of two moments:

* **pipeline** — weights + gradients + optimizer state + buffers, plus the activations of every micro-batch in
  flight (AFAB: ``m``; 1F1B: ``pp − stage``), plus the largest temporary of one block's forward or backward
  (the loss holds the fp32 logits next to their shifted copy; a weight's gradient is computed into a fresh
  tensor before it is added to ``.grad``);
* **optimizer step** — weights + gradients + optimizer state + buffers, plus the step's temporaries.

Under zb1p the pipeline moment adds, on stage ``r``, ``min(r, m - 1)`` deferred weight-gradient passes (zb2p:
``min(2r, m - 1)``), each keeping each trainable weight's input and output gradient (:func:`pending_tensors`);
zb2p also holds up to ``2(pp - r) - 1`` micro-batches in flight where 1F1B holds ``pp - r``.

What each block saves, temporarily holds and sends is :mod:`nanotron_ext.costs.block_memory`'s; the pipeline's worst
moment, followed block by block, :mod:`nanotron_ext.costs.pipeline_moment`'s. Static bytes
per parameter follow Nanotron's optimizer and gradient accumulator (:func:`nanotron_ext.costs.analytic.param_bytes`).
Runtime overhead (CUDA context, communication buffers, fragmentation) is not a tensor: it is the config's
``memory_overhead_gib``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.config import MemoryRuntime, ModelShape, PlannerConfig, RunShape
from nanotron_ext.costs.analytic import GIB, in_flight, param_bytes
from nanotron_ext.costs.block_memory import deferred_at_once
from nanotron_ext.costs.pipeline_moment import PerBlock, per_block, pipeline_moment, stage_parameters
from nanotron_ext.costs.segment_peaks import SegmentPeaks
from nanotron_ext.schedule import ZERO_BUBBLE

__all__ = [
    "RUNTIME_TENSORS_BYTES",
    "PeakOfTwoMoments",
    "SegmentMemory",
    "StageMemory",
    "config_stage_memory",
    "estimate_key",
    "stage_memory",
]


#: Small tensors of the engine, P2P, TP collectives and optimizer that no block owns (metadata buffers, Adam's
#: step counters, losses, the masks of the data): 9–70 KiB per rank measured on the CPU runtime, varying from run
#: to run at tp=2; counted with the buffers.
RUNTIME_TENSORS_BYTES = 128 * 1024


class PeakOfTwoMoments:
    """The rule of a peak estimate: the larger of the pipeline's worst moment and the optimizer step (a stage's
    :class:`StageMemory`, a V rank's :class:`~nanotron_ext.costs.v_memory.VRankMemory`)."""

    pipeline_peak: float
    optimizer_peak: float

    @property
    def peak(self) -> float:
        """The estimated peak: the larger of the pipeline and the optimizer step."""
        return max(self.pipeline_peak, self.optimizer_peak)

    @property
    def peak_at(self) -> str:
        """``pipeline`` or ``optimizer``: the moment of the peak."""
        return "pipeline" if self.pipeline_peak >= self.optimizer_peak else "optimizer"


@dataclass(frozen=True)
class StageMemory(PeakOfTwoMoments):
    """Estimated peak memory of one stage, by term (bytes).

    Attributes:
        weights: parameters (a tied weight held twice on one rank counted once).
        gradients: gradients, fp32 accumulation buffers and DDP buckets.
        optimizer: Adam's moments and fp32 master weights (ZeRO-1 sharded).
        buffers: allocated once outside the parameters (rotary tables, the runtime's small tensors).
        activations: one micro-batch's activations (saved tensors, plus the stage's held input and output).
        in_flight: micro-batches in flight at the stage (AFAB: ``m``; 1F1B, zb1p: ``pp − stage``; zb2p:
            ``2(pp − stage) − 1``; at most ``m``).
        pipeline_activations: activations alive at the pipeline's peak: the other micro-batches in flight in
            full, and what the one being computed has saved so far.
        pipeline_gradients: gradient bytes alive at the pipeline's peak (all of them once a backward has run
            before a forward, as in 1F1B's steady state; under AFAB only those of the blocks already back-propagated
            in the first backward).
        pipeline_temporaries: the rest of the pipeline's peak: the computing block's input, output and
            temporaries, the gradient it receives, and (CPU runtime) sent tensors kept until the step ends.
        optimizer_temporaries: the optimizer step's temporaries.
        overhead: the configured allowance for runtime overhead.
        weight_pending: bytes one deferred weight-gradient pass (zb1p's ``W``) of one micro-batch keeps: the
            stage's :func:`weight_pending`.
        deferred: W's the stage keeps deferred at once besides the one running (zb1p: its rank, zb2p: twice
            it, at most ``m - 1``; AFAB and 1F1B: 0); ``deferred × weight_pending`` joins the pipeline's peak.
    """

    weights: float
    gradients: float
    optimizer: float
    buffers: float
    activations: float
    in_flight: int
    pipeline_activations: float
    pipeline_gradients: float
    pipeline_temporaries: float
    optimizer_temporaries: float
    overhead: float
    weight_pending: float = 0.0
    deferred: int = 0

    @property
    def pending_weights(self) -> float:
        """Bytes of the deferred W's at the pipeline's peak (zb1p, zb2p)."""
        return self.deferred * self.weight_pending

    @property
    def static(self) -> float:
        """Bytes held through the optimizer step: weights, gradients, optimizer state, buffers."""
        return self.weights + self.gradients + self.optimizer + self.buffers

    @property
    def pipeline_peak(self) -> float:
        return (
            self.weights
            + self.optimizer
            + self.buffers
            + self.pipeline_gradients
            + self.pipeline_activations
            + self.pipeline_temporaries
            + self.pending_weights
            + self.overhead
        )

    @property
    def optimizer_peak(self) -> float:
        return self.static + self.optimizer_temporaries + self.overhead

    @property
    def temporaries(self) -> float:
        """The temporaries of the peak's moment."""
        return self.pipeline_temporaries if self.peak_at == "pipeline" else self.optimizer_temporaries

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "peak": self.peak,
            "peak_at": self.peak_at,
            "pipeline_peak": self.pipeline_peak,
            "optimizer_peak": self.optimizer_peak,
        }


def stage_memory(
    blocks: Sequence[BlockInfo],
    m: ModelShape,
    run: RunShape,
    stage: int,
    *,
    pp: int | None = None,
    overhead_gib: float = 0.0,
    optimizer: str = "foreach",
    retain_sends: bool = False,
    runtime: MemoryRuntime = "cpu",
) -> StageMemory:
    """The peak-memory breakdown of a stage holding ``blocks`` (contiguous, forward order).

    The micro-batch being computed is followed block by block: in its forward, block ``i`` holds the stage's
    input, what blocks ``0..i`` saved, its own input (when not saved), temporaries and output; in its backward,
    what blocks ``0..i`` saved, the stage's output, the gradient it receives and its backward temporaries. The other
    ``in_flight − 1`` micro-batches hold their full activations. Under zb1p (zb2p) the stage also keeps the state
    of up to ``stage`` (``2 · stage``) deferred weight-gradient passes (:func:`pending_tensors`), counted at every
    moment of the pipeline; the W that runs is counted as 1F1B's backward of its micro-batch (it keeps less than that
    backward held).

    Args:
        blocks: the stage's blocks.
        m: model shape.
        run: parallelism, batch, dtype, engine.
        stage: the stage's PP rank (1F1B holds ``pp − stage`` micro-batches).
        pp: number of stages (``run.pp`` when None).
        overhead_gib: runtime overhead allowance added to the peak.
        optimizer: how AdamW runs: ``foreach`` (torch's default on CUDA: one temporary per state element of
            every parameter at once), ``for_loop`` (CPU: two temporaries the size of the largest parameter) or
            ``fused`` (none).
        retain_sends: the CPU runtime's P2P keeps every sent tensor until the step ends.
        runtime: whose code saves the activations (:func:`~nanotron_ext.costs.block_memory.block_memory`).

    Returns:
        The :class:`StageMemory`.

    Raises:
        ValueError: an unknown ``optimizer``.
    """
    if optimizer not in ("foreach", "for_loop", "fused"):
        raise ValueError(f"optimizer={optimizer!r} is not one of foreach, for_loop, fused")
    pp = run.pp if pp is None else pp
    n = in_flight(run.engine, pp, run.n_micro_batches)[stage] if blocks else 0
    deferred = deferred_at_once(run.engine, pp, run.n_micro_batches)[stage] if blocks else 0
    return _stage_memory(
        blocks,
        per_block(blocks, m, run, runtime),
        m,
        run,
        stage,
        pp,
        n,
        deferred,
        overhead_gib,
        optimizer,
        retain_sends,
    )


def _stage_memory(
    blocks: Sequence[BlockInfo],
    per: PerBlock,
    m: ModelShape,
    run: RunShape,
    stage: int,
    pp: int,
    n: int,
    deferred: int,
    overhead_gib: float,
    optimizer: str,
    retain_sends: bool,
) -> StageMemory:
    """:func:`stage_memory` of ``blocks`` with what it reads of each block given, ``n`` micro-batches in flight
    and ``deferred`` W's."""
    bytes_per = param_bytes(run)
    held = stage_parameters(blocks, m, bytes_per)
    mems = per.memory
    activations, worst = pipeline_moment(per, run, stage, pp, n, held, retain_sends)
    return StageMemory(
        weights=held.params * bytes_per.weights,
        gradients=sum(held.grads) + held.allocated,
        optimizer=sum(held.trainable) * bytes_per.optimizer,
        buffers=sum(x.persistent for x in mems) + (RUNTIME_TENSORS_BYTES if blocks else 0.0),
        activations=activations,
        in_flight=n,
        pipeline_activations=worst[0],
        pipeline_gradients=worst[1],
        pipeline_temporaries=worst[2],
        optimizer_temporaries=_optimizer_temporaries(per.largest, held.trainable, bytes_per.state, optimizer),
        overhead=overhead_gib * GIB,
        weight_pending=sum(per.pending) if run.engine in ZERO_BUBBLE else 0.0,
        deferred=deferred,
    )


def _optimizer_temporaries(
    largest: Sequence[int], trainable: Sequence[int], state_bytes: float, optimizer: str
) -> float:
    """The optimizer step's temporaries (bytes) for AdamW run as ``optimizer`` (see :func:`stage_memory`), from each
    block's largest trainable tensor and trainable parameters."""
    largest_trained = max((x for x, tr in zip(largest, trainable) if tr), default=0)
    if optimizer == "for_loop":
        # torch's single-tensor AdamW: denom = (exp_avg_sq.sqrt() / c).add_(eps), two tensors for a moment.
        return 2.0 * largest_trained * state_bytes
    if optimizer == "foreach":
        return max(2.0 * largest_trained, sum(trainable)) * state_bytes
    return 0.0


def config_stage_memory(
    blocks: Sequence[BlockInfo], cfg: PlannerConfig, stage: int, *, retain_sends: bool | None = None
) -> StageMemory:
    """:func:`stage_memory` with the config's runtime, optimizer and overhead (what ``plan`` prints).

    Args:
        blocks: the stage's blocks.
        cfg: the config (``nanotron_ext.memory_runtime``, ``memory_overhead_gib``, ``torch_adam_is_fused``).
        stage: the stage's PP rank.
        retain_sends: whether sent tensors are kept to the step's end (None: as the config's runtime does).
    """
    optimizer, retains = _config_runtime(cfg)
    return stage_memory(
        blocks,
        cfg.model,
        cfg.run,
        stage,
        overhead_gib=cfg.ext.overhead_gib,
        optimizer=optimizer,
        retain_sends=retains if retain_sends is None else retain_sends,
        runtime=cfg.ext.memory_runtime,
    )


def estimate_key(cfg: PlannerConfig) -> tuple[object, ...]:
    """What :func:`config_stage_memory` reads of ``cfg`` (hashable): configs with equal keys estimate alike."""
    return cfg.model, cfg.run, cfg.ext.memory_runtime, cfg.ext.overhead_gib


def _config_runtime(cfg: PlannerConfig) -> tuple[str, bool]:
    """How the config's run steps AdamW, and whether its P2P keeps every sent tensor (the CPU runtime)."""
    cpu = cfg.ext.memory_runtime == "cpu"
    if cpu:
        return "for_loop", True
    return ("fused" if cfg.run.torch_adam_is_fused else "foreach"), False


class SegmentMemory:
    """:func:`config_stage_memory` of any contiguous run ``blocks[s:e]`` of one inventory on any stage: what each
    block saves, holds and defers is worked out once (a split search asks for thousands of segments)."""

    def __init__(self, blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> None:
        self.blocks, self.cfg = list(blocks), cfg
        run = cfg.run
        self._per = per_block(self.blocks, cfg.model, run, cfg.ext.memory_runtime)
        self._flight = in_flight(run.engine, run.pp, run.n_micro_batches)
        self._deferred = deferred_at_once(run.engine, run.pp, run.n_micro_batches)
        self._optimizer, self._retain_sends = _config_runtime(cfg)
        self._many: SegmentPeaks | None = None

    def peaks(self, stage: int, s: np.ndarray, e: np.ndarray) -> np.ndarray:
        """The peaks of many segments ``[s[j], e[j])`` (``s[j] < e[j]``) on ``stage`` at once, each equal to
        ``self(stage, s[j], e[j]).peak`` (:class:`~nanotron_ext.costs.segment_peaks.SegmentPeaks`)."""
        if self._many is None:
            cfg = self.cfg
            self._many = SegmentPeaks(
                self.blocks,
                self._per,
                cfg.run,
                self._flight,
                self._deferred,
                overhead=cfg.ext.overhead_gib * GIB,
                buffers=RUNTIME_TENSORS_BYTES,
                optimizer=self._optimizer,
                retain_sends=self._retain_sends,
                tied=cfg.model.tie_word_embeddings,
                one_by_one=lambda k, s0, e0: self(k, s0, e0).peak,
            )
        return self._many(stage, s, e)

    def __call__(self, stage: int, s: int, e: int) -> StageMemory:
        """The estimate of blocks ``[s, e)`` on ``stage``: equal to ``config_stage_memory(blocks[s:e], cfg, stage)``."""
        cfg = self.cfg
        held = e > s
        return _stage_memory(
            self.blocks[s:e],
            self._per.part(s, e),
            cfg.model,
            cfg.run,
            stage,
            cfg.run.pp,
            self._flight[stage] if held else 0,
            self._deferred[stage] if held else 0,
            cfg.ext.overhead_gib,
            self._optimizer,
            self._retain_sends,
        )
