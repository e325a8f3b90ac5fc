"""Mutations of a run's re-plan after K steps (issue 42): the choice, and the move in the same processes."""

from __future__ import annotations

from mutations.base import M, Mutation

CHOICE = "nanotron_ext/plan/replan.py"
MOVE = "nanotron_ext/runtime/replan.py"
CHOICE_TESTS = "tests/test_replan.py"
MOVE_TESTS = "tests/runtime/test_replan.py"
LAUNCHER = "nanotron_ext/integration/replan.py"
LAUNCHER_TESTS = "tests/upstream/test_launcher_replan.py"

MUTATIONS: tuple[Mutation, ...] = (
    M(
        "a gain below min_gain moves",
        CHOICE,
        (
            "        Verdict.BEST\n"
            "        if new is old\n"
            "        else Verdict.SMALL\n"
            "        if gain < cfg.ext.replan.min_gain\n"
            "        else Verdict.NOISY\n"
            "        if noise >= gain\n"
            "        else Verdict.MOVE\n"
        ),
        "        Verdict.BEST if new is old else Verdict.SMALL if False else Verdict.NOISY if noise >= gain else Verdict.MOVE\n",
        (f"{CHOICE_TESTS}::test_min_gain_and_the_noise_of_the_gain_decide",),
    ),
    M(
        "a gain within the run's noise moves",
        CHOICE,
        "        if noise >= gain\n",
        "        if noise > gain\n",
        (f"{CHOICE_TESTS}::test_noise_equal_to_the_gain_stays",),
    ),
    M(
        "the noise is not looked at",
        CHOICE,
        "        if noise >= gain\n",
        "        if False\n",
        (f"{CHOICE_TESTS}::test_min_gain_and_the_noise_of_the_gain_decide",),
    ),
    M(
        "the noise is the halves' whole gap",
        CHOICE,
        "return abs(gains[0] - gains[1]) / 2",
        "return abs(gains[0] - gains[1])",
        (f"{CHOICE_TESTS}::test_min_gain_and_the_noise_of_the_gain_decide",),
    ),
    M(
        "one half is enough for a noise",
        CHOICE,
        "    if len(halves) != 2:\n        return 0.0\n",
        "",
        (f"{CHOICE_TESTS}::test_without_two_halves_or_a_move_there_is_no_noise",),
    ),
    M(
        "the run's halves are not priced",
        MOVE,
        "                whole, inventory_from_config(whole), s.plan, step=step, engines=self.engines, halves=halves\n",
        "                whole, inventory_from_config(whole), s.plan, step=step, engines=self.engines, halves=()\n",
        (f"{MOVE_TESTS}::test_a_bad_split_moves_after_k_steps_and_trains_as_the_new_plan_from_the_start",),
        "0.2",
    ),
    M(
        "without a cap a move may raise the largest stage",
        CHOICE,
        "    capped = priced.with_overrides(memory_cap_gib=cap / GIB)\n",
        "    capped = priced\n",
        (f"{CHOICE_TESTS}::test_without_a_cap_a_move_never_raises_the_largest_stage_above_the_runs",),
    ),
    M(
        "a fixed rule re-plans to its own split",
        CHOICE,
        'cfg.ext.cost_strategy if cfg.ext.cost_strategy in PRICED_STRATEGIES else "constrained"',
        "cfg.ext.cost_strategy",
        (f"{CHOICE_TESTS}::test_a_run_on_a_fixed_rule_re_plans_with_the_step_time_strategy",),
    ),
    M(
        "the re-plan may change the engine when told to keep it",
        CHOICE,
        'return CONTIGUOUS_AUTO_ENGINES if wanted == "auto" else (cfg.run.engine,)',
        "return CONTIGUOUS_AUTO_ENGINES",
        (f"{CHOICE_TESTS}::test_the_engines_a_replan_may_pick",),
    ),
    M(
        "the schedule steps once more after the move",
        MOVE,
        "state.load_lr_scheduler(scheduler, initial_step=False)",
        "state.load_lr_scheduler(scheduler)",
        (f"{MOVE_TESTS}::test_a_bad_split_moves_after_k_steps_and_trains_as_the_new_plan_from_the_start",),
        "0.2",
    ),
    M(
        "the move's checkpoint keeps rank 0's schedule only",
        MOVE,
        "if trainee.scheduler is not None and dist.get_rank(ctx.dp_pg) == 0:",
        "if trainee.scheduler is not None and dist.get_rank(ctx.world_pg) == 0:",
        (f"{MOVE_TESTS}::test_a_bad_split_moves_after_k_steps_and_trains_as_the_new_plan_from_the_start",),
        "0.2",
    ),
    M(
        "the new split starts without the moved state",
        MOVE,
        "    state.load_weights(model, ctx, state.source.folder, load_optimizer=True)\n",
        "",
        (f"{MOVE_TESTS}::test_a_bad_split_moves_after_k_steps_and_trains_as_the_new_plan_from_the_start",),
        "0.2",
    ),
    M(
        "the optimizer's moments are not moved",
        MOVE,
        "    state.optimizer = optimizer\n    state.load_optimizer(optimizer)\n",
        "    state.optimizer = optimizer\n",
        (f"{MOVE_TESTS}::test_a_bad_split_moves_after_k_steps_and_trains_as_the_new_plan_from_the_start",),
        "0.2",
    ),
    M(
        "step 1 is timed into the run's prices",
        MOVE,
        "with self.clock.step(record=step > 1):",
        "with self.clock.step(record=True):",
        (f"{MOVE_TESTS}::test_a_bad_split_moves_after_k_steps_and_trains_as_the_new_plan_from_the_start",),
        "0.2",
    ),
    M(
        "the move's checkpoint is left behind",
        MOVE,
        "                shutil.rmtree(folder.parent, ignore_errors=True)\n",
        "                pass\n",
        (f"{MOVE_TESTS}::test_a_bad_split_moves_after_k_steps_and_trains_as_the_new_plan_from_the_start",),
        "0.2",
    ),
    M(
        "the move's checkpoint is marked complete before every rank wrote",
        MOVE,
        "    state.mark(folder, step, complete=False)\n",
        "    state.mark(folder, step, complete=True)\n",
        (f"{MOVE_TESTS}::test_a_rank_killed_during_the_move_ends_the_run_and_leaves_the_checkpoint_incomplete",),
        "0.2",
    ),
    M(
        "a short run re-plans anyway",
        "nanotron_ext/runtime/train.py",
        "    if s.steps <= k:",
        "    if False:",
        (f"{MOVE_TESTS}::test_a_run_of_at_most_k_steps_trains_its_plan_and_says_why",),
        "0.2",
    ),
    M(
        "the launcher counts a new build's first step after the re-plan",
        LAUNCHER,
        "        self._skip = 1  # step K + 1",
        "        self._skip = 0  # step K + 1",
        (f"{LAUNCHER_TESTS}::test_a_run_that_stays_says_why_and_trains_its_plan_to_the_end",),
        "upstream",
    ),
    M(
        "the launcher's move keeps the recorded split",
        LAUNCHER,
        '            resume_plan="replan",\n',
        '            resume_plan="keep",\n',
        (
            f"{LAUNCHER_TESTS}::test_a_run_on_a_bad_split_moves_after_k_steps_and_trains_the_bits_of_the_run_that_stayed",
        ),
        "upstream",
    ),
    M(
        "the launcher's move saves no checkpoint off the interval",
        LAUNCHER,
        "if step % checkpoints.checkpoint_interval != 0:",
        "if False:",
        (
            f"{LAUNCHER_TESTS}::test_a_run_on_a_bad_split_moves_after_k_steps_and_trains_the_bits_of_the_run_that_stayed",
        ),
        "upstream",
    ),
    M(
        "the re-launch trains the YAML's engine, not the new plan's",
        "nanotron_ext/integration/trainer_patches.py",
        "cfg.run.engine, always=moved)",
        "cfg.run.engine, always=False)",
        ("tests/test_launcher_cli.py::test_launcher_installs_into_nanotrons_own_trainer_and_loader",),
    ),
    M(
        "the launcher re-plans a run of at most K steps",
        LAUNCHER,
        "        if steps <= self.after_steps:",
        "        if False:",
        (f"{LAUNCHER_TESTS}::test_a_run_of_at_most_k_steps_trains_its_plan_and_says_why",),
        "upstream",
    ),
    M(
        "the re-launch's first step is taken for the run's",
        LAUNCHER,
        "        if self.first_step is None:\n",
        "        if True:\n",
        (
            f"{LAUNCHER_TESTS}::test_a_run_on_a_bad_split_moves_after_k_steps_and_trains_the_bits_of_the_run_that_stayed",
        ),
        "upstream",
    ),
)
