"""The C++ CPU decode kernel against the torch reference (itself checked against dense SDPA)."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_decode, reference
from tests.kernels.batches import mixed_specs, paged_batch


def test_the_kernel_builds_here() -> None:
    # The test machines have g++ and ninja; a build failure here is a real regression, not a skip.
    assert cpu_decode.available()


_X86 = "processor\t: {n}\nvendor_id\t: GenuineIntel\nmodel name\t: {model}\nflags\t\t: {flags}\n\n"


def test_build_name_is_keyed_by_the_cpu(tmp_path, monkeypatch) -> None:
    """-march=native code must not be loaded on another CPU: the cached extension's name changes with the CPU
    model or its feature flags, and only with them."""
    cpuinfo = tmp_path / "cpuinfo"
    monkeypatch.setattr(cpu_decode, "_CPUINFO", cpuinfo)

    def name_for(model: str, flags: str, processors: int = 2) -> str:
        cpuinfo.write_text("".join(_X86.format(n=n, model=model, flags=flags) for n in range(processors)))
        return cpu_decode.extension_name()

    base = name_for("Xeon 8480", "fpu sse2 avx2 avx512f")
    assert base.startswith("tandem_paged_decode_") and base.isidentifier()
    assert cpu_decode.extension_name() == base
    # The same CPU with another core count, or other spacing in cpuinfo, is the same build.
    assert name_for("Xeon 8480", "fpu  sse2 avx2 avx512f ", processors=64) == base
    others = {name_for("Xeon 8480", "fpu sse2 avx2"),  # the same model without AVX-512 (a VM masking it)
              name_for("EPYC 9654", "fpu sse2 avx2 avx512f")}
    assert base not in others and len(others) == 2


def test_build_name_without_cpuinfo_uses_platform(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(cpu_decode, "_CPUINFO", tmp_path / "missing")
    monkeypatch.setattr(cpu_decode.platform, "processor", lambda: "arm")
    monkeypatch.setattr(cpu_decode.platform, "machine", lambda: "arm64")
    arm = cpu_decode.extension_name()
    assert arm == cpu_decode.extension_name()
    monkeypatch.setattr(cpu_decode.platform, "machine", lambda: "x86_64")
    assert cpu_decode.extension_name() != arm


def test_the_built_module_carries_this_cpus_name() -> None:
    assert cpu_decode._module().__name__ == cpu_decode.extension_name()


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 3])
def test_mixed_decode_and_prefill_chunks(block_size: int, group: int) -> None:
    specs = mixed_specs(seed=10 * block_size + group, n_random=6)
    batch = paged_batch(specs, block_size, num_kv_heads=2, group=group, head_dim=32, seed=block_size + group)
    got = cpu_decode.paged_attention(*batch.args())
    torch.testing.assert_close(got, reference.paged_attention(*batch.args()), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("block_size,group", [(16, 3), (32, 1)])
def test_decode_only_batch_lengths_1_to_100(block_size: int, group: int) -> None:
    specs = [(ctx - 1, 1) for ctx in (1, 2, 15, 16, 17, 31, 32, 33, 64, 99, 100)]
    batch = paged_batch(specs, block_size, num_kv_heads=3, group=group, head_dim=64, seed=7)
    got = cpu_decode.paged_attention(*batch.args())
    torch.testing.assert_close(got, reference.paged_attention(*batch.args()), atol=1e-4, rtol=1e-4)


def test_non_float32_is_refused() -> None:
    batch = paged_batch([(3, 1)], block_size=16, num_kv_heads=1, group=1, head_dim=16, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_decode.paged_decode_attention(batch.query, batch.k_cache, batch.v_cache, batch.block_tables,
                                          batch.seq_lens, batch.scale)


@pytest.mark.parametrize("window,softcap", [(16, 0.0), (7, 0.0), (1, 0.0), (0, 50.0), (16, 30.0)])
def test_sliding_window_and_softcap_match_the_reference(window: int, softcap: float) -> None:
    """Decodes (through the C++ kernel) and prefill chunks in one batch, contexts shorter and longer than the window."""
    specs = mixed_specs(seed=window + 11, n_random=6) + [(ctx - 1, 1) for ctx in (1, 15, 16, 17, 40, 100)]
    batch = paged_batch(specs, 16, num_kv_heads=2, group=3, head_dim=32, seed=window)
    got = cpu_decode.paged_attention(*batch.args(), window=window, softcap=softcap)
    want = reference.paged_attention(*batch.args(), window=window, softcap=softcap)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    decodes = [(ctx - 1, 1) for ctx in (1, 15, 16, 17, 40, 100)]  # a decode-only step takes the all-C++ branch
    only = paged_batch(decodes, 16, num_kv_heads=2, group=3, head_dim=32, seed=window + 1)
    torch.testing.assert_close(cpu_decode.paged_attention(*only.args(), window=window, softcap=softcap),
                               reference.paged_attention(*only.args(), window=window, softcap=softcap),
                               atol=1e-4, rtol=1e-4)
