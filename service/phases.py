"""Start-up phases that take a while (loading the model, converting it on first use, building kernels) say when
they start, how big their input is, and when they end with the time taken, so a first start is never silent."""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

_WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt")


@contextmanager
def phase(log: logging.Logger, what: str, size_bytes: int | None = None) -> Iterator[None]:
    """Log `what` and its size on entry, its time taken on a normal exit (a failure is the caller's to say)."""
    size = f" ({size_bytes / 1e6:,.0f} MB)" if size_bytes else ""
    log.info("%s%s: started", what, size)
    started = time.monotonic()
    yield
    log.info("%s: done in %.1f s", what, time.monotonic() - started)


def weights_size(model: str | None) -> int | None:
    """Bytes of the weights `--model` names: the file, a folder's weight files, or the embedded GGUF (None: unknown,
    e.g. a path that does not exist; loading says why)."""
    if model is None:
        from engine.models.loader import embedded_gguf_path

        try:
            return embedded_gguf_path().stat().st_size
        except FileNotFoundError:
            return None
    path = Path(model).expanduser()
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(f.stat().st_size for f in path.iterdir() if f.is_file() and f.suffix in _WEIGHT_SUFFIXES) or None
    return None
