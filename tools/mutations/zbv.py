"""Mutations of the V (issue 43): its one order of transfers (keys, the held sends in the engine and the replay),
its plan at any micro-batch count, its checkpoints (the record, a resume into, out of and on a V), and auto's price of
it where its sends wait."""

from __future__ import annotations

from mutations.base import M, Mutation

ORDER = "nanotron_ext/schedule/v_replay.py"
ENGINE = "nanotron_ext/zero_bubble/v_engine.py"
STATE = "nanotron_ext/zero_bubble/v_state.py"
ORDER_TESTS = "tests/test_v_replay.py"
ENGINE_TESTS = "tests/runtime/test_zbv_engine.py"
PROBLEM = "nanotron_ext/partition/schedule_problem.py"
RECORD = "nanotron_ext/checkpoint/record.py"
RESUME = "nanotron_ext/checkpoint/resume.py"
RECORD_TESTS = "tests/test_checkpoint_record.py"

MUTATIONS: tuple[Mutation, ...] = (
    M(
        "a transfer is keyed by when it is made, not taken",
        ORDER,
        "key = (start[taker], taker.stage, taker.kind, taker.micro_batch)",
        "key = (start[maker], taker.stage, taker.kind, taker.micro_batch)",
        (
            f"{ORDER_TESTS}::test_the_transfers_order_two_ranks_two_micro_batches_by_hand",
            f"{ORDER_TESTS}::test_where_sends_wait_the_transfers_order_never_deadlocks_and_posting_as_made_does",
        ),
    ),
    M(
        "the replay posts held sends as made",
        ORDER,
        "held = transfer_order(order, keys_from, p2p_time) if sends_wait else None",
        "held = None",
        (f"{ORDER_TESTS}::test_a_held_send_costs_the_time_it_waits_for_the_receive_before_it",),
    ),
    M(
        "where sends wait the engine posts them as made",
        ENGINE,
        "            if not self.sends_wait\n",
        "            if True\n",
        (f"{ENGINE_TESTS}::test_every_zbv_order_runs_to_completion_and_each_receive_gets_what_its_peer_sent",),
        "0.2",
    ),
    M(
        "a transfer that never happens holds the sends after it",
        STATE,
        "        for t in [t for t in self.turn if t.op == op]:\n            self._finish(t)\n",
        "",
        (f"{ENGINE_TESTS}::test_zbv_equals_1f1b_two_ranks",),
        "0.2",
    ),
    M(
        "a V's chunks take the 1F1B family's micro-batch rule",
        PROBLEM,
        "None if self.v_chunks else too_few_micro_batches(",
        "None if False else too_few_micro_batches(",
        ("tests/test_v_plan.py::test_a_v_plans_micro_batch_counts_1f1b_would_refuse_on_as_many_stages",),
    ),
    M(
        "a V's record keeps no chunks",
        RECORD,
        "v_stages=tuple(plan.stages) if v else ()",
        "v_stages=()",
        (f"{RECORD_TESTS}::test_a_v_records_its_ranks_and_chunks_and_a_contiguous_record_reads_as_before",),
    ),
    M(
        "a contiguous record writes an empty v_stages",
        RECORD,
        '            del out["v_stages"]',
        "            pass",
        (f"{RECORD_TESTS}::test_a_v_records_its_ranks_and_chunks_and_a_contiguous_record_reads_as_before",),
    ),
    M(
        "a resume keeps a V under a contiguous engine",
        RESUME,
        "    if bool(record.v_stages) != bool(now.v_stages):",
        "    if False:",
        (f"{RECORD_TESTS}::test_a_v_checkpoint_keeps_its_chunks_under_zbv_and_moves_off_them_under_another_engine",),
    ),
    M(
        "a kept V is searched again",
        RESUME,
        "make_v_plan(blocks, cfg, v_stages=record.v_stages, strategy=record.strategy)",
        "make_v_plan(blocks, cfg)",
        (f"{RECORD_TESTS}::test_a_v_checkpoint_keeps_its_chunks_under_zbv_and_moves_off_them_under_another_engine",),
    ),
    M(
        "the launcher leaves zbv to Nanotron's casts",
        "nanotron_ext/integration/trainer_patches.py",
        "if cfg.run.engine in ZERO_BUBBLE_ENGINES or cfg.run.engine == V_ENGINE:",
        "if cfg.run.engine in ZERO_BUBBLE_ENGINES:",
        ("tests/upstream/test_zbv_launcher.py",),
        "upstream",
    ),
    M(
        "auto prices the launcher's V with its sends posted as made",
        "nanotron_ext/plan/engine_choice.py",
        "        if sends_wait:  # the split searched",
        "        if False:  # the split searched",
        ("tests/test_engine_choice.py::test_held_sends_cost_the_v_where_a_send_is_ready_before_its_turn",),
    ),
    M(
        "the V's timeline never holds its sends",
        "nanotron_ext/plan/v_plan.py",
        (
            "        replay_v_order(plan.order, chunks, plan.n_micro_batches, p2p, sends_wait=sends_wait, keys_from=chunks),\n"
            "        chunks,\n"
            "        p2p,\n"
        ),
        "        replay_v_order(plan.order, chunks, plan.n_micro_batches, p2p, sends_wait=False, keys_from=chunks), chunks, p2p\n",
        ("tests/test_engine_choice.py::test_held_sends_cost_the_v_where_a_send_is_ready_before_its_turn",),
    ),
    M(
        "the launcher's auto prices the V with its sends posted as made",
        RESUME,
        "    return resolve_engine(cfg, engines, sends_wait=True)",
        "    return resolve_engine(cfg, engines, sends_wait=False)",
        (
            "tests/test_launcher_cli.py::test_the_launchers_auto_prices_the_v_with_its_sends_held_and_a_replan_starts_contiguous",
        ),
    ),
    M(
        "the launcher's auto starts a re-planning run on a V",
        RESUME,
        "engines = CONTIGUOUS_AUTO_ENGINES if cfg.ext.replan.after_steps is not None else AUTO_ENGINES",
        "engines = AUTO_ENGINES",
        (
            "tests/test_launcher_cli.py::test_the_launchers_auto_prices_the_v_with_its_sends_held_and_a_replan_starts_contiguous",
        ),
    ),
    M(
        "the plan's keys are the unit keys",
        ORDER,
        "    planned = _keyed(order, _starts(order, chunks, m, cuts))",
        "    planned = unit",
        (f"{ORDER_TESTS}::test_keyed_by_the_plans_own_times_the_held_sends_cost_a_fraction_of_the_unit_keys",),
    ),
    M(
        "tied plan keys that stop are kept",
        ORDER,
        "    except ValueError:  # every rank's next op waits on one not run yet\n        return unit",
        "    except ValueError:  # every rank's next op waits on one not run yet\n        return planned",
        (
            f"{ORDER_TESTS}::test_where_ops_of_no_length_tie_the_plans_keys_into_an_order_that_stops_the_unit_keys_serve",
        ),
    ),
    M(
        "the plan's keys are kept where they hold longer",
        ORDER,
        "    return planned if ends[0] <= ends[1] else unit",
        "    return planned",
        (f"{ORDER_TESTS}::test_keyed_by_the_plans_own_times_the_held_sends_cost_a_fraction_of_the_unit_keys",),
    ),
    M(
        "a V plan keeps no transfers of its own",
        "nanotron_ext/plan/v_plan.py",
        "        transfers=tuple(tuple(t) for t in transfer_order(result.order, chunks, p2p)),\n",
        "        transfers=(),\n",
        ("tests/test_engine_choice.py::test_held_sends_cost_the_v_where_a_send_is_ready_before_its_turn",),
    ),
)
