"""No import cycles among the project's modules, counting every import statement.

Every .py file of engine/, kernels/, service/, clients/, proto/ and bench/ is parsed with `ast` (never imported), and
every import is an edge: top-level ones, those under `if TYPE_CHECKING:`, and function-local ones alike (a cycle held
together by a guard or a deferred import is still a cycle: the modules still cannot be understood apart).

How an import becomes an edge of the module graph:

* `import a.b.c` is an edge to `a.b.c`; `from a.b import name` is an edge to `a.b.name` when that is a module of the
  project, else to `a.b` (the package's `__init__`, or the module `a/b.py`); relative imports are resolved against the
  importing module's package first.
* Only modules of the six packages above count; third-party and standard-library imports are not edges.
* A package `__init__` is a module like any other: its re-exports (`from engine.engine import LLMEngine` in
  engine/__init__.py) are edges from the package to those modules, and `from engine import LLMEngine` elsewhere is an
  edge to the package. So a module that imports its own package's `__init__` (which re-exports it) makes a cycle.
* The implicit import of parent packages that Python performs before `a.b.c` (running `a/__init__.py` and
  `a/b/__init__.py`) is NOT an edge: every submodule would otherwise be in a cycle with an `__init__` that re-exports
  anything below it. Only statements written in the code count.
"""
from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "kernels", "service", "clients", "proto", "bench")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "__pycache__" not in path.parts:
                modules[_module_name(path)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module `name` names, or its nearest enclosing project module (None: not the project's)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                targets.add(_resolve(alias.name, modules))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[:len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in modules else _resolve(base, modules))
    targets.discard(None)
    targets.discard(module)
    return targets


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports."""
    modules = project_modules()
    return {module: imports_of(module, path, modules) for module, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph (its first module repeated at the end), or None."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        return list(exc.args[1])
    return None


def test_the_project_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 50  # the walk found the project
    cycle = find_cycle(graph)
    assert cycle is None, ("import cycle (every import counts, TYPE_CHECKING and function-local ones too): "
                           + " -> ".join(reversed(cycle)))


@pytest.mark.parametrize("source, expected", [
    ("from engine.request import Sequence", {"engine.request"}),
    ("from engine import request", {"engine.request"}),
    ("from engine import LLM", {"engine"}),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine.config import EngineConfig",
     {"engine.config"}),
    ("def f():\n    import engine.runner\n", {"engine.runner"}),
    ("from .pairs import PairTemplate\nfrom .. import config", {"engine.rerank.pairs", "engine.config"}),
    ("import torch\nfrom transformers import AutoTokenizer", set()),
])
def test_every_kind_of_import_is_an_edge(tmp_path, source, expected):
    modules = project_modules()
    path = tmp_path / "probe.py"
    path.write_text(source)
    assert imports_of("engine.rerank.probe", path, modules) == expected


def test_a_cycle_through_a_guarded_import_is_found():
    graph = import_graph()
    graph["engine.config"].add("engine.scheduler")  # what `if TYPE_CHECKING: from engine.scheduler ...` would add
    cycle = find_cycle(graph)
    assert cycle is not None and "engine.config" in cycle and "engine.scheduler" in cycle
