"""Mutations of the pictures (timeline, stage loads) and of how plan and simulate print times and bubbles."""

from __future__ import annotations

from mutations.base import M, Mutation

TIMELINE_TESTS = "tests/test_timeline.py"
MARKS_TESTS = "tests/test_timeline_marks.py"
SIMULATE_CLI = "tests/test_simulate_cli.py"
MARKS = "nanotron_ext/simulate/timeline_marks.py"

MUTATIONS: tuple[Mutation, ...] = (
    M(
        "a title that runs off the frame is left there",
        "nanotron_ext/simulate/figure.py",
        "    if shift:\n",
        "    if False:\n",
        (f"{TIMELINE_TESTS}::test_the_loads_charts_title_stays_inside_the_frame",),
    ),
    M(
        "a title wider than the figure is not wrapped",
        "nanotron_ext/simulate/figure.py",
        "    while title.get_window_extent().width > frame and width > 20:",
        "    while False:",
        (
            f"{TIMELINE_TESTS}::test_the_loads_charts_title_stays_inside_the_frame",
            f"{TIMELINE_TESTS}::test_the_timelines_title_stays_inside_the_frame",
        ),
    ),
    M(
        "the loads chart draws a plan that cannot train as any other",
        "nanotron_ext/simulate/loads_chart.py",
        "        if name in invalid:\n",
        "        if False:\n",
        (f"{TIMELINE_TESTS}::test_an_invalid_plan_is_marked_on_the_loads_chart_and_never_a_yardstick",),
    ),
    M(
        "simulate --compare tells the loads chart of no plan that cannot train",
        "nanotron_ext/cli/simulate.py",
        "invalid={name: _codes(plan) for name, plan in plans.items() if name in loads and not plan.ok},",
        "invalid={},",
        (f"{TIMELINE_TESTS}::test_simulate_compare_marks_nanotrons_split_invalid_on_its_loads_chart",),
    ),
    M(
        "micro-batch numbers are decided box by box",
        MARKS,
        "        if widths and min(widths) >= label_px:",
        "        if widths and max(widths) >= label_px:",
        (
            f"{MARKS_TESTS}::test_the_numbering_rule_is_one_for_every_row",
            f"{TIMELINE_TESTS}::test_every_row_numbers_its_ops_by_one_rule",
        ),
    ),
    M(
        "a V's second chunk is drawn as its first",
        "nanotron_ext/simulate/timeline.py",
        "    if not second:\n        return colour\n",
        "    if True:\n        return colour\n",
        (f"{TIMELINE_TESTS}::test_a_vs_two_chunks_are_told_apart_and_a_sliver_of_work_is_drawn_with_its_time",),
    ),
    M(
        "a V's chunks are read off its order back to front",
        MARKS,
        "        chunks.append(held.popleft())",
        "        chunks.append(held.pop())",
        (f"{MARKS_TESTS}::test_a_vs_ops_get_their_chunks_and_its_transfers_arrive_when_the_replay_says",),
    ),
    M(
        "every transfer is priced by the first cut",
        MARKS,
        "        took = result.p2p_times[cut]\n",
        "        took = result.p2p_times[0]\n",
        (f"{MARKS_TESTS}::test_every_transfer_is_made_before_it_leaves_and_its_rank_waits_through_it",),
    ),
    M(
        "a V's transfer is drawn ending where its taker starts",
        MARKS,
        "            out.append(Hop(box.row, what, box.micro_batch, cut, left, left + took))",
        "            out.append(Hop(box.row, what, box.micro_batch, cut, box.start - took, box.start))",
        (f"{MARKS_TESTS}::test_a_vs_ops_get_their_chunks_and_its_transfers_arrive_when_the_replay_says",),
    ),
    M(
        "a frozen prefix is drawn receiving gradients",
        "nanotron_ext/cli/simulate.py",
        "        grad_cuts=plan_stage_times(plan, blocks, cfg).grad_cuts,\n",
        "",
        (f"{TIMELINE_TESTS}::test_a_frozen_prefix_is_drawn_without_the_gradients_it_never_receives",),
    ),
    M(
        "an op is drawn as narrow as it lasts",
        MARKS,
        "                width=max(op.end - op.start, floor),",
        "                width=op.end - op.start,",
        (
            f"{MARKS_TESTS}::test_a_stage_whose_work_is_a_sliver_of_the_step_is_drawn_at_the_floor_and_its_times_printed",
        ),
    ),
    M(
        "a share of 99.8 % prints as 100 %",
        "nanotron_ext/report.py",
        '        if float(text.rstrip("%")) not in (0.0, 100.0) or fraction in (0.0, 1.0):',
        "        if True:",
        (f"{MARKS_TESTS}::test_a_share_that_is_not_whole_never_prints_as_0_or_100_percent",),
    ),
    M(
        "a time rounded up to 1000 of a unit stays in it",
        "nanotron_ext/report.py",
        '    if abs(float(f"{seconds / scale:.3g}")) >= 1000:  # rounded up into the next unit',
        "    if False:",
        (f"{SIMULATE_CLI}::test_format_seconds",),
    ),
    M(
        "simulate's stage table prints its times in ms",
        "nanotron_ext/cli/step_report.py",
        "format_seconds(t.forward), format_seconds(t.backward)",
        'f"{t.forward * 1e3:.4g}", f"{t.backward * 1e3:.4g}"',
        (f"{SIMULATE_CLI}::test_simulate_prints_table_bubble_and_writes_timeline",),
    ),
    M(
        "the V's header calls its pipeline bubble the bubble",
        "nanotron_ext/plan/v_types.py",
        'f"pipeline bubble {self.bubble:.1%}; each rank under {limit}"',
        'f"bubble {self.bubble:.1%}; each rank under {limit}"',
        (f"{SIMULATE_CLI}::test_bubble_is_the_steps_and_pipeline_bubble_the_pipeline_parts_in_every_output",),
    ),
    M(
        "a V's plan --json carries its pipeline bubble as its bubble",
        "nanotron_ext/cli/v_plan.py",
        '"bubble_fraction": step.bubble_fraction,',
        '"bubble_fraction": plan.bubble,',
        (f"{SIMULATE_CLI}::test_bubble_is_the_steps_and_pipeline_bubble_the_pipeline_parts_in_every_output",),
    ),
)
