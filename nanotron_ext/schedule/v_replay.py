"""The program of a V that the engine runs, and its simulator: each rank's ops, the one order of its transfers, and
the step they make under real times.

:func:`~nanotron_ext.schedule.zbv.simulate_zbv` *builds* an order by list scheduling under the chunks' times and keeps
the fastest of a few rules. The engine runs an order fixed before the step (:func:`~nanotron_ext.schedule.zbv.zbv_order`
or one the planner chose). :func:`replay_v_order` prices exactly that order: each rank runs its ops in sequence,
each as soon as the rank is free and its input is there (the op before it on the V, plus the cut's transfer when it
crosses ranks), which is what the engine's blocking receives do.

**The transfers' order** (:func:`transfer_order`). Nanotron's send on a GPU waits until its receive is posted. In a V
the activations cross each pair of neighbouring ranks both ways (down the V and back up), so a rank that sends its
next activation down while its neighbour sends one up waits on a receive the neighbour posts only after its own
send: posted as soon as made, every order of two or more micro-batches deadlocks that way. So every transfer gets a
key, the same on both of its ranks: when the op that takes it starts with every op one unit long, then its stage,
kind and micro-batch; and each rank keeps its transfers in key order. A receive happens when its op needs it (a
rank's receives come in key order: each of its ops starts after the one before); a send is held until every
transfer before it in the rank's order is done. Then no rank waits forever: the transfer with the smallest key not
yet done has every earlier transfer of both of its ranks done, and every op before it on either rank needs only
those, so both ranks reach it.

Holding costs time where a send is ready before a receive its key puts first: with ``sends_wait`` the replay holds
sends as the engine then does. Keyed by a plan's own times instead of unit ones (``keys_from``), a transfer's key is
when the plan's schedule takes it: the argument above holds as it stands (each op starts after the one before it on
its rank, and a transfer is taken after it is made), and the transfers keep the order the plan's schedule takes them
in. That holds less, not nothing: a receive is done only when its op starts, so a send keyed after it still waits
for that op; where it holds longer than the unit keys (rarely), the unit keys serve, and so they do where ops of no
length tie keys into an order that would not get through. The CPU runtime's sends do not wait: there the engine and the
replay post each send as soon as it is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

from nanotron_ext.schedule.simulator import StageTimes, check_stage_times, per_cut_p2p
from nanotron_ext.schedule.zbv import VOp, VResult, _ready_after, v_rank, v_result

__all__ = ["Transfer", "replay_v_order", "stuck_when_sends_wait", "transfer_order"]

#: Every op one unit (``W`` half of the backward): the times the transfers' keys come from.
UNIT = StageTimes(1.0, 2.0, weight=1.0)


class Transfer(NamedTuple):
    """What ``op`` on this rank sends to ``peer`` (its activation or gradient) or receives from it (its input)."""

    kind: Literal["send", "recv"]
    op: VOp
    peer: int

    def __str__(self) -> str:
        return f"{self.kind} {self.op} {'to' if self.kind == 'send' else 'from'} rank {self.peer}"


def transfer_order(
    order: Sequence[Sequence[VOp]],
    keys_from: Sequence[StageTimes] | None = None,
    p2p_time: float | Sequence[float] = 0.0,
) -> list[list[Transfer]]:
    """Each rank's transfers (rank 0 first) in the one order every rank keeps (see the module docstring): keyed by
    when each taking op starts with every op one unit long or, given ``keys_from``, under those chunks' times and
    ``p2p_time`` (the plan's own: the order its schedule takes them in), where their held step under those times is
    no longer than the unit keys'. Where those times would key the transfers into an order that does not get
    through (ops of no length tie), the unit keys.

    Raises:
        ValueError: as :func:`replay_v_order`, for an order that cannot run.
    """
    pp = len(order)
    m = max((op.micro_batch for ops in order for op in ops), default=-1) + 1
    unit = _keyed(order, _starts(order, [UNIT] * (2 * pp), m, [0.0] * (2 * pp - 1)))
    if keys_from is None:
        return unit
    chunks, cuts = check_stage_times(keys_from, "keys_from"), per_cut_p2p(p2p_time, 2 * pp)
    planned = _keyed(order, _starts(order, chunks, m, cuts))
    if planned == unit or stuck_when_sends_wait(planned) is not None:
        return unit
    try:
        held = _op_times(order, chunks, m, cuts, planned)
    except ValueError:  # every rank's next op waits on one not run yet
        return unit
    # Keyed by the plan's order the holds are fewer, not always shorter (4 of 300 random Vs): the shorter of the two.
    ends = [max(end for _, end in times.values()) for times in (held, _op_times(order, chunks, m, cuts, unit))]
    return planned if ends[0] <= ends[1] else unit


def _starts(
    order: Sequence[Sequence[VOp]], chunks: Sequence[StageTimes], m: int, cuts: Sequence[float]
) -> dict[VOp, float]:
    """When each op starts, its sends posted as made."""
    return {op: t[0] for op, t in _op_times(order, chunks, m, cuts, None).items()}


def _keyed(order: Sequence[Sequence[VOp]], start: dict[VOp, float]) -> list[list[Transfer]]:
    """Each rank's transfers sorted by key: the start of the op that takes it, then its stage, kind, micro-batch."""
    pp = len(order)
    keyed: list[list[tuple[tuple[float, int, str, int], Transfer]]] = [[] for _ in range(pp)]
    for ops in order:
        for taker in ops:
            maker = _ready_after(taker, pp)
            if taker.kind == "W" or maker is None or maker.kind == "F" and taker.kind == "B":
                continue  # a W takes nothing; the loss's B starts from its own F
            a, b = v_rank(pp, maker.stage), v_rank(pp, taker.stage)
            if a == b:
                continue  # at the V's bottom the two chunks share a rank
            key = (start[taker], taker.stage, taker.kind, taker.micro_batch)
            keyed[a].append((key, Transfer("send", maker, b)))
            keyed[b].append((key, Transfer("recv", taker, a)))
    return [[t for _, t in sorted(rank)] for rank in keyed]


def stuck_when_sends_wait(transfers: Sequence[Sequence[Transfer]]) -> list[Transfer] | None:
    """Replay each rank's transfers in its order where a send waits for its receive and a receive for its send:
    None when every rank gets through, else what each rank waits on."""
    pp = len(transfers)
    pos = [0] * pp
    while any(pos[r] < len(transfers[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            if pos[r] == len(transfers[r]):
                continue
            t = transfers[r][pos[r]]
            q = t.peer
            other = transfers[q][pos[q]] if pos[q] < len(transfers[q]) else None
            send, recv = (t, other) if t.kind == "send" else (other, t)
            if (
                other is not None
                and other.peer == r
                and send is not None
                and recv is not None
                and send.kind == "send"
                and recv.kind == "recv"
                and _ready_after(recv.op, pp) == send.op
            ):
                pos[r] += 1
                pos[q] += 1
                moved = True
        if not moved:
            return [transfers[r][pos[r]] for r in range(pp) if pos[r] < len(transfers[r])]
    return None


def replay_v_order(
    order: Sequence[Sequence[VOp]],
    chunks: Sequence[StageTimes],
    n_micro_batches: int,
    p2p_time: float | Sequence[float] = 0.0,
    *,
    sends_wait: bool = False,
    keys_from: Sequence[StageTimes] | None = None,
) -> VResult:
    """The step of ``order`` (each rank's ops, rank 0 first) under the chunks' times; with ``sends_wait`` (the
    engine's) its sends held as :func:`transfer_order` says, keyed by unit times or by ``keys_from``'s (with the
    same ``p2p_time``).

    Raises:
        ValueError: an order that is not every F, B and W once on its rank, or one that waits forever (an op before
            the op it needs, on a rank whose earlier ops need it).
    """
    chunks = check_stage_times(chunks, "chunks")
    pp = len(chunks) // 2
    if len(chunks) != 2 * pp or len(order) != pp or pp < 1:
        raise ValueError(f"{len(chunks)} chunks and {len(order)} ranks' orders; a V over pp ranks has 2 pp chunks")
    m = n_micro_batches
    for r, ops in enumerate(order):
        expected = sorted((k, j, s) for k in "FBW" for j in range(m) for s in (r, 2 * pp - 1 - r))
        if sorted(tuple(op) for op in ops) != expected:
            raise ValueError(
                f"rank {r}'s order is not each F, B and W of its chunks {r} and {2 * pp - 1 - r} once "
                f"for micro-batches 0..{m - 1}"
            )
    held = transfer_order(order, keys_from, p2p_time) if sends_wait else None
    times = _op_times(order, chunks, m, per_cut_p2p(p2p_time, 2 * pp), held)
    return v_result(chunks, m, times, order)


def _op_times(
    order: Sequence[Sequence[VOp]],
    chunks: Sequence[StageTimes],
    m: int,
    cuts: Sequence[float],
    sends: Sequence[Sequence[Transfer]] | None,
) -> dict[VOp, tuple[float, float]]:
    """Each op's start and end: a rank runs its ops in order, each once the rank is free and its input is there.
    With ``sends`` (:func:`transfer_order`) an activation or gradient leaves its rank once every transfer before it
    there is done (a receive when its op starts); without, when its op ends."""
    pp = len(order)
    times: dict[VOp, tuple[float, float]] = {}
    nxt, free = [0] * pp, [0.0] * pp
    done: list[list[float]] = [[] for _ in range(pp)]  # each rank's leading transfers' times, in its order
    left: dict[VOp, float] = {}  # when each op's send left its rank

    def settle(r: int, mine: Sequence[Transfer]) -> None:
        while len(done[r]) < len(mine):
            t = mine[len(done[r])]
            own = times.get(t.op)
            if own is None:
                return
            at = max(own[0] if t.kind == "recv" else own[1], done[r][-1] if done[r] else 0.0)
            done[r].append(at)
            if t.kind == "send":
                left[t.op] = at

    while any(nxt[r] < len(order[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while nxt[r] < len(order[r]):
                op = order[r][nxt[r]]
                before = _ready_after(op, pp)
                crosses = before is not None and v_rank(pp, before.stage) != r
                if before is not None and (before not in times or crosses and sends is not None and before not in left):
                    break
                if before is None:
                    ready = 0.0
                elif not crosses:
                    ready = times[before][1]
                else:  # when its input left the other rank (held there, or as made), and the cut's transfer
                    gone = left[before] if sends is not None else times[before][1]
                    ready = gone + cuts[min(op.stage, before.stage)]
                st = chunks[op.stage]
                start = max(free[r], ready)
                free[r] = start + {"F": st.forward, "B": st.backward - st.weight, "W": st.weight}[op.kind]
                times[op] = (start, free[r])
                nxt[r] += 1
                moved = True
            if sends is not None:
                for q in range(pp):
                    settle(q, sends[q])
        if not moved:
            stuck = {r: str(order[r][nxt[r]]) for r in range(pp) if nxt[r] < len(order[r])}
            raise ValueError(f"the order waits forever: each rank's next op needs one not run yet ({stuck})")
    return times
