"""Mutations of a run's re-plan after K steps (issues 42 and 53): what it tries, the trial in turns, the verdict, and
the moves in the same processes (the CPU runtime) and by re-launch (the launcher)."""

from __future__ import annotations

from mutations.base import M, Mutation

CHOICE = "nanotron_ext/plan/replan.py"
TRIAL = "nanotron_ext/plan/replan_trial.py"
SESSION = "nanotron_ext/integration/replan_session.py"
MOVE = "nanotron_ext/runtime/replan.py"
CHOICE_TESTS = "tests/test_replan.py"
TRIAL_TESTS = "tests/test_replan_trial.py"
MOVE_TESTS = "tests/runtime/test_replan.py"
LAUNCHER = "nanotron_ext/integration/replan.py"
LAUNCHER_TESTS = "tests/upstream/test_launcher_replan.py"
UNDONE = f"{MOVE_TESTS}::test_a_move_a_transient_load_made_look_good_is_measured_and_undone"
CLOSE_CALL = f"{MOVE_TESTS}::test_a_close_call_is_tried_in_turns_and_the_run_trains_the_bits_of_a_run_that_never_moved"
TURNS = f"{LAUNCHER_TESTS}::test_a_run_tries_the_candidate_in_turns_and_trains_the_bits_of_the_run_that_stayed"
TRIED_WHERE = f"{CHOICE_TESTS}::test_a_plan_is_tried_where_its_gain_at_the_profiles_error_reaches_min_gain"
CLOSE = f"{CHOICE_TESTS}::test_a_close_call_tries_every_plan_within_the_error_of_the_fastest_up_to_trials_and_the_steps_left"
VERDICT = f"{TRIAL_TESTS}::test_the_run_goes_back_unless_a_candidate_beats_its_plan_beyond_the_noise_and_min_gain"

CHOICE_ROWS: tuple[Mutation, ...] = (
    M(
        "a run on the fastest priced plan tries nothing, however close the others",
        CHOICE,
        "        fastest = own  # the run's plan is the fastest priced",
        "        return ReplanChoice(*args, (), own, noise, error, replan.min_gain, cap, Verdict.BEST, engine_lines)\n"
        "        fastest = own  # the run's plan is the fastest priced",
        (
            f"{CHOICE_TESTS}::test_a_run_on_the_fastest_priced_plan_tries_the_plans_within_the_error_of_it_that_min_gain"
            "_allows",
        ),
    ),
    M(
        "a plan is tried whatever its gain at the profile's error",
        CHOICE,
        "_gain(old_step, c.step) + error >= replan.min_gain",
        "True",
        (TRIED_WHERE,),
    ),
    M(
        "a plan is tried only where its predicted gain reaches min_gain",
        CHOICE,
        "_gain(old_step, c.step) + error >= replan.min_gain",
        "_gain(old_step, c.step) >= replan.min_gain",
        (TRIED_WHERE,),
    ),
    M(
        "the profile's error leaves out the run's noise",
        CHOICE,
        "    error = max(PROFILE_ERROR, noise)\n",
        "    error = PROFILE_ERROR\n",
        (TRIED_WHERE,),
    ),
    M(
        "the profile's error leaves out the held-out error",
        CHOICE,
        "    error = max(PROFILE_ERROR, noise)\n",
        "    error = noise\n",
        (
            f"{CHOICE_TESTS}::test_without_two_halves_or_a_faster_plan_there_is_no_noise_and_the_error_is_the_held_out_one",
        ),
    ),
    M(
        "the noise is the halves' whole gap",
        CHOICE,
        "return abs(gains[0] - gains[1]) / 2",
        "return abs(gains[0] - gains[1])",
        (TRIED_WHERE,),
    ),
    M(
        "one half is enough for a noise",
        CHOICE,
        "    if len(halves) != 2:\n        return 0.0\n",
        "",
        (
            f"{CHOICE_TESTS}::test_without_two_halves_or_a_faster_plan_there_is_no_noise_and_the_error_is_the_held_out_one",
        ),
    ),
    M(
        "a close call tries the fastest alone",
        CHOICE,
        "    pool = _around(capped, blocks, fastest, bests, error, strategy)\n",
        "    pool = [fastest]\n",
        (CLOSE,),
    ),
    M(
        "replan.trials does not cap what is tried",
        CHOICE,
        "    tried = worth[: replan.trials]\n",
        "    tried = worth\n",
        (CLOSE,),
    ),
    M(
        "a trial longer than the steps left runs anyway",
        CHOICE,
        "trial_length(len(tried) + 1, replan.turn_steps) > steps_left",
        "False",
        (CLOSE,),
    ),
    M(
        "a split beyond the error of the fastest is tried",
        CHOICE,
        "    bound = fastest.step * (1 + error)\n",
        "    bound = fastest.step * (1 + 10 * error)\n",
        (CLOSE,),
    ),
    M("a split that cannot train is tried", CHOICE, "            if plan.ok:\n", "            if True:\n", (CLOSE,)),
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
        "--replan-after takes 1",
        "nanotron_ext/config_ext.py",
        "not isinstance(k, int) or k < 2:",
        "not isinstance(k, int) or k < 1:",
        (f"{CHOICE_TESTS}::test_replan_after_has_the_keys_rule_and_names_the_flag",),
    ),
)

