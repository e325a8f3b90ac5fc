"""The one reading of time: which machine prices a config (:func:`machine_for`), and what each block costs on
it (:func:`price_blocks`).

Every strategy's objective, ``vocab_shards: auto``, ``simulate`` and the timeline price through these two
functions (via :func:`nanotron_ext.strategies.step_time.schedule_problem`), so a split is never planned under one
pricing and simulated under another.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

from nanotron_ext.blocks import DEFERS_WEIGHT_GRADIENT, BlockInfo, tied_pair
from nanotron_ext.config import DTYPE_BYTES, PlannerConfig
from nanotron_ext.costs.analytic import trainable_before, training_flops, update_bytes
from nanotron_ext.costs.block_memory import block_memory, output_tensors
from nanotron_ext.machine.analytic import ANALYTIC_GPU
from nanotron_ext.machine.profile import (
    POSITIONS,
    BlockCost,
    MachineProfile,
    block_signature,
    key_for,
    load_machine,
)

__all__ = [
    "BlockPrices",
    "PositionPrices",
    "machine_for",
    "measured_blocks",
    "price_blocks",
    "tied_sync_seconds",
    "tied_weight_bytes",
    "weight_part",
]


class PositionPrices(NamedTuple):
    """Per block, seconds on a stage of one position (``first``, ``middle``, ``last``): forward and backward per
    micro-batch and the backward's weight-gradient part, as :class:`BlockPrices` prices them, from the figures an
    in-run profile measured at that position (a block it did not measure there keeps its mean)."""

    forward: list[float]
    backward: list[float]
    weight: list[float]


class BlockPrices(NamedTuple):
    """Per block, seconds: forward and backward per micro-batch, update per step (optimizer, gradient syncs),
    ``send[c][i]``: one transfer of what block ``i`` sends when cut ``c`` (between stages ``c`` and ``c + 1``)
    follows it, over that cut's link (one row per cut, at least one), and ``weight``: the weight-gradient part of
    ``backward`` (zb1p's deferred ``W``; its ``B`` is ``backward - weight``, the call overhead included)."""

    forward: list[float]
    backward: list[float]
    update: list[float]
    send: list[list[float]]
    weight: list[float]
    #: A tied model's ``(embedding index, lm_head index)`` (:func:`~nanotron_ext.blocks.tied_pair`) and, per block,
    #: the update a stage holding both saves (the lm_head's whole update, the embedding's tied all-reduce: it holds
    #: one tensor, stepped and synced once); None and [] when untied.
    tied_pair: tuple[int, int] | None = None
    tied_saving: list[float] = []
    #: ``(position, its prices)`` for each stage position, where the machine measured blocks by position (an in-run
    #: profile); empty: every stage takes ``forward``, ``backward`` and ``weight``.
    positions: tuple[tuple[str, PositionPrices], ...] = ()


def machine_for(
    cfg: PlannerConfig,
    blocks: Sequence[BlockInfo] | None = None,
    *,
    device: str | None = None,
    backend: str | None = None,
) -> MachineProfile:
    """The machine that prices ``cfg``: ``nanotron_ext.machine`` (key-checked) or the analytic default, then the
    overrides ``times`` (``flops``: one FLOP rate; ``profiled``: ``blocks`` measured here now), ``tflops`` and
    ``p2p_gbps``. ``cost_strategy: profiled`` without a measured profile measures ``blocks`` as ``times:
    profiled`` does. A run that knows its ``device`` type and process-group ``backend`` passes them, so that a
    profile measured elsewhere (CPU for a GPU run, gloo for NCCL) is refused too.

    Raises:
        ConfigError: the profile is unreadable or was measured for another key.
    """
    ext = cfg.ext
    if ext.machine is not None:
        machine = load_machine(ext.machine)
        machine.check_key(key_for(cfg, device=device, backend=backend), origin=repr(ext.machine))
    else:
        machine = ANALYTIC_GPU
    if ext.times == "flops" or ext.tflops is not None:
        machine = machine.with_flop_rate(None if ext.tflops is None else ext.tflops * 1e12)
    measure = ext.times == "profiled" or (
        ext.cost_strategy == "profiled" and ext.times == "machine" and not machine.blocks
    )
    if measure and blocks is not None:
        machine = machine.with_blocks(measured_blocks(blocks, cfg), "compute: blocks measured here (profiled)")
    if ext.p2p_gbps is not None:
        machine = machine.with_p2p_bandwidth(ext.p2p_gbps)
    return machine


def measured_blocks(blocks: Sequence[BlockInfo], cfg: PlannerConfig, **kwargs: object) -> list[BlockCost]:
    """``blocks`` measured on this machine (rank 0 measures and broadcasts under torch.distributed; cached on
    disk, see :mod:`nanotron_ext.costs.profiled`), one :class:`BlockCost` per distinct signature."""
    from nanotron_ext.costs.profiled import block_timings  # needs torch: only when measuring

    timings = block_timings(blocks, cfg, **kwargs)  # type: ignore[arg-type]
    out: dict[str, BlockCost] = {}
    for b, grad, t in zip(blocks, trainable_before(blocks), timings):
        sig = block_signature(b, input_grad=grad)
        # zero-bubble's W as measured, within the whole backward it is a part of (both a fastest round's).
        weight = None if t.weight is None else min(t.weight, t.backward)
        out.setdefault(sig, BlockCost(sig, t.forward, t.backward, t.optimizer, spread=t.spread, backward_weight=weight))
    return list(out.values())


def price_blocks(machine: MachineProfile, blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> BlockPrices:
    """Each block's times on ``machine`` under ``cfg``.

    A measured block (same signature) takes its measured times; any other is priced by its role's FLOP rate:
    forward FLOPs ÷ rate, backward = the rest of its training FLOPs (freeze-aware) ÷ rate, and its optimizer step
    by the device memory it moves (:func:`~nanotron_ext.costs.analytic.update_bytes` per trainable parameter ÷
    ``memory_bytes_per_second``). Then every
    ``PipelineBlock`` call pays the engine's overhead, a trainable block's update pays its share of the dp
    gradient all-reduce, the embedding and the lm_head of a tied model the tied all-reduce (which a stage holding
    both does not run: ``tied_saving``), a decoder layer under ``parallelism.recompute_layer`` its forward
    once more in its backward, and a send
    across cut ``c`` costs :meth:`MachineProfile.p2p_time` of what the block hands on (the memory model's
    ``output``, in :func:`~nanotron_ext.costs.block_memory.output_tensors` tensors) over that cut's link.

    The weight-gradient part of the backward (:func:`weight_part`): a measured ``backward_weight``, else the
    measured backward split by FLOPs, input-gradient : weight-gradient (freeze-aware); on the rate model the
    weight-gradient FLOPs ÷ rate. The call overhead stays with the input-gradient part. AFAB and 1F1B only
    read the whole ``backward``, which the split leaves as it was.
    """
    upd = []
    step_bytes = update_bytes(cfg.run)
    sent: list[tuple[float, int]] = []
    grad_bytes = DTYPE_BYTES[cfg.run.dtype]
    tied = tied_pair(blocks, cfg.model.tie_word_embeddings)
    saving = [0.0] * len(blocks)
    for i, (b, grad) in enumerate(zip(blocks, trainable_before(blocks))):
        measured = machine.block(block_signature(b, input_grad=grad))
        if measured is not None:
            u = measured.update
        else:
            u = 0.0
            if machine.memory_bytes_per_second is not None:
                u = b.trainable * step_bytes / machine.memory_bytes_per_second
        if b.trainable and machine.dp_allreduce is not None:
            u += machine.dp_allreduce.time(b.trainable * grad_bytes, cfg.run.dp)
        # Both ends of the tie wait in its all-reduce when they sit on different stages (tied_saving otherwise).
        if tied is not None and i in tied and machine.tied_allreduce is not None:
            synced = tied_sync_seconds(machine, cfg)
            u += synced
            if b.role == "embedding":
                saving[i] = synced
        upd.append(u)
        sent.append((block_memory(b, cfg.model, cfg.run).output, output_tensors(b)))
    if tied is not None:  # one tensor on a stage holding both: stepped and synced once, no tied sync
        saving[tied[1]] = upd[tied[1]]
    # A row per cut, shared by the cuts over the same links, each distinct transfer priced once (a large model
    # hands on a few distinct outputs across hundreds of cuts).
    rows: dict[tuple[object, ...], list[float]] = {}
    send = []
    for c in range(max(cfg.run.pp - 1, 1)):
        links = machine.cut_links(c)
        if links not in rows:
            times = {s: machine.p2p_time(*s, cut=c) for s in set(sent)}
            rows[links] = [times[s] for s in sent]
        send.append(rows[links])
    mean = _compute(machine, blocks, cfg, None)
    by_position = any(cost.positions for cost in machine.blocks)
    positions = tuple((p, _compute(machine, blocks, cfg, p)) for p in POSITIONS) if by_position else ()
    return BlockPrices(
        mean.forward, mean.backward, upd, send, mean.weight, tied, saving if tied is not None else [], positions
    )


def _compute(
    machine: MachineProfile, blocks: Sequence[BlockInfo], cfg: PlannerConfig, position: str | None
) -> PositionPrices:
    """Each block's forward, backward and weight part on a stage of ``position`` (None: the mean of where it ran)."""
    fwd, bwd, wgt = [], [], []
    call = machine.overhead.block_call
    for b, grad, train in zip(blocks, trainable_before(blocks), training_flops(blocks)):
        cost = machine.block(block_signature(b, input_grad=grad))
        measured = None
        if cost is not None:
            f, w, weight = cost.at(position)
            measured = dataclasses.replace(cost, backward_weight=weight)  # weight_part reads the position's W
        else:
            rate = machine.rate(b.role)
            f, w = b.flops_fwd / rate, max(0.0, train - b.flops_fwd) / rate
        fwd.append(f + call)
        wgt.append(weight_part(b, grad, w, measured, None if measured is not None else machine.rate(b.role)))
        if cfg.run.recompute_layer and b.role == "decoder":  # its backward runs its forward again first (B's part)
            w += f
        bwd.append(w + call if (grad or b.trainable) else w)  # no backward call where autograd never reaches
    return PositionPrices(fwd, bwd, wgt)


def tied_weight_bytes(cfg: PlannerConfig) -> float:
    """Bytes of the tied embedding's gradient on one tp rank: what its all-reduce between the first and the last
    stage moves (priced here, measured by ``calibrate``)."""
    return float(cfg.model.vocab_size * cfg.model.hidden_size // cfg.run.tp * DTYPE_BYTES[cfg.run.dtype])


def tied_sync_seconds(machine: MachineProfile, cfg: PlannerConfig) -> float:
    """Seconds of the tied embedding's gradient all-reduce between the first and the last stage on ``machine`` (0
    where the profile has no tied all-reduce)."""
    if machine.tied_allreduce is None:
        return 0.0
    return machine.tied_allreduce.time(tied_weight_bytes(cfg), 2)


def weight_part(
    block: BlockInfo, input_grad: bool, backward: float, measured: BlockCost | None, rate: float | None
) -> float:
    """Seconds of ``block``'s weight-gradient pass, a part of its ``backward`` seconds (the call overhead left
    out): 0 for a frozen block and for a block zb1p does not defer (an embedding, a norm:
    :data:`~nanotron_ext.blocks.DEFERS_WEIGHT_GRADIENT`); all of it for a block whose input needs no gradient.

    ``measured.backward_weight`` when set; else ``backward`` × weight-gradient FLOPs ÷ backward FLOPs (both
    freeze-aware); on the rate model (``rate``) weight-gradient FLOPs ÷ ``rate``.

    Example:
        A decoder layer with input-gradient and weight-gradient FLOPs 2 : 1 measured at 3 ms of backward
        spends 1 ms on weight gradients; frozen, none.
    """
    if block.role not in DEFERS_WEIGHT_GRADIENT:  # the engine makes its weight gradient in B
        return 0.0
    if measured is not None and measured.backward_weight is not None:
        return min(measured.backward_weight, backward)
    w_flops = block.flops_bwd_weight * (block.trainable / block.params) if block.params else 0.0
    if w_flops <= 0:
        return 0.0
    if rate is not None:
        return min(w_flops / rate, backward)  # min: train - forward FLOPs can round a hair below
    total = (block.flops_bwd_input if input_grad else 0.0) + w_flops
    return backward * (w_flops / total)
