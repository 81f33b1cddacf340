"""bench/ shaped like the code (issue #72): no benchmark module named like a package it would shadow, and bench/ and
the tests import neither the other, but for tests/bench/, which tests the benchmarks themselves.

Read with `ast`, never imported: every import statement counts, function-local ones included.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP_LEVEL = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}


def _imported(path: Path) -> set[str]:
    """The first dotted part of every absolute import in `path`."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def _py(folder: Path) -> list[Path]:
    return [p for p in sorted(folder.rglob("*.py")) if "__pycache__" not in p.parts]


def test_no_bench_module_shadows_a_project_package_or_the_standard_library():
    shadowing = [str(p.relative_to(ROOT)) for p in _py(ROOT / "bench")
                 if p.stem in TOP_LEVEL or p.stem in sys.stdlib_module_names]
    assert shadowing == []


# Not yet: journeys profiles every thread of an in-process server, the one tests/service/harness.py starts; the
# service has no such server of its own to give it.
IMPORTS_TESTS = {"bench/journeys.py"}


def test_bench_imports_nothing_of_the_tests():
    importers = {str(p.relative_to(ROOT)) for p in _py(ROOT / "bench") if "tests" in _imported(p)}
    assert importers <= IMPORTS_TESTS


def test_only_tests_bench_imports_bench():
    outside = [str(p.relative_to(ROOT)) for p in _py(ROOT / "tests")
               if ROOT / "tests" / "bench" not in p.parents and "bench" in _imported(p)]
    assert outside == []
