"""The developers' guide's size rule: at most 400 lines per module under ``nanotron_ext/`` and ``benchmarks/``, at
most 80 lines per function (``def``, methods and nested functions included, decorators left out)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("nanotron_ext", "benchmarks")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def _modules() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def _long_functions(path: Path, root: Path = ROOT) -> list[str]:
    """``path:line name (n lines)`` for each function over the limit, ``path`` relative to ``root``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                out.append(f"{path.relative_to(root).as_posix()}:{node.lineno} {node.name} ({lines} lines)")
    return out


def test_the_check_sees_both_folders() -> None:
    # A glob that found nothing would pass both checks below.
    names = {p.relative_to(ROOT).as_posix() for p in _modules()}
    assert {"nanotron_ext/plan/make.py", "benchmarks/pvm/scenarios.py"} <= names


def test_the_function_count_spans_the_whole_def(tmp_path: Path) -> None:
    # A nested function of 81 lines is caught; one of 80 is not (end_lineno - lineno + 1 counts the def line).
    body = "".join(f"        x{i} = {i}\n" for i in range(79))
    (tmp_path / "m.py").write_text(f"def outer():\n    def inner():\n{body}        return 0\n")
    assert sorted(_long_functions(tmp_path / "m.py", tmp_path)) == [
        "m.py:1 outer (82 lines)",
        "m.py:2 inner (81 lines)",
    ]
    flat = "".join(f"    x{i} = {i}\n" for i in range(78))
    (tmp_path / "m.py").write_text(f"def flat():\n{flat}    return 0\n")  # 80 lines
    assert _long_functions(tmp_path / "m.py", tmp_path) == []


def test_no_module_over_400_lines() -> None:
    long = {
        p.relative_to(ROOT).as_posix(): n
        for p in _modules()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split each by concept, not in halves): {long}"


def test_no_function_over_80_lines() -> None:
    long = [f for p in _modules() for f in _long_functions(p)]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split each into named steps):\n" + "\n".join(long)
