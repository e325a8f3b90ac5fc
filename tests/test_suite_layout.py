"""The suite's own layout rules (tests/conftest.py): which folder starts processes, which modules run in both passes,
the quick set and the slow one, and a root conftest that collects the planner's tests without importing torch."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import BOTH_PASSES, PLANNER_PASS_ENV, SLOW_COMMAND, collected_here, planner_pass

TESTS = Path(__file__).resolve().parent

#: Names of the helpers that start ranks; a test module that uses one belongs in tests/runtime/.
_LAUNCHERS = re.compile(
    r"\b(run_local_ranks|run_distributed|run_ranks|launch_ranks|LocalRanks)\b|^import torch\.multiprocessing",
    re.MULTILINE,
)


def test_root_conftest_imports_neither_torch_nor_nanotron() -> None:
    # A fresh interpreter: this one has imported torch already through other tests.
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import conftest; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'nanotron', 'numpy'}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(TESTS)], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]", f"tests/conftest.py imports {out.stdout.strip()} (it must stay torch-free)"


def test_conftest_names_the_installed_nanotron() -> None:
    import importlib.metadata

    from installed_nanotron import NANOTRON

    version = importlib.metadata.version("nanotron")
    assert NANOTRON == ("0.2" if version.startswith("0.2") else "upstream"), (NANOTRON, version)


def test_only_tests_under_runtime_start_ranks() -> None:
    outside = [p for p in TESTS.glob("*.py") if _LAUNCHERS.search(p.read_text())]
    outside = [p for p in outside if p.name != Path(__file__).name]
    assert not outside, (
        f"{[p.name for p in outside]} start ranks: move them to tests/runtime/ (the conftest runs that "
        "folder against Nanotron 0.2 only and keeps the planner's tests quick)"
    )


def _function_imports(tree: ast.Module) -> list[str]:
    """Modules imported inside the module's functions, and names passed to ``pytest.importorskip`` there."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            for inner in ast.walk(node):
                if isinstance(inner, ast.Import):
                    names += [alias.name for alias in inner.names]
                elif isinstance(inner, ast.ImportFrom) and inner.module and not inner.level:
                    names.append(inner.module)
                elif isinstance(inner, ast.Call) and ast.unparse(inner.func) == "pytest.importorskip" and inner.args:
                    names.append(ast.literal_eval(inner.args[0]))
    return names


def test_the_planners_tests_import_no_nanotron_so_one_pass_runs_them() -> None:
    # Each top-level module outside BOTH_PASSES, and every module its functions import, in a fresh interpreter: none
    # may bring in Nanotron, or the pass that leaves these modules out would miss a difference (a test marked
    # nanotron02 too: CI may run the planner's tests in the upstream pass, where it would never run).
    one_pass = sorted(p for p in TESTS.glob("test_*.py") if p.name not in BOTH_PASSES)
    importers = {p.stem: p.name for p in one_pass}
    for p in one_pass:
        for name in _function_imports(ast.parse(p.read_text())):
            if name.split(".")[0] in ("nanotron", "nanotron_ext"):
                importers.setdefault(name, p.name)
    # After a module brings Nanotron in, what it added of Nanotron and nanotron_ext is forgotten, so that the next
    # module that imports it is found too.
    code = (
        "import importlib, sys; sys.path.insert(0, sys.argv[1]); found = []\n"
        "for name in sys.argv[2:]:\n"
        "    before = set(sys.modules)\n"
        "    importlib.import_module(name)\n"
        "    if 'nanotron' in sys.modules:\n"
        "        found.append(name)\n"
        "        for key in set(sys.modules) - before:\n"
        "            if key.split('.')[0] in ('nanotron', 'nanotron_ext'): del sys.modules[key]\n"
        "print('\\n'.join(found))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(TESTS), *importers], capture_output=True, text=True, timeout=300, cwd=TESTS
    )
    assert out.returncode == 0, out.stderr[-3000:]
    found = sorted({importers[name] for name in out.stdout.split()})
    assert found == [], (
        f"{found} import Nanotron (directly or through nanotron_ext): name them in tests/conftest.py's BOTH_PASSES "
        "(both passes run them)"
    )


