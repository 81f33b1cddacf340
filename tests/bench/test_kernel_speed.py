"""bench/kernel_speed.py needs a GPU to measure; here its CLI and bookkeeping run on CPU with a fake clock."""
from __future__ import annotations

import pytest
import torch

from bench import kernel_speed as bench


def test_parses_args_and_refuses_without_cuda(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    args = bench.parse_args(["--decode-seqs", "64,128", "--dtypes", "bfloat16", "--out", str(tmp_path / "k.json")])
    assert args.decode_seqs == [64, 128] and args.dtypes == [torch.bfloat16]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="CUDA"):
        bench.main(["--out", str(tmp_path / "k.json")])
    assert not (tmp_path / "k.json").exists()


def test_rows_on_cpu_with_fake_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny shapes through the real inputs, kernels and baselines; only the timer is fake (1 ms per call)."""
    monkeypatch.setattr(bench, "time_ms", lambda fn: (fn(), 1.0)[1])
    shape = bench.Shape(num_heads=4, num_kv_heads=2, head_dim=16, block_size=16)
    decode = bench.bench_decode(shape, num_seqs=3, context=20, dtype=torch.float32, copy_gbps=1.0, device="cpu")
    prefill = bench.bench_prefill(shape, num_seqs=2, length=18, dtype=torch.float32, device="cpu")

    assert decode["bytes_moved"] == (2 * 3 * 20 * 2 + 2 * 3 * 4) * 16 * 4
    assert decode["triton"]["GBps"] == pytest.approx(decode["bytes_moved"] / 1e-3 / 1e9)
    assert prefill["flops"] == 4 * 2 * 4 * 16 * 18 * 19 / 2
    assert decode["max_abs_err_vs_torch"] < 1e-4 and prefill["max_abs_err_vs_torch"] < 1e-4
