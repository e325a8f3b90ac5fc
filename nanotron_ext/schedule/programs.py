"""Each PP rank's *program* under Nanotron's two pipeline engines and zb1p: typed actions in the engine's order.

A rank's program is: its forwards (``F``), backwards (``B``), activation and gradient sends and
receives, in exactly the order Nanotron's engine code issues them (:func:`engine_program`):

* ``afab`` (``AllForwardAllBackwardPipelineEngine``): every forward, each followed by the send of its
  activation; then every backward, each followed by the send of its input gradient.
* ``1f1b`` (``OneForwardOneBackwardPipelineEngine``): ``pp - rank - 1`` warm-up forwards (sent at once), then
  one forward and one backward per remaining micro-batch, then the left-over backwards. In the steady phase
  sends are *deferred*: Nanotron only queues them, and ``PipelineTrainBatchState.run_communication`` runs
  them at the rank's next receive, in the order send activation, receive activation, send gradient, receive
  gradient. So the last stage sends micro-batch ``j``'s gradient only after it has received micro-batch
  ``j + 1``'s activation, and a stage sends a forward's activation when its next backward asks for a
  gradient.
* ``zb1p`` (ZB-H1 of Qi et al., ICLR 2024): 1F1B's program, where ``B`` computes input gradients only and
  each micro-batch's weight gradients run later as a ``W``: rank ``r`` defers the W of its first ``r``
  backwards, then runs the oldest deferred W after each backward (after the sends issued right after it),
  and every W left after its last backward. ``StageTimes.weight`` is W; B takes ``backward - weight``.

Backwards pop micro-batches first-in-first-out in both engines. :mod:`nanotron_ext.schedule.simulator` replays the
programs in time; the planner's evaluator (:mod:`nanotron_ext.partition.step_time_eval`) compiles them into a graph.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from functools import cache, lru_cache
from typing import NamedTuple

from nanotron_ext.schedule import (
    AUTO_UNRESOLVED,
    ENGINE_AUTO,
    ENGINES,
    ZERO_BUBBLE,
    Engine,
    too_few_micro_batches,
)

__all__ = [
    "Action",
    "Step",
    "check_engine",
    "deferred_weights",
    "engine_order",
    "engine_program",
    "pipeline_programs",
    "warmup_forwards",
]


class Action(str, Enum):
    """What a rank does next: compute, or one of the four kinds of communication of Nanotron's engines.

    ``WEIGHT`` (``W``) is zb1p's deferred weight-gradient pass of one micro-batch; under zb1p ``BACKWARD``
    is the input-gradient part alone, under AFAB and 1F1B the whole backward (input and weight gradients).

    A ``str`` enum, so ``Action.FORWARD == "F"`` and programs compare equal to ``("F", 0)`` tuples.
    """

    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT = "W"
    SEND_ACT = "send_act"
    RECV_ACT = "recv_act"
    SEND_GRAD = "send_grad"
    RECV_GRAD = "recv_grad"

    @property
    def is_compute(self) -> bool:
        return self in (Action.FORWARD, Action.BACKWARD, Action.WEIGHT)

    @property
    def is_send(self) -> bool:
        return self in (Action.SEND_ACT, Action.SEND_GRAD)

    @property
    def carries_gradient(self) -> bool:
        """A communication of a gradient (backward, towards stage 0) rather than an activation."""
        return self in (Action.SEND_GRAD, Action.RECV_GRAD)

    @property
    def peer(self) -> int:
        """The other stage of a receive, relative to this one: activations come from ``-1``, gradients ``+1``."""
        return {Action.RECV_ACT: -1, Action.RECV_GRAD: 1}.get(self, 0)

    def __str__(self) -> str:
        return self.value


class Step(NamedTuple):
    """One entry of a rank's program: an action on one micro-batch; prints as ``F0``, ``recv_grad3``."""

    action: Action
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.action.value}{self.micro_batch}"


@cache
def _step(action: Action, micro_batch: int) -> Step:
    """One shared :class:`Step` per action and micro-batch: a large pipeline's programs repeat each one on every
    rank (pp 128 with 512 micro-batches: 391k steps, a third of planning's time when each was built anew)."""
    return Step(action, micro_batch)


def check_engine(engine: str) -> None:
    if engine == ENGINE_AUTO:
        raise ValueError(AUTO_UNRESOLVED)
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; use one of {', '.join(map(repr, ENGINES))}")


def _check_stage(engine: str, pp: int, stage: int, n_micro_batches: int) -> None:
    if pp < 1 or n_micro_batches < 1:
        raise ValueError(f"pp = {pp} and n_micro_batches = {n_micro_batches}; both must be at least 1")
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} is outside 0..{pp - 1}; pass a PP rank of the {pp}-stage pipeline")
    check_engine(engine)
    shortfall = too_few_micro_batches(engine, pp, n_micro_batches)
    if shortfall is not None:
        raise ValueError(shortfall)