@pytest.mark.parametrize("planner", ["0.2", "upstream"])
def test_a_pass_collects_its_folders_and_the_planners_tests_once(planner) -> None:
    top = TESTS / "test_zb1p.py"
    assert [collected_here(top, nanotron, planner) for nanotron in ("0.2", "upstream")] == [
        planner == "0.2",
        planner == "upstream",
    ]
    both = [TESTS / name for name in BOTH_PASSES]
    assert all(collected_here(p, nanotron, planner) for p in both for nanotron in ("0.2", "upstream"))
    assert all(p.is_file() for p in both)
    runtime, upstream = TESTS / "runtime", TESTS / "upstream"
    assert collected_here(runtime, "0.2", planner) and not collected_here(runtime, "upstream", planner)
    assert collected_here(upstream, "upstream", planner) and not collected_here(upstream, "0.2", planner)


def test_the_planners_pass_is_0_2_or_upstream_and_a_typo_is_named(monkeypatch) -> None:
    monkeypatch.delenv(PLANNER_PASS_ENV, raising=False)
    assert planner_pass() == "0.2"
    monkeypatch.setenv(PLANNER_PASS_ENV, "upstream")
    assert planner_pass() == "upstream"
    monkeypatch.setenv(PLANNER_PASS_ENV, "main")
    with pytest.raises(pytest.UsageError, match=rf"{PLANNER_PASS_ENV}='main' is not a pass: set it to 0.2 or upstream"):
        planner_pass()


_SLOW_CASE = """
import pytest

def test_quick():
    pass

@pytest.mark.slow
def test_slow():
    pass
"""


def _run_suite(tmp_path: Path, case: str, args: list[str]) -> subprocess.CompletedProcess:
    """This suite's conftest over a folder holding ``case`` as its one test file, run by pytest with ``args``."""
    folder = tmp_path / "tests"
    folder.mkdir()
    for helper in ("conftest.py", "installed_nanotron.py"):
        (folder / helper).write_text((TESTS / helper).read_text())
    (folder / "test_case.py").write_text(textwrap.dedent(case))
    (tmp_path / "pytest.ini").write_text("[pytest]\ntestpaths = tests\n")
    from installed_nanotron import NANOTRON

    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, PLANNER_PASS_ENV: NANOTRON},  # test_case.py is a planner's test: this pass runs it
    )


@pytest.mark.parametrize(
    "args, ran, says",
    [
        ([], "1 passed, 1 deselected", "left out 1 slow tests"),
        (["-m", "slow"], "1 passed, 1 deselected", None),
        (["tests/test_case.py"], "2 passed", None),
        (["tests/test_case.py::test_slow"], "1 passed", None),
    ],
)
def test_the_quick_run_leaves_slow_tests_out_and_says_how_to_run_them(tmp_path, args, ran, says) -> None:
    out = _run_suite(tmp_path, _SLOW_CASE, args)
    assert out.returncode == 0 and f"{ran} in" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    left = re.findall(r"^left out .*$", out.stdout, re.M)
    if says is None:
        assert left == [], left
    else:
        assert len(left) == 1 and left[0].startswith(says) and left[0].endswith(f"run them with: {SLOW_COMMAND}"), left


_TIMED_CASE = (
    _SLOW_CASE
    + """
@pytest.mark.slow
@pytest.mark.timed
def test_timed():
    pass
"""
)


def test_ci_runs_the_timed_tests_alone_after_both_passes(tmp_path) -> None:
    """The passes' slow runs of ``.ci/run`` leave the timed test out, and its run after them takes it alone."""
    ci = (TESTS.parent / ".ci" / "run").read_text()
    passes = re.findall(r'python -m pytest -m "([^"]+)"', ci)
    after = re.findall(r"python -m pytest -m (\w+) ", ci)
    assert len(passes) == 2 and len(after) == 1, (passes, after)
    runs = [*((e, "test_slow PASSED") for e in passes), (after[0], "test_timed PASSED")]
    for i, (expression, ran) in enumerate(runs):
        (tmp_path / str(i)).mkdir()
        out = _run_suite(tmp_path / str(i), _TIMED_CASE, ["-m", expression, "-v"])
        assert out.returncode == 0 and "1 passed, 2 deselected in" in out.stdout, out.stdout[-2000:]
        assert ran in out.stdout, (expression, out.stdout[-2000:])


def test_a_timed_test_not_marked_slow_is_refused_naming_it(tmp_path) -> None:
    """A timed test in the quick set would run beside CI's other pass, which ``timed`` exists to avoid."""
    out = _run_suite(tmp_path, _TIMED_CASE.replace("@pytest.mark.slow\n@pytest.mark.timed", "@pytest.mark.timed"), [])
    assert out.returncode != 0, out.stdout[-2000:]
    assert "tests/test_case.py::test_timed is marked timed but not slow" in out.stdout + out.stderr
    assert "mark it slow too" in out.stdout + out.stderr
