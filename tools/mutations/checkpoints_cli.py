"""Mutations of checkpoints across plans, their files, --cpu-debug, and the command line's exit codes and
messages."""

from __future__ import annotations

from mutations.base import (
    CLOSED_PIPE,
    COMPARISONS,
    CPU_DEBUG_E2E,
    CPU_STANDINS,
    FILES_E2E,
    FILES_TESTS,
    LAUNCHER,
    LOCATE,
    PLACEMENT,
    RECORD,
    RECORD_TESTS,
    RESHARD,
    RESHARD_TESTS,
    RESUME,
    RESUME_E2E,
    SAVED,
    SIMULATOR,
    VERIFY,
    M,
    Mutation,
)

MUTATIONS: tuple[Mutation, ...] = (
    # --- checkpoints across plans (issue 28) -------------------------------------------------------------------
    M(
        "a saved part is copied to the live tensor's own offsets",
        RESHARD,
        "out[_index(_shift(common, mine.whole, mine.local))]",
        "out[_index(_shift(common, mine.whole, theirs.local))]",
        (RESHARD_TESTS,),
    ),
    M(
        "a saved part is read at the live tensor's offsets",
        RESHARD,
        "                    slot, _shift(common, theirs.whole, theirs.local)\n",
        "                    slot, _shift(common, mine.whole, theirs.local)\n",
        (RESHARD_TESTS,),
    ),
    M(
        "ZeRO-1's dp slices are joined in reverse order",
        SAVED,
        "flat = pieces[0] if len(pieces) == 1 else torch.cat(pieces)",
        "flat = pieces[0] if len(pieces) == 1 else torch.cat(pieces[::-1])",
        (RESHARD_TESTS,),
    ),
    M(
        "a vocabulary shard's state is named by the shard, not as lm_head rows",
        SAVED,
        "    return LM_HEAD if vocab_shard_index(name) is not None else name",
        "    return name",
        (RESHARD_TESTS,),
    ),
    M(
        "optimizer state of the part is taken by position",
        RESHARD,
        "state[entry.index] = {key: _live(_optimizer_tensor(saved, entry.need, key), entry) for key in keys}",
        "state[entry.index] = {key: _live(_optimizer_tensor(saved, live.entries[-1 - entry.index].need, key), entry) "
        "for key in keys}",
        (RESHARD_TESTS,),
    ),
    M(
        "saved parameters without a place are dropped silently",
        PLACEMENT,
        "        if left and d == 0:",
        "        if left and d < 0:",
        (RESHARD_TESTS,),
    ),
    M(
        "an untied parameter may be placed twice",
        PLACEMENT,
        "if len(distinct) < len(held) and not all(n.tied for n in held):",
        "if len(distinct) < len(held) and all(n.tied for n in held):",
        (RESHARD_TESTS,),
    ),
    M(
        "a trainable parameter without saved moments gets none",
        PLACEMENT,
        "            if (n.name, slot.key) not in sources:",
        "            if False:",
        (RESHARD_TESTS,),
    ),
    M(
        "a checkpoint marked incomplete is loaded",
        LOCATE,
        "    if record is not None and not record.complete:",
        "    if False:",
        (RECORD_TESTS,),
    ),
    M(
        "an empty latest.txt is taken for step 0",
        LOCATE,
        "        if not text.isdigit():",
        "        if text and not text.isdigit():",
        (RECORD_TESTS,),
    ),
    M(
        "a chain's state is read by position under the same split",
        RECORD,
        (
            "        return (\n"
            "            (self.blocks, self.stages, self.pp, self.tp, self.vocab_bounds, self.zero_stage)\n"
            "            == (now.blocks, now.stages, now.pp, now.tp, now.vocab_bounds, now.zero_stage)\n"
            "            and (self.zero_stage == 0 or self.dp == now.dp)\n"
            "            and not self.vocab_bounds\n"
            "        )\n"
        ),
        (
            "        return (self.blocks, self.stages, self.pp, self.tp, self.vocab_bounds, self.zero_stage) == (\n"
            "            now.blocks,\n"
            "            now.stages,\n"
            "            now.pp,\n"
            "            now.tp,\n"
            "            now.vocab_bounds,\n"
            "            now.zero_stage,\n"
            "        ) and (self.zero_stage == 0 or self.dp == now.dp)\n"
        ),
        (RECORD_TESTS,),
    ),
    M(
        "the recorded split is kept at another pp",
        RESUME,
        "    if record.pp != cfg.run.pp:\n",
        "    if False:\n",
        (RECORD_TESTS,),
    ),
    M(
        "replan keeps the recorded vocabulary shards",
        RESUME,
        'mode == "replan" or cfg.ext.vocab_shards != "auto"',
        'cfg.ext.vocab_shards != "auto"',
        (RECORD_TESTS,),
    ),
    M(
        "the dummy data restarts on a resume",
        "nanotron_ext/integration/dummy_data.py",
        "consumed = _consumed(current[-1]) if current else 0",
        "consumed = 0",
        (f"{RESUME_E2E}::test_resuming_under_plan_a_through_nanotrons_own_loader_is_the_uninterrupted_run",),
        "upstream",
    ),
    M(
        "a chain is saved under vocab_shards/",
        "nanotron_ext/integration/checkpoint_hooks.py",
        "        state.save_chain_as_lm_head(model, parallel_context, Path(root_folder))\n",
        "",
        (f"{RESUME_E2E}::test_a_chain_checkpoint_is_a_nanotron_checkpoint",),
        "upstream",
    ),
    M(
        "a checkpoint is never marked complete",
        "nanotron_ext/integration/checkpoints.py",
        "        self.mark(folder, step, complete=True, files=files)",
        "        self.mark(folder, step, complete=False, files=files)",
        (f"{RESUME_E2E}::test_the_plan_travels_with_every_checkpoint",),
        "upstream",
    ),
    # --- issue 44: a checkpoint proves its files before anything loads --------------------------------------------
    M(
        "a resume skips the check of the checkpoint's files",
        "nanotron_ext/integration/checkpoint_hooks.py",
        "state.verified = verify_on_every_rank(state.source, state.world_pg, state.say).verified",
        "state.verified = False",
        (f"{FILES_E2E}::test_damaged_files_stop_every_rank_before_anything_loads_naming_each",),
        "upstream",
    ),
    M(
        "plan --checkpoint skips the check of the checkpoint's files",
        "nanotron_ext/cli/resume.py",
        "    verdict = verify_checkpoint(source)",
        "    verdict = verify_checkpoint(type(source)(source.folder, source.step, None))",
        (f"{FILES_TESTS}::test_plan_checkpoint_runs_the_resumes_check_and_exits_non_zero_on_a_damaged_file",),
    ),
    M(
        "a file's size is not compared",
        VERIFY,
        "            if size != file.size:",
        "            if False:",
        (FILES_TESTS,),
    ),
    M(
        "a file's checksum is not compared",
        VERIFY,
        "                if found != file.checksum:",
        "                if False:",
        (FILES_TESTS,),
    ),
    M(
        "the checkpoint named instead may be a newer one",
        VERIFY,
        "complete_checkpoints(source.folder.parent, before=source.step)",
        "complete_checkpoints(source.folder.parent, before=None)",
        (FILES_TESTS,),
    ),
    M(
        "a file that no writer hashed is left out of the record",
        "nanotron_ext/integration/checkpoint_io.py",
        "            if relative not in recorded and relative != RECORD_FILE",
        "            if False and relative != RECORD_FILE",
        (FILES_TESTS,),
    ),
    M(
        "the record is written before model_config.json",
        "nanotron_ext/integration/checkpoint_hooks.py",
        "            state.complete(folder, self.iteration_step, self.parallel_context.world_pg, last=True)\n",
        "",
        (
            f"{FILES_E2E}::test_every_file_the_save_wrote_is_listed_with_its_size_and_checksum_and_the_record_is_"
            f"written_last",
        ),
        "upstream",
    ),
    M(
        "a load failure exits 1, as a plan that cannot train",
        "nanotron_ext/integration/checkpoint_io.py",
        (
            "        raise CheckpointLoadFailure(\n"
            "            load_failure_message(source, failed, verified=verified(), instead=instead)\n"
            "        ) from error\n"
        ),
        "        raise NanotronExtError(load_failure_message(source, failed, verified=verified(), instead=instead)) from error\n",
        (f"{FILES_E2E}::test_a_file_that_fails_to_load_stops_every_rank_with_a_load_failure_naming_it",),
        "upstream",
    ),
    M(
        "a load failure stops only the rank it happened on",
        "nanotron_ext/integration/checkpoint_io.py",
        "        if not failed:\n            return out",
        "        if mine is None:\n            return out",
        (f"{FILES_E2E}::test_a_file_that_fails_to_load_stops_every_rank_with_a_load_failure_naming_it",),
        "upstream",
    ),
    # --- issue 44: resume on a laptop (--cpu-debug), exactly ------------------------------------------------------
    M(
        "the launcher leaves Nanotron's per-rank clipping",
        LAUNCHER,
        "    install_split_independent_clipping(patches, trainer)\n",
        "",
        (
            "tests/test_launcher_cli.py::test_launcher_installs_into_nanotrons_own_trainer_and_loader",
            f"{CPU_DEBUG_E2E}::test_the_laptop_example_resumes_under_another_pp_and_split_bit_identically",
        ),
        "upstream",
    ),
    M(
        "the launcher installs the stand-ins without the flag",
        "nanotron_ext/run.py",
        "    if opts.cpu_debug:  # before",
        "    if True:  # before",
        (f"{CPU_DEBUG_E2E}::test_without_the_flag_no_standin_is_importable_and_with_it_the_script_runs_on_them",),
        "upstream",
    ),
    M(
        "an installed flash_attn wins over the stand-in",
        CPU_STANDINS,
        "        sys.path.insert(0, folder)",
        "        sys.path.append(folder)",
        (f"{CPU_DEBUG_E2E}::test_without_the_flag_no_standin_is_importable_and_with_it_the_script_runs_on_them",),
        "upstream",
    ),
    M(
        "every rank prints the debugging banner",
        "nanotron_ext/run.py",
        "if rank0 else (lambda line: None)",
        "if True else (lambda line: None)",
        (f"{CPU_DEBUG_E2E}::test_the_flag_says_once_that_the_run_is_for_debugging",),
        "upstream",
    ),
    M(
        "--cpu-debug runs on Nanotron 0.2",
        CPU_STANDINS,
        "    if not _installed_nanotron_is_upstream():",
        "    if False:",
        ("tests/test_cpu_debug_flag.py",),
        "0.2",
    ),
    # --- issue 29: one figure, one meaning; a command line that behaves like a Unix tool ---------------------
    M(
        "a tied weight is counted twice on its stage",
        "nanotron_ext/plan/make.py",
        "held_parameters(members, cfg.model.tie_word_embeddings)",
        "held_parameters(members, False)",
        ("tests/test_cli.py::test_a_tied_weight_is_counted_once",),
    ),
    M(
        "a frozen-only stage's fix ignores allow_frozen_stages",
        "nanotron_ext/strategies/fixes.py",
        "    if cfg.ext.allow_frozen_stages:\n",
        "    if False:\n",
        ("tests/test_cli.py::test_frozen_stages_allowed_get_no_fix_to_set_what_is_set_and_a_verdict_that_says_so",),
    ),
    M(
        "the cap's fix names the 1f1b engine under 1f1b",
        "nanotron_ext/strategies/fixes.py",
        '    if run.engine == "afab":',
        "    if True:",
        ("tests/test_strategies.py::test_the_caps_fix_names_the_1f1b_engine_only_to_an_afab_run",),
    ),
    M(
        "a closed pipe is an unexpected error",
        "nanotron_ext/cli/failure.py",
        "    if isinstance(exc, BrokenPipeError) and reader_left():",
        "    if False:",
        (f"{CLOSED_PIPE}::test_a_broken_pipe_is_a_closed_output_only_when_the_reader_of_stdout_left",),
    ),
    # --- issue 44: exit codes and messages that hold every time ------------------------------------------------
    M(
        "any broken pipe is a reader that left",
        "nanotron_ext/cli/failure.py",
        "    if isinstance(exc, BrokenPipeError) and reader_left():",
        "    if isinstance(exc, BrokenPipeError):",
        (f"{CLOSED_PIPE}::test_a_broken_pipe_is_a_closed_output_only_when_the_reader_of_stdout_left",),
    ),
    M(
        "the output is written as it is printed",
        "nanotron_ext/cli/output.py",
        "        if not interactive:\n",
        "        if False:\n",
        (f"{CLOSED_PIPE}::test_the_output_is_written_once_at_the_end",),
    ),
    M(
        "train's progress is held to the end",
        "nanotron_ext/cli/__init__.py",
        '    if not getattr(args, "whole_output", False):  # train and calibrate stream their progress\n'
        "        output.release()\n",
        "",
        (f"{CLOSED_PIPE}::test_reports_are_held_and_progress_streams",),
    ),
    M(
        "plan's report goes out line by line",
        "nanotron_ext/cli/plan.py",
        "p.set_defaults(func=cmd_plan, whole_output=True)",
        "p.set_defaults(func=cmd_plan)",
        (f"{CLOSED_PIPE}::test_reports_are_held_and_progress_streams",),
    ),
    M(
        "the held output is flushed again after the reader left",
        "nanotron_ext/cli/__init__.py",
        "    except BrokenPipeError:  # the reader left before the output was written\n        drop_output()\n",
        "    except BrokenPipeError:  # the reader left before the output was written\n",
        (f"{CLOSED_PIPE}::test_every_command_ends_141_when_the_reader_is_gone_and_its_own_code_when_it_read",),
    ),
    M(
        "a full disk is a traceback",
        "nanotron_ext/cli/__init__.py",
        "    except OSError as exc:  # the output could not be written",
        "    except ZeroDivisionError as exc:  # x",
        (f"{CLOSED_PIPE}::test_an_output_that_cannot_be_written_is_one_line_and_exit_3",),
    ),
    M(
        "--micro-batches is a bare int",
        "nanotron_ext/cli/common.py",
        "            type=positive_int,\n",
        "            type=int,\n",
        ("tests/test_user_errors.py::test_every_numeric_flag_is_checked_where_it_is_parsed",),
    ),
    M(
        "a negative seed reaches the runtime",
        "nanotron_ext/cli/train.py",
        '"--seed", type=non_negative_int,',
        '"--seed", type=int,',
        ("tests/test_user_errors.py::test_a_bad_flag_value_is_one_line_naming_the_flag",),
    ),
    M(
        "a usage error prints the usage first",
        "nanotron_ext/cli/common.py",
        '        line = f"{self.prog}: error: {message} ({where})"\n',
        "        super().error(message)\n",
        ("tests/test_user_errors.py::test_usage_errors_are_one_line_with_where_the_flags_are",),
    ),
    M(
        "an override's error does not name its flags",
        "nanotron_ext/cli/common.py",
        'raise ConfigError(f"{flags}: {exc}") from exc',
        "raise",
        ("tests/test_user_errors.py::test_flags_the_config_refuses_are_named_before_its_message",),
    ),
    M(
        "calibrate's counts are named by their parameter",
        "nanotron_ext/machine/calibrate.py",
        '                f"calibrate: --{name}={value!r} must be an integer >= {least} (e.g. --warmup 2 "\n',
        '                f"calibrate: {name}={value!r} must be an integer >= {least} (e.g. --warmup 2 "\n',
        ("tests/test_user_errors.py::test_calibrates_counts_name_their_flag",),
    ),
    M(
        "docs/cli.md leaves out a flag --help lists",
        "docs/cli.md",
        " [--replan-after K] [--device cpu\\|cuda]` |",
        " [--replan-after K]` |",
        ("tests/test_docs.py::test_every_flag_of_every_subcommand_is_in_the_docs_with_its_choices",),
    ),
    M(
        "docs/cli.md lists other choices than --engine takes",
        "docs/cli.md",
        "[--engine afab\\|1f1b\\|zb1p\\|zb2p\\|zbv\\|auto] [--micro-batches N] [--compare] [--json]",
        "[--engine afab\\|1f1b\\|zb1p\\|zbv\\|auto] [--micro-batches N] [--compare] [--json]",
        ("tests/test_docs.py::test_every_flag_of_every_subcommand_is_in_the_docs_with_its_choices",),
    ),
    M(
        "docs/cli.md's --compare-engines leaves out zb2p",
        "docs/cli.md",
        "planned under each of `1f1b`, `zb1p`, `zb2p` and `zbv`",
        "planned under each of `1f1b`, `zb1p` and `zbv`",
        ("tests/test_docs.py::test_the_docs_name_the_engines_and_strategies_the_command_line_takes",),
    ),
    M(
        "the simulator's summary prints the pipeline part as the bubble",
        SIMULATOR,
        '+ f", bubble={self.bubble_fraction:.1%} "',
        '+ f", bubble={self.pipeline_bubble_fraction:.1%} "',
        (
            "tests/test_simulate_cli.py::test_the_simulators_own_summary_names_the_steps_bubble_and_the_pipeline_parts_apart",
        ),
    ),
    M(
        "the simulator's summary prints the bubble as the pipeline part",
        SIMULATOR,
        '(f"(pipeline part {self.pipeline_bubble_fraction:.1%}, "',
        '(f"(pipeline part {self.bubble_fraction:.1%}, "',
        (
            "tests/test_simulate_cli.py::test_the_simulators_own_summary_names_the_steps_bubble_and_the_pipeline_parts_apart",
        ),
    ),
    M(
        "simulate's bubble line prints the pipeline part for the step's",
        "nanotron_ext/cli/simulate.py",
        'f"with the update, bubble {result.bubble_fraction:.1%}; "',
        'f"with the update, bubble {result.pipeline_bubble_fraction:.1%}; "',
        ("tests/test_simulate_cli.py::test_the_summary_lines_print_the_simulations_own_step_and_bubbles",),
    ),
    M(
        "plan's Nanotron line keeps quiet about a split that does not fit",
        "nanotron_ext/cli/plan_step.py",
        "                f\"{speed_cell(rule, result.step_time)} as fast{'; ' + caveat if caveat else ''}\"\n",
        '                f"{speed_cell(rule, result.step_time)} as fast"\n',
        (f"{COMPARISONS}::test_the_nanotron_line_says_that_nanotrons_split_does_not_fit",),
    ),
    M(
        "simulate's Nanotron line keeps quiet about a split that cannot train",
        "nanotron_ext/cli/simulate.py",
        "            f\"{speed_cell(rule, chosen)} as fast{'; ' + caveat if caveat else ''}\"\n",
        '            f"{speed_cell(rule, chosen)} as fast"\n',
        (f"{COMPARISONS}::test_the_nanotron_line_says_that_nanotrons_split_cannot_train",),
    ),
    M(
        "a split over the memory is named by its last stage over",
        "nanotron_ext/plan/compare.py",
        "worst = max((plan.stages[k] for k in where), key=lambda s: s.memory_bytes)",
        "worst = plan.stages[where[-1]]",
        (f"{COMPARISONS}::test_compare_engines_says_when_the_1f1b_plan_it_compares_with_does_not_fit",),
    ),
    M(
        "--compare-engines keeps quiet about a 1f1b plan that does not fit",
        "nanotron_ext/cli/plan_compare.py",
        "        if base is not None and caveat:\n",
        "        if False:\n",
        (f"{COMPARISONS}::test_compare_engines_says_when_the_1f1b_plan_it_compares_with_does_not_fit",),
    ),
    M(
        "the frozen tradeoff keeps quiet about a plan that does not fit",
        "nanotron_ext/cli/plan_compare.py",
        (
            "    return (\n"
            '        "\\n"\n'
            '        + titled_table("frozen setup: what a trainable block on every stage costs", head, rows, notes)\n'
            '        + (f"\\nvs frozen allowed: {caveat}" if caveat else "")\n'
            "    )\n"
        ),
        '    return "\\n" + titled_table("frozen setup: what a trainable block on every stage costs", head, rows, notes)\n',
        (f"{COMPARISONS}::test_the_frozen_tradeoff_says_when_the_plan_with_frozen_stages_does_not_fit",),
    ),
    M(
        "the best valid split ignores the memory",
        "nanotron_ext/plan/compare.py",
        'cfg.with_overrides(objective="slowest_stage", base_strategy="flops")',
        'cfg.with_overrides(objective="slowest_stage", base_strategy="flops", memory_cap_gib=1e9)',
        (f"{COMPARISONS}::test_vs_best_valid_is_the_lightest_slowest_stage_of_any_split_that_can_train",),
    ),
    M(
        "the best valid split may be one that cannot train",
        "nanotron_ext/plan/compare.py",
        '    return None if any(f.severity == "error" and f.stage is not None for f in plan.findings) else plan',
        "    return plan",
        (f"{COMPARISONS}::test_vs_best_valid_is_a_dash_when_no_split_can_train",),
    ),
    M(
        "vs optimum is the FLOP optimum of any split",
        "nanotron_ext/cli/plan_compare.py",
        "                best_valid_cell(best, plan),\n",
        "                speed_cell(plan.optimum_flops, plan.slowest_flops),\n",
        (f"{COMPARISONS}::test_vs_best_valid_is_the_lightest_slowest_stage_of_any_split_that_can_train",),
    ),
    M(
        "simulate's vs best counts plans that cannot train",
        "nanotron_ext/cli/simulate.py",
        "if r is not None and p is not None and p.ok]",
        "if r is not None]",
        (f"{COMPARISONS}::test_simulate_vs_best_is_the_fastest_plan_that_can_train",),
    ),
    M(
        "vs best is this step over the best's",
        "nanotron_ext/cli/simulate.py",
        "speed_cell(best, result.step_time)",
        "speed_cell(result.step_time, best)",
        ("tests/test_simulate_cli.py::test_simulate_compare_table_and_stage_loads",),
    ),
    M(
        "plan prints the bubble formula, not the simulated bubble",
        "nanotron_ext/cli/plan_step.py",
        'bubble {result.bubble_fraction:.1%} "',
        'bubble {plan.bubble_estimate:.1%} "',
        ("tests/test_cli.py::test_plan_and_simulate_give_the_same_step_and_bubble",),
    ),
    M(
        "an error cell is cut",
        "nanotron_ext/cli/common.py",
        'return f"{what} {notes.tag(error)}"',
        'return f"{what}: {str(error)[:20]}…"',
        ("tests/test_cli.py::test_compare_table_lists_every_strategy",),
    ),
    M(
        "a rank other than 0 repeats every warning",
        "nanotron_ext/cli/train.py",
        "    quiet_repeated_warnings(rank)\n",
        "",
        ("tests/test_cli.py::test_train_ranks_but_0_print_no_warning_every_rank_prints",),
    ),
    # --- a rank exits with its own code, not gloo's abort at the interpreter's exit (seen twice in CI) ----------
    M(
        "the launcher leaves the process groups to the interpreter's exit",
        "nanotron_ext/run.py",
        "    close_process_groups(code)\n",
        "",
        (
            "tests/runtime/test_launcher_exit.py::test_the_launcher_closes_the_process_groups_before_the_interpreters_exit",
        ),
    ),
    M(
        "the launcher closes the process groups only after a clean run",
        "nanotron_ext/run.py",
        "    closing = threading.Thread(",
        "    return\n    closing = threading.Thread(",
        (
            "tests/runtime/test_launcher_exit.py::test_the_launcher_closes_the_process_groups_before_the_interpreters_exit",
        ),
    ),
    M(
        "after an error the launcher waits on a close that blocks",
        "nanotron_ext/run.py",
        "        os._exit(code)",
        "        pass",
        (
            "tests/runtime/test_launcher_exit.py::test_the_launcher_closes_the_process_groups_before_the_interpreters_exit",
        ),
    ),
    M(
        "the launcher's exit skips the atexit handlers",
        "nanotron_ext/procs.py",
        "    atexit._run_exitfuncs()\n",
        "",
        (
            "tests/runtime/test_launcher_exit.py::test_the_launcher_ends_a_rank_as_the_interpreter_would_with_the_scripts_code",
        ),
    ),
    M(
        "the launcher's exit kills a running thread",
        "nanotron_ext/procs.py",
        "            thread.join()\n",
        "            pass\n",
        (
            "tests/runtime/test_launcher_exit.py::test_the_launcher_ends_a_rank_as_the_interpreter_would_with_the_scripts_code",
        ),
    ),
    M(
        "a rank stopped by our error in the script exits without waiting for its peers",
        "nanotron_ext/cli/failure.py",
        "    wait_for_peers_to_report(store)\n    return code\n",
        "    return code\n",
        ("tests/runtime/test_launcher_exit.py::test_every_rank_reports_why_it_stops_even_when_one_is_slow_to_say_it",),
    ),
    M(
        "under torchrun the peers' report is not counted on the agent's store",
        "nanotron_ext/cli/failure.py",
        '    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":\n        return None',
        "    if True:\n        return None",
        ("tests/runtime/test_launcher_exit.py::test_every_rank_reports_why_it_stops_even_when_one_is_slow_to_say_it",),
    ),
    M(
        "a rank waits for the first report only, not for every peer's",
        "nanotron_ext/cli/failure.py",
        "            while reported < world and",
        "            while reported < 1 and",
        ("tests/runtime/test_launcher_exit.py::test_every_rank_reports_why_it_stops_even_when_one_is_slow_to_say_it",),
    ),
    M(
        "the peers' report is a fixed grace, not a barrier",
        "nanotron_ext/cli/failure.py",
        '    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":',
        "    if False:",
        ("tests/runtime/test_launcher_exit.py::test_every_rank_reports_why_it_stops_even_when_one_is_slow_to_say_it",),
    ),
    M(
        "a free port is drawn from the ephemeral range",
        "nanotron_ext/procs.py",
        "    for _ in range(64 if high > low else 0):",
        "    for _ in range(0):",
        ("tests/runtime/test_procs.py::test_a_free_port_is_bindable_and_outside_the_range_the_kernel_hands_out",),
        "0.2",
    ),
    # --- issue 55: a V's checkpoint explained, one job one message, small things ---------------------------------
    M(
        "plan --checkpoint refuses a checkpoint without a plan record",
        "nanotron_ext/cli/resume.py",
        "    verdict = verify_checkpoint(source)  # the resume's own check, in one process\n",
        "    if source.record is None:\n        raise CheckpointError('no plan record')\n"
        "    verdict = verify_checkpoint(source)  # the resume's own check, in one process\n",
        (
            "tests/test_checkpoint_record.py::test_plan_checkpoint_without_a_plan_record_notes_how_the_launcher_resumes_it",
        ),
    ),
    M(
        "plan --checkpoint plans the resume as contiguous stages under zbv",
        "nanotron_ext/cli/resume.py",
        "choose_plan(plan_for(blocks, cfg),",
        "choose_plan(plan_for(blocks, cfg.with_overrides(engine='zb1p')),",
        ("tests/test_checkpoint_record.py::test_plan_checkpoint_of_a_v_under_zbv_keeps_its_chunks_or_replans_them",),
    ),
    M(
        "every rank prints our error under torchrun",
        "nanotron_ext/cli/failure.py",
        "    if store is None or _first_to_say(store):\n",
        "    if True:\n",
        (
            "tests/runtime/test_job_errors.py::test_a_replan_setting_the_launcher_refuses_is_one_message_named_as_torchruns_root_cause",
        ),
    ),
    M(
        "no rank writes torchelastic's error file",
        "nanotron_ext/cli/failure.py",
        "    written = _write_error_file(message, callstack or message)\n",
        "    written = False\n",
        (
            "tests/runtime/test_job_errors.py::test_a_config_error_on_the_ranks_of_train_is_one_message_named_as_torchruns_root_cause",
        ),
    ),
    M(
        "a message of several lines is printed whole under torchrun",
        "nanotron_ext/cli/failure.py",
        "        if written and rest:\n",
        "        if False:\n",
        (
            "tests/runtime/test_job_errors.py::test_a_message_of_several_lines_prints_its_first_and_torchruns_summary_holds_the_rest",
        ),
    ),
    M(
        "an output's missing folder is made silently",
        "nanotron_ext/outputs.py",
        "    if not parent.is_dir():\n",
        "    parent.mkdir(parents=True, exist_ok=True)\n    if not parent.is_dir():\n",
        ("tests/test_bad_input.py::test_an_output_into_a_missing_folder_is_refused_and_no_folder_is_made",),
    ),
    M(
        "a number's error gives no example",
        "nanotron_ext/config_ext.py",
        "{key}: {example:g}, or null for {otherwise}",
        "or null for {otherwise}",
        ("tests/test_user_errors.py::test_every_number_error_gives_an_example_value",),
    ),
    M(
        "a layout error does not name its source",
        "nanotron_ext/strategies/builtin.py",
        "        ranks = layout_ranks(layout_of(cfg), [b.role for b in blocks], source=layout_source(cfg))",
        "        ranks = layout_ranks(layout_of(cfg), [b.role for b in blocks])",
        ("tests/test_bad_input.py::test_bad_input",),
    ),
    M(
        "the launcher writes a checkpoint twice where Nanotron saves it twice",
        "nanotron_ext/integration/checkpoint_hooks.py",
        "        if state.last_saved == self.iteration_step:\n",
        "        if False:\n",
        (
            "tests/upstream/test_resume_files.py::test_every_file_the_save_wrote_is_listed_with_its_size_and_checksum_and_the_record_is_written_last",
        ),
        "upstream",
    ),
)
