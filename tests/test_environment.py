"""engine/ and kernels/ read the environment in one place: engine/settings.py (`Settings.from_env`, called once at
start-up), plus kernels/cpu_build.py, which builds the C++ extensions where torch builds them
(TORCH_EXTENSIONS_DIR) with pip's ninja on PATH. Every other module gets its settings in signatures, so nothing reads
a variable per step, per layer or per matmul. Each file is parsed with `ast`, never imported."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {"engine/settings.py", "kernels/cpu_build.py"}
READERS = {"environ", "getenv", "getenvb", "environb", "putenv", "unsetenv"}  # the os names that touch the environment


def environment_reads(source: str) -> list[int]:
    """Lines that name os.environ / os.getenv / ... (as attributes, `from os import ...`, or bare names)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in READERS:
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and any(a.name in READERS for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.Name) and node.id in READERS:
            lines.append(node.lineno)
    return lines


def test_the_scan_finds_every_spelling() -> None:
    assert environment_reads("import os\nos.environ.get('X')\n") == [2]
    assert environment_reads("import os\nx = os.getenv('X')\n") == [2]
    assert environment_reads("from os import environ\n") == [1]
    assert environment_reads("from os import getenv as g\n") == [1]
    assert environment_reads("import os\nos.getpid()\nenv = {}\nenv.get('X')\n") == []


def test_only_the_settings_module_and_the_extension_build_read_the_environment() -> None:
    readers = {}
    for package in ("engine", "kernels"):
        for path in sorted((ROOT / package).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            lines = environment_reads(path.read_text())
            if lines and name not in ALLOWED:
                readers[name] = lines
    assert not readers, f"read the environment outside engine/settings.py (pass a Settings field down): {readers}"
