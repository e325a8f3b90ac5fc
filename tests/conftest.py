"""Which tests a run collects: the quick set or the slow one, and the folders of each CI pass.

**Quick and slow.** ``python -m pytest`` (the README's command) runs the quick set: every planner, simulator,
partition, memory, config, CLI and checkpoint-format test, and for each way to train one end-to-end run in real
processes (the CPU runtime; the launcher where upstream Nanotron is installed). Every other test is marked ``slow``:
the process tests beyond those two, the GPU-path memory check, the benchmarks' tests. To mark one, decorate it with
``@pytest.mark.slow``; a whole module, ``pytestmark = pytest.mark.slow`` at its top. ``python -m pytest -m slow``
runs the slow set; any ``-m`` expression is taken as given (``-m "slow or not slow"`` runs both). A test file or
node id named on the command line runs whatever its mark. The quick run ends saying how many slow tests it left
out and how to run them. A slow test that decides by what it measures (a re-plan's trial) is marked ``timed`` too:
``.ci/run`` leaves it out of the two passes, which run side by side and load both cores, and runs it alone after
them (``-m timed``).

**Two passes.** CI (``.ci/run``) runs both sets against ``nanotron==0.2`` from PyPI, whose engines the CPU runtime
drives, and against upstream main installed from ``../shared/upstream/nanotron`` with the import stand-ins of
``tests/upstream_stubs`` on ``PYTHONPATH``. A test runs in one pass unless it imports Nanotron, whose version can
then change its outcome:

* ``tests/runtime/``: every test that starts processes or drives Nanotron 0.2's engines (the CPU runtime): the 0.2
  pass;
* ``tests/upstream/``: upstream main's models, loader and launcher: the upstream pass;
* ``tests/*.py`` named in :data:`BOTH_PASSES`: they import Nanotron in the test process (directly, or through
  nanotron_ext's engines, launcher or runtime): both passes;
* the other ``tests/*.py``, the planner's own tests, which import no Nanotron (``tests/test_suite_layout.py``
  checks it): one pass, the 0.2 pass unless ``NANOTRON_EXT_TEST_PLANNER_PASS=upstream`` names the other. A plain
  clone installs 0.2 and runs them; ``.ci/run`` gives them to the upstream pass, whose slow set is the lighter.

A plain ``git clone`` has no ``../shared``: upstream's example configs are read from their copies under
``tests/data``, and a test that needs upstream's source tree itself (``tests/upstream/e2e.py``: its
``run_train.py``) skips saying so, or fails with ``NANOTRON_EXT_REQUIRE_SHARED=1`` (set by ``.ci/run``); see
``upstream.harness.upstream_tree``.

This file must not import torch (nor nanotron): collecting the planner's tests should not pay for it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from installed_nanotron import NANOTRON

# Every timed block call first writes twice the last-level cache to evict it; this VM reports 480 MiB of L3, so
# each one would write 960 MiB (75 ms), most of a calibration test's time. The suite checks what is timed and how it
# is priced, not how cold: 64 MiB, for this process and every rank it starts (tests/runtime/test_profiled.py
# checks the default size with the variable unset). Benchmarks and users keep the default.
os.environ.setdefault("NANOTRON_EXT_FLUSH_MIB", "64")

TESTS = Path(__file__).resolve().parent
#: The command that runs what the quick run leaves out (the README and the quick run's last line name it).
SLOW_COMMAND = "python -m pytest -m slow"
#: What the slow set holds, in the words the quick run prints.
SLOW_SET = "process tests beyond one end-to-end run per way to train, the GPU-path memory check, the benchmarks' tests"
_LEFT_OUT = pytest.StashKey[int]()


#: The top-level modules that import Nanotron (see the module docstring): collected in both passes.
BOTH_PASSES = (
    "test_bad_input.py",
    "test_checkpoint_files.py",
    "test_checkpoint_record.py",
    "test_config.py",
    "test_cpu_debug_flag.py",
    "test_docs.py",
    "test_fiber.py",
    "test_launcher_cli.py",
    "test_op_clock_marks.py",
    "test_patch.py",
    "test_suite_layout.py",
    "test_user_errors.py",
    "test_v_plan.py",
    "test_v_stages.py",
    "test_vocab_shards.py",
    "test_zero_bubble_store.py",
)


#: Names the pass that runs the planner's own tests: ``0.2`` (unset) or ``upstream``.
PLANNER_PASS_ENV = "NANOTRON_EXT_TEST_PLANNER_PASS"


def planner_pass() -> str:
    """The pass that runs the planner's own tests (see the module docstring).

    Raises:
        pytest.UsageError: :data:`PLANNER_PASS_ENV` holds another value.
    """
    value = os.environ.get(PLANNER_PASS_ENV, "0.2")
    if value not in ("0.2", "upstream"):
        raise pytest.UsageError(
            f"{PLANNER_PASS_ENV}={value!r} is not a pass: set it to 0.2 or upstream (the pass that runs the "
            "planner's tests), or unset it for 0.2"
        )
    return value


def collected_here(path: Path, nanotron: str, planner: str = "0.2") -> bool:
    """Whether a pass against ``nanotron`` ("0.2" or "upstream") collects ``path``, a folder or module right under
    ``tests/``, when ``planner`` is the pass that runs the planner's own tests."""
    if path.name == "runtime":
        return nanotron == "0.2"
    if path.name == "upstream":
        return nanotron == "upstream"
    if not path.name.startswith("test_") or path.name in BOTH_PASSES:
        return True
    return nanotron == planner


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "nanotron02: needs Nanotron 0.2 (the CPU runtime's engines, 0.2's config classes)"
    )
    config.addinivalue_line("markers", f"slow: left out of `python -m pytest`; `{SLOW_COMMAND}` runs it ({SLOW_SET})")
    config.addinivalue_line(
        "markers", "timed: a slow test that decides by what it measures: CI runs it alone, after both passes"
    )


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Leave out what the other pass runs (a path named on the command line is collected whatever this says)."""
    if collection_path.parent == TESTS and not collected_here(collection_path, NANOTRON, planner_pass()):
        return True
    return None  # not False: pytest's own --ignore and collect_ignore still apply


def pytest_report_header(config: pytest.Config) -> str:
    here = ["tests/runtime/" if NANOTRON == "0.2" else "tests/upstream/", "the modules of BOTH_PASSES"]
    if planner_pass() == NANOTRON:
        here.append("the planner's tests")
    return f"nanotron under test: {NANOTRON}; this pass collects {', '.join(here)} (tests/conftest.py)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:  # a timed test in the quick set would run beside CI's other pass, which `timed` avoids
        if item.get_closest_marker("timed") and not item.get_closest_marker("slow"):
            raise pytest.UsageError(f"{item.nodeid} is marked timed but not slow: mark it slow too (tests/conftest.py)")
    if NANOTRON == "upstream":
        skip = pytest.mark.skip(reason="needs Nanotron 0.2; runs in the nanotron==0.2 pass of CI")
        for item in items:
            if item.get_closest_marker("nanotron02"):
                item.add_marker(skip)
    if config.option.markexpr:  # -m: the user's selection, as given
        return
    named = _named_files(config)
    left = [item for item in items if item.get_closest_marker("slow") and Path(item.path) not in named]
    if left:
        config.hook.pytest_deselected(items=left)
        out = {id(item) for item in left}
        items[:] = [item for item in items if id(item) not in out]
    config.stash[_LEFT_OUT] = len(left)


def _named_files(config: pytest.Config) -> set[Path]:
    """Test files named on the command line, alone or in a node id (a folder names none)."""
    files = set()
    for arg in config.args:
        path = (config.invocation_params.dir / arg.split("::")[0]).resolve()
        if path.is_file():
            files.add(path)
    return files


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    left = config.stash.get(_LEFT_OUT, 0)
    if left:
        terminalreporter.write_line(f"left out {left} slow tests ({SLOW_SET}); run them with: {SLOW_COMMAND}")
