"""bench/serve_load.py end to end against the `tandem serve` it spawns, tiny: the report has every figure it
promises."""
from __future__ import annotations

import json

from bench import serve_load as bench_serve


def test_open_loop_bench_reports_latencies_throughput_and_ratios(tmp_path):
    out = tmp_path / "serve_load.json"
    report = bench_serve.main(["--spawn", "--requests", "6", "--rate", "20", "--rerank-fraction",
                               "0.5", "--documents", "2", "--max-tokens", "3", "--baseline-requests", "1",
                               "--streams", "2", "--seed", "3", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    loaded = report["loaded"]
    assert loaded["failed"] == 0 and loaded["requests"] == 6
    assert loaded["ttft_s"]["n"] + loaded["rerank_latency_s"]["n"] == 6
    assert loaded["ttft_s"]["p50"] > 0 and loaded["rerank_latency_s"]["p99"] >= loaded["rerank_latency_s"]["p50"]
    assert report["throughput"]["output_tokens_per_s"] > 0
    assert report["ratios"]["ttft_s_p50_vs_idle_p50"] > 0
