"""The suite's own layout rules (tests/conftest.py): which folder starts processes, and a root conftest that
collects the planner's tests without importing torch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

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
