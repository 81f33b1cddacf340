"""Decode-only forwards replayed from CUDA graphs, one graph per padded batch size.

A decode step of a small batch is a few hundred tiny kernels, so on a GPU its time is mostly launch overhead;
replaying a captured graph launches them all at once. A graph fixes every tensor's address and shape, so a step
copies its inputs into static buffers sized for the largest graph, pads the batch up to the next captured size,
and reads the first rows of the graph's output. Padding rows write no KV (slot -1) and attend to one key of
block 0 (finite values, discarded).
"""
from __future__ import annotations

import bisect
import logging
from typing import Callable

import torch

from engine.attention import AttentionMetadata
from engine.models.decoder import DecoderForCausalLM

log = logging.getLogger("tandem.engine")

Capture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]
"""Turns a forward over the static buffers into a replay that returns that forward's output."""

MAX_CAPTURED_BATCH = 256


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 (as vLLM), up to the first that holds max_num_seqs, at most 256."""
    sizes = []
    for size in [1, 2, 4] + list(range(8, MAX_CAPTURED_BATCH + 1, 8)):
        sizes.append(size)
        if size >= max_num_seqs:
            break
    return sizes


def cuda_graph_capture() -> Capture:
    """Captures on the current CUDA stream; all graphs share one memory pool (they never run at once)."""
    pool = torch.cuda.graph_pool_handle()

    def capture(forward: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        # Warm-up outside the capture: Triton compiles, cuBLAS picks its kernels, the allocator caches blocks.
        for _ in range(2):
            forward()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = forward()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    return capture


def eager_capture(forward: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """A "graph" that reruns the forward: the padding and buffer logic without CUDA (tests, CPU)."""
    return forward


class DecodeGraphs:
    """Replays the model forward of decode-only batches (one query token per sequence) from captured graphs."""

    def __init__(self, model: DecoderForCausalLM, kv_caches: torch.Tensor, sizes: list[int], max_blocks_per_seq: int,
                 capture: Capture) -> None:
        if not sizes:
            raise ValueError("no batch sizes to capture")
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.replays = 0  # steps served from a graph
        n, dev = self.sizes[-1], kv_caches.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self._graphs: dict[int, Callable[[], torch.Tensor]] = {}
        with torch.inference_mode():
            for size in reversed(self.sizes):  # largest first: smaller graphs reuse its pool memory
                self._graphs[size] = capture(lambda size=size: self._forward(size))

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
                                 seq_lens=self.seq_lens[:size], query_start_loc=self.query_start_loc[:size + 1])
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)

    def padded_size(self, num_seqs: int) -> int | None:
        """The smallest captured size that holds num_seqs, or None when none does."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Hidden states [B, hidden] from a graph, or None when this batch cannot use one (run it eagerly)."""
        batch, width = meta.block_tables.shape
        size = self.padded_size(batch)
        if size is None or input_ids.shape[0] != batch or width > self.max_blocks_per_seq:
            return None
        self.input_ids[:batch].copy_(input_ids)
        self.positions[:batch].copy_(positions)
        self.slot_mapping[:batch].copy_(meta.slot_mapping)
        self.block_tables[:batch, :width].copy_(meta.block_tables)
        self.seq_lens[:batch].copy_(meta.seq_lens)
        # Padding rows: token 0 at position 0, attending to one key of block 0, writing no KV.
        self.input_ids[batch:size].zero_()
        self.positions[batch:size].zero_()
        self.slot_mapping[batch:size].fill_(-1)
        self.block_tables[batch:size, 0].zero_()
        self.seq_lens[batch:size].fill_(1)
        self.replays += 1
        return self._graphs[size]()[:batch]


def try_capture(model: DecoderForCausalLM, kv_caches: torch.Tensor, sizes: list[int], max_blocks_per_seq: int,
                capture: Capture) -> DecodeGraphs | None:
    """DecodeGraphs, or None (logged) when capture fails, e.g. a kernel backend that syncs with the host."""
    try:
        return DecodeGraphs(model, kv_caches, sizes, max_blocks_per_seq, capture)
    except Exception as exc:  # the eager path still serves every step
        log.warning("CUDA graph capture failed, decode steps run eagerly: %s", exc)
        return None
