"""What a rank's clock records of one training step inside Nanotron's engine (plain data; the CPU runtime's
:mod:`nanotron_ext.integration.op_clock` fills it, :mod:`nanotron_ext.machine.in_run` prices from it).

Every figure is the op's own work: a block's forward is the time inside its module (the receive before it is
Nanotron's ``PipelineBlock`` around it), its backward runs from the gradient reaching its output to the gradient
leaving its input, and a wait on a peer is never inside either. Times are seconds on one clock for every process of
the host (``time.perf_counter``, the system's monotonic clock), so a send's post and its receive compare.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BlockOps", "Receive", "RankStep", "Send"]


@dataclass(frozen=True)
class BlockOps:
    """One block's ops in one step, one figure per micro-batch, in the order they ran.

    Attributes:
        block: the block's module path (``model.decoder.3``), as in the inventory.
        forward: its forward.
        backward: its backward as the engine ran it: the whole backward under AFAB and 1F1B, the input-gradient
            part (``B``) under zb1p and zb2p; empty where no gradient reaches it.
        weight: its deferred weight gradients (``W``) under zb1p and zb2p; empty otherwise.
    """

    block: str
    forward: tuple[float, ...]
    backward: tuple[float, ...] = ()
    weight: tuple[float, ...] = ()


@dataclass(frozen=True)
class Send:
    """One call that posted tensors to a pipeline peer: when, and what (pipeline ranks)."""

    src: int
    dst: int
    n_bytes: int
    n_tensors: int
    posted: float


@dataclass(frozen=True)
class Receive:
    """One blocking receive from a pipeline peer: when it started waiting and when the tensors were there."""

    src: int
    dst: int
    n_bytes: int
    n_tensors: int
    started: float
    ended: float


@dataclass(frozen=True)
class RankStep:
    """One rank's step, as its clock saw it.

    Attributes:
        pp_rank: the rank's pipeline stage.
        engine: the engine that ran (``1f1b``, ``afab``, ``zb1p``, ``zb2p``).
        blocks: its blocks' ops, in forward order.
        calls: per forward or backward op of the engine, ``(seconds of the op less its blocks and its waits, the
            blocks it ran)``: Nanotron's bookkeeping around the blocks (the engine's overhead).
        update: busy seconds after the pipeline (gradient finishing, the optimizer step), waits left out.
        sends / receives: every pipeline transfer it posted or waited for, in order.
        tied_sync: when it entered and left the tied embedding's gradient all-reduce (None: it holds no end of a
            tie that crosses stages).
        clock: seconds the rank spent inside the clock's own hooks during the step: what timing it cost.
    """

    pp_rank: int
    engine: str
    blocks: tuple[BlockOps, ...]
    calls: tuple[tuple[float, int], ...] = ()
    update: float = 0.0
    sends: tuple[Send, ...] = ()
    receives: tuple[Receive, ...] = ()
    tied_sync: tuple[float, float] | None = None
    clock: float = 0.0
