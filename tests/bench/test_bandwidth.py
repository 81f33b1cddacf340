"""bench/bandwidth.py: the streaming read it times, and which GGUF tensors a batch-1 decode token reads."""
from __future__ import annotations

import pytest
import torch

from bench.bandwidth import bytes_read_per_token, decode_bytes_per_token, read_bandwidth


def test_read_bandwidth_reads_the_whole_buffer_and_keeps_the_best_pass() -> None:
    before = torch.get_num_threads()
    bw = read_bandwidth(8 << 20, repeats=3, threads=1)
    assert bw.bytes == 8 << 20 and len(bw.gbps_each) == 3 and bw.gbps == max(bw.gbps_each) > 0
    assert bw.threads == 1 and torch.get_num_threads() == before  # the caller's setting is restored
    with pytest.raises(ValueError):
        read_bandwidth(0)


def test_tied_embeddings_count_as_the_lm_head_and_untied_ones_do_not() -> None:
    tied = bytes_read_per_token({"token_embd.weight": 100, "blk.0.attn_q.weight": 10})
    assert tied["bytes"] == 110 and tied["tied_embeddings"]
    untied = bytes_read_per_token({"token_embd.weight": 100, "output.weight": 60, "blk.0.attn_q.weight": 10})
    assert untied["bytes"] == 70 and not untied["tied_embeddings"] and untied["file_tensor_bytes"] == 170


def test_the_embedded_file_is_read_in_full_per_token(monkeypatch) -> None:
    import gguf

    from engine.models.loader import embedded_gguf_path

    path = embedded_gguf_path()
    reader = gguf.GGUFReader(str(path))  # parsing the file's 49,152-token vocabulary is ~3 s of a core: once, here
    monkeypatch.setattr(gguf, "GGUFReader", lambda p: reader if p == str(path) else pytest.fail(p))
    names = {t.name for t in reader.tensors}
    got = decode_bytes_per_token(path)
    assert got["tied_embeddings"] == ("output.weight" not in names)
    assert 0.5 * path.stat().st_size < got["bytes"] <= path.stat().st_size  # the blocks, less headers
