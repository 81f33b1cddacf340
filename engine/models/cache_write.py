"""The one way a cache entry (a converted model folder, a GGUF file's metadata folder or tensor file) is written:
into a temporary sibling, then renamed into place, so a reader never sees half of one and processes that start
together do not clobber each other."""
from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path


def write_atomically(target: Path, write: Callable[[Path], None]) -> Path:
    """`write(tmp)` fills a temporary path beside `target` (a file or a folder), which is then renamed to `target`.
    A folder another process renamed into place first wins: this one's copy is removed."""
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    write(tmp)
    try:
        tmp.rename(target)  # a file replaces an older one; a folder fails where one is already in place
    except OSError:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
    return target
