"""Mutation check: do the tests catch small, plausible bugs? Not part of CI; re-run it after changing the
validator, freezing, the collective check, profiling, the partitioner or the simulator.

Each mutation is (file, exact old text, new text, the tests to run). The script copies the repository to a
temporary folder (``git archive HEAD`` by default, so that what is checked is the committed code and never
someone's half-done edit; ``--worktree`` copies the working tree instead), checks that the selected tests pass
there unmutated, then applies one mutation at a time to the copy, runs ``python -m pytest -x -q SELECTION`` in
it with this interpreter, and restores the file. The repository itself is never written.

The copy's package must be the one imported: the virtual environment has an editable install pointing at the
original checkout, so ``PYTHONPATH`` is set to the copy (setuptools' editable finder comes after ``PYTHONPATH``
on ``sys.meta_path``; the script checks it), and the spawned test ranks put the copy first as well.

Some tests run against only one Nanotron (``tests/conftest.py``): each mutation names the pass its tests run in
(``nanotron``: ``any``, ``0.2`` or ``upstream``). The script runs the mutations of the Nanotron installed in the
interpreter that runs it and lists the others as left for the other pass, so run it once per environment (the
upstream one with ``tests/upstream_stubs`` on ``PYTHONPATH``, as CI does; ``--only`` to run a few). The copy
sits beside a link to the project's ``../shared`` so that the upstream tests find upstream's checkout.

Usage: ``python tools/mutate.py [--only SUBSTRING] [--worktree] [--keep]``; exit 1 if a mutation survives, cannot
be applied, or its tests collect nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: A mutation that runs longer than this is stopped and reported as TIMEOUT (the spawn helper's own deadlines are
#: well below it, so a hang there fails the test first).
MUTATION_TIMEOUT_S = 300


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    nanotron: str = "any"  # the pass its tests run in: "any", "0.2" or "upstream" (tests/conftest.py)


M = Mutation
VALIDATE = "nanotron_ext/plan/validate.py"
FREEZE = "nanotron_ext/inventory/freeze.py"
CHECKS = "nanotron_ext/integration/checks.py"
MEASURED = "nanotron_ext/costs/profiled.py"
SEND_ORDER = "nanotron_ext/runtime/send_order.py"
GPU_PATH_TESTS = "tests/test_gpu_path_memory.py"
GPU_MEMORY = "nanotron_ext/costs/gpu_memory.py"
OPTIMAL = "nanotron_ext/partition/optimal.py"
FEASIBLE = "nanotron_ext/partition/feasible.py"
SCHEDULE_AWARE = "nanotron_ext/partition/schedule_aware.py"
SHORTCUTS = "tests/test_search_shortcuts.py"
RULE = "nanotron_ext/partition/nanotron_rule.py"
SIMULATOR = "nanotron_ext/schedule/simulator.py"
PROGRAMS = "nanotron_ext/schedule/programs.py"
VOCAB = "nanotron_ext/models/vocab_chain.py"
LLAMA = "nanotron_ext/models/llama.py"
ENGINE = "nanotron_ext/runtime/engine.py"
CHAIN = "tests/runtime/test_vocab_chain.py"
STEP_TIME = "nanotron_ext/partition/step_time_bound.py"
STRATEGIES = "nanotron_ext/strategies/builtin.py"
MEMORY = "nanotron_ext/costs/memory_estimate.py"
LAUNCHER = "nanotron_ext/integration/trainer_patches.py"
CONFIG_KEYS = "nanotron_ext/config_keys.py"
PRICING = "nanotron_ext/machine/pricing.py"
PROFILE = "nanotron_ext/machine/profile.py"
MACHINE_TESTS = "tests/test_machine_pricing.py"
RESHARD = "nanotron_ext/checkpoint/reshard.py"
SAVED = "nanotron_ext/checkpoint/saved.py"
COMPARISONS = "tests/test_comparisons.py"
CLOSED_PIPE = "tests/test_closed_pipe.py"
PLACEMENT = "nanotron_ext/checkpoint/placement.py"
RECORD = "nanotron_ext/checkpoint/record.py"
LOCATE = "nanotron_ext/checkpoint/locate.py"
RESUME = "nanotron_ext/checkpoint/resume.py"
RESHARD_TESTS = "tests/test_checkpoint_reshard.py"
RECORD_TESTS = "tests/test_checkpoint_record.py"
RESUME_E2E = "tests/upstream/test_resume.py"
CPU_DEBUG_E2E = "tests/upstream/test_cpu_debug.py"
CPU_STANDINS = "nanotron_ext/integration/cpu_standins/__init__.py"
FILES_E2E = "tests/upstream/test_resume_files.py"
FILES_TESTS = "tests/test_checkpoint_files.py"
VERIFY = "nanotron_ext/checkpoint/verify.py"
IN_RUN = "benchmarks/_in_run_ops.py"
SPLIT = "nanotron_ext/costs/split_backward.py"
SPLIT_TESTS = "tests/runtime/test_split_backward.py"
IN_RUN_TESTS = "tests/test_in_run_ops.py"

MUTATIONS: tuple[Mutation, ...] = (
    # --- the four that survived in issue 14 ----------------------------------------------------------------
    M("no-trainable is always a warning", VALIDATE,
      'severity: Severity = "warning" if cfg.ext.allow_frozen_stages else "error"',
      'severity: Severity = "warning"',
      ("tests/test_strategies.py", "tests/test_freeze.py")),
    M("freeze patterns ignore module paths", FREEZE,
      "        or fnmatchcase(block.name, pattern)\n", "",
      ("tests/test_freeze.py",)),
    M("collective check tests params, not trainable", CHECKS,
      'bad = [r for r in rows if r["trainable"] == 0]', 'bad = [r for r in rows if r["params"] == 0]',
      ("tests/runtime/test_integration.py",), "0.2"),
    M("rank 0 re-raises its profiling error", MEASURED,
      '            payload[0] = {"error": f"{type(exc).__name__}: {exc}"}\n', "            raise\n",
      ("tests/runtime/test_profiled.py::test_rank0_profiling_failure_raises_on_every_rank",), "0.2"),
    # --- partitioner ---------------------------------------------------------------------------------------
    M("partitioner allows empty stages", OPTIMAL,
      "base = idx[:, None] < idx[None, :]  # non-empty", "base = idx[:, None] <= idx[None, :]  # non-empty",
      ("tests/test_partition.py",)),
    M("partitioner ignores per-stage requirements", OPTIMAL,
      "base = base & ((fp[None, :] - fp[:, None]) >= 1)", "base = base & ((fp[None, :] - fp[:, None]) >= 0)",
      ("tests/test_partition.py",)),
    M("partitioner skips the evenness tie-break", OPTIMAL,
      '_, bounds = _dp(pp, n, seg, valid, combine="sumsq", cap=bound)',
      '_, bounds = _dp(pp, n, seg, valid, combine="max", cap=bound)',
      ("tests/test_partition.py",)),
    M("partitioner ignores the memory cap", OPTIMAL,
      "        return base & ((q[None, :] - q[:, None]) <= limit)\n", "        return base\n",
      ("tests/test_partition.py", "tests/test_strategies.py")),
    # --- Nanotron's rule -----------------------------------------------------------------------------------
    M("Nanotron's rule moves on at equality", RULE,
      "if c > thresholds[idx]:", "if c >= thresholds[idx]:",
      ("tests/test_strategies.py", "tests/test_partition.py")),
    M("Nanotron's rule compares before assigning", RULE,
      "        ranks.append(idx)\n        if c > thresholds[idx]:\n            idx += 1\n",
      "        if c > thresholds[idx]:\n            idx += 1\n        ranks.append(idx)\n",
      ("tests/test_strategies.py", "tests/test_partition.py")),
    # --- validator -----------------------------------------------------------------------------------------
    M("too few 1F1B micro-batches is only a warning", VALIDATE,
      'Finding("error" if shortfall.fatal else "warning", "few-micro-batches"', 'Finding("warning", "few-micro-batches"',
      ("tests/test_validate.py", "tests/test_strategies.py")),
    M("memory cap compared in bytes, not GiB", "nanotron_ext/machine/memory_limit.py",
      'MemoryLimit(cap * GIB, "cap"', 'MemoryLimit(cap * 1e9, "cap"', ("tests/test_validate.py", "tests/test_strategies.py")),
    # --- freezing ------------------------------------------------------------------------------------------
    M("unfreeze_last_decoder_layers thaws the first layers", FREEZE,
      "last = decoders[-spec.unfreeze_last_decoder_layers :]", "last = decoders[: spec.unfreeze_last_decoder_layers]",
      ("tests/test_freeze.py",)),
    M("tied weights checked one way only", FREEZE,
      "if (a in frozen) != (b in frozen):", "if (a in frozen) and (b not in frozen):",
      ("tests/test_freeze.py",)),
    # --- simulator schedule --------------------------------------------------------------------------------
    M("1F1B runs one warm-up forward too many", PROGRAMS,
      "    base = pp - stage - 1\n", "    base = pp - stage\n",
      ("tests/test_simulate.py",)),
    M("a receive does not wait for its send", SIMULATOR,
      "clock[s] = max(clock[s], sent) + p2p_times[min(s, s + action.peer)]",
      "clock[s] = clock[s] + p2p_times[min(s, s + action.peer)]",
      ("tests/test_simulate.py",)),
    M("the update of every stage adds up", SIMULATOR,
      "step_time = pipeline_time + max(st.update for st in stages)",
      "step_time = pipeline_time + sum(st.update for st in stages)",
      ("tests/test_simulate.py",)),
    # --- collective check ----------------------------------------------------------------------------------
    M("collective check ignores allow_frozen_stages", CHECKS,
      "if bad and not allow_frozen_stages:", "if bad:",
      ("tests/runtime/test_integration.py",), "0.2"),
    M("collective check counts frozen weights as trainable", CHECKS,
      '"trainable": sum(p.numel() for p in unwrapped.parameters() if p.requires_grad),',
      '"trainable": sum(p.numel() for p in unwrapped.parameters()),',
      ("tests/runtime/test_integration.py",), "0.2"),
    # --- profiling -----------------------------------------------------------------------------------------
    M("profiler keeps the last warm-up run", MEASURED,
      "run.once(cfg, device, timed=r >= warmup)", "run.once(cfg, device, timed=r >= warmup - 1)",
      ("tests/runtime/test_profiled.py",), "0.2"),
    M("profiler keys a block by its own trainability", MEASURED,
      "for b, g in zip(blocks, trainable_before(blocks))]", "for b, g in zip(blocks, trainable_before(blocks)[1:])]",
      ("tests/runtime/test_profiled.py",), "0.2"),
    M("every rank measures for itself", MEASURED,
      "    if dist.get_rank() == 0:\n        try:\n            timings = profile_blocks(",
      "    if True:\n        try:\n            timings = profile_blocks(",
      ("tests/runtime/test_profiled.py::test_same_plan_on_every_rank_when_one_rank_measures_differently",), "0.2"),
    M("profiler times the backward with warm caches", MEASURED,
      "            flush_caches(device)\n            grads = [", "            grads = [",
      ("tests/runtime/test_profiled.py::test_every_timed_section_starts_with_cold_caches",), "0.2"),
    M("the flush fits in the last-level cache", "nanotron_ext/costs/block_inputs.py",
      "2 * _last_level_cache_bytes() if", "_last_level_cache_bytes() // 2 if",
      ("tests/runtime/test_profiled.py::test_the_flush_is_twice_the_last_level_cache_and_at_least_64_mib",), "0.2"),
    # --- a calibration you can take twice (issue 32) ----------------------------------------------------------------
    M("blocks timed in the same order every round", MEASURED,
      "for run in runs[r % len(runs):] + runs[:r % len(runs)]:", "for run in runs:",
      ("tests/test_repeatability.py::test_blocks_take_turns_in_every_round_the_first_one_rotating",)),
    M("blocks timed on CPU with glibc's moving thresholds", MEASURED,
      "        keep_freed_memory()\n    out: list[BlockTiming] = []", "        pass\n    out: list[BlockTiming] = []",
      ("tests/test_repeatability.py::test_blocks_take_turns_in_every_round_the_first_one_rotating",)),
    M("the CPU runtime trains with glibc's moving thresholds", "nanotron_ext/runtime/context.py",
      "        keep_freed_memory()  #", "        pass  #",
      ("tests/runtime/test_profiled.py::test_the_cpu_runtime_keeps_freed_memory_as_calibration_does",), "0.2"),
    M("the malloc opt-out is ignored", "nanotron_ext/allocator.py",
      'not in ("1", "true", "yes") and _mallopt()', 'is not None and _mallopt()',
      ("tests/test_repeatability.py::test_glibc_keeps_freed_memory_unless_the_user_opts_out",)),
    M("a block keeps the median of its rounds", MEASURED,
      "best = [max(0.0, fastest(t)) for t in self.times]",
      "best = [max(0.0, sorted(t)[len(t) // 2]) for t in self.times]",
      ("tests/runtime/test_profiled.py::test_fastest_of_repeats_after_warmup",), "0.2"),
    M("a block's spread is the median's interval", MEASURED,
      "spread = tuple(fastest_spread(t) for t in self.times)",
      "spread = tuple((max(t) - min(t)) / 2 / min(t) if min(t) > 0 else 0.0 for t in self.times)",
      ("tests/runtime/test_profiled.py::test_fastest_of_repeats_after_warmup",), "0.2"),
    M("calibrate takes one block round per repeat", "nanotron_ext/machine/calibrate.py",
      "    rounds = BLOCK_ROUNDS_PER_REPEAT * repeats\n", "    rounds = repeats\n",
      ("tests/runtime/test_calibrate.py::test_blocks_take_three_rounds_for_each_repeat",), "0.2"),
    M("the fastest's spread is the whole gap", "nanotron_ext/stats.py",
      "return abs(first - second) / 2 / best if best > 0 else 0.0",
      "return abs(first - second) / best if best > 0 else 0.0",
      ("tests/test_repeatability.py::test_the_fastest_and_how_far_two_half_calibrations_put_it_apart",)),
    M("the halves interleaved, so a drift hides", "nanotron_ext/stats.py",
      "first, second = fastest(values[:half]), fastest(values[half:])",
      "first, second = fastest(values[::2]), fastest(values[1::2])",
      ("tests/test_repeatability.py::test_the_fastest_and_how_far_two_half_calibrations_put_it_apart",)),
    M("the spread is the whole interval", "nanotron_ext/stats.py",
      "return (high - low) / 2 / median", "return (high - low) / median",
      ("tests/test_repeatability.py",)),
    M("the median's interval one order statistic wider", "nanotron_ext/stats.py",
      "return xs[k - 1], xs[n - k], 1 - 2 * tail", "return xs[max(k - 2, 0)], xs[min(n - k + 1, n - 1)], 1 - 2 * tail",
      ("tests/test_repeatability.py",)),
    M("identical blocks' spread counted once", "nanotron_ext/machine/spread.py",
      "per_step * len(shorts) * getattr(cost, field)", "per_step * getattr(cost, field)",
      ("tests/test_repeatability.py",)),
    M("a negative spread in a profile passes", PROFILE,
      '_nonnegative(f"blocks[{b.signature}].spread of its {name}", value, "a fraction")', "pass",
      ("tests/test_repeatability.py::test_a_profile_with_a_bad_spread_is_refused_naming_it",)),
    M("a figure flagged at twice the limit", "nanotron_ext/machine/spread.py",
      "if spread * seconds > STEP_SHARE_LIMIT * stage]", "if spread * seconds > 2 * STEP_SHARE_LIMIT * stage]",
      ("tests/test_repeatability.py",)),
    # --- the runtime's send order (issue 22, item 3) ----------------------------------------------------------
    M("eager order posts one activation per call", SEND_ORDER,
      "        _post_all(self.microbatches_activations_to_send)\n        if send_only_activation:",
      "        if self.microbatches_activations_to_send:\n            self.microbatches_activations_to_send.popleft()()\n"
      "        if send_only_activation:",
      ("tests/runtime/test_send_order.py",), "0.2"),
    # --- the vocabulary-shard chain (issue 15) ---------------------------------------------------------------
    M("chain drops the running-max rescale", VOCAB,
      "sumexp = sumexp + running_sumexp * torch.exp(running_max - new_max)", "sumexp = sumexp + running_sumexp",
      (CHAIN,), "0.2"),
    M("chain drops the target-logit hand-off", VOCAB,
      "            target = target + target_logit\n", "            pass\n", (CHAIN,), "0.2"),
    M("chain rescales by its own max only", VOCAB,
      "new_max = local_max if running_max is None else torch.maximum(running_max, local_max)",
      "new_max = local_max", (CHAIN,), "0.2"),
    M("chain's slice test is off by one", VOCAB,
      "here = (labels >= self.lo) & (labels < self.hi)", "here = (labels >= self.lo) & (labels <= self.hi)", (CHAIN,), "0.2"),
    M("chain's backward drops the target logit's gradient", VOCAB,
      "        grad.scatter_add_(-1, index, (grad_target * here).unsqueeze(-1).to(grad.dtype))\n", "", (CHAIN,), "0.2"),
    M("chain's loss ignores label_mask", VOCAB,
      "mask = self._as_tokens(label_mask).to(torch.float)",
      "mask = torch.ones_like(self._as_tokens(label_mask), dtype=torch.float)", (CHAIN,), "0.2"),
    M("shard rows start from fresh draws, not the lm_head's", LLAMA,
      "param.copy_(full[shard.lo:shard.hi].to(dtype=param.dtype))",
      "param.copy_(full[:shard.hi - shard.lo].to(dtype=param.dtype))", (CHAIN,), "0.2"),
    M("labels only on the last stage", ENGINE,
      "label_ranks = label_pp_ranks(unwrapped)", "label_ranks = [out_rank]", (CHAIN,), "0.2"),
    # --- bugs that passed the whole suite (issue 21 §3) ------------------------------------------------------
    M("step-time search compares a stage with the whole cap", STEP_TIME,
      "mem = (memory, memory.room + memory.cap * RTOL)",
      "mem = (memory, memory.cap + memory.cap * RTOL)",
      ("tests/test_schedule_aware.py::test_memory_cap_leaves_room_for_the_overhead_and_the_micro_batches_in_flight",
       "tests/test_strategies.py::test_memory_cap_search_keeps_the_overhead_allowance")),
    M("FLOP partitioner compares a stage with the whole cap", OPTIMAL,
      "    limit = memory.room + memory.cap * _RTOL\n", "    limit = memory.cap + memory.cap * _RTOL\n",
      ("tests/test_schedule_aware.py::test_memory_cap_leaves_room_for_the_overhead_and_the_micro_batches_in_flight",
       "tests/test_strategies.py::test_memory_cap_search_keeps_the_overhead_allowance")),
    M("strategies' memory cap leaves out the overhead", STRATEGIES,
      "        overhead=cfg.ext.overhead_gib * GIB,\n", "        overhead=0.0,\n",
      ("tests/test_strategies.py::test_memory_cap_search_keeps_the_overhead_allowance",)),
    M("optimizer-step peak drops the overhead", MEMORY,
      "return self.static + self.optimizer_temporaries + self.overhead",
      "return self.static + self.optimizer_temporaries",
      ("tests/test_memory.py::test_the_overhead_allowance_counts_at_both_moments",)),
    M("2 micro-batches in flight skip the later backward", MEMORY,
      "            if n >= 2:  # a later backward", "            if n >= 3:  # a later backward",
      ("tests/test_memory.py::test_two_micro_batches_peak_in_the_second_backward_with_every_gradient_alive",)),
    M("chain flattens Qwen2's labels seq-major", VOCAB,
      'per_token.transpose(0, 1) if self.token_layout == "seq_batch" else per_token.reshape(-1)',
      'per_token.transpose(0, 1) if self.token_layout == "seq_batch" else per_token.transpose(0, 1).reshape(-1)',
      (f"{CHAIN}::test_token_layouts_read_labels_in_the_hidden_states_order",), "0.2"),
    M("label broadcast takes the group rank for a global one", LAUNCHER,
      "source = dist.get_global_rank(pp_pg, model.output_pp_rank)", "source = model.output_pp_rank",
      ("tests/upstream/test_launcher.py::"
       "test_vocabulary_chain_at_dp2_takes_each_replicas_labels_from_its_own_output_rank",), "upstream"),
    M("launcher hands frozen weights to the optimizer", LAUNCHER,
      '    patches.set(NanotronModel, "get_named_params_with_correct_tied",\n'
      "                lambda self: ((n, p) for n, p in named(self) if p.requires_grad))\n", "",
      ("tests/test_launcher_cli.py::"
       "test_the_optimizer_nanotron_builds_under_the_launcher_gets_only_trainable_parameters",), "0.2"),
    M("tp need not divide the KV heads", CONFIG_KEYS,
      'for heads_key in ("num_attention_heads", "num_key_value_heads"):', 'for heads_key in ("num_attention_heads",):',
      ("tests/test_bad_input.py::test_bad_input[tp: 4 with 2 KV heads]",)),
    # --- fault messages --------------------------------------------------------------------------------------
    M("the context names a collective's failure after tearing its groups down", "nanotron_ext/runtime/context.py",
      "            failure = comm_failure(exc, peer=None, what=\"a collective (barrier, all-reduce or gather)\")\n"
      "        self.destroy(barrier=exc_type is None)\n",
      "            pass\n        self.destroy(barrier=exc_type is None)\n"
      "        if isinstance(exc, RuntimeError) and not isinstance(exc, NanotronExtError):\n"
      "            failure = comm_failure(exc, peer=None, what=\"a collective (barrier, all-reduce or gather)\")\n",
      ("tests/runtime/test_faults.py::test_a_silent_peer_is_named_whatever_rank_0_waits_in",), "0.2"),
    M("the launcher spares what an exited rank left behind", "nanotron_ext/procs.py",
      "    try:\n        os.killpg(proc.pid, signal.SIGKILL)\n    except ProcessLookupError:  # nothing left in the group\n"
      "        pass\n    proc.wait()\n",
      "    if proc.poll() is None:\n        os.killpg(proc.pid, signal.SIGKILL)\n    proc.wait()\n",
      ("tests/runtime/test_procs.py::test_a_rank_that_exits_leaves_no_child_behind",), "0.2"),
    # --- the machine model (issue 22) ----------------------------------------------------------------------
    M("planner prices blocks by FLOPs, not the config's machine", STRATEGIES,
      "    problem = schedule_problem(blocks, cfg)\n", "    problem = schedule_problem(blocks, cfg.with_overrides(times='flops'))\n",
      (f"{MACHINE_TESTS}::test_the_planner_and_the_simulator_price_through_the_one_machine",)),
    M("simulate prices with the analytic model, not the config's machine", "nanotron_ext/simulate/stage_times.py",
      "problem = schedule_problem(blocks, dataclasses.replace(cfg, run=run), machine)",
      "problem = schedule_problem(blocks, dataclasses.replace(cfg, run=run, ext=dataclasses.replace(cfg.ext, machine=None)), machine)",
      (f"{MACHINE_TESTS}::test_the_planner_and_the_simulator_price_through_the_one_machine",)),
    M("measured blocks are ignored", PRICING,
      "cost = machine.block(block_signature(b, input_grad=grad))", "cost = None",
      (MACHINE_TESTS,)),
    M("dp all-reduce not priced", PRICING,
      "u += machine.dp_allreduce.time(b.trainable * grad_bytes, cfg.run.dp)", "u += 0.0",
      (MACHINE_TESTS,)),
    M("p2p takes the fastest link", PROFILE,
      "slowest = max(links, key=lambda link: link.time(n_bytes))",
      "slowest = min(links, key=lambda link: link.time(n_bytes))",
      (MACHINE_TESTS,)),
    M("ties in step time ignore memory", "nanotron_ext/partition/schedule_aware.py",
      "if t <= limit and key < chosen:", "if t <= limit and key < chosen and False:",
      ("tests/test_schedule_aware.py", "tests/test_freeze.py")),
    M("a tie may be slower than the best", "nanotron_ext/partition/schedule_aware.py",
      "if t <= limit and key < chosen:", "if key < chosen:",
      ("tests/test_schedule_aware.py", "tests/test_freeze.py")),
    M("the memory levels stop before the answer", "nanotron_ext/partition/schedule_aware.py",
      "if chosen[0] <= cap * (1 + RTOL) or left <= 0:", "if True:",
      ("tests/test_schedule_aware.py", "tests/test_freeze.py")),
    M("a cut takes every link, not its own", PROFILE,
      "own = tuple(link for link in self.links if {link.src, link.dst} == pair)", "own = self.links",
      (MACHINE_TESTS,)),
    M("every cut is priced as the slowest one (the old shortcut)", "nanotron_ext/partition/step_time_eval.py",
      "return [float(self.send[c][max(e, 1) - 1]) for c, e in enumerate(bounds[1:-1])]",
      "return [max(float(self.send[c][max(e, 1) - 1]) for c, e in enumerate(bounds[1:-1]))] * (len(bounds) - 2)",
      ("tests/test_simulate_cli.py",)),
    M("the evaluator prices every message as cut 0's", "nanotron_ext/partition/step_time_eval.py",
      "code.append(p2p + min(s, s + peer))", "code.append(p2p)",
      ("tests/test_schedule_aware.py",)),
    M("the simulator prices every message as cut 0's", SIMULATOR,
      "+ p2p_times[min(s, s + action.peer)]", "+ p2p_times[0]",
      ("tests/test_simulate.py", "tests/test_simulate_cli.py")),
    M("a key mismatch passes", PROFILE, "        if diffs:\n            raise ConfigError(",
      "        if diffs and False:\n            raise ConfigError(", (MACHINE_TESTS,)),
    M("the p2p override drops the latency", PROFILE,
      "links=(Link(-1, -1, latency, gbps * 1e9),)", "links=(Link(-1, -1, 0.0, gbps * 1e9),)",
      (MACHINE_TESTS, "tests/test_simulate_cli.py")),

    M("allow_frozen_stages still forces a trainable block per stage", STRATEGIES,
      "return n_trainable >= cfg.run.pp and not cfg.ext.allow_frozen_stages", "return n_trainable >= cfg.run.pp",
      ("tests/test_strategies.py::test_allow_frozen_stages_lets_the_default_take_a_faster_frozen_stage",)),

    M("tied all-reduce priced on the lm_head's stage only", PRICING,
      "if tied is not None and i in tied and machine.tied_allreduce is not None:",
      "if tied is not None and i == tied[1] and machine.tied_allreduce is not None:",
      (MACHINE_TESTS,)),
    M("a CPU-runtime config is held to the analytic GPU's memory", "nanotron_ext/machine/memory_limit.py",
      'elif cfg.ext.memory_runtime == "cpu":', "elif False:", ("tests/test_fit.py",)),
    M("a stage 2 % over its memory passes", "nanotron_ext/plan/fit.py",
      "if limit is None or memory.peak <= limit.bytes:", "if limit is None or memory.peak <= limit.bytes * 1.02:",
      ("tests/test_fit.py",)),
    M("over the GPU's memory is only ever a warning", "nanotron_ext/plan/fit.py",
      "if memory.peak - GPU_ACTIVATION_OVERCOUNT * memory.pipeline_activations <= limit.bytes:", "if True:",
      ("tests/test_fit.py",)),
    M("constrained ignores the device's memory", "nanotron_ext/strategies/memory_fit.py",
      "if cfg.ext.memory_cap_gib is not None or limit is None:", "if True:", ("tests/test_fit.py",)),
    M("the split given up for memory is not recorded", "nanotron_ext/strategies/memory_fit.py",
      "return dataclasses.replace(fits, over_memory=list(fastest.ranks))", "return fits", ("tests/test_fit.py",)),
    M("a fastest split that fits is searched again under the cap", "nanotron_ext/strategies/memory_fit.py",
      "    if _fits(bounds_from_ranks(fastest.ranks, cfg.run.pp), blocks, cfg, limit.bytes):\n        return fastest\n",
      "", ("tests/test_fit.py",)),
    M("the fixes are not ordered by what fits", "nanotron_ext/plan/fit.py",
      "ordered = sorted(fixes, key=lambda f: (not f.fits, f.peak))", "ordered = list(fixes)",
      ("tests/test_validate.py",)),
    M("a tp that does not divide the heads is tried", "nanotron_ext/plan/fit.py",
      "return m.num_attention_heads % tp == 0 and m.num_key_value_heads % tp == 0", "return True",
      ("tests/test_fit.py",)),
    M("--fit rows are not ordered", "nanotron_ext/simulate/fit_search.py",
      "    rows.sort(key=lambda r:", "    sorted(rows, key=lambda r:", ("tests/test_fit.py",)),
    # Issue 44: planning in seconds; each shortcut gives the straightforward computation's answer.
    M("the fit check ignores the requirements", FEASIBLE,
      "    hi = latest_starts(n, requirements)\n    if memory is None:", "    hi = latest_starts(n, ())\n    if memory is None:",
      (SHORTCUTS,)),
    M("the fit check ignores the memory", FEASIBLE,
      "(_earliest_fitting(prefixes[k], memory.slack_room), hi)", "(np.zeros(n + 1, dtype=np.int64), hi)", (SHORTCUTS,)),
    M("the fit check's dense path ignores the memory", FEASIBLE,
      "ok = (starts <= hi[None, :]) & ((q[None, :] - q[:, None]) <= room)", "ok = starts <= hi[None, :]",
      (SHORTCUTS,)),
    M("an infeasible partition's message needs a split", OPTIMAL,
      "    if not bounds:  # the requirements alone leave no split, whatever the memory\n        return no_split\n", "",
      (SHORTCUTS,)),
    M("a search is refused though a split fits", "nanotron_ext/strategies/memory_fit.py",
      "    if any_split_fits(n, pp, requirements, memory) or Validity.build(n, requirements, memory).any_split(pp):\n"
      "        return\n", "", (SHORTCUTS,)),
    M("the refusal also answers callers that read the error", "nanotron_ext/strategies/memory_fit.py",
      "if memory is None or memory.exact is not None or _EXACT_ERRORS.get():",
      "if memory is None or memory.exact is not None:", (SHORTCUTS,)),
    M("a segment's estimate holds stage 0's micro-batches", MEMORY,
      "self._flight[stage] if held else 0", "self._flight[0] if held else 0", (SHORTCUTS,)),
    M("every stage reads stage 0's memory prefix", OPTIMAL,
      "        return self._prefixes[k]", "        return self._prefixes[min(self._prefixes)]",
      ("tests/test_partition.py", SHORTCUTS)),
    M("the descent simulates only its first batch", SCHEDULE_AWARE,
      "    kept = [tuple(int(x) for x in row) for row in rest[keep]]\n", "    kept = []\n", (SHORTCUTS,)),
    M("the descent does not charge the splits it rules out", SCHEDULE_AWARE,
      "    evaluate.charge(rest[~keep])\n", "", (SHORTCUTS,)),
    M("branch and bound keeps the ends of a best it has beaten", SCHEDULE_AWARE,
      "                pushed.clear()\n", "                pass\n", (SHORTCUTS,)),
    M("branch and bound counts a split whose last stage ends nowhere", SCHEDULE_AWARE,
      "        if not ends:  # the last stage ends at n, or nowhere\n            continue\n", "", (SHORTCUTS,)),
    M("splits within a bound reuse another stage's ends", SCHEDULE_AWARE,
      "        pushed = within.get((k, s))\n        if pushed is None:\n            ends, values = stage_ends(k, s)\n"
      "            pushed = within[(k, s)] =",
      "        pushed = within.get(s)\n        if pushed is None:\n            ends, values = stage_ends(k, s)\n"
      "            pushed = within[s] =", (SHORTCUTS,)),
    M("a stage's bound takes its smallest term", STEP_TIME,
      "+ self._C[k][:, None]).max(axis=0)", "+ self._C[k][:, None]).min(axis=0)", (SHORTCUTS,)),
    M("the tie-break's memory levels admit half their memory", SCHEDULE_AWARE,
      "requirements, terms, room + room * RTOL))", "requirements, terms, 0.5 * room))", ("tests/test_schedule_aware.py",)),
    M("the evaluator levels a receive by its own rank alone", "nanotron_ext/partition/step_time_eval.py",
      "depth.append((d if d > d_sent else d_sent) + 1)", "depth.append(d + 1)", ("tests/test_schedule_aware.py",)),
    M("fixes that all stay over do not point to --fit", "nanotron_ext/plan/fit.py",
      'return text if any(f.fits for f in fixes) else f"{text}. {FIT_POINTER}"', "return text", ("tests/test_fit.py",)),
    M("fixes point to --fit though one fits", "nanotron_ext/plan/fit.py",
      'return text if any(f.fits for f in fixes) else f"{text}. {FIT_POINTER}"', 'return f"{text}. {FIT_POINTER}"',
      ("tests/test_fit.py",)),
    M("--fit counts every row it left out as fitting", "nanotron_ext/cli/plan.py",
      "fitting = sum(r.fits for r in hidden)", "fitting = len(hidden)", ("tests/test_fit.py",)),
    M("--fit says nothing of the rows it left out", "nanotron_ext/cli/plan.py",
      "        print(f\"\\n{left_out(rows, shown)}\")\n", "        pass\n", ("tests/test_fit.py",)),
    M("--fit --all still prints only the first rows", "nanotron_ext/cli/plan.py",
      "shown = shown if every else shown[:FIT_ROWS]", "shown = shown[:FIT_ROWS]", ("tests/test_fit.py",)),
    M("a split over the cap by the full estimate is kept", "nanotron_ext/strategies/memory_fit.py",
      "        return found\n    return search(exact)", "        return found\n    return found", ("tests/test_fit.py",)),
    M("the least memory is the additive part's", "nanotron_ext/strategies/memory_fit.py",
      "        return search(exact)  # raises too", "        raise  # raises too", ("tests/test_fit.py",)),
    M("the full estimate's window admits a start after a gap", "nanotron_ext/partition/step_time_bound.py",
      "        while s >= 0 and fits[s, e]:\n            s -= 1\n        lo[e] = s + 1",
      "        while s >= 0 and fits[s, e]:\n            s -= 1\n        lo[e] = 0 if s >= 0 else s + 1",
      ("tests/test_fit.py",)),
    M("the CPU runtime ignores recompute_layer", "nanotron_ext/models/llama_layers.py",
      "if self.recompute_layer and torch.is_grad_enabled():", "if False:",
      ("tests/runtime/test_memory_cap.py::test_recomputed_layers_hold_what_the_estimate_says",)),
    M("a recomputed layer is estimated as if it saved everything", "nanotron_ext/costs/block_memory.py",
      "return _recomputed(whole, largest_part) if run.recompute_layer else whole", "return whole",
      ("tests/runtime/test_memory_cap.py::test_recomputed_layers_hold_what_the_estimate_says",)),
    M("a recomputed layer's backward is estimated without what it recomputes", "nanotron_ext/costs/block_memory.py",
      "backward_temp=whole.saved + whole.output + whole.backward_temp", "backward_temp=whole.backward_temp",
      ("tests/runtime/test_memory_cap.py::test_recomputed_layers_hold_what_the_estimate_says",)),
    M("a recomputed layer's backward is priced without the forward again", PRICING,
      "            w += f\n", "            w += 0.0\n", (MACHINE_TESTS,)),
    M("recompute_layer is not offered as a fix", "nanotron_ext/plan/fit.py",
      "    if not run.recompute_layer:\n        tries.append(", "    if False:\n        tries.append(",
      ("tests/test_validate.py",)),
    M("the GPU path's multi-head q keeps only itself, not the q|k|v copy it views", GPU_MEMORY,
      "q_kept = q if gqa else q + 2 * kv", "q_kept = q", (GPU_PATH_TESTS,)),
    M("the GPU path forgets flash-attn's log-sum-exp", GPU_MEMORY,
      "    lse = 4.0 * heads\n", "    lse = 0.0\n", (GPU_PATH_TESTS,)),
    M("the GPU path keeps an o_proj copy for one sequence", GPU_MEMORY,
      "o_copy = q if run.micro_batch_size > 1 else 0", "o_copy = q", (GPU_PATH_TESTS,)),
    M("the GPU path's fused norm forgets rstd", GPU_MEMORY,
      "    fused = tn * (h * w + 4.0)\n", "    fused = tn * h * w\n", (GPU_PATH_TESTS,)),
    M("the GPU path's forward forgets the k and v copies under GQA", GPU_MEMORY,
      "(2 * kv if gqa else 0) + 2 * kv)", "0 + 2 * kv)", (GPU_PATH_TESTS,)),
    M("the GPU path's rotary cache is fp32", GPU_MEMORY,
      "rotary = 2 * run.sequence_length * (d // 2) * w", "rotary = 2 * run.sequence_length * (d // 2) * 4.0",
      (GPU_PATH_TESTS,)),
    M("the GPU path's final norm is counted as the CPU path's", "nanotron_ext/costs/block_memory.py",
      '    if role == "final_norm" and gpu and fused_final_norm(m):',
      '    if role == "final_norm" and False:', (GPU_PATH_TESTS,)),
    M("Qwen2's unfused final norm is counted as the fused one", GPU_MEMORY,
      'return m.family == "llama" or m.fused_rms_norm', "return True", (GPU_PATH_TESTS,)),
    M("Qwen2's input norm is counted as fused", GPU_MEMORY,
      "norms = norm_saved(tn, h, w) + (fused if", "norms = fused + (fused if", (GPU_PATH_TESTS,)),
    M("Qwen2's flash-attn is counted as keeping only q and k|v, not the whole qkv output", GPU_MEMORY,
      "attention = t * (w * ((q + 2 * kv) + q) + lse)", "attention = t * (w * (q + q) + lse)", (GPU_PATH_TESTS,)),
    M("Qwen2 is counted as Llama on the GPU path", GPU_MEMORY,
      '    if m.family == "qwen2":\n        attention', '    if False:\n        attention', (GPU_PATH_TESTS,)),
    M("every family is counted for its GPU code", GPU_MEMORY,
      "return runtime == \"gpu\" and m.family in GPU_FAMILIES", "return runtime == \"gpu\"", (GPU_PATH_TESTS,)),
    M("_fused_rms_norm is not read from the YAML", "nanotron_ext/config.py",
      'fused_rms_norm=family != "qwen2" or model_cfg.get("_fused_rms_norm", True) is not False,', "",
      (GPU_PATH_TESTS,)),
    M("upstream's sequence-parallel linears keep the gathered input", "nanotron_ext/costs/block_memory.py",
      "keeps_shard = run.tp_async or (gpu and run.tp_recompute_allgather)", "keeps_shard = run.tp_async",
      (GPU_PATH_TESTS,)),
    M("tp_recompute_allgather is not read from the YAML", "nanotron_ext/config.py",
      'tp_recompute_allgather=get("parallelism.tp_recompute_allgather", default=True),', "",
      ("tests/test_gpu_path_memory.py",)),
    M("a Llama on the GPU path keeps the warning band", "nanotron_ext/plan/fit.py",
      "counted_high = cfg.ext.memory_runtime == \"gpu\" and not gpu_path(cfg.model, cfg.ext.memory_runtime)",
      "counted_high = cfg.ext.memory_runtime == \"gpu\"", ("tests/test_fit.py",)),
    M("the step-time search's lost split is not recovered", "nanotron_ext/strategies/builtin.py",
      "        return optimal_assignment(blocks, cfg, costs, unit, trainable_per_stage=trainable_per_stage,\n"
      "                                  strategy=strategy)",
      "        optimal_assignment(blocks, cfg, costs, unit, trainable_per_stage=trainable_per_stage,\n"
      "                           strategy=strategy)\n        raise",
      ("tests/test_fit.py::test_issue_30s_smollm_at_pp_8_fits_its_cap_and_names_the_least_memory_a_hand_layout_reaches",)),
    M("a stage holding both ends of a tie still syncs it", PRICING,
      "                saving[i] = synced", "                saving[i] = 0.0", (MACHINE_TESTS,)),
    M("a stage holding both ends of a tie steps it twice", PRICING,
      "saving[tied[1]] = upd[tied[1]]", "saving[tied[1]] = 0.0", (MACHINE_TESTS,)),
    M("the tie's saving is never applied", "nanotron_ext/partition/step_time_eval.py",
      "both = (lo <= first) & (hi > last)", "both = (lo < 0) & (hi > last)", ("tests/test_schedule_aware.py",)),
    M("the tie's saving applies to a stage holding one end", "nanotron_ext/partition/step_time_eval.py",
      "both = (lo <= first) & (hi > last)", "both = (lo <= first) | (hi > last)", ("tests/test_schedule_aware.py",)),
    M("the lower bound ignores the tie's saving", "nanotron_ext/partition/step_time_eval.py",
      "np.cumsum(np.subtract(self.update, self.tied_saving))", "np.cumsum(self.update)",
      ("tests/test_schedule_aware.py",)),
    M("a cut's tensors share one latency", PROFILE,
      "return n_tensors * per_tensor + n_bytes / slowest.bytes_per_second",
      "return per_tensor + n_bytes / slowest.bytes_per_second", (MACHINE_TESTS,)),

    # --- zb1p (issue 23) ---------------------------------------------------------------------------------------
    M("a B's own products are not counted while they wait for its W", MEMORY,
      "        current = sum(pending[i:])\n", "        current = 0.0\n",
      ("tests/test_zb1p.py::test_stage_peak_adds_rank_times_the_deferred_state_under_zb1p_only",)),
    M("embeddings and norms priced with a deferred W", PRICING,
      "    if block.role not in DEFERS_WEIGHT_GRADIENT:  # the engine makes its weight gradient in B\n        return 0.0\n",
      "", ("tests/test_zb1p.py::test_rate_model_prices_b_and_w_by_their_own_flops",)),

    # --- zb2p (issue 31) ---------------------------------------------------------------------------------------
    M("zb2p runs zb1p's warm-up", PROGRAMS,
      "return min(n_micro_batches, 2 * base) if engine == \"zb2p\" else base", "return base",
      ("tests/test_zb2p.py",)),
    M("zb2p defers zb1p's W's", PROGRAMS,
      "return 2 * stage if engine == \"zb2p\" else stage", "return stage", ("tests/test_zb2p.py",)),
    M("the memory estimate counts 1F1B's micro-batches in flight under zb2p", "nanotron_ext/costs/analytic.py",
      "warmup_forwards(engine, pp, stage, n_micro_batches) + 1)", "(pp - stage if engine != \"afab\" else n_micro_batches))",
      ("tests/test_zb2p.py",)),
    M("the memory estimate counts zb1p's deferred W's under zb2p", "nanotron_ext/costs/block_memory.py",
      "    return [min(deferred_weights(engine, stage) or 0, n_micro_batches - 1) for stage in range(pp)]",
      "    return [min(deferred_weights(\"zb1p\" if engine == \"zb2p\" else engine, stage) or 0, n_micro_batches - 1)"
      " for stage in range(pp)]",
      ("tests/runtime/test_memory_cap.py::test_a_plan_accepted_under_a_cap_just_above_its_estimate_stays_under_it",)),
    M("zb2p sends its steady forward's activation before its backward's receive", PROGRAMS,
      "        rank.act_lead = warmup_forwards(engine, pp, stage + 1, m) + 1", "        pass",
      ("tests/test_zb2p.py",)),
    M("the engine sends the activation the program holds", "nanotron_ext/zero_bubble/engine.py",
      "                    held = list(queue)\n                    queue.clear()", "                    held = []",
      ("tests/runtime/test_runtime_pipeline.py::test_simulator_program_is_what_nanotron_engine_runs",)),
    M("the zb2p engine runs zb1p's program", "nanotron_ext/zero_bubble/engine.py",
      "    schedule: Engine = \"zb2p\"", "    schedule: Engine = \"zb1p\"",
      ("tests/runtime/test_runtime_pipeline.py::test_simulator_program_is_what_nanotron_engine_runs",)),

    M("auto takes the slowest engine", "nanotron_ext/plan/engine_choice.py",
      "    best = min(options, key=_rank)", "    best = max(options, key=_rank)", ("tests/test_engine_choice.py",)),
    M("auto ignores the memory limit", "nanotron_ext/plan/engine_choice.py",
      "    fits = not any(f.code == \"memory\" for f in errors)", "    fits = True", ("tests/test_engine_choice.py",)),
    M("auto does not price the recompute", "nanotron_ext/plan/engine_choice.py",
      "    problem = schedule_problem(blocks, trial)",
      "    problem = schedule_problem(blocks, dataclasses.replace(trial, run=dataclasses.replace(trial.run, "
      "recompute_layer=False)))",
      ("tests/test_engine_choice.py",)),
    M("the launcher hands Nanotron pp_engine: auto", "nanotron_ext/integration/trainer_patches.py",
      "str(parallelism.get(\"pp_engine\")).lower() == ENGINE_AUTO", "False",
      ("tests/upstream/test_launcher_zero_bubble.py",), nanotron="upstream"),

    # --- checkpoints across plans (issue 28) -------------------------------------------------------------------
    M("a saved part is copied to the live tensor's own offsets", RESHARD,
      "out[_index(_shift(common, mine.whole, mine.local))]", "out[_index(_shift(common, mine.whole, theirs.local))]",
      (RESHARD_TESTS,)),
    M("a saved part is read at the live tensor's offsets", RESHARD,
      "read(slot, _shift(common, theirs.whole,\n", "read(slot, _shift(common, mine.whole,\n", (RESHARD_TESTS,)),
    M("ZeRO-1's dp slices are joined in reverse order", SAVED,
      "flat = pieces[0] if len(pieces) == 1 else torch.cat(pieces)",
      "flat = pieces[0] if len(pieces) == 1 else torch.cat(pieces[::-1])", (RESHARD_TESTS,)),
    M("a vocabulary shard's state is named by the shard, not as lm_head rows", SAVED,
      "    return LM_HEAD if vocab_shard_index(name) is not None else name",
      "    return name", (RESHARD_TESTS,)),
    M("optimizer state of the part is taken by position", RESHARD,
      "state[entry.index] = {key: _live(_optimizer_tensor(saved, entry.need, key), entry) for key in keys}",
      "state[entry.index] = {key: _live(_optimizer_tensor(saved, live.entries[-1 - entry.index].need, key), entry) "
      "for key in keys}", (RESHARD_TESTS,)),
    M("saved parameters without a place are dropped silently", PLACEMENT,
      "        if left and d == 0:", "        if left and d < 0:", (RESHARD_TESTS,)),
    M("an untied parameter may be placed twice", PLACEMENT,
      "if len(distinct) < len(held) and not all(n.tied for n in held):",
      "if len(distinct) < len(held) and all(n.tied for n in held):", (RESHARD_TESTS,)),
    M("a trainable parameter without saved moments gets none", PLACEMENT,
      "            if (n.name, slot.key) not in sources:", "            if False:", (RESHARD_TESTS,)),
    M("a checkpoint marked incomplete is loaded", LOCATE,
      "    if record is not None and not record.complete:", "    if False:", (RECORD_TESTS,)),
    M("an empty latest.txt is taken for step 0", LOCATE,
      "        if not text.isdigit():", "        if text and not text.isdigit():", (RECORD_TESTS,)),
    M("a chain's state is read by position under the same split", RECORD,
      "and (self.zero_stage == 0 or self.dp == now.dp) and not self.vocab_bounds",
      "and (self.zero_stage == 0 or self.dp == now.dp)", (RECORD_TESTS,)),
    M("the recorded split is kept at another pp", RESUME,
      "    if record.pp != cfg.run.pp:\n", "    if False:\n", (RECORD_TESTS,)),
    M("replan keeps the recorded vocabulary shards", RESUME,
      'mode == "replan" or cfg.ext.vocab_shards != "auto"', 'cfg.ext.vocab_shards != "auto"', (RECORD_TESTS,)),
    M("the dummy data restarts on a resume", "nanotron_ext/integration/dummy_data.py",
      "consumed = _consumed(current[-1]) if current else 0", "consumed = 0",
      (f"{RESUME_E2E}::test_resuming_under_plan_a_through_nanotrons_own_loader_is_the_uninterrupted_run",), "upstream"),
    M("a chain is saved under vocab_shards/", "nanotron_ext/integration/checkpoints.py",
      "        state.save_chain_as_lm_head(model, parallel_context, Path(root_folder))\n", "",
      (f"{RESUME_E2E}::test_a_chain_checkpoint_is_a_nanotron_checkpoint",), "upstream"),
    M("a checkpoint is never marked complete", "nanotron_ext/integration/checkpoints.py",
      "        self.mark(folder, step, complete=True, files=files)", "        self.mark(folder, step, complete=False, files=files)",
      (f"{RESUME_E2E}::test_the_plan_travels_with_every_checkpoint",), "upstream"),
    # --- issue 44: a checkpoint proves its files before anything loads --------------------------------------------
    M("a resume skips the check of the checkpoint's files", "nanotron_ext/integration/checkpoints.py",
      "state.verified = verify_on_every_rank(state.source, state.world_pg, state.say).verified",
      "state.verified = False", (f"{FILES_E2E}::test_damaged_files_stop_every_rank_before_anything_loads_naming_each",),
      "upstream"),
    M("plan --checkpoint skips the check of the checkpoint's files", "nanotron_ext/cli/resume.py",
      "    verdict = verify_checkpoint(source)", "    verdict = verify_checkpoint(type(source)(source.folder, source.step, None))",
      (f"{FILES_TESTS}::test_plan_checkpoint_runs_the_resumes_check_and_exits_non_zero_on_a_damaged_file",)),
    M("a file's size is not compared", VERIFY, "            if size != file.size:", "            if False:",
      (FILES_TESTS,)),
    M("a file's checksum is not compared", VERIFY, "                if found != file.checksum:",
      "                if False:", (FILES_TESTS,)),
    M("the checkpoint named instead may be a newer one", VERIFY,
      "complete_checkpoints(source.folder.parent, before=source.step)",
      "complete_checkpoints(source.folder.parent, before=None)", (FILES_TESTS,)),
    M("a file that no writer hashed is left out of the record", "nanotron_ext/integration/checkpoint_io.py",
      "            if relative not in recorded and relative != RECORD_FILE", "            if False and relative != RECORD_FILE",
      (FILES_TESTS,)),
    M("the record is written before model_config.json", "nanotron_ext/integration/checkpoints.py",
      "            state.complete(folder, self.iteration_step, self.parallel_context.world_pg, last=True)\n", "",
      (f"{FILES_E2E}::test_every_file_the_save_wrote_is_listed_with_its_size_and_checksum_and_the_record_is_"
       f"written_last",), "upstream"),
    M("a load failure exits 1, as a plan that cannot train", "nanotron_ext/integration/checkpoint_io.py",
      "raise CheckpointLoadFailure(load_failure_message(", "raise NanotronExtError(load_failure_message(",
      (f"{FILES_E2E}::test_a_file_that_fails_to_load_stops_every_rank_with_a_load_failure_naming_it",), "upstream"),
    M("a load failure stops only the rank it happened on", "nanotron_ext/integration/checkpoint_io.py",
      "        if not failed:\n            return out", "        if mine is None:\n            return out",
      (f"{FILES_E2E}::test_a_file_that_fails_to_load_stops_every_rank_with_a_load_failure_naming_it",), "upstream"),
    # --- issue 44: resume on a laptop (--cpu-debug), exactly ------------------------------------------------------
    M("the launcher leaves Nanotron's per-rank clipping", LAUNCHER,
      "    install_split_independent_clipping(patches, trainer)\n", "",
      (f"{CPU_DEBUG_E2E}::test_the_laptop_example_resumes_under_another_pp_and_split_bit_identically",), "upstream"),
    M("the launcher installs the stand-ins without the flag", "nanotron_ext/run.py",
      "        if opts.cpu_debug:  # before", "        if True:  # before",
      (f"{CPU_DEBUG_E2E}::test_without_the_flag_no_standin_is_importable_and_with_it_the_script_runs_on_them",),
      "upstream"),
    M("an installed flash_attn wins over the stand-in", CPU_STANDINS,
      "        sys.path.insert(0, folder)", "        sys.path.append(folder)",
      (f"{CPU_DEBUG_E2E}::test_without_the_flag_no_standin_is_importable_and_with_it_the_script_runs_on_them",),
      "upstream"),
    M("every rank prints the debugging banner", "nanotron_ext/run.py",
      """if os.environ.get("RANK", "0") == "0" else None)""", "if True else None)",
      (f"{CPU_DEBUG_E2E}::test_the_flag_says_once_that_the_run_is_for_debugging",), "upstream"),
    M("--cpu-debug runs on Nanotron 0.2", CPU_STANDINS,
      "    if not _installed_nanotron_is_upstream():", "    if False:",
      ("tests/test_cpu_debug_flag.py",), "0.2"),
    # --- issue 29: one figure, one meaning; a command line that behaves like a Unix tool ---------------------
    M("a tied weight is counted twice on its stage", "nanotron_ext/plan/make.py",
      "held_parameters(members, cfg.model.tie_word_embeddings)", "held_parameters(members, False)",
      ("tests/test_cli.py::test_a_tied_weight_is_counted_once",)),
    M("a frozen-only stage's fix ignores allow_frozen_stages", "nanotron_ext/strategies/fixes.py",
      "    if cfg.ext.allow_frozen_stages:\n", "    if False:\n",
      ("tests/test_cli.py::test_frozen_stages_allowed_get_no_fix_to_set_what_is_set_and_a_verdict_that_says_so",)),
    M("the cap's fix names the 1f1b engine under 1f1b", "nanotron_ext/strategies/fixes.py",
      '    if run.engine == "afab":', "    if True:",
      ("tests/test_validate.py::test_the_memory_cap_fix_names_only_what_the_config_has_not_taken",)),
    M("a closed pipe is an unexpected error", "nanotron_ext/cli/common.py",
      "    if isinstance(exc, BrokenPipeError) and reader_left():", "    if False:",
      (f"{CLOSED_PIPE}::test_a_broken_pipe_is_a_closed_output_only_when_the_reader_of_stdout_left",)),
    # --- issue 44: exit codes and messages that hold every time ------------------------------------------------
    M("any broken pipe is a reader that left", "nanotron_ext/cli/common.py",
      "    if isinstance(exc, BrokenPipeError) and reader_left():", "    if isinstance(exc, BrokenPipeError):",
      (f"{CLOSED_PIPE}::test_a_broken_pipe_is_a_closed_output_only_when_the_reader_of_stdout_left",)),
    M("the output is written as it is printed", "nanotron_ext/cli/output.py",
      "        if not interactive:\n", "        if False:\n",
      (f"{CLOSED_PIPE}::test_the_output_is_written_once_at_the_end",)),
    M("train's progress is held to the end", "nanotron_ext/cli/__init__.py",
      "    if not getattr(args, \"whole_output\", False):  # train and calibrate stream their progress\n"
      "        output.release()\n", "",
      (f"{CLOSED_PIPE}::test_reports_are_held_and_progress_streams",)),
    M("plan's report goes out line by line", "nanotron_ext/cli/plan.py",
      "p.set_defaults(func=cmd_plan, whole_output=True)", "p.set_defaults(func=cmd_plan)",
      (f"{CLOSED_PIPE}::test_reports_are_held_and_progress_streams",)),
    M("the held output is flushed again after the reader left", "nanotron_ext/cli/__init__.py",
      "    except BrokenPipeError:  # the reader left before the output was written\n        drop_output()\n",
      "    except BrokenPipeError:  # the reader left before the output was written\n",
      (f"{CLOSED_PIPE}::test_every_command_ends_141_when_the_reader_is_gone_and_its_own_code_when_it_read",)),
    M("a full disk is a traceback", "nanotron_ext/cli/__init__.py",
      "    except OSError as exc:  # the output could not be written", "    except ZeroDivisionError as exc:  # x",
      (f"{CLOSED_PIPE}::test_an_output_that_cannot_be_written_is_one_line_and_exit_3",)),
    M("--micro-batches is a bare int", "nanotron_ext/cli/common.py",
      'dest="micro_batches", type=positive_int,', 'dest="micro_batches", type=int,',
      ("tests/test_user_errors.py::test_every_numeric_flag_is_checked_where_it_is_parsed",)),
    M("a negative seed reaches the runtime", "nanotron_ext/cli/train.py",
      '"--seed", type=non_negative_int,', '"--seed", type=int,',
      ("tests/test_user_errors.py::test_a_bad_flag_value_is_one_line_naming_the_flag",)),
    M("a usage error prints the usage first", "nanotron_ext/cli/common.py",
      "        self.exit(EXIT_USAGE, f\"{self.prog}: error: {message} ({where})\\n\")",
      "        super().error(message)",
      ("tests/test_user_errors.py::test_usage_errors_are_one_line_with_where_the_flags_are",)),
    M("an override's error does not name its flags", "nanotron_ext/cli/common.py",
      'raise ConfigError(f"{flags}: {exc}") from exc', "raise",
      ("tests/test_user_errors.py::test_flags_the_config_refuses_are_named_before_its_message",)),
    M("calibrate's counts are named by their parameter", "nanotron_ext/machine/calibrate.py",
      'ConfigError(f"calibrate: --{name}={value!r} must', 'ConfigError(f"calibrate: {name}={value!r} must',
      ("tests/test_user_errors.py::test_calibrates_counts_name_their_flag",)),
    M("docs/cli.md leaves out a flag --help lists", "docs/cli.md",
      " [--plan-out FILE.json] [--device cpu\\|cuda]` |", " [--plan-out FILE.json]` |",
      ("tests/test_docs.py::test_every_flag_of_every_subcommand_is_in_the_docs_with_its_choices",)),
    M("docs/cli.md lists other choices than --engine takes", "docs/cli.md",
      "[--engine afab\\|1f1b\\|zb1p\\|zb2p\\|auto] [--micro-batches N] [--compare] [--json]",
      "[--engine afab\\|1f1b\\|zb1p\\|auto] [--micro-batches N] [--compare] [--json]",
      ("tests/test_docs.py::test_every_flag_of_every_subcommand_is_in_the_docs_with_its_choices",)),
    M("docs/cli.md's --compare-engines leaves out zb2p", "docs/cli.md",
      "planned under each of `1f1b`, `zb1p` and `zb2p`, side by side",
      "planned under each of `1f1b` and `zb1p`, side by side",
      ("tests/test_docs.py::test_the_docs_name_the_engines_and_strategies_the_command_line_takes",)),
    M("the simulator's summary prints the pipeline part as the bubble", SIMULATOR,
      '+ f", bubble={self.bubble_fraction:.1%} "', '+ f", bubble={self.pipeline_bubble_fraction:.1%} "',
      ("tests/test_simulate_cli.py::test_the_summary_lines_print_the_simulations_own_step_and_bubbles",)),
    M("the simulator's summary prints the bubble as the pipeline part", SIMULATOR,
      '(f"(pipeline part {self.pipeline_bubble_fraction:.1%}, "', '(f"(pipeline part {self.bubble_fraction:.1%}, "',
      ("tests/test_simulate_cli.py::test_the_summary_lines_print_the_simulations_own_step_and_bubbles",)),
    M("simulate's bubble line prints the pipeline part for the step's", "nanotron_ext/cli/simulate.py",
      'f"with the update, bubble {result.bubble_fraction:.1%}; "',
      'f"with the update, bubble {result.pipeline_bubble_fraction:.1%}; "',
      ("tests/test_simulate_cli.py::test_the_summary_lines_print_the_simulations_own_step_and_bubbles",)),
    M("plan's Nanotron line keeps quiet about a split that does not fit", "nanotron_ext/cli/plan.py",
      "f\"{speed_cell(rule.step_time, result.step_time)} as fast{'; ' + caveat if caveat else ''}\")",
      "f\"{speed_cell(rule.step_time, result.step_time)} as fast\")",
      (f"{COMPARISONS}::test_the_nanotron_line_says_that_nanotrons_split_does_not_fit",)),
    M("simulate's Nanotron line keeps quiet about a split that cannot train", "nanotron_ext/cli/simulate.py",
      "f\"{speed_cell(rule, chosen)} as fast{'; ' + caveat if caveat else ''}\")",
      "f\"{speed_cell(rule, chosen)} as fast\")",
      (f"{COMPARISONS}::test_the_nanotron_line_says_that_nanotrons_split_cannot_train",)),
    M("a split over the memory is named by its last stage over", "nanotron_ext/plan/compare.py",
      "worst = max((plan.stages[k] for k in where), key=lambda s: s.memory_bytes)",
      "worst = plan.stages[where[-1]]",
      (f"{COMPARISONS}::test_compare_engines_says_when_the_1f1b_plan_it_compares_with_does_not_fit",)),
    M("--compare-engines keeps quiet about a 1f1b plan that does not fit", "nanotron_ext/cli/plan.py",
      "        if base is not None and caveat:\n", "        if False:\n",
      (f"{COMPARISONS}::test_compare_engines_says_when_the_1f1b_plan_it_compares_with_does_not_fit",)),
    M("the frozen tradeoff keeps quiet about a plan that does not fit", "nanotron_ext/cli/plan.py",
      '+ (f"\\nvs frozen allowed: {caveat}" if caveat else ""))', ')',
      (f"{COMPARISONS}::test_the_frozen_tradeoff_says_when_the_plan_with_frozen_stages_does_not_fit",)),
    M("the best valid split ignores the memory", "nanotron_ext/plan/compare.py",
      'cfg.with_overrides(objective="slowest_stage", base_strategy="flops")',
      'cfg.with_overrides(objective="slowest_stage", base_strategy="flops", memory_cap_gib=1e9)',
      (f"{COMPARISONS}::test_vs_best_valid_is_the_lightest_slowest_stage_of_any_split_that_can_train",)),
    M("the best valid split may be one that cannot train", "nanotron_ext/plan/compare.py",
      "    return None if any(f.severity == \"error\" and f.stage is not None for f in plan.findings) else "
      "plan", "    return plan", (f"{COMPARISONS}::test_vs_best_valid_is_a_dash_when_no_split_can_train",)),
    M("vs optimum is the FLOP optimum of any split", "nanotron_ext/cli/plan.py",
      "rows.append([name, stage_cell(plan.stage_map()), best_valid_cell(best, plan),",
      "rows.append([name, stage_cell(plan.stage_map()), speed_cell(plan.optimum_flops, plan.slowest_flops),",
      (f"{COMPARISONS}::test_vs_best_valid_is_the_lightest_slowest_stage_of_any_split_that_can_train",)),
    M("simulate's vs best counts plans that cannot train", "nanotron_ext/cli/simulate.py",
      "if r is not None and p is not None and p.ok]", "if r is not None]",
      (f"{COMPARISONS}::test_simulate_vs_best_is_the_fastest_plan_that_can_train",)),
    M("vs best is this step over the best's", "nanotron_ext/cli/simulate.py",
      "speed_cell(best, result.step_time)", "speed_cell(result.step_time, best)",
      ("tests/test_simulate_cli.py::test_simulate_compare_table_and_stage_loads",)),
    M("plan prints the bubble formula, not the simulated bubble", "nanotron_ext/cli/plan.py",
      'bubble {result.bubble_fraction:.1%} "', 'bubble {plan.bubble_estimate:.1%} "',
      ("tests/test_cli.py::test_plan_and_simulate_give_the_same_step_and_bubble",)),
    M("an error cell is cut", "nanotron_ext/cli/common.py",
      'return f"{what} {notes.tag(error)}"', 'return f"{what}: {str(error)[:20]}…"',
      ("tests/test_cli.py::test_compare_table_lists_every_strategy",)),
    M("a rank other than 0 repeats every warning", "nanotron_ext/cli/train.py",
      "    quiet_repeated_warnings(rank)\n", "",
      ("tests/test_cli.py::test_train_ranks_but_0_print_no_warning_every_rank_prints",)),
    # --- issue 31: the profile a run's own ops make (benchmarks/_in_run_ops.py) --------------------------------
    M("an op is the median of the run's", IN_RUN,
      "return _per_kind(run, rank, statistics.fmean)", "return _per_kind(run, rank, statistics.median)",
      (IN_RUN_TESTS,)),
    M("the W is left out of the in-run backward", IN_RUN,
      'backward=mean["B"] + mean["W"]', 'backward=mean["B"]', (IN_RUN_TESTS,)),
    M("the update counts the pipeline's busy time too", IN_RUN,
      'r["busy"] - (r["pipeline"] - r["pipeline_idle"])', 'r["busy"]', (IN_RUN_TESTS,)),
    M("every block's backward is split", SPLIT,
      "return (block.role in DEFERS_WEIGHT_GRADIENT and isinstance", "return (isinstance",
      (SPLIT_TESTS + "::test_the_blocks_zero_bubble_splits_time_their_w_and_no_other_does",), "0.2"),
    M("a frozen block's backward is split", SPLIT,
      "            and any(p.requires_grad for p in module.parameters()))", "            )",
      (SPLIT_TESTS + "::test_a_frozen_block_has_no_w",), "0.2"),
    M("the W pass computes nothing", SPLIT,
      "        accumulate_weight_gradients(products)\n", "        pass\n",
      (SPLIT_TESTS + "::test_the_w_pass_makes_the_weight_gradients_of_a_whole_backward",), "0.2"),
    M("W is timed in every round", MEASURED,
      "if self.splits and timed and len(self.times[0]) % 2 == 0:", "if self.splits and timed:",
      (SPLIT_TESTS + "::test_w_is_timed_in_every_other_timed_round_the_first_included",), "0.2"),
    M("the profile drops the measured W", PRICING,
      "backward_weight=weight))", "backward_weight=None))",
      (SPLIT_TESTS + "::test_the_profile_prices_zero_bubble_w_as_measured_within_the_whole_backward",), "0.2"),
    M("a measured W may exceed its backward", PRICING,
      "weight = None if t.weight is None else min(t.weight, t.backward)", "weight = t.weight",
      (SPLIT_TESTS + "::test_the_profile_prices_zero_bubble_w_as_measured_within_the_whole_backward",), "0.2"),
    M("zero-bubble B is the whole backward", IN_RUN,
      'out.append({"F": st["forward"], "B": st["backward"] - w, "W": w})',
      'out.append({"F": st["forward"], "B": st["backward"], "W": w})', (IN_RUN_TESTS,)),
    # Issue 41: three pricing rules no test guarded, the one device rule.
    M("the dp all-reduce of a partly frozen block reduces all its weights", PRICING,
      "u += machine.dp_allreduce.time(b.trainable * grad_bytes, cfg.run.dp)",
      "u += machine.dp_allreduce.time(b.params * grad_bytes, cfg.run.dp)",
      (f"{MACHINE_TESTS}::test_the_dp_all_reduce_of_a_partly_frozen_block_reduces_only_its_trainable_gradients",)),
    M("a backward call is priced where autograd never reaches", PRICING,
      "bwd.append(w + call if (grad or b.trainable) else w)", "bwd.append(w + call)",
      (f"{MACHINE_TESTS}::test_no_backward_call_is_priced_for_a_block_autograd_never_reaches",)),
    M("a link's latency is a whole round trip", "nanotron_ext/machine/calibrate_comm.py",
      "links.append(Link(src, dst, c / 2, 1.0 / slope, spread))", "links.append(Link(src, dst, c, 1.0 / slope, spread))",
      (f"{MACHINE_TESTS}::test_a_links_one_way_latency_is_half_its_fitted_round_trip",)),
    M("a visible GPU wins over NANOTRON_EXT_DEVICE", "nanotron_ext/devices.py",
      'origin, raw = DEVICE_ENV, os.environ.get(DEVICE_ENV, "")', 'origin, raw = DEVICE_ENV, ""',
      ("tests/test_devices.py::test_the_variable_overrides_a_visible_gpu_and_the_flag_overrides_the_variable",)),
    M("calibrate times blocks on CUDA whenever it is visible", "nanotron_ext/costs/timing_cache.py",
      "return torch.device(device_type())", 'return torch.device("cuda" if torch.cuda.is_available() else "cpu")',
      ("tests/runtime/test_device.py::test_a_visible_gpu_does_not_move_a_run_that_asks_for_the_cpu",), "0.2"),
    M("a profile from another device is accepted", PROFILE,
      'run = [d for d in diffs if d.startswith(("device:", "backend:"))]', "run = []",
      ("tests/test_devices.py::test_simulate_plan_refuses_a_gpu_profile_for_a_cpu_run_naming_both",)),
    M("simulate_plan never checks the run's device", "nanotron_ext/simulate/stage_times.py",
      "    if machine is not None and (device is not None or backend is not None):",
      "    if False:", ("tests/test_devices.py::test_simulate_plan_refuses_another_backend",)),
    # Issue 41: prices by stage position (an in-run profile's), through the pricing, the evaluator and the bound.
    M("a block's figures at a position are its mean", "nanotron_ext/machine/block_cost.py",
      "found = next((p for p in self.positions if p.position == position), None)", "found = None",
      ("tests/test_in_run.py::test_a_profile_by_position_prices_each_stage_at_its_position",)),
    M("the in-run profile keeps no position", "nanotron_ext/machine/in_run.py",
      "                    if position is not None:\n                        s.positions[position].add(ops)",
      "                    if position is None:\n                        s.positions[position].add(ops)",
      ("tests/test_in_run.py::test_each_signature_keeps_its_means_by_stage_position",)),
    M("the evaluator prices every stage at the mean", "nanotron_ext/partition/step_time_eval.py",
      "            times = problem.at(k)", "            times = (problem.forward, problem.backward, problem.weight)",
      ("tests/test_schedule_aware.py::test_prices_by_stage_position_keep_evaluator_simulate_bound_and_search_in_step",)),
    M("the bound charges a block its mean, not its least", "nanotron_ext/partition/step_time_bound.py",
      "        f, b, bop, w = problem.lowest()",
      "        f, b, w = (np.asarray(x, dtype=np.float64) for x in (problem.forward, problem.backward, problem.weight))"
      "\n        bop = np.maximum(b - w, 0.0)",
      ("tests/test_schedule_aware.py::test_prices_by_stage_position_keep_evaluator_simulate_bound_and_search_in_step",)),
    M("a stage ignores its position's prices", "nanotron_ext/partition/schedule_problem.py",
      "        position = stage_position(stage, self.pp)", "        position = None",
      ("tests/test_schedule_aware.py::test_a_stage_takes_the_prices_of_its_position",)),
    # Issue 41: the in-run profile, priced (tests/test_in_run.py) and clocked in the engine (tests/runtime).
    M("a rank's update is shared by block, not by trainable weights", "nanotron_ext/machine/in_run.py",
      "weights = {i: 0 if together and i == tie[1] else blocks[i].trainable for i in held}",
      "weights = {i: 0 if together and i == tie[1] else 1 for i in held}",
      ("tests/test_in_run.py::test_a_ranks_update_is_shared_by_trainable_parameters",)),
    M("a tied lm_head beside its embedding takes a share of the update", "nanotron_ext/machine/in_run.py",
      "together = tie is not None and tie[0] in held and tie[1] in held", "together = False",
      ("tests/test_in_run.py::test_a_tied_lm_head_beside_its_embedding_holds_no_share_of_the_update",)),
    M("a 1F1B run's backward is not split", "nanotron_ext/machine/in_run.py",
      "        return backward * base.backward_weight / base.backward", "        return None",
      ("tests/test_in_run.py::test_a_one_f_one_b_run_splits_its_backward_as_the_standalone_calibration_did",)),
    M("a receive that came late counts as a whole transfer", "nanotron_ext/machine/in_run.py",
      "if r.started <= s.posted and r.n_bytes == s.n_bytes:", "if r.n_bytes == s.n_bytes:",
      ("tests/test_in_run.py::test_a_link_takes_the_latency_of_its_whole_transfers_in_the_run",)),
    M("the tied all-reduce takes the earlier end's wait", "nanotron_ext/machine/in_run.py",
      "later = max(spans, key=lambda span: span[0])", "later = min(spans, key=lambda span: span[0])",
      ("tests/test_in_run.py::test_the_tied_all_reduce_is_the_later_ends_time_inside_it",)),
    M("an unseen block keeps its standalone figure", "nanotron_ext/machine/in_run.py",
      "f, b, u = ratios.get(name, ratios.get(\"*\", (1.0, 1.0, 1.0)))", "f, b, u = 1.0, 1.0, 1.0",
      ("tests/test_in_run.py::test_a_block_no_run_timed_is_its_standalone_figure_times_its_roles_in_run_ratio",)),
    M("the engine's overhead is per op, not per block", "nanotron_ext/machine/in_run.py",
      "                    calls += n", "                    calls += 1",
      ("tests/test_in_run.py::test_the_engines_overhead_is_its_ops_own_time_per_block_they_ran",)),
    M("a block's backward runs to the end of the engine's op", "nanotron_ext/runtime/op_clock.py",
      "span = (start, ends.get(name, last))", "span = (start, last)",
      ("tests/runtime/test_op_clock.py::test_a_ranks_blocks_add_up_to_no_more_than_its_busy_time_in_the_pipeline",),
      "0.2"),
    M("the W's timing is not put on the blocks", "nanotron_ext/runtime/op_clock.py",
      "return original(products, timed=self._timed_weight)", "return original(products, timed=None)",
      ("tests/runtime/test_op_clock.py::test_every_block_of_a_rank_is_timed_once_per_micro_batch_where_the_engine_ran_it",),
      "0.2"),
)


def _copy_repo(dest: Path, worktree: bool) -> None:
    if worktree:
        ignore = shutil.ignore_patterns(".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis",
                                        "*.egg-info")
        shutil.copytree(ROOT, dest, ignore=ignore, dirs_exist_ok=True)
        return
    archive = subprocess.run(["git", "archive", "--format=tar", "HEAD"], cwd=ROOT, check=True, capture_output=True)
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")


def _env(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(copy)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _pytest(copy: Path, tests: tuple[str, ...], timeout: float, *, stop_first: bool = True,
            deselect: tuple[str, ...] = ()) -> tuple[int | None, str]:
    cmd = [sys.executable, "-m", "pytest", *(["-x"] if stop_first else []), "-q", "-rfE", "-p", "no:cacheprovider",
           *tests, *(f"--deselect={t}" for t in deselect)]
    try:
        proc = subprocess.run(cmd, cwd=copy, env=_env(copy), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return None, out
    return proc.returncode, proc.stdout + proc.stderr


def _failures(output: str) -> list[str]:
    return re.findall(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", output, re.M)  # ids may hold spaces: [tp: 4 ...]


def _nothing_ran(code: int | None, output: str) -> bool:
    """pytest collected nothing (exit 4 or 5), or passed without one passing test (every one skipped, as a test
    of the other Nanotron's pass is): a "pass" that tests nothing. The project's ``-q`` plus ours leave no summary
    line, so the passes are counted in the progress lines (``..s.   [100%]``)."""
    progress = re.findall(r"^([.sxXFE]+)\s+\[\s*\d+%\]\s*$", output, re.M)
    return code in (4, 5) or (code == 0 and not any("." in line for line in progress))


def _nanotron_under_test(copy: Path) -> str:
    """``upstream`` or ``0.2``, decided as ``tests/upstream/harness.py`` decides (upstream main has Qwen2)."""
    probe = "import importlib.util; print('upstream' if importlib.util.find_spec('nanotron.models.qwen') else '0.2')"
    return subprocess.run([sys.executable, "-c", probe], cwd=copy, env=_env(copy), capture_output=True, text=True,
                          check=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", help="run only mutations whose name contains this (repeatable)")
    parser.add_argument("--worktree", action="store_true", help="copy the working tree instead of HEAD")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copy")
    args = parser.parse_args(argv)
    selected = [m for m in MUTATIONS if not args.only or any(o in m.name for o in args.only)]
    tmp = Path(tempfile.mkdtemp(prefix="nanotron_ext_mutate_"))
    copy = tmp / "repo"
    rows = []
    try:
        _copy_repo(copy, args.worktree)
        if (ROOT.parent / "shared").is_dir():  # tests/upstream/harness.py finds upstream's checkout at ../shared
            (tmp / "shared").symlink_to(ROOT.parent / "shared")
        nanotron = _nanotron_under_test(copy)
        mutations = [m for m in selected if m.nanotron in ("any", nanotron)]
        for m in selected:
            if m not in mutations:
                rows.append((m.name, m.file, f"LEFT FOR THE {m.nanotron} PASS", 0.0))
        where = subprocess.run([sys.executable, "-c", "import nanotron_ext; print(nanotron_ext.__file__)"],
                               cwd=copy, env=_env(copy), capture_output=True, text=True, check=True).stdout.strip()
        if not Path(where).resolve().is_relative_to(copy.resolve()):
            print(f"the copy's package is not the one imported ({where}); stopping", file=sys.stderr)
            return 2
        print(f"copy: {copy} ({'working tree' if args.worktree else 'HEAD'}); nanotron_ext from {where}; "
              f"Nanotron under test: {nanotron} ({len(rows)} mutation(s) left for the other pass)")
        selection = tuple(dict.fromkeys(t for m in mutations for t in m.tests))
        if not selection:  # pytest without paths would run the whole suite
            print("no mutation for this Nanotron was selected")
            mutations = []
        start = time.monotonic()
        code, output = _pytest(copy, selection, MUTATION_TIMEOUT_S * 2, stop_first=False) if selection else (0, "")
        broken = tuple(_failures(output))
        if code != 0 and not broken:
            print(f"baseline: the selected tests do not run:\n{output[-4000:]}", file=sys.stderr)
            return 2
        print(f"baseline: {len(selection)} test selections unmutated ({time.monotonic() - start:.0f} s); "
              + (f"{len(broken)} fail already and are left out: {', '.join(broken)}" if broken else "all pass"))
        print()
        for m in mutations:
            path = copy / m.file
            original = path.read_text()
            count = original.count(m.old)
            if count != 1:
                rows.append((m.name, m.file, f"NOT APPLIED (old text found {count} times)", 0.0))
                print(f"{rows[-1][0]}: {rows[-1][2]}", flush=True)
                continue
            path.write_text(original.replace(m.old, m.new))
            start = time.monotonic()
            try:
                code, output = _pytest(copy, m.tests, MUTATION_TIMEOUT_S, deselect=broken)
            finally:
                path.write_text(original)
            seconds = time.monotonic() - start
            if code is None:
                verdict = "TIMEOUT"
            elif _nothing_ran(code, output):
                verdict = f"NOT RUN (pytest exit code {code}, no test passed or failed)"
            elif code == 0:
                verdict = "SURVIVED"
            else:
                verdict = (_failures(output) or [f"? (pytest exit code {code})"])[0]
            rows.append((m.name, m.file, verdict, seconds))
            print(f"{m.name}: {verdict} ({seconds:.0f} s)", flush=True)
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    order = {m.name: i for i, m in enumerate(MUTATIONS)}
    rows.sort(key=lambda r: order[r[0]])
    headers = ("mutation", "file", "caught by", "s")
    cells = [(n, f.removeprefix("nanotron_ext/"), v, f"{s:.0f}") for n, f, v, s in rows]
    widths = [max(len(str(r[i])) for r in [headers, *cells]) for i in range(4)]
    print()
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip())
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(str(c).rjust(w) if i == 3 else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    bad = [r for r in rows if r[2] in ("SURVIVED", "TIMEOUT") or r[2].startswith(("NOT APPLIED", "NOT RUN"))]
    left = [r for r in rows if r[2].startswith("LEFT FOR")]
    ran = len(rows) - len(left)
    print(f"\n{ran - len(bad)} of {ran} mutations caught; {sum(r[2] == 'SURVIVED' for r in rows)} survived"
          + (f"; {len(left)} left for the other Nanotron's pass" if left else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
