"""Mutations of a run's re-plan after K steps (issue 42): the choice, and the move in the same processes."""

from __future__ import annotations

from mutations.base import M, Mutation

CHOICE = "nanotron_ext/plan/replan.py"
MOVE = "nanotron_ext/runtime/replan.py"
CHOICE_TESTS = "tests/test_replan.py"
MOVE_TESTS = "tests/runtime/test_replan.py"

MUTATIONS: tuple[Mutation, ...] = (
    M("a gain below min_gain moves", CHOICE,
      "Verdict.SMALL if gain < cfg.ext.replan.min_gain", "Verdict.SMALL if False",
      (f"{CHOICE_TESTS}::test_min_gain_and_the_noise_of_the_gain_decide",)),
    M("a gain within the run's noise moves", CHOICE,
      "Verdict.NOISY if noise >= gain", "Verdict.NOISY if noise > gain",
      (f"{CHOICE_TESTS}::test_noise_equal_to_the_gain_stays",)),
    M("the noise is not looked at", CHOICE,
      "Verdict.NOISY if noise >= gain", "Verdict.NOISY if False",
      (f"{CHOICE_TESTS}::test_min_gain_and_the_noise_of_the_gain_decide",)),
    M("the noise is the halves' whole gap", CHOICE,
      "return abs(gains[0] - gains[1]) / 2", "return abs(gains[0] - gains[1])",
      (f"{CHOICE_TESTS}::test_min_gain_and_the_noise_of_the_gain_decide",)),
    M("one half is enough for a noise", CHOICE,
      "    if len(halves) != 2:\n        return 0.0\n", "",
      (f"{CHOICE_TESTS}::test_without_two_halves_or_a_move_there_is_no_noise",)),
    M("the run's halves are not priced", MOVE,
      "engines=self.engines,\n                                   halves=halves)",
      "engines=self.engines,\n                                   halves=())",
      (f"{MOVE_TESTS}::test_a_bad_split_moves_after_k_steps_and_trains_as_the_new_plan_from_the_start",), "0.2"),
    M("without a cap a move may raise the largest stage", CHOICE,
      "    capped = priced.with_overrides(memory_cap_gib=cap / GIB)\n", "    capped = priced\n",
      (f"{CHOICE_TESTS}::test_without_a_cap_a_move_never_raises_the_largest_stage_above_the_runs",)),
    M("a fixed rule re-plans to its own split", CHOICE,
      'cfg.ext.cost_strategy if cfg.ext.cost_strategy in PRICED_STRATEGIES else "constrained"',
      "cfg.ext.cost_strategy",
      (f"{CHOICE_TESTS}::test_a_run_on_a_fixed_rule_re_plans_with_the_step_time_strategy",)),
    M("the re-plan may change the engine when told to keep it", CHOICE,
      'return CONTIGUOUS_AUTO_ENGINES if wanted == "auto" else (cfg.run.engine,)', "return CONTIGUOUS_AUTO_ENGINES",
      (f"{CHOICE_TESTS}::test_the_engines_a_replan_may_pick",)),
    M("the schedule steps once more after the move", MOVE,
      "state.load_lr_scheduler(scheduler, initial_step=False)", "state.load_lr_scheduler(scheduler)",
      (f"{MOVE_TESTS}::test_a_bad_split_moves_after_k_steps_and_trains_as_the_new_plan_from_the_start",), "0.2"),
    M("the move's checkpoint keeps rank 0's schedule only", MOVE,
      "if trainee.scheduler is not None and dist.get_rank(ctx.dp_pg) == 0:",
      "if trainee.scheduler is not None and dist.get_rank(ctx.world_pg) == 0:",
      (f"{MOVE_TESTS}::test_a_bad_split_moves_after_k_steps_and_trains_as_the_new_plan_from_the_start",), "0.2"),
    M("the new split starts without the moved state", MOVE,
      "    state.load_weights(model, ctx, state.source.folder, load_optimizer=True)\n", "",
      (f"{MOVE_TESTS}::test_a_bad_split_moves_after_k_steps_and_trains_as_the_new_plan_from_the_start",), "0.2"),
    M("the optimizer's moments are not moved", MOVE,
      "    state.optimizer = optimizer\n    state.load_optimizer(optimizer)\n", "    state.optimizer = optimizer\n",
      (f"{MOVE_TESTS}::test_a_bad_split_moves_after_k_steps_and_trains_as_the_new_plan_from_the_start",), "0.2"),
    M("step 1 is timed into the run's prices", MOVE,
      "with self.clock.step(record=step > 1):", "with self.clock.step(record=True):",
      (f"{MOVE_TESTS}::test_a_bad_split_moves_after_k_steps_and_trains_as_the_new_plan_from_the_start",), "0.2"),
    M("the move's checkpoint is left behind", MOVE,
      "                shutil.rmtree(folder.parent, ignore_errors=True)\n", "                pass\n",
      (f"{MOVE_TESTS}::test_a_bad_split_moves_after_k_steps_and_trains_as_the_new_plan_from_the_start",), "0.2"),
    M("the move's checkpoint is marked complete before every rank wrote", MOVE,
      "    state.mark(folder, step, complete=False)\n", "    state.mark(folder, step, complete=True)\n",
      (f"{MOVE_TESTS}::test_a_rank_killed_during_the_move_ends_the_run_and_leaves_the_checkpoint_incomplete",), "0.2"),
    M("a short run re-plans anyway", "nanotron_ext/runtime/train.py",
      "    if s.steps <= k:", "    if False:",
      (f"{MOVE_TESTS}::test_a_run_of_at_most_k_steps_trains_its_plan_and_says_why",), "0.2"),
)
