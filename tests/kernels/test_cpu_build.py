"""The C++ kernels load even when a killed build left torch's lock file behind (it used to hang every start)."""
import subprocess
import sys

from kernels import cpu_build, cpu_decode, quant


def test_a_stale_torch_lock_does_not_hang_the_next_load() -> None:
    for module in (cpu_decode, quant):
        assert module.available()  # built (or loaded) in this process first
        lock = cpu_build.build_directory(module.extension_name()) / "lock"
        lock.write_text("")  # what a process killed mid-build leaves
        code = f"from kernels import {module.__name__.split('.')[-1]} as m; assert m.available()"
        # Without the fix torch waits on the file forever; the timeout turns that into a failure.
        done = subprocess.run([sys.executable, "-c", code], timeout=300, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        assert not lock.exists()


def test_the_name_changes_with_the_source(tmp_path) -> None:
    """Two checkouts with different kernel sources build into different directories instead of rebuilding one."""
    other = tmp_path / "paged_decode.cpp"
    other.write_text(cpu_decode._SOURCE.read_text() + "\n// another version\n")
    assert cpu_decode.extension_name(sources=[other]) != cpu_decode.extension_name()
    assert cpu_decode.extension_name(sources=[cpu_decode._SOURCE]) == cpu_decode.extension_name()


def test_the_name_changes_with_the_sources_path(tmp_path) -> None:
    """The same source in another checkout builds apart: torch's build file names the source's path, so one shared
    directory made two checkouts of one commit rebuild the module in turn."""
    copy = tmp_path / "paged_decode.cpp"
    copy.write_bytes(cpu_decode._SOURCE.read_bytes())
    assert cpu_decode.extension_name(sources=[copy]) != cpu_decode.extension_name()


def test_make_venv_builds_the_kernels_where_the_engine_loads_them() -> None:
    """`python -m kernels.build` (the last step of the Makefile's venv recipe) leaves both modules where a later
    engine start looks for them, so the first `tandem serve` compiles nothing."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    recipe = (root / "Makefile").read_text().split("$(SERVE_STAMP): pyproject.toml Makefile\n")[1].split("\n\n")[0]
    assert "$(PY) -m kernels.build" in recipe and recipe.index("kernels.build") < recipe.index("touch $(SERVE_STAMP)")
    done = subprocess.run([sys.executable, "-m", "kernels.build"], cwd=root, timeout=900, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "decode attention ready, quantized matmul ready (CPU path " in done.stdout, done.stdout
    for module in (cpu_decode, quant):
        name = module.extension_name()
        assert (cpu_build.build_directory(name) / f"{name}.so").is_file()
