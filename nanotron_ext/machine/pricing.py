"""The one reading of time: which machine prices a config (:func:`machine_for`), and what each block costs on
it (:func:`price_blocks`).

Every strategy's objective, ``vocab_shards: auto``, ``simulate`` and the timeline price through these two
functions (via :func:`nanotron_ext.strategies.step_time.schedule_problem`), so a split is never planned under one
pricing and simulated under another.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.config import DTYPE_BYTES, PlannerConfig
from nanotron_ext.costs.analytic import trainable_before, training_flops
from nanotron_ext.costs.memory_estimate import block_memory
from nanotron_ext.machine.analytic import ANALYTIC_GPU
from nanotron_ext.machine.profile import BlockCost, MachineProfile, block_signature, key_for, load_machine

__all__ = ["BlockPrices", "machine_for", "measured_blocks", "price_blocks"]


class BlockPrices(NamedTuple):
    """Per block, seconds: forward and backward per micro-batch, update per step (optimizer, gradient syncs),
    and one transfer of what it sends when a cut follows it."""

    forward: list[float]
    backward: list[float]
    update: list[float]
    send: list[float]


def machine_for(cfg: PlannerConfig, blocks: Sequence[BlockInfo] | None = None, *, device: str | None = None,
                backend: str | None = None) -> MachineProfile:
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
    measure = ext.times == "profiled" or (ext.cost_strategy == "profiled" and ext.times == "machine"
                                          and not machine.blocks)
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
        out.setdefault(sig, BlockCost(sig, t.forward, t.backward, t.optimizer))
    return list(out.values())


def price_blocks(machine: MachineProfile, blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> BlockPrices:
    """Each block's times on ``machine`` under ``cfg``.

    A measured block (same signature) takes its measured times; any other is priced by its role's FLOP rate:
    forward FLOPs ÷ rate, backward = the rest of its training FLOPs (freeze-aware) ÷ rate. Then every
    ``PipelineBlock`` call pays the engine's overhead, a trainable block's update pays its share of the dp
    gradient all-reduce, the lm_head of a tied model at pp > 1 the tied all-reduce, and a send costs
    :meth:`MachineProfile.p2p_time` of what the block hands on (the memory model's ``output``).
    """
    fwd, bwd, upd, send = [], [], [], []
    call = machine.overhead.block_call
    grad_bytes = DTYPE_BYTES[cfg.run.dtype]
    for b, grad, train in zip(blocks, trainable_before(blocks), training_flops(blocks)):
        measured = machine.block(block_signature(b, input_grad=grad))
        if measured is not None:
            f, w, u = measured.forward, measured.backward, measured.update
        else:
            rate = machine.rate(b.role)
            f, w, u = b.flops_fwd / rate, max(0.0, train - b.flops_fwd) / rate, 0.0
        fwd.append(f + call)
        bwd.append(w + call if (grad or b.trainable) else w)  # no backward call where autograd never reaches
        if b.trainable and machine.dp_allreduce is not None:
            u += machine.dp_allreduce.time(b.trainable * grad_bytes, cfg.run.dp)
        if (cfg.model.tie_word_embeddings and b.role == "lm_head" and cfg.run.pp > 1
                and machine.tied_allreduce is not None):
            u += machine.tied_allreduce.time(cfg.model.vocab_size * cfg.model.hidden_size // cfg.run.tp * grad_bytes, 2)
        upd.append(u)
        send.append(machine.p2p_time(block_memory(b, cfg.model, cfg.run).output))
    return BlockPrices(fwd, bwd, upd, send)
