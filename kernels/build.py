"""`python -m kernels.build`: compile the two C++ CPU kernels (paged decode attention, quantized matmul) now, into
torch's extension cache, so the first `tandem serve` loads them in a second instead of compiling them (minutes on a
loaded 2-core host). `make venv` runs it once the packages are installed; a later start finds them built for this
CPU and these sources (kernels/cpu_decode.py extension_name). Without a C++ compiler it says so and exits 0: the
engine then runs the torch reference, as it would have anyway.
"""
from __future__ import annotations

import logging
import sys
import time


def build() -> dict[str, bool]:
    """Build (or find built) each C++ kernel; name -> whether it is available."""
    from kernels import cpu_decode, quant

    return {"decode attention": cpu_decode.available(), "quantized matmul": quant.available()}


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    started = time.monotonic()
    built = build()
    from kernels import quant

    path = quant.default_cpu_path().isa.label if built["quantized matmul"] else "none"
    states = ", ".join(f"{name} {'ready' if ok else 'unavailable'}" for name, ok in built.items())
    print(f"C++ CPU kernels: {states} (CPU path {path}; {time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
