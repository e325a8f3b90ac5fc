"""The simulator of one given V order: what the engine runs, replayed under real times.

:func:`~nanotron_ext.schedule.zbv.simulate_zbv` *builds* an order by list scheduling under the chunks' times and keeps
the fastest of a few rules. The engine runs an order fixed before the step (:func:`~nanotron_ext.schedule.zbv.zbv_order`
or one the planner chose). :func:`replay_v_order` prices exactly that order: each rank runs its ops in sequence,
each as soon as the rank is free and its input is there (the op before it on the V, plus the cut's transfer when it
crosses ranks), which is what the engine's blocking receives do.
"""

from __future__ import annotations

from collections.abc import Sequence

from nanotron_ext.schedule.simulator import StageTimes, check_stage_times, per_cut_p2p
from nanotron_ext.schedule.zbv import VOp, VResult, _ready_after, v_rank, v_result

__all__ = ["replay_v_order"]


def replay_v_order(order: Sequence[Sequence[VOp]], chunks: Sequence[StageTimes], n_micro_batches: int,
                   p2p_time: float | Sequence[float] = 0.0) -> VResult:
    """The step of ``order`` (each rank's ops, rank 0 first) under the chunks' times.

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
            raise ValueError(f"rank {r}'s order is not each F, B and W of its chunks {r} and {2 * pp - 1 - r} once "
                             f"for micro-batches 0..{m - 1}")
    cuts = per_cut_p2p(p2p_time, 2 * pp)
    times: dict[VOp, tuple[float, float]] = {}
    nxt, free = [0] * pp, [0.0] * pp
    while any(nxt[r] < len(order[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while nxt[r] < len(order[r]):
                op = order[r][nxt[r]]
                before = _ready_after(op, pp)
                if before is not None and before not in times:
                    break
                ready = 0.0 if before is None else times[before][1] + (
                    cuts[min(op.stage, before.stage)] if v_rank(pp, before.stage) != r else 0.0)
                st = chunks[op.stage]
                start = max(free[r], ready)
                free[r] = start + {"F": st.forward, "B": st.backward - st.weight, "W": st.weight}[op.kind]
                times[op] = (start, free[r])
                nxt[r] += 1
                moved = True
        if not moved:
            stuck = {r: str(order[r][nxt[r]]) for r in range(pp) if nxt[r] < len(order[r])}
            raise ValueError(f"the order waits forever: each rank's next op needs one not run yet ({stuck})")
    return v_result(chunks, m, times, order)
