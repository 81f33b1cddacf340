"""The service's shape (docs/architecture.md, "The service: one core API, two doors"): both doors call only the core
API, protobuf lives in the gRPC door alone, JSON shapes in the HTTP door alone, and neither door imports the other. Read with `ast` from the
source, as tests/test_import_cycles.py reads it, so a function-local import counts too."""
from __future__ import annotations

import pytest

from tests.test_import_cycles import imports_of, project_modules

MODULES = project_modules()
HTTP_DOOR = sorted(m for m in MODULES if m.startswith("service.http"))
GRPC_DOOR = ["service.servicer", "service.handlers", "service.session", "service.interceptors", "service.server"]


def _imports(module: str) -> set[str]:
    return imports_of(module, MODULES[module], MODULES)


@pytest.mark.parametrize("module", HTTP_DOOR)
def test_the_http_door_imports_no_protobuf_and_not_the_grpc_door(module):
    imported = _imports(module)
    assert not {m for m in imported if m.startswith("proto")}, f"{module} imports protobuf"
    assert not imported & set(GRPC_DOOR), f"{module} imports the gRPC door: {imported & set(GRPC_DOOR)}"


@pytest.mark.parametrize("module", GRPC_DOOR)
def test_the_grpc_door_does_not_import_the_http_door(module):
    assert not {m for m in _imports(module) if m.startswith("service.http")}


@pytest.mark.parametrize("module", ["service.core", "service.bridge", "service.lifecycle", "service.errors",
                                    "service.tokens", "service.config"])
def test_the_core_api_knows_neither_door_nor_protobuf(module):
    imported = _imports(module)
    assert not {m for m in imported if m.startswith(("proto", "service.http"))} and not imported & set(GRPC_DOOR)


def test_the_doors_reach_the_engine_only_through_the_core_api():
    """Neither door holds the bridge or calls into the engine: no door module imports service.bridge."""
    for module in HTTP_DOOR + GRPC_DOOR:
        assert "service.bridge" not in _imports(module), module


def _top_level_packages(module: str) -> set[str]:
    """Every package a module imports, third-party ones too (function-local imports included)."""
    import ast

    names: set[str] = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("module", ["service.core", "service.bridge", "service.errors", "service.lifecycle",
                                    "service.access_log"])
def test_the_core_api_says_what_went_wrong_without_grpc(module):
    """A refusal's kind is door-neutral (service.errors.ErrorKind): the core never names a gRPC status, and the HTTP
    door maps kinds to statuses without importing grpc."""
    assert "grpc" not in _top_level_packages(module)


@pytest.mark.parametrize("module", HTTP_DOOR)
def test_the_http_door_does_not_import_grpc(module):
    assert "grpc" not in _top_level_packages(module)
