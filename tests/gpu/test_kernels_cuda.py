"""The Triton kernels compiled for the GPU against the torch reference, on realistic shapes.

The reference runs on CUDA too, in float32 on the same inputs upcast (SDPA's math backend, so no TF32), and the
Triton output is compared in float32. Tolerances (atol = rtol): float32 1e-4 (exact dots); float16 5e-3 and
bfloat16 2e-2, where the kernel keeps tiles native for tensor-core dots and rounds probabilities and outputs to
10 / 7 mantissa bits. Unused cache blocks and slots hold large garbage, so a read outside a sequence's own
blocks or past its context shows up as a mismatch.
"""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels import reference
from kernels.triton_kv_cache import write_kv_cache
from kernels.triton_paged_attention import paged_attention
from kernels.triton_varlen_attention import varlen_attention
from tests.kernels.batches import PagedBatch, paged_batch, seeded_lengths, varlen_batch

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
TOL = {torch.float16: 5e-3, torch.bfloat16: 2e-2, torch.float32: 1e-4}
# (KV heads, query heads per KV head, head dim): Llama-3-8B-like GQA, and the embedded SmolLM2 (9 q / 3 kv, d64).
HEADS = [(8, 4, 128), (3, 3, 64)]
MAX_CTX = 2048


@pytest.fixture(autouse=True)
def _no_tf32():
    """The float32 reference must be float32: no TF32 matmuls (torch's default, enforced here)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


def _id(x) -> str:
    return str(x).removeprefix("torch.") if isinstance(x, torch.dtype) else "kv{}xg{}xd{}".format(*x)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.is_cuda
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


def mixed_specs(seed: int, n: int = 64) -> list[tuple[int, int]]:
    """(cached tokens, new query tokens) for n sequences with contexts up to MAX_CTX, half decodes, half chunks.

    Fixed cases: decodes at context 1, 17 and MAX_CTX; a fresh 512-token prefill; chunks after 21, 1023 and 1500
    cached tokens (boundaries inside a block) and after 64 (on one); a two-token chunk. The rest are seeded.
    """
    specs = [(0, 1), (16, 1), (MAX_CTX - 1, 1), (0, 512), (21, 30), (1023, 257), (1500, 300), (64, 36), (5, 2)]
    g = torch.Generator().manual_seed(seed)
    while len(specs) < n:
        ctx = int(torch.randint(2, MAX_CTX + 1, (1,), generator=g))
        decode = bool(torch.rand(1, generator=g) < 0.5)
        q_len = 1 if decode else int(torch.randint(2, min(ctx, 400) + 1, (1,), generator=g))
        specs.append((ctx - q_len, q_len))
    return specs


def decode_specs(seed: int, n: int) -> list[tuple[int, int]]:
    """n decodes: contexts MAX_CTX, MAX_CTX - 1, 1, 16, 17 (as many as fit), the rest seeded in 1..MAX_CTX."""
    ctxs = seeded_lengths(seed, n, 1, MAX_CTX)
    ctxs[:5] = [MAX_CTX, MAX_CTX - 1, 1, 16, 17][:n]
    return [(ctx - 1, 1) for ctx in ctxs]


def run_paged(batch: PagedBatch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(Triton output in `dtype`, float32 reference) for `batch` moved to CUDA."""
    kv = torch.stack([batch.k_cache, batch.v_cache]).to("cuda", dtype)  # one allocation, as in the engine
    q = batch.query.to("cuda", dtype)
    meta = [t.cuda() for t in (batch.block_tables, batch.seq_lens, batch.query_start_loc)]
    got = paged_attention(q, kv[0], kv[1], *meta, batch.scale)
    with sdpa_kernel(SDPBackend.MATH):
        want = reference.paged_attention(q.float(), kv[0].float(), kv[1].float(), *meta, batch.scale)
    torch.cuda.synchronize()
    return got, want


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("heads", HEADS, ids=_id)
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_attention_mixed_decodes_and_prefill_chunks(block_size: int, heads: tuple, dtype: torch.dtype) -> None:
    num_kv_heads, group, head_dim = heads
    batch = paged_batch(mixed_specs(seed=block_size), block_size, num_kv_heads, group, head_dim, seed=block_size)
    got, want = run_paged(batch, dtype)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("heads", HEADS, ids=_id)
@pytest.mark.parametrize("block_size,num_seqs", [(16, 64), (32, 64), (16, 3)])  # 3: few programs, long contexts
def test_paged_attention_decode_only(block_size: int, num_seqs: int, heads: tuple, dtype: torch.dtype) -> None:
    """Only decodes: the launch takes the one-token-per-q-block path (BLOCK_Q = 1)."""
    num_kv_heads, group, head_dim = heads
    specs = decode_specs(seed=num_seqs, n=num_seqs)
    batch = paged_batch(specs, block_size, num_kv_heads, group, head_dim, seed=num_seqs + block_size)
    got, want = run_paged(batch, dtype)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("num_heads,head_dim", [(12, 32), (16, 128)])  # MiniLM-like, and a large encoder
def test_varlen_attention(num_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    """Packed pairs of 1..512 tokens, an empty one among them."""
    lengths = [1, 512, 0, 17, 64, 65] + seeded_lengths(seed=head_dim, n=26, low=1, high=512)
    q, k, v, cu = varlen_batch(lengths, num_heads, head_dim, seed=num_heads)
    q, k, v, cu = q.to("cuda", dtype), k.to("cuda", dtype), v.to("cuda", dtype), cu.cuda()
    scale = head_dim ** -0.5
    got = varlen_attention(q, k, v, cu, scale)
    with sdpa_kernel(SDPBackend.MATH):
        want = reference.varlen_attention(q.float(), k.float(), v.float(), cu, scale)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("src,cache", [(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
                                       (torch.float32, torch.bfloat16), (torch.float32, torch.float32)],
                         ids=_id)
@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv_cache(block_size: int, src: torch.dtype, cache: torch.dtype) -> None:
    """Bit-identical to the reference (a copy and one round-to-nearest cast); slot -1 writes nothing."""
    g = torch.Generator().manual_seed(block_size)
    num_blocks, num_kv_heads, head_dim, tokens = 64, 8, 128, 300
    key = torch.randn(tokens, num_kv_heads, head_dim, generator=g).to("cuda", src)
    value = torch.randn(tokens, num_kv_heads, head_dim, generator=g).to("cuda", src)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[::7] = -1  # padding rows and tokens that write no KV (e.g. CUDA-graph padding)
    slots = slots.cuda()
    before = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to("cuda", cache)
    got, want = before.clone(), before.clone()

    write_kv_cache(key, value, got[0], got[1], slots)
    reference.write_kv_cache(key, value, want[0], want[1], slots)

    assert torch.equal(got, want)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device="cuda")
    written[slots[slots >= 0]] = True
    assert int(written.sum()) == tokens - len(range(0, tokens, 7))
    assert torch.equal(got.flatten(1, 2)[:, ~written], before.flatten(1, 2)[:, ~written])
