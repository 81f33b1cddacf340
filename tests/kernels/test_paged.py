"""kernels.paged: one plan per forward, then write + attend per layer, with exactly the values of the separate ops
(kernels.write_kv_cache then kernels.paged_attention) on every CPU backend; and the C++ KV write against the
reference."""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels import cpu_decode, paged, reference
from tests.kernels.batches import mixed_specs, paged_batch

HEAD_DIM = 32


def _step(specs: list[tuple[int, int]], group: int, seed: int, dtype: torch.dtype = torch.float32):
    """A paged batch, a fused qkv [T, Hq + 2 Hkv, D] of its new tokens and their cache slots."""
    batch = paged_batch(specs, 16, num_kv_heads=2, group=group, head_dim=HEAD_DIM, seed=seed, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 1)
    k_new = torch.randn(batch.query.shape[0], 2, HEAD_DIM, generator=g).to(dtype)
    v_new = torch.randn(batch.query.shape[0], 2, HEAD_DIM, generator=g).to(dtype)
    qkv = torch.cat([batch.query, k_new, v_new], dim=1)
    slots = []
    for b, (cached, q_len) in enumerate(specs):
        for p in range(cached, cached + q_len):
            slots.append(int(batch.block_tables[b, p // 16]) * 16 + p % 16)
    return batch, qkv, torch.tensor(slots, dtype=torch.int64)


def _separate(batch, qkv, slots, window=0, softcap=0.0, mode="auto"):
    """The per-op path: kernels.write_kv_cache then kernels.paged_attention, on copies of the caches."""
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    q, k, v = qkv.split([batch.query.shape[1], 2, 2], dim=1)
    kernels.write_kv_cache(k, v, k_cache, v_cache, slots, mode)
    out = kernels.paged_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                                  batch.scale, window=window, softcap=softcap, mode=mode)
    return out, k_cache, v_cache


def _fused(batch, qkv, slots, window=0, softcap=0.0, mode="auto"):
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    plan = kernels.plan_step(slots, batch.block_tables, batch.seq_lens, batch.query_start_loc, qkv,
                             torch.stack([k_cache, v_cache]), mode)
    out = kernels.write_and_attend(plan, qkv, batch.query.shape[1], k_cache, v_cache, batch.scale, window, softcap)
    return out, k_cache, v_cache, plan


_DECODES = [(ctx - 1, 1) for ctx in (1, 15, 16, 17, 40, 100)]


@pytest.mark.parametrize("mode", ["cpp", "torch"])
@pytest.mark.parametrize("specs", [_DECODES, mixed_specs(seed=3, n_random=4)], ids=["decode", "mixed"])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (16, 0.0), (0, 30.0)])
def test_write_and_attend_equals_the_separate_ops(mode: str, specs, window: int, softcap: float) -> None:
    batch, qkv, slots = _step(specs, group=3, seed=len(specs) + window)
    want = _separate(batch, qkv, slots, window, softcap, mode)
    *got, plan = _fused(batch, qkv, slots, window, softcap, mode)
    assert plan.backend == mode and plan.decode_only == (specs is _DECODES)
    for g, w in zip(got, want):
        assert torch.equal(g, w)  # bit for bit: the model's outputs must not move


@pytest.mark.parametrize("mode", ["cpp", "torch"])
def test_padding_slots_write_nothing(mode: str) -> None:
    """CUDA-graph padding rows (slot -1) are skipped, checked once in the plan (torch) or in C++ (cpp)."""
    batch, qkv, slots = _step(_DECODES, group=1, seed=5)
    slots[[1, 4]] = -1
    want = _separate(batch, qkv, slots, mode=mode)
    *got, plan = _fused(batch, qkv, slots, mode=mode)
    assert (plan.kept_rows is not None) == (mode == "torch")
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_cpp_kv_write_matches_the_reference_on_strided_rows() -> None:
    batch, qkv, slots = _step(mixed_specs(seed=1), group=2, seed=9)
    slots[0] = -1
    _, k, v = qkv.split([batch.query.shape[1], 2, 2], dim=1)  # views with qkv's row stride
    got = batch.k_cache.clone(), batch.v_cache.clone()
    want = batch.k_cache.clone(), batch.v_cache.clone()
    cpu_decode.write_kv_cache(k, v, *got, slots)
    reference.write_kv_cache(k, v, *want, slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_decode.write_kv_cache(k, v, *got, torch.full_like(slots, 10 ** 9))


def test_plan_falls_back_to_the_reference_for_other_dtypes_unless_forced() -> None:
    batch, qkv, slots = _step(_DECODES, group=1, seed=2, dtype=torch.float64)
    kv = torch.stack([batch.k_cache, batch.v_cache])
    args = (slots, batch.block_tables, batch.seq_lens, batch.query_start_loc, qkv, kv)
    assert paged.plan_step(*args, "auto").backend == "torch"
    with pytest.raises(RuntimeError, match="float32"):
        paged.plan_step(*args, "cpp")


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (16, 0.0), (0, 30.0)])
def test_a_narrow_mixed_step_runs_as_decode_rows_with_causal_attention(window: int, softcap: float) -> None:
    """Decodes beside a few prompt or pair tokens (at most paged.NARROW_ROWS query tokens) take the decode path on
    the C++ backend, one row per query token, each attending to its own causal prefix: the values of the separate
    ops within float32 summation order, the caches bit for bit."""
    specs = [(14, 1), (39, 1), (99, 1), (30, 3), (0, 2), (5, 4)]
    batch, qkv, slots = _step(specs, group=3, seed=11 + window)
    want = _separate(batch, qkv, slots, window, softcap, "cpp")
    *got, plan = _fused(batch, qkv, slots, window, softcap, "cpp")
    assert plan.decode_only and len(plan.seq_lens) == sum(q for _, q in specs) <= paged.NARROW_ROWS
    assert plan.seq_lens.tolist() == [15, 40, 100, 31, 32, 33, 1, 2, 6, 7, 8, 9]
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    wide = [(0, paged.NARROW_ROWS + 1)]  # a prefill-shaped step keeps the varlen path
    batch, qkv, slots = _step(wide, group=3, seed=3)
    assert not _fused(batch, qkv, slots, mode="cpp")[-1].decode_only