def engine_program(
    engine: Engine,
    pp: int,
    stage: int,
    n_micro_batches: int,
    *,
    grad_in: bool = True,
    grad_out: bool = True,
) -> list[Step]:
    """The ``(action, micro_batch)`` sequence Nanotron's engine runs on PP rank ``stage``, communication included.

    Mirrors ``nanotron.parallel.pipeline_parallel.engine`` and ``PipelineTrainBatchState.run_communication``:
    a forward on a rank after the first starts by receiving its activation (after any queued activation send;
    in Nanotron's order none is queued there) and then sends one queued gradient; a backward on a rank before
    the last starts with its queued activation sends, one queued gradient send, then receives its gradient.
    Warm-up forwards (1F1B), every forward and backward under AFAB, and the 1F1B cool-down send at once.

    A cut whose activation needs no gradient (nothing trainable at or before it) carries none back: the rank
    after it sends no gradients (``grad_in=False``), and the rank before it receives none
    (``grad_out=False``; its backward only sends a queued activation).

    Example:
        >>> print(*engine_program("1f1b", 2, 1, 2))
        recv_act0 F0 B0 recv_act1 send_grad0 F1 B1 send_grad1

    ``zb1p`` (ZB-H1) is 1F1B's program with the deferred weight-gradient passes ``W`` added: rank ``stage``
    defers the W of its first ``stage`` backwards; after each later backward (and the sends issued right after
    it) it runs the oldest deferred W, and after its last backward every W left, oldest first. Rank 1 of 2:

        >>> print(*engine_program("zb1p", 2, 1, 3))
        recv_act0 F0 B0 recv_act1 send_grad0 F1 B1 W0 recv_act2 send_grad1 F2 B2 send_grad2 W1 W2

    Args:
        engine: ``"1f1b"``, ``"afab"`` or ``"zb1p"``.
        pp: number of stages.
        stage: the PP rank.
        n_micro_batches: micro-batches per step.
        grad_in: a gradient flows back into this stage's input (ignored on stage 0).
        grad_out: this stage's output gets a gradient back (ignored on the last stage).

    Raises:
        ValueError: for ``pp`` or ``n_micro_batches`` below 1, a stage outside ``0..pp-1``, an unknown engine,
            or under 1F1B or zb1p with fewer than ``pp - 1`` micro-batches.
    """
    _check_stage(engine, pp, stage, n_micro_batches)
    m, first, last = n_micro_batches, stage == 0, stage == pp - 1
    rank = _RankProgram(first, last, sends_grads=not first and grad_in, gets_grads=not last and grad_out)
    if engine == "afab":
        for j in range(m):
            rank.forward(j)
            rank.flush(rank.acts_to_send, Action.SEND_ACT)
        for j in range(m):
            rank.backward(j)
            rank.flush(rank.grads_to_send, Action.SEND_GRAD)
        return rank.program
    if not last:  # the next stage receives micro-batches up to its warm-up + 1 + j before it sends gradient j back
        rank.act_lead = warmup_forwards(engine, pp, stage + 1, m) + 1
    return _one_f_one_b(rank, m, warmup=warmup_forwards(engine, pp, stage, m), defer=deferred_weights(engine, stage))


def warmup_forwards(engine: Engine, pp: int, stage: int, n_micro_batches: int) -> int:
    """Forwards stage ``stage`` runs before its steady phase (one forward, one backward): 1F1B's and zb1p's
    ``pp - stage - 1``; zb2p's (ZB-H2) twice that, at most ``n_micro_batches``, so that stage 0 computes forwards
    until its first backward's gradient is back instead of idling (AFAB: every forward)."""
    if engine == "afab":
        return n_micro_batches
    base = pp - stage - 1
    return min(n_micro_batches, 2 * base) if engine == "zb2p" else base


def deferred_weights(engine: Engine, stage: int) -> int | None:
    """W's stage ``stage`` keeps deferred in its steady phase: zb1p's ``stage`` (ZB-H1: every stage ends its last B
    ``pp - 1 - stage`` backwards after the last stage's and fills that with W's), zb2p's ``2 * stage`` (where
    attention, which has no weights, makes a backward's input-gradient part longer than its W, each stage needs
    more W's to fill that tail); None where a backward is not split (AFAB, 1F1B)."""
    if engine not in ZERO_BUBBLE:
        return None
    return 2 * stage if engine == "zb2p" else stage


def _one_f_one_b(rank: _RankProgram, m: int, *, warmup: int, defer: int | None) -> list[Step]:
    """1F1B's program on ``rank`` after ``warmup`` forwards. With ``defer`` (zb1p, zb2p) each backward is B (input
    gradient) and the rank defers the W of its first ``defer`` backwards, then runs the oldest deferred W after
    each later one (sail-sg's ZB-H1: ``if i >= rank: WeightGradStore.pop()``), after the sends issued right after
    it, and every W left after its last backward."""
    for j in range(warmup):
        rank.forward(j)
        rank.flush(rank.acts_to_send, Action.SEND_ACT)
    for i in range(m - warmup):
        rank.forward(warmup + i)
        rank.backward(i)
        if i == m - warmup - 1:
            rank.flush(rank.grads_to_send, Action.SEND_GRAD)
        rank.weight(i, defer)
    rank.flush(rank.grads_to_send, Action.SEND_GRAD)
    for j in range(m - warmup, m):
        rank.backward(j)
        rank.flush(rank.grads_to_send, Action.SEND_GRAD)
        rank.weight(j, defer)
    rank.weight_all(defer)
    return rank.program


