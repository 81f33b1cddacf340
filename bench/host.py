"""What host a benchmark ran on: the CPU's model and the vector-unit flags either system's kernels may use."""
from __future__ import annotations

from pathlib import Path


_VECTOR_FLAG_PREFIXES = ("sse", "ssse", "avx", "fma", "f16c", "amx", "bmi", "neon", "asimd", "sve")


def cpu_identity() -> dict:
    """The CPU's model name and the vector-unit flags the kernels of either system may use (/proc/cpuinfo, Linux)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return {}
    flags = (fields.get("flags") or fields.get("Features") or "").split()
    return {"model": fields.get("model name", ""), "vector_flags": sorted(f for f in flags
                                                                           if f.startswith(_VECTOR_FLAG_PREFIXES))}
