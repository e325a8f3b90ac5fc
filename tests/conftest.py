"""Which Nanotron this run tests against, and which folder of tests each one runs.

The suite runs twice in CI (``.ci/run``): against ``nanotron==0.2`` from PyPI, whose engines the CPU runtime
drives, and against upstream main installed from ``../shared/upstream/nanotron`` with the import stand-ins of
``tests/upstream_stubs`` on ``PYTHONPATH``. The rule is by folder:

* ``tests/runtime/``: every test that starts processes or drives Nanotron 0.2's engines (the CPU runtime);
  only against Nanotron 0.2;
* ``tests/upstream/``: upstream main's models, loader and launcher; only against upstream main;
* everything else (the planner's own tests): both; quick (``pytest tests --ignore=tests/runtime
  --ignore=tests/upstream`` runs them alone).

A plain ``git clone`` has no ``../shared``: upstream's example configs are read from their copies under
``tests/data``, and a test that needs upstream's source tree itself (``tests/upstream/e2e.py``: its
``run_train.py``) skips saying so, or fails with ``NANOTRON_EXT_REQUIRE_SHARED=1`` (set by ``.ci/run``); see
``upstream.harness.upstream_tree``.

This file must not import torch (nor nanotron): collecting the planner's tests should not pay for it.
"""

from __future__ import annotations

import os

import pytest
from installed_nanotron import NANOTRON

# Every timed block call first writes twice the last-level cache to evict it; this VM reports 480 MiB of L3, so
# each one would write 960 MiB (75 ms), most of a calibration test's time. The suite checks what is timed and how it
# is priced, not how cold: 64 MiB, for this process and every rank it starts (tests/runtime/test_profiled.py
# checks the default size with the variable unset). Benchmarks and users keep the default.
os.environ.setdefault("NANOTRON_EXT_FLUSH_MIB", "64")

#: The folder of tests the other Nanotron runs.
collect_ignore = ["runtime"] if NANOTRON == "upstream" else ["upstream"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "nanotron02: needs Nanotron 0.2 (the CPU runtime's engines, 0.2's config classes)"
    )


def pytest_report_header(config: pytest.Config) -> str:
    return f"nanotron under test: {NANOTRON} (not collected here: tests/{collect_ignore[0]}/; the other pass runs it)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if NANOTRON != "upstream":
        return
    skip = pytest.mark.skip(reason="needs Nanotron 0.2; runs in the nanotron==0.2 pass of CI")
    for item in items:
        if item.get_closest_marker("nanotron02"):
            item.add_marker(skip)