@dataclass
class _RankProgram:
    """One rank's program as Nanotron's engine issues it: forwards and backwards, with the sends they queue
    (``PipelineTrainBatchState``) and the communication points that run them (``run_communication``)."""

    first: bool
    last: bool
    sends_grads: bool
    gets_grads: bool
    program: list[Step] = field(default_factory=list)
    #: Before receiving gradient ``j`` send only the activations of micro-batches ``<= act_lead + j``: those the
    #: next stage receives before it sends gradient ``j``. Then each link carries its messages in one order on
    #: both sides, which a send that waits for its receive needs (Nanotron's P2P syncs the host after its metadata
    #: send on GPU). 1F1B's and zb1p's warm-ups differ by one between neighbours and never hold anything back;
    #: zb2p's differ by two, so the activation of its steady forward is held and sent right after the backward.
    act_lead: int | None = None
    acts_to_send: deque[int] = field(default_factory=deque)
    grads_to_send: deque[int] = field(default_factory=deque)
    weights_pending: deque[int] = field(default_factory=deque)

    def forward(self, j: int) -> None:
        if not self.first:  # recv_from_pipeline_state_buffer -> run_communication()
            if self.acts_to_send:
                self.program.append(_step(Action.SEND_ACT, self.acts_to_send.popleft()))
            self.program.append(_step(Action.RECV_ACT, j))
            # An activation that needs no gradient ends run_communication right after its receive.
            if self.sends_grads and self.grads_to_send:
                self.program.append(_step(Action.SEND_GRAD, self.grads_to_send.popleft()))
        self.program.append(_step(Action.FORWARD, j))
        if not self.last:
            self.acts_to_send.append(j)

    def backward(self, j: int) -> None:
        held = False
        if self.gets_grads:  # SendTensorToPipelineBuffer.backward -> run_communication()
            limit = None if self.act_lead is None else self.act_lead + j
            while self.acts_to_send and (limit is None or self.acts_to_send[0] <= limit):
                self.program.append(_step(Action.SEND_ACT, self.acts_to_send.popleft()))
            held = bool(self.acts_to_send)
            if self.grads_to_send:
                self.program.append(_step(Action.SEND_GRAD, self.grads_to_send.popleft()))
            self.program.append(_step(Action.RECV_GRAD, j))
        elif (
            not self.last and self.acts_to_send
        ):  # SendTensorWithoutGradient...: run_communication(send_only_activation)
            self.program.append(_step(Action.SEND_ACT, self.acts_to_send.popleft()))
        self.program.append(_step(Action.BACKWARD, j))
        if held:  # right after the backward (see act_lead)
            self.flush(self.acts_to_send, Action.SEND_ACT)
        if self.sends_grads:
            self.grads_to_send.append(j)

    def weight(self, j: int, defer: int | None) -> None:
        """After backward ``j`` under zb1p or zb2p (``defer``: :func:`deferred_weights`): defer its W, and run the
        oldest deferred W once ``j >= defer``. Nothing under AFAB/1F1B (``defer`` None), where a backward is B and W in
        one."""
        if defer is None:
            return
        self.weights_pending.append(j)
        if j >= defer:
            self.program.append(_step(Action.WEIGHT, self.weights_pending.popleft()))

    def weight_all(self, defer: int | None) -> None:
        """Under zb1p or zb2p, after the last backward: every W still deferred, oldest first."""
        if defer is not None:
            self.flush(self.weights_pending, Action.WEIGHT)

    def flush(self, queue: deque[int], action: Action) -> None:
        while queue:
            self.program.append(_step(action, queue.popleft()))


def engine_order(engine: Engine, pp: int, stage: int, n_micro_batches: int) -> list[tuple[str, int]]:
    """The ``(kind, micro_batch)`` sequence of forwards and backwards that Nanotron's engine runs on ``stage``.

    Raises:
        ValueError: as :func:`engine_program`.
    """
    return [(str(a), j) for a, j in engine_program(engine, pp, stage, n_micro_batches) if a.is_compute]


@lru_cache(maxsize=8)
def pipeline_programs(engine: Engine, pp: int, m: int, grad_cuts: tuple[bool, ...]) -> tuple[list[Step], ...]:
    """Every rank's program (:func:`~nanotron_ext.schedule.programs.engine_program`), no gradient back across a cut
    whose ``grad_cuts`` entry is False. Kept for the next caller (read them, do not change them): a plan simulates
    its split and Nanotron's rule's, and the step-time search compiles the same programs (a third of a large
    pipeline's simulation was building them)."""
    return tuple(
        engine_program(engine, pp, s, m, grad_in=s == 0 or grad_cuts[s - 1], grad_out=s == pp - 1 or grad_cuts[s])
        for s in range(pp)
    )
