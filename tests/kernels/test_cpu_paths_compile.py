"""Every CPU path of the quantized matmul compiles on any x86-64 host, also the ones this CPU cannot run.

The module itself is built with -march=native, so a host without AVX-512 never compiles avx512.cpp or vnni.cpp and
its test run says nothing about them (test_quant.py skips those paths there, saying why). The path files include no
torch header, so each compiles here alone, with its own instruction set switched on, into an object that must define
the path's entry point (a file whose guard is off compiles to nothing, which this catches).

Compiling the seven objects costs every run ~a minute on 2 cores, so (issue #64) a compile runs when what it depends on
changes: the object's symbol table is kept under the cache directory (TANDEM_CACHE_DIR/compile-checks), keyed like the
kernel cache by the sources' bytes (every file of kernels/cpu/quant, as a path file may include any of them), the
flags and the compiler's version. The symbols are checked against the stored table on every run.
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess

import pytest

from kernels import quant

_BASE = ["-std=c++17", "-O1", "-ffp-contract=off", "-march=x86-64"]
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
_AVX512 = [*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl"]
# (file, instruction-set flags, the symbols the object must define)
PATHS = {
    "portable": ("formats.cpp", [], ["tandem::dequant_row_scalar("]),
    "avx2": ("avx2.cpp", _AVX2, ["tandem::row_avx2("]),
    "avx2-int8": ("avx2_int8.cpp", _AVX2, ["tandem::row_int8_avx2(", "tandem::row_int8k_avx2("]),  # + K-quants
    "avx512": ("avx512.cpp", _AVX512, ["tandem::row_avx512("]),
    "avx512-vnni": ("vnni.cpp", [*_AVX512, "-mavx512vnni"], ["tandem::row_int8("]),
    # the K-quants' int8 kernel of the avx512 path: AVX-512 BW alone, and with VNNI's vpdpwssd where the CPU has it
    "avx512-k8": ("avx512_k8.cpp", _AVX512, ["tandem::row_int8k_avx512(", "tandem::order_rows_k4("]),
    "avx512-k8-vnni": ("avx512_k8.cpp", [*_AVX512, "-mavx512vnni"], ["tandem::row_int8k_avx512("]),
}
_CXX = shutil.which(os.environ.get("CXX", "c++"))
_NM = shutil.which("nm")


def _key(source: str, flags: list[str]) -> str:
    h = hashlib.sha256()
    for part in (_CXX, *_BASE, *flags, source):
        h.update(part.encode() + b"\0")
    h.update(subprocess.run([_CXX, "--version"], capture_output=True, text=True, check=True).stdout.encode())
    for path in sorted(quant._SOURCE_DIR.iterdir()):
        if path.is_file():
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:24]


def _compiled_symbols(source: str, flags: list[str], tmp_path) -> str:
    """`nm -C --defined-only` of the path's object, compiled now unless these exact inputs compiled before."""
    from engine.settings import Settings

    stamp = Settings.from_env().cache_dir / "compile-checks" / f"{_key(source, flags)}.nm"
    if stamp.is_file():
        return stamp.read_text()
    obj = tmp_path / "path.o"
    done = subprocess.run([_CXX, *_BASE, *flags, "-c", str(quant._SOURCE_DIR / source), "-o", str(obj)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    defined = subprocess.run([_NM, "-C", "--defined-only", str(obj)], capture_output=True, text=True,
                             check=True).stdout
    stamp.parent.mkdir(parents=True, exist_ok=True)
    tmp = stamp.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(defined)
    tmp.replace(stamp)
    return defined


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the vector paths are x86-64 code")
@pytest.mark.skipif(_CXX is None or _NM is None, reason="needs a C++ compiler and nm")
@pytest.mark.parametrize("path", list(PATHS))
def test_the_path_compiles_for_its_instruction_set(path: str, tmp_path) -> None:
    source, flags, symbols = PATHS[path]
    defined = _compiled_symbols(source, flags, tmp_path)
    for symbol in symbols:
        assert symbol in defined, f"{source} compiled without its kernels: {symbol} missing"
