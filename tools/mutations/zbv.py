"""Mutations of the V (issue 43): its one order of transfers (keys, the held sends in the engine and the replay), and
its plan at any micro-batch count."""

from __future__ import annotations

from mutations.base import M, Mutation

ORDER = "nanotron_ext/schedule/v_replay.py"
ENGINE = "nanotron_ext/zero_bubble/v_engine.py"
ORDER_TESTS = "tests/test_v_replay.py"
ENGINE_TESTS = "tests/runtime/test_zbv_engine.py"
PROBLEM = "nanotron_ext/partition/schedule_problem.py"

MUTATIONS: tuple[Mutation, ...] = (
    M("a transfer is keyed by when it is made, not taken", ORDER,
      "key = (start[taker], taker.stage, taker.kind, taker.micro_batch)",
      "key = (start[maker], taker.stage, taker.kind, taker.micro_batch)",
      (f"{ORDER_TESTS}::test_the_transfers_order_two_ranks_two_micro_batches_by_hand",
       f"{ORDER_TESTS}::test_where_sends_wait_the_transfers_order_never_deadlocks_and_posting_as_made_does")),
    M("the replay posts held sends as made", ORDER,
      "transfer_order(order) if sends_wait else None", "None",
      (f"{ORDER_TESTS}::test_a_held_send_costs_the_time_it_waits_for_the_receive_before_it",)),
    M("where sends wait the engine posts them as made", ENGINE,
      "transfer_order(order)[rank] if self.sends_wait else []", "[]",
      (f"{ENGINE_TESTS}::test_every_zbv_order_runs_to_completion_and_each_receive_gets_what_its_peer_sent",), "0.2"),
    M("a transfer that never happens holds the sends after it", ENGINE,
      "        for t in [t for t in self.turn if t.op == op]:\n            self._finish(t)\n", "",
      (f"{ENGINE_TESTS}::test_zbv_equals_1f1b_two_ranks",), "0.2"),
    M("a V's chunks take the 1F1B family's micro-batch rule", PROBLEM,
      "None if self.v_chunks else too_few_micro_batches(", "None if False else too_few_micro_batches(",
      ("tests/test_v_plan.py::test_a_v_plans_micro_batch_counts_1f1b_would_refuse_on_as_many_stages",)),
)
