"""Building the C++ CPU kernels with torch's cpp_extension, safely when processes race or die mid-build.

torch guards a build with a `lock` file in the build directory and waits, without a timeout, while that file
exists. A process killed during a build (Ctrl-C in the first `make serve`, a test timeout) leaves the file behind and
every later engine start hung. Here every build first takes an OS lock (flock) on a file of its own in the same
directory: the kernel releases that lock when its holder dies, and while we hold it no other tandem process is
building, so a torch `lock` file found then is stale and is removed.
"""
from __future__ import annotations

import fcntl
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger("tandem.kernels")


def build_directory(name: str) -> Path:
    """Where torch would build `name` (TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions, per Python version)."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / f"py{sys.version_info.major}{sys.version_info.minor}_cpu" / name


def load_extension(name: str, sources: Sequence[Path], extra_cflags: list[str], extra_ldflags: list[str]):
    """cpp_extension.load of the source files into one module, under an flock that makes a leftover torch lock file
    harmless."""
    from torch.utils import cpp_extension

    # pip's ninja lives next to the interpreter, which is not on PATH when the venv is not activated.
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    directory = build_directory(name)
    directory.mkdir(parents=True, exist_ok=True)
    building = not (directory / f"{name}.so").exists()
    if building:
        log.info("compiling the CPU kernel %s (%.0f kB of C++) into %s: once per CPU and torch version, one to "
                 "several minutes (make venv does it ahead: python -m kernels.build)", name, sum(source.stat().st_size for source in sources) / 1e3, directory)
    started = time.monotonic()
    with open(directory / "tandem.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # waits for a live build by another process; released if it dies
        (directory / "lock").unlink(missing_ok=True)  # held by no live tandem build: a dead process's leftover
        module = cpp_extension.load(name=name, sources=[str(source) for source in sources], extra_cflags=extra_cflags,
                                    extra_ldflags=extra_ldflags, build_directory=str(directory), verbose=False)
    if building:
        log.info("compiled the CPU kernel %s in %.0f s", name, time.monotonic() - started)
    return module
