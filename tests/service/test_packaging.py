"""The committed stubs match the proto; clients and the client CLI stay free of torch."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STUBS = ("tandem_pb2.py", "tandem_pb2_grpc.py", "tandem_pb2.pyi")


def test_committed_stubs_equal_freshly_generated_ones(tmp_path):
    (tmp_path / "proto").mkdir()
    (tmp_path / "proto" / "tandem.proto").write_bytes((ROOT / "proto" / "tandem.proto").read_bytes())
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", ".", "--python_out=.", "--grpc_python_out=.",
                    "--pyi_out=.", "proto/tandem.proto"], cwd=tmp_path, check=True)
    for name in STUBS:
        fresh = (tmp_path / "proto" / name).read_text()
        assert fresh == (ROOT / "proto" / name).read_text(), f"proto/{name} is stale: regenerate it (see tandem.proto)"


def _modules_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return set(out.split())


def test_clients_never_import_torch():
    modules = _modules_after("import clients; from clients import AsyncClient, Client")
    assert "clients.aio" in modules and "grpc" in modules
    assert "torch" not in modules and "engine" not in modules


def test_client_commands_never_import_torch():
    modules = _modules_after("import service.cli; service.cli.build_parser().parse_args(['generate', 'Hi'])")
    assert "clients.cli" in modules
    assert "torch" not in modules and "engine" not in modules
