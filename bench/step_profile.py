"""Where the steps of a likelihood rerank flood go: Python (cProfile) and torch ops (torch.profiler, with CUDA
kernels on a GPU). Written for the first GPU run, where a prefill step turned out launch-bound.

    python -m bench.step_profile --device cuda --dtype bfloat16 --out-dir bench/results/gpu_h100

Writes cprofile_cumtime.txt, cprofile_tottime.txt and torch_ops.txt to --out-dir; prints tokens/s and the share of
step time inside model forwards.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.datasets import synthetic_rerank
from engine import LLM, EngineConfig


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    ap.add_argument("--queries", type=int, default=4, help="rerank queries of 50 documents (16-400 tokens)")
    ap.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = ap.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    llm = LLM(EngineConfig(device=args.device, dtype=args.dtype, rerank_mode="likelihood",
                           max_num_batched_tokens=args.budget))
    queries = synthetic_rerank(llm.tokenizer, args.queries, 50, 16, 400, seed=0)
    llm.rerank(queries[0].query, queries[0].documents[:10])  # warm-up (kernels compile)
    records: list = []
    llm.engine.add_observer(records.append)
    start = time.perf_counter()
    prof = cProfile.Profile()
    prof.enable()
    for q in queries[1:-1]:
        llm.rerank(q.query, q.documents)
    prof.disable()
    seconds = time.perf_counter() - start
    tokens = sum(r.rerank_tokens for r in records)
    forward = sum(r.forward_s for r in records) / sum(r.duration_s for r in records)
    print(f"rerank: {tokens} tokens in {seconds:.2f}s = {tokens / seconds:.0f} tok/s, {len(records)} steps, "
          f"forward share {forward:.2f}")
    for key in ("tottime", "cumtime"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(40)
        (args.out_dir / f"cprofile_{key}.txt").write_text(text.getvalue())
    cuda = torch.device(args.device).type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as p:
        llm.rerank(queries[-1].query, queries[-1].documents)
    tables = [p.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)]
    if cuda:
        tables.append(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=20))
    (args.out_dir / "torch_ops.txt").write_text("\n\n".join(tables))


if __name__ == "__main__":
    main()