TRIAL_ROWS: tuple[Mutation, ...] = (
    M(
        "the middle turn is not doubled",
        TRIAL,
        "n = turn_steps * (2 if i == n_plans - 1 else 1)",
        "n = turn_steps",
        (f"{TRIAL_TESTS}::test_two_plans_run_a_then_a_double_turn_of_b_then_a",),
    ),
    M(
        "the turns go out and do not come back",
        TRIAL,
        "order = [*range(n_plans - 1), n_plans - 1, *range(n_plans - 2, -1, -1)]",
        "order = [*range(n_plans - 1), n_plans - 1, 0]",
        (f"{TRIAL_TESTS}::test_a_linear_drift_moves_every_plans_estimate_alike",),
    ),
    M(
        "a turn's first step, on a new build, is timed",
        TRIAL,
        "TURN_WARMUP_STEPS = 1\n",
        "TURN_WARMUP_STEPS = 0\n",
        (f"{TRIAL_TESTS}::test_two_plans_run_a_then_a_double_turn_of_b_then_a",),
    ),
    M(
        "a plan's estimate is its first turn",
        TRIAL,
        "        return statistics.fmean(self.turns)\n",
        "        return self.turns[0]\n",
        (f"{TRIAL_TESTS}::test_a_linear_drift_moves_every_plans_estimate_alike",),
    ),
    M(
        "the drift is the whole gap",
        TRIAL,
        "drift = abs(first - last) / (first + last)",
        "drift = 2 * abs(first - last) / (first + last)",
        (VERDICT,),
    ),
    M(
        "the steps' scatter is not noise",
        TRIAL,
        "    noise = drift + scatter\n",
        "    noise = drift\n",
        (f"{TRIAL_TESTS}::test_the_scatter_is_the_median_deviation_of_a_step_from_its_turns_median",),
    ),
    M(
        "the run plan's drift is not noise",
        TRIAL,
        "    noise = drift + scatter\n",
        "    noise = scatter\n",
        (VERDICT,),
    ),
    M(
        "the noise is the larger of the drift and the scatter, not their sum",
        TRIAL,
        "    noise = drift + scatter\n",
        "    noise = max(drift, scatter)\n",
        (
            f"{TRIAL_TESTS}::test_the_noise_is_the_drift_plus_the_scatter_so_a_load_gone_before_the_candidate_is_no_gain",
        ),
    ),
    M("a gain equal to the noise is kept", TRIAL, "    elif gain <= noise:\n", "    elif gain < noise:\n", (VERDICT,)),
    M(
        "the measured gain is not held to min_gain",
        TRIAL,
        "    elif gain < min_gain:\n",
        "    elif False:\n",
        (VERDICT,),
    ),
    M(
        "the run keeps the fastest within the noise",
        TRIAL,
        "    kept = fastest if verdict is TrialVerdict.KEEP else 0\n",
        "    kept = fastest\n",
        (VERDICT,),
    ),
)

