"""The V's list scheduler (``nanotron_ext.schedule.v_list``) against a plain statement of its rules: every rule's
order and times, its stalls, the fastest rule with the rules an earlier one decided for skipped, and a schedule
stopped once it is sure to end after a search's best."""

from __future__ import annotations

import math
import random

import pytest

from nanotron_ext.schedule.simulator import StageTimes
from nanotron_ext.schedule.v_list import POLICIES, Policy, Stalled, VBudget, fastest_schedule, list_schedule
from nanotron_ext.schedule.zbv import simulate_zbv, simulate_zbv_under


def _plain(chunks, m, cuts, cap, policy, eager=frozenset(), budget=None):
    """The rules as the module docstring states them, recomputed from scratch at every decision: each op
    ``(kind, micro-batch, stage, start, end)`` in the order scheduled, or None where every rank waits for good."""
    pp, last = len(chunks) // 2, len(chunks) - 1
    cap = cap if cap is not None else 2 * pp if budget is None else 2 * m + 1
    end, ops = {}, []
    nxt = {(r, kind, c): 0 for r in range(pp) for kind in "FB" for c in (0, 1)}
    deferred, held, used, free = [[] for _ in range(pp)], [0] * pp, [0.0] * pp, [0.0] * pp
    need = [0.0 if budget is None else budget.need(s) for s in range(last + 1)]

    def arrival(kind, j, s):
        before = ("F", j, s - 1) if kind == "F" else ("F", j, s) if s == last else ("B", j, s + 1)
        if kind == "F" and s == 0:
            return 0.0
        if before not in end:
            return None
        crossing = (min(before[2], last - before[2])) != (min(s, last - s))
        return end[before] + (cuts[min(s, before[2])] if crossing else 0.0)

    def candidates(r):
        stage = (r, last - r)
        ops_ = [("B", nxt[(r, "B", c)], stage[c]) for c in policy.b_chunks if nxt[(r, "B", c)] < m]
        room = cap - held[r] - (policy.w_reserve if deferred[r] else 0)
        for c in (1, 0):
            if nxt[(r, "F", c)] < m and room > (policy.down_reserve if c == 0 else 0):
                if budget is not None:
                    up = last - r
                    want = need[stage[c]] + (need[up] if c == 0 and policy.down_reserve else 0.0)
                    if not used[r] + want + budget.overlap(r) <= budget.budget[r] * (1 + 1e-9):
                        continue
                ops_.append(("F", nxt[(r, "F", c)], stage[c]))
        return [(op, arrival(*op)) for op in ops_]

    waiting = set()
    while len(ops) < 3 * (last + 1) * m:
        r = min(range(pp), key=lambda q: (free[q], q in waiting, q))
        now = free[r]
        if r in waiting:
            idle = [q for q in range(pp) if free[q] == now]
            later = [f for f in free if f > now] + [
                a for q in idle for _, a in candidates(q) if a is not None and a > now
            ]
            if not later:
                return None
            for q in idle:
                free[q] = min(later)
            waiting.clear()
            continue
        op = next((o for o, a in candidates(r) if a is not None and a <= now), None)
        if op is None and deferred[r]:
            op = deferred[r].pop(0)
        if op is None:
            waiting.add(r)
            continue
        waiting.clear()
        kind, j, s = op
        st = chunks[s]
        free[r] = now + {"F": st.forward, "B": st.backward - st.weight, "W": st.weight}[kind]
        end[op] = free[r]
        ops.append((kind, j, s, now, free[r]))
        c = 0 if s < pp else 1
        if kind != "W":
            nxt[(r, kind, c)] += 1
        held[r] += 1 if kind == "F" else -1 if kind == "W" or s in eager else 0
        used[r] += need[s] if kind == "F" else -need[s] if kind == "W" or s in eager else 0.0
        if kind == "B" and s in eager:
            ops.append(("W", j, s, free[r], free[r] + st.weight))
            free[r] += st.weight
        elif kind == "B":
            deferred[r].append(("W", j, s))
    return ops


def _case(rng: random.Random):
    pp = rng.randint(1, 4)
    m = rng.randint(1, 4 * pp)
    chunks = [
        StageTimes(rng.choice([1.0, rng.uniform(0.1, 2.0)]), b, weight=b * rng.choice([0.5, rng.random()]))
        for b in (rng.choice([2.0, rng.uniform(0.2, 3.0)]) for _ in range(2 * pp))
    ]
    cuts = [rng.choice([0.0, rng.uniform(0.0, 2.0)]) for _ in range(2 * pp - 1)]
    cap = rng.choice([None, None, 2, 3, 2 * pp + 2])
    eager = frozenset(rng.sample(range(2 * pp), rng.randint(0, 2)))
    budget = None
    if rng.random() < 0.5:
        act = tuple(rng.uniform(1, 10) for _ in range(2 * pp))
        pending = tuple(rng.uniform(0, 5) for _ in range(2 * pp))
        least = [max(act[s], pending[s]) + max(act[2 * pp - 1 - s], pending[2 * pp - 1 - s]) for s in range(pp)]
        budget = VBudget(act, pending, tuple(x * rng.uniform(1.2, 4.0) for x in least))
    return chunks, m, cuts, cap, eager, budget


@pytest.mark.parametrize("seed", range(4))
def test_every_rule_schedules_as_its_plain_statement_and_the_fastest_skips_no_rule_that_decides_otherwise(seed):
    rng = random.Random(seed)
    for _ in range(40):
        chunks, m, cuts, cap, eager, budget = _case(rng)
        plain = {}
        for policy in POLICIES:
            plain[policy] = _plain(chunks, m, cuts, cap, policy, eager, budget)
            try:
                got = list_schedule(chunks, m, cuts, cap, policy, eager, budget).ops
            except Stalled:
                got = None
            assert got == plain[policy], (policy, m, cap, eager)
        done = [(max(o[4] for o in ops), k) for k, ops in enumerate(plain[p] for p in POLICIES) if ops is not None]
        fastest = fastest_schedule(chunks, m, cuts, cap, eager, budget)
        if not done:
            assert fastest is None
            continue
        assert fastest is not None and fastest.ops == plain[POLICIES[min(done)[1]]]  # the earlier rule of equals


def test_a_rule_that_makes_a_different_choice_is_scheduled_even_after_one_that_matched_it_so_far():
    # Both chunks' B ready at once on the bottom rank: the two orders of chunks part there.
    chunks = [StageTimes(1.0, 2.0, weight=1.0)] * 4
    a = list_schedule(chunks, 4, [0.0] * 3, None, Policy((0, 1), 0, 1)).ops
    b = list_schedule(chunks, 4, [0.0] * 3, None, Policy((1, 0), 0, 1)).ops
    assert a != b


@pytest.mark.parametrize("seed", range(3))
def test_a_schedule_sure_to_end_after_the_best_is_not_finished_and_one_before_it_is_the_full_one(seed):
    rng = random.Random(100 + seed)
    for _ in range(40):
        chunks, m, cuts, cap, eager, budget = _case(rng)
        try:
            full = simulate_zbv(chunks, m, cuts, cap, eager, budget)
        except ValueError:
            continue
        step = full.step_time
        for under in (step, math.nextafter(step, math.inf), step * 1.02, step * 0.98, step * 0.5, math.inf):
            got = simulate_zbv_under(chunks, m, cuts, cap, eager, budget, under=under)
            assert got == (full if step < under else None), (under, step)
