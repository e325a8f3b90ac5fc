"""The mutation record and the paths the tables name (tools/mutate.py runs them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutation:
    """One small, plausible bug: ``old`` replaced by ``new`` in ``file`` must make one of ``tests`` fail."""

    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    nanotron: str = "any"  # the pass its tests run in: "any", "0.2" or "upstream" (tests/conftest.py)


M = Mutation
VALIDATE = "nanotron_ext/plan/validate.py"
MAKE = "nanotron_ext/plan/make.py"
ZBV = "nanotron_ext/schedule/zbv.py"
V_LIST = "nanotron_ext/schedule/v_list.py"
ZBV_TESTS = "tests/test_zbv.py"
V_MEMORY = "nanotron_ext/costs/v_memory.py"
V_SEARCH = "nanotron_ext/partition/v_search.py"
V_SEARCH_TESTS = "tests/test_v_search.py"
FREEZE = "nanotron_ext/inventory/freeze.py"
CHECKS = "nanotron_ext/integration/checks.py"
MEASURED = "nanotron_ext/costs/profiled.py"
SEND_ORDER = "nanotron_ext/runtime/send_order.py"
GPU_PATH_TESTS = "tests/test_gpu_path_memory.py"
GPU_MEMORY = "nanotron_ext/costs/gpu_memory.py"
OPTIMAL = "nanotron_ext/partition/optimal.py"
FEASIBLE = "nanotron_ext/partition/feasible.py"
SCHEDULE_AWARE = "nanotron_ext/partition/schedule_aware.py"
BRANCH_BOUND = "nanotron_ext/partition/branch_bound.py"
SEGMENT_PEAKS = "nanotron_ext/costs/segment_peaks.py"
SPEEDUPS = "tests/test_search_speedups.py"
SHORTCUTS = "tests/test_search_shortcuts.py"
RULE = "nanotron_ext/partition/nanotron_rule.py"
SIMULATOR = "nanotron_ext/schedule/simulator.py"
PROGRAMS = "nanotron_ext/schedule/programs.py"
VOCAB = "nanotron_ext/models/vocab_chain.py"
LLAMA_INIT = "nanotron_ext/models/llama_init.py"
ENGINE = "nanotron_ext/runtime/engine.py"
CHAIN = "tests/runtime/test_vocab_chain.py"
STEP_TIME = "nanotron_ext/partition/step_time_bound.py"
STRATEGIES = "nanotron_ext/strategies/builtin.py"
MEMORY = "nanotron_ext/costs/memory_estimate.py"
MOMENT = "nanotron_ext/costs/pipeline_moment.py"
LAUNCHER = "nanotron_ext/integration/trainer_patches.py"
CONFIG_VALUES = "nanotron_ext/config_values.py"
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
