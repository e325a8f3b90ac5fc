"""The package's import graph: no cycles, and every part only looks down.

One layer per top-level module or folder, bottom up, in the order docs/architecture.md's module map gives: the shared
leaves, the schedule, then the flow inventory → models → costs → machine → partition → strategies → plan → simulate →
integration → runtime → cli → run. A module may import its own part and the parts below it, never one above.
Every import counts: module level, inside functions, under ``TYPE_CHECKING``, and a module named in a string
(``importlib`` / ``module:attr``).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nanotron_ext"
ROOT = "nanotron_ext"

#: The parts of the package, bottom up; a module may import its own part and the ones before it.
ORDER = (
    "errors",
    "report",
    "outputs",
    "procs",
    "stats",
    "allocator",
    "devices",
    "blocks",
    "schedule",
    "families",
    "config_values",
    "config_keys",
    "config_ext",
    "config_shapes",
    "config",
    "inventory",
    "zero_bubble",
    "models",
    "costs",
    "machine",
    "partition",
    "strategies",
    "plan",
    "__init__",
    "simulate",
    "checkpoint",
    "integration",
    "runtime",
    "cli",
    "run",
)
LAYERS: dict[str, int] = {part: i for i, part in enumerate(ORDER)}
# The package's own ``__init__`` is the planner's public API: it sits right above the parts it re-exports.
_NAMED = re.compile(r"nanotron_ext(?:\.\w+)+(?::\w+)?")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The nanotron_ext module ``name`` refers to (a module, or an attribute of the longest module prefix)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _ancestors(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(2, len(parts))}  # the root package's __init__ is left out


def _edges(module: str, path: Path) -> tuple[set[str], set[str]]:
    """(imported modules, modules named in strings) of one module."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            # `from pkg import submodule` imports the submodule (pkg's own __init__ is an ancestor, counted below).
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] == ROOT and (resolved := _resolve(target)):
                imported.add(resolved)
    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    named = {
        _resolve(node.value.partition(":")[0])
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
        and _NAMED.fullmatch(node.value)
    }
    named.discard(None)
    # Importing a.b.c runs a.b's __init__ first: that is an import too (the root's is left out).
    imported |= {a for m in imported for a in _ancestors(m)} - _ancestors(module) - {module}
    imported.discard(module)
    return imported, named  # type: ignore[return-value]


GRAPH = {m: _edges(m, p) for m, p in MODULES.items()}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_graph_sees_the_package():
    # A parser that found nothing would pass every check below.
    assert {"nanotron_ext.plan.make", "nanotron_ext.runtime.train", "nanotron_ext.cli.simulate"} <= set(MODULES)
    assert "nanotron_ext.strategies" in GRAPH["nanotron_ext.plan.make"][0]
    assert "nanotron_ext.models.profiled_blocks" in GRAPH["nanotron_ext.costs.standalone"][0]
    # Lazy imports inside functions count: cli.train imports the runtime only when training.
    assert "nanotron_ext.runtime.train" in GRAPH["nanotron_ext.cli.train"][0]


def test_no_import_cycles():
    cycles = _cycles({m: imported | named for m, (imported, named) in GRAPH.items()})
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_layers_only_import_downwards(module: str):
    imported, named = GRAPH[module]
    part = _part(module)
    assert part in LAYERS, f"{module}: add its folder to ORDER"
    wrong = sorted(t for t in imported | named if LAYERS[_part(t)] > LAYERS[part])
    assert not wrong, f"{module} ({part}, layer {LAYERS[part]}) imports {wrong}, from a part above it in {ORDER}"


def test_every_part_has_a_layer():
    # A new folder must be placed in the order, not silently left out of the check.
    assert {_part(m) for m in MODULES} == set(ORDER)


def test_planner_simulator_and_adapter_never_import_the_runtime():
    below = [m for m in MODULES if LAYERS[_part(m)] < LAYERS["runtime"]]
    offenders = {m: sorted(t for t in GRAPH[m][0] if _part(t) == "runtime") for m in below}
    assert not {m: t for m, t in offenders.items() if t}


def test_the_launcher_never_loads_the_runtime():
    # `python -m nanotron_ext.run` drives the Nanotron at hand (upstream main too); the CPU runtime is built on
    # Nanotron 0.2's engines. Checked in a fresh interpreter, so lazy imports in what main() loads count too.
    code = (
        "import sys, nanotron_ext.run, nanotron_ext.integration.trainer_patches; "
        "print(sorted(m for m in sys.modules if m.startswith('nanotron_ext.runtime')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
    assert "nanotron_ext.procs" in GRAPH["nanotron_ext.run"][0]  # the parent-death hook comes from the leaf