MOVE_ROWS: tuple[Mutation, ...] = (
    M(
        "a step's time is this rank's, not its slowest rank's",
        SESSION,
        "            self.times[s] = max(rank_times[s] for rank_times in every)\n",
        "            self.times[s] = every[0][s]\n",
        (CLOSE_CALL,),
        "0.2",
    ),
    M(
        "the CPU runtime never makes the trial's moves",
        MOVE,
        "        target = session.next_move(step)\n",
        "        target = None\n",
        (CLOSE_CALL,),
        "0.2",
    ),
    M(
        "the trial's verdict is not the plan the run trains after it",
        SESSION,
        "                return self.choice.plans[self.outcome.kept]\n",
        "                return self.choice.plans[self.outcome.fastest]\n",
        (
            "tests/runtime/test_replan_session.py",
            CLOSE_CALL,
        ),
        "0.2",
    ),
    M(
        "after the trial the run trains the move the profile proposed, whatever the trial measured",
        SESSION,
        "                return self.choice.plans[self.outcome.kept]\n",
        "                return self.choice.plans[-1]\n",
        (UNDONE,),
        "0.2",
    ),
    M(
        "the schedule steps once more after the move",
        MOVE,
        "state.load_lr_scheduler(scheduler, initial_step=False)",
        "state.load_lr_scheduler(scheduler)",
        (CLOSE_CALL,),
        "0.2",
    ),
    M(
        "the move's checkpoint keeps rank 0's schedule only",
        MOVE,
        "if trainee.scheduler is not None and dist.get_rank(ctx.dp_pg) == 0:",
        "if trainee.scheduler is not None and dist.get_rank(ctx.world_pg) == 0:",
        (CLOSE_CALL,),
        "0.2",
    ),
    M(
        "the new split starts without the moved state",
        MOVE,
        "    state.load_weights(model, ctx, state.source.folder, load_optimizer=True)\n",
        "",
        (CLOSE_CALL,),
        "0.2",
    ),
    M(
        "the optimizer's moments are not moved",
        MOVE,
        "    state.optimizer = optimizer\n    state.load_optimizer(optimizer)\n",
        "    state.optimizer = optimizer\n",
        (CLOSE_CALL,),
        "0.2",
    ),
    M(
        "step 1 is timed into the run's prices",
        SESSION,
        "        return self.first_step < step <= self.decide_after\n",
        "        return step <= self.decide_after\n",
        (CLOSE_CALL,),
        "0.2",
    ),
    M(
        "the move's checkpoint is left behind",
        MOVE,
        "                shutil.rmtree(folder.parent, ignore_errors=True)\n",
        "                pass\n",
        (CLOSE_CALL,),
        "0.2",
    ),
    M(
        "the move's checkpoint is marked complete before every rank wrote",
        MOVE,
        "    state.mark(folder, step, complete=False)\n",
        "    state.mark(folder, step, complete=True)\n",
        (f"{MOVE_TESTS}::test_a_rank_killed_during_a_move_ends_the_run_and_leaves_the_checkpoint_incomplete",),
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
)

LAUNCHER_ROWS: tuple[Mutation, ...] = (
    M(
        "the launcher's move keeps the recorded split",
        LAUNCHER,
        '            resume_plan="replan",\n',
        '            resume_plan="keep",\n',
        (TURNS,),
        "upstream",
    ),
    M(
        "the launcher's move saves no checkpoint off the interval",
        LAUNCHER,
        "if step % checkpoints.checkpoint_interval != 0:",
        "if False:",
        (TURNS,),
        "upstream",
    ),
    M(
        "a checkpoint saved for a move alone stays once superseded",
        LAUNCHER,
        "                if folder != self._resumed:\n",
        "                if False:\n",
        (TURNS,),
        "upstream",
    ),
    M(
        "the launcher never makes the trial's moves",
        LAUNCHER,
        "                target = session.next_move(step - 1)\n",
        "                target = None\n",
        (TURNS,),
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
        "        if after is None or last - step + 1 <= after:\n",
        "        if after is None or last - step + 1 < after:\n",
        (f"{LAUNCHER_TESTS}::test_a_run_of_at_most_k_steps_trains_its_plan_and_says_why",),
        "upstream",
    ),
)

IN_RUN = "nanotron_ext/machine/in_run.py"
IN_RUN_TESTS = "tests/test_in_run.py"
PRICE_ROWS: tuple[Mutation, ...] = (
    M(
        "the in-run profile prices by the mean of every sample",
        IN_RUN,
        "STEP_STATISTIC: Statistic = median_of_steps",
        "STEP_STATISTIC: Statistic = mean_of_samples",
        (f"{IN_RUN_TESTS}::test_the_profile_prices_each_block_by_the_median_of_its_steps",),
    ),
    M(
        "the median of steps is the median of every sample",
        IN_RUN,
        "    return statistics.median(statistics.fmean(step) for step in by_step)\n",
        "    return statistics.median(x for step in by_step for x in step)\n",
        (
            f"{IN_RUN_TESTS}::test_a_figure_is_the_median_over_steps_of_each_steps_mean_so_one_slow_step_moves_it_no_more_than_another",
        ),
    ),
    M(
        "the in-run W is the backward times W over B, multiplied first",
        IN_RUN,
        "        return backward * (base.backward_weight / base.backward)\n",
        "        return backward * base.backward_weight / base.backward\n",
        (
            f"{IN_RUN_TESTS}::test_a_backward_the_standalone_profile_deferred_whole_stays_whole_in_run_not_one_rounding_over",
        ),
    ),
)

MUTATIONS: tuple[Mutation, ...] = CHOICE_ROWS + TRIAL_ROWS + MOVE_ROWS + LAUNCHER_ROWS + PRICE_ROWS
