"""Which Nanotron this run tests against, and the tests that only one of them can run.

The suite runs twice in CI (``.ci/run``): against ``nanotron==0.2`` from PyPI, whose engines the CPU runtime
drives, and against upstream main installed from ``../shared/upstream/nanotron`` with the import stand-ins of
``tests/upstream_stubs`` on ``PYTHONPATH``. The planner's own tests run in both.
"""

from __future__ import annotations

import pytest
from upstream.harness import NANOTRON

# Modules that drive Nanotron 0.2's engines through the CPU runtime (nanotron_ext.runtime) at import time.
_RUNTIME_ONLY = [
    "runtime/test_memory_cap.py",
    "runtime/test_runtime_layers.py",
    "runtime/test_runtime_pipeline.py",
    "runtime/test_spawn_helper.py",
    "runtime/test_vocab_chain.py",
    "runtime/test_faults.py",
    "runtime/test_frozen_training.py",
    "runtime/test_integration.py",
    "runtime/test_profiled.py",
    "runtime/test_timing.py",
    "runtime/test_train_cli.py",
]
collect_ignore = _RUNTIME_ONLY if NANOTRON == "upstream" else ["upstream"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "nanotron02: needs Nanotron 0.2 (the CPU runtime's engines, 0.2's config classes)")


def pytest_report_header(config: pytest.Config) -> str:
    left_out = ", ".join(collect_ignore)
    return f"nanotron under test: {NANOTRON} (not collected here: {left_out}; they run against the other one)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if NANOTRON != "upstream":
        return
    skip = pytest.mark.skip(reason="needs Nanotron 0.2's CPU runtime; runs in the nanotron==0.2 pass of CI")
    for item in items:
        if item.get_closest_marker("nanotron02"):
            item.add_marker(skip)
