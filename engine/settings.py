"""The process settings engine/ and kernels/ take from the environment, read once at start-up.

`Settings.from_env()` is the one place of engine/ and kernels/ that reads `TANDEM_*` variables (kernels/cpu_build.py
reads torch's own `TORCH_EXTENSIONS_DIR`); the builder calls it once and hands the values down in signatures: the
kernel backend to the models, the CPU path (resolved by kernels.quant.resolve_cpu_path) to the model's quantized
weights, the cache folder to the loaders. Nothing reads the
environment per step, per layer or per matmul. None of these has a `tandem serve` flag: they are for operators and
A/B runs (docs/configuration.md "Environment").
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kernels.dispatch import MODES
from kernels.quant import CpuIsa

ISA_CHOICES = ("auto", *(isa.label for isa in CpuIsa))


def _default_cache_dir() -> Path:
    return Path.home() / ".cache" / "tandem"


@dataclass(frozen=True, slots=True)
class Settings:
    # TANDEM_KERNELS: torch | triton | cpp | auto (auto: Triton on CUDA tensors, the C++ decode kernel on CPU)
    kernels: str = "auto"
    # TANDEM_CPU_ISA: auto | avx512 | avx2 | portable, the vector path of the quantized CPU kernels
    cpu_isa: str = "auto"
    # TANDEM_QUANT_SMALL_M: the most rows the in-register quantized matmul takes (None: the CPU path's measured value)
    quant_small_m: int | None = None
    # TANDEM_FUSED_OPS=0 turns the fused C++ small ops of CPU float32 layers off (A/B runs)
    fused_ops: bool = True
    # TANDEM_LAYER_WALKER=0 turns the C++ walker of small decode steps off (A/B runs)
    layer_walker: bool = True
    # TANDEM_NATIVE_BF16=0: resolve EngineConfig.encoder_dtype "auto" as on a CPU without native bf16 (float32), and
    # keep the quantized matmul's wide steps float32 (kernels.quant bf16_gemm), to run or test the path of most CPUs
    # on one that has it
    native_bf16: bool = True
    # TANDEM_CACHE_DIR: converted models and GGUF caches (default ~/.cache/tandem)
    cache_dir: Path = field(default_factory=_default_cache_dir)
    # TANDEM_RECALIBRATE=1: measure the latency objective's step-time model again, whatever the cache holds
    recalibrate: bool = False

    def __post_init__(self) -> None:
        if self.kernels not in MODES:
            raise ValueError(f"TANDEM_KERNELS={self.kernels!r}: expected one of {', '.join(MODES)}")
        if self.cpu_isa not in ISA_CHOICES:
            raise ValueError(f"TANDEM_CPU_ISA={self.cpu_isa!r}: expected auto or one of {', '.join(ISA_CHOICES[1:])}")
        if self.quant_small_m is not None and self.quant_small_m < 0:
            raise ValueError(f"TANDEM_QUANT_SMALL_M={self.quant_small_m}: expected a row count >= 0")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "Settings":
        """The settings these variables ask for (unset or empty: the default)."""
        def get(name: str) -> str:
            return environ.get(name, "").strip()

        small_m = get("TANDEM_QUANT_SMALL_M")
        if small_m and not small_m.lstrip("-").isdigit():
            raise ValueError(f"TANDEM_QUANT_SMALL_M={small_m!r}: expected a row count >= 0")
        cache = get("TANDEM_CACHE_DIR")
        return cls(kernels=get("TANDEM_KERNELS").lower() or "auto", cpu_isa=get("TANDEM_CPU_ISA").lower() or "auto",
                   quant_small_m=int(small_m) if small_m else None,
                   fused_ops=get("TANDEM_FUSED_OPS") != "0", layer_walker=get("TANDEM_LAYER_WALKER") != "0",
                   native_bf16=get("TANDEM_NATIVE_BF16") != "0",
                   cache_dir=Path(cache) if cache else _default_cache_dir(),
                   recalibrate=get("TANDEM_RECALIBRATE") not in ("", "0"))
