"""Decode CUDA graphs' padding and static buffers, checked on CPU with a capture that reruns the forward.

What CUDA adds (the capture itself) needs a GPU: tests/gpu runs the engine with graphs on and off there.
"""
from __future__ import annotations

import pytest
import torch

from engine.attention import AttentionMetadata
from engine.cuda_graphs import DecodeGraphs, capture_sizes, eager_capture
from engine.models.decoder import DecoderForCausalLM as LlamaForCausalLM
from engine.models.decoder_args import DecoderArgs as LlamaArgs
from tests.engine.conftest import GREEDY_32, assert_no_leaks, make_llm, record_steps

BLOCK = 16
NUM_BLOCKS = 40


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs():
    assert capture_sizes(128) == [1, 2, 4] + list(range(8, 129, 8))
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]
    assert capture_sizes(5000)[-1] == 256
    for n in (1, 3, 8, 9, 100, 128):
        assert max(capture_sizes(n)) >= n


@pytest.fixture(scope="module")
def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    args = LlamaArgs(vocab_size=97, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=6, num_kv_heads=2,
                     head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
                     tie_word_embeddings=False, attention_bias=False, qk_norm=False)
    model = LlamaForCausalLM(args).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return model


def _decode_batch(context_lens: list[int], generator: torch.Generator):
    """One decode token per sequence, each with its own random blocks; returns (ids, positions, meta)."""
    blocks = torch.randperm(NUM_BLOCKS - 1, generator=generator) + 1  # block 0 stays for padding rows
    tables, slots, start = [], [], 0
    for n in context_lens:
        used = -(-n // BLOCK)
        table = blocks[start:start + used].tolist()
        start += used
        tables.append(table)
        slots.append(table[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK)
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        seq_lens=torch.tensor(context_lens, dtype=torch.int32),
        query_start_loc=torch.arange(len(context_lens) + 1, dtype=torch.int32))
    ids = torch.randint(0, 97, (len(context_lens),), generator=generator)
    return ids, torch.tensor(context_lens) - 1, meta


def test_padded_replay_matches_the_eager_forward_and_writes_only_real_slots(tiny_model):
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 2, NUM_BLOCKS, BLOCK, 2, 8, generator=g)  # [layers, k/v, blocks, slot, Hkv, D]
    graph_cache = cache.clone()
    graphs = DecodeGraphs(tiny_model, graph_cache, [1, 2, 4, 8], max_blocks_per_seq=8, capture=eager_capture)
    # Big batch first, then smaller ones: stale buffer rows from earlier steps must not leak into later ones.
    for lens in ([100, 7, 33, 64, 1, 90, 17], [5, 120, 16], [48], [31, 2, 77, 77, 9]):
        ids, positions, meta = _decode_batch(lens, g)
        with torch.inference_mode():
            expected = tiny_model(ids, positions, cache, meta)
            got = graphs.run(ids, positions, meta)
        assert got is not None and got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        # Same cache afterwards: the real tokens' K/V landed in their slots, padding rows wrote nothing.
        torch.testing.assert_close(graph_cache, cache, atol=1e-5, rtol=1e-5)
        written = graph_cache.view(2, 2, -1, 2, 8)[:, :, meta.slot_mapping]
        assert written.abs().sum() > 0
    assert graphs.replays == 4


def test_batches_a_graph_cannot_serve_are_left_to_the_eager_path(tiny_model):
    g = torch.Generator().manual_seed(2)
    cache = torch.randn(2, 2, NUM_BLOCKS, BLOCK, 2, 8, generator=g)
    graphs = DecodeGraphs(tiny_model, cache, [1, 2, 4], max_blocks_per_seq=4, capture=eager_capture)
    assert graphs.run(*_decode_batch([3, 4, 5, 6, 7], g)) is None  # more sequences than the largest graph
    assert graphs.run(*_decode_batch([3, 100], g)) is None  # a block table wider than the buffers
    ids, positions, meta = _decode_batch([10, 20], g)
    prefill_meta = AttentionMetadata(slot_mapping=meta.slot_mapping.repeat(2), block_tables=meta.block_tables,
                                     seq_lens=meta.seq_lens, query_start_loc=torch.tensor([0, 2, 4], dtype=torch.int32))
    assert graphs.run(ids.repeat(2), positions.repeat(2), prefill_meta) is None  # two query tokens per sequence
    assert graphs.replays == 0


def test_engine_with_decode_graphs_is_token_identical_to_transformers(prompts, hf_greedy):
    llm = make_llm(max_num_seqs=16, fresh=True)  # its runner keeps the graphs captured here
    runner = llm.engine.runner
    assert runner.capture_decode_graphs(capture_sizes(16), max_blocks_per_seq=64, capture=eager_capture)
    records = record_steps(llm)
    outs = llm.generate(prompts, GREEDY_32)
    for i, (out, ref) in enumerate(zip(outs, hf_greedy)):
        assert out.token_ids == ref, f"prompt {i} diverged"
    decode_only = [r for r in records if r.decode_tokens and not r.prefill_tokens]
    assert runner.decode_graphs.replays == len(decode_only) > 0
    # Sequences finish at different times, so some decode batches were padded up to a captured size.
    assert any(r.decode_tokens not in capture_sizes(16) for r in decode_only)
    assert_no_leaks(llm)


def test_a_failed_capture_leaves_the_engine_eager(caplog):
    llm = make_llm(max_num_seqs=4, fresh=True)  # its runner is asked to capture (and fails)

    def broken_capture(forward):
        raise RuntimeError("operation not permitted when stream is capturing")

    assert not llm.engine.runner.capture_decode_graphs([1, 2, 4], 8, broken_capture)
    assert llm.engine.runner.decode_graphs is None
    assert "CUDA graph capture failed" in caplog.text
    out = llm.generate(["The capital of France is"], GREEDY_32)[0]
    assert len(out.token_ids) > 0
    assert_no_leaks(llm)
