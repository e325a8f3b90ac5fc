"""The analytic cost model: the training FLOPs of blocks (what trains decides what is paid), the micro-batches a
stage holds, and the bytes per parameter of weights, gradients and optimizer state.

Each block's forward / input-gradient / weight-gradient FLOPs are inventory facts
(:mod:`nanotron_ext.inventory.flops`). Training work of a block depends on what is trainable: a frozen block pays no
weight-gradient work, and a block with nothing trainable before it pays no input-gradient work (autograd never asks for
it), so a fully frozen prefix costs forward only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.config import DTYPE_BYTES, RunShape
from nanotron_ext.schedule import Engine
from nanotron_ext.schedule.programs import warmup_forwards

__all__ = [
    "GIB",
    "ParamBytes",
    "in_flight",
    "param_bytes",
    "static_bytes",
    "trainable_before",
    "training_flops",
    "update_bytes",
]

GIB = float(1 << 30)


def trainable_before(blocks: Sequence[BlockInfo]) -> list[bool]:
    """Entry ``i``: does any of ``blocks[:i]`` train? One entry per block, plus one for after the last.

    A block's input asks autograd for a gradient only then, so this decides whether a block pays input-gradient
    work, whether the profiler times its backward, and whether a gradient crosses a pipeline cut back.

    Example:
        Frozen embedding, trainable decoder, frozen head: ``[False, False, True, True]``.
    """
    out, before = [False], False
    for b in blocks:
        before = before or b.trainable > 0
        out.append(before)
    return out


def training_flops(blocks: Sequence[BlockInfo]) -> list[float]:
    """FLOPs of one micro-batch's forward and backward per block, aware of what is trainable.

    A block pays weight-gradient work in proportion to its trainable share, and input-gradient work
    only when some block before it is trainable.

    Example:
        Frozen embedding, frozen decoder, trainable lm_head: the first two cost forward only, the head
        forward + weight-gradient.
    """
    out: list[float] = []
    for b, input_grad in zip(blocks, trainable_before(blocks)):
        cost = b.flops_fwd
        if input_grad:
            cost += b.flops_bwd_input
        if b.params:
            cost += b.flops_bwd_weight * (b.trainable / b.params)
        out.append(cost)
    return out


def in_flight(engine: Engine, pp: int, n_micro_batches: int) -> list[int]:
    """Micro-batches whose activations a stage holds at its peak.

    AFAB runs every forward first, so each stage holds all ``m``; the 1F1B family its warm-up forwards and the one
    of its steady phase (:func:`~nanotron_ext.schedule.programs.warmup_forwards`): 1F1B and zb1p at most
    ``pp − stage``, zb2p at most ``2(pp − stage) − 1``.
    """
    return [min(n_micro_batches, warmup_forwards(engine, pp, stage, n_micro_batches) + 1) for stage in range(pp)]


@dataclass(frozen=True)
class ParamBytes:
    """Bytes per trainable parameter (``weights`` also per frozen one).

    Attributes:
        weights: the parameter in the model dtype.
        gradients: ``.grad`` (plus the fp32 accumulation buffer, plus DDP's bucket when dp > 1).
        optimizer: Adam's two moments, plus fp32 master weights when a 16-bit model accumulates in fp32
            (divided by dp under ZeRO-1).
        state: bytes of one optimizer-state element (the dtype Adam's temporaries are made in).
        gradients_allocated: the part of ``gradients`` allocated before training and kept (the fp32
            accumulation buffer, DDP's buckets); the rest, ``.grad``, appears during the backward.
    """

    weights: float
    gradients: float
    optimizer: float
    state: float
    gradients_allocated: float = 0.0


def param_bytes(run: RunShape) -> ParamBytes:
    """Bytes per parameter under ``run``'s dtype, gradient accumulation, ZeRO stage and dp.

    * fp32: weights 4, ``.grad`` 4, Adam 8.
    * 16-bit with ``accumulate_grad_in_fp32``: weights 2; gradients: the fp32 buffer 4 plus the 16-bit ``.grad``
      that lives until the accumulator adds it (2); optimizer: fp32 master weights 4 + Adam 8 in fp32.
    * 16-bit without it: Nanotron runs AdamW on the 16-bit parameters themselves: weights 2, ``.grad`` 2,
      Adam 2 + 2.
    * dp > 1: DDP's gradient buckets, one more gradient in the model dtype.
    * ZeRO-1: the optimizer column (master weights and Adam) divided by dp.
    """
    w = DTYPE_BYTES[run.dtype]
    allocated = 0.0
    if w == 4:
        grads, state, master = 4.0, 4.0, 0.0
    elif run.accumulate_grad_in_fp32:
        # FP32GradientAccumulator allocates its contiguous fp32 buffer when it is built.
        grads, state, master, allocated = 4.0 + w, 4.0, 4.0, 4.0
    else:
        grads, state, master = float(w), float(w), 0.0
    if run.dp > 1:
        grads += w  # DDP keeps its own bucket copy of every gradient (gradient_as_bucket_view is off)
        allocated += w  # ... allocated when DDP wraps the model
    optimizer = 2 * state + master
    if run.zero_stage >= 1:
        optimizer /= run.dp
    return ParamBytes(
        weights=float(w), gradients=grads, optimizer=optimizer, state=state, gradients_allocated=allocated
    )


def update_bytes(run: RunShape) -> float:
    """Bytes of device memory one trainable parameter's optimizer step moves: fused AdamW's one pass reads the
    weight it updates, its gradient and both moments and writes the weight and the moments (7 × the optimizer's
    width: 28 bytes in fp32, 14 in 16-bit); with ``accumulate_grad_in_fp32`` it updates the fp32 master and then
    copies it into the 16-bit weight (+ 4 read + 2 written). Under ZeRO-1 a rank updates its 1/dp share.

    Example:
        bf16 with fp32 accumulation, ZeRO-0: 7 × 4 + 4 + 2 = 34 bytes per parameter.
    """
    per = param_bytes(run)
    moved = 7 * per.state + (per.state + per.weights if run.accumulate_grad_in_fp32 and per.weights < 4 else 0.0)
    return moved / run.dp if run.zero_stage >= 1 else moved


def static_bytes(block: BlockInfo, run: RunShape) -> float:
    """Weights + gradients + optimizer state (+ fp32 master weights) of a block, ZeRO-1 and DDP aware.

    Bytes per parameter are :func:`param_bytes`'s. Frozen weights carry no gradient or
    optimizer state.
    """
    per = param_bytes(run)
    return block.params * per.weights + block.trainable * (per.gradients + per.optimizer)
